"""How a `GRPOTrainer` is assembled: `assemble` builds its parts once, in order (the training rows, the policy and
its optimizer, the engine and the rounds, the bookkeeping), and returns them as one frozen record, `Parts`, which
the trainer holds. No part is ever replaced; some change inside as the run goes (the loop's position, the buffer,
the optimizer's state, the engine a test scripts). The trainer's own run state (its `TrainerState`, the policy's
version, a train() call's metrics window) is not a part: the trainer keeps and writes it. The loop that uses the
parts is `grpo.trainer`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel, TrainerState

from grpo.agent import Environments, Rollouts
from grpo.agent.environments import placeholder_dataset
from grpo.algo.loss_terms import LossTerms
from grpo.algo.losses import LossParams
from grpo.algo.sampling_correction import SamplingCorrection
from grpo.base import seeding
from grpo.checkpoint import Saved, StateComponent, components, strategy
from grpo.checkpoint.hub import Hub, HubSettings, ModelCard
from grpo.config import ResolvedConfig, warn_odd_combinations
from grpo.data import datasets
from grpo.data import prompts as data
from grpo.distributed import collectives
from grpo.learner import optimization, ref_sync
from grpo.learner.acceleration import make_accelerator
from grpo.learner.forward import TrainingPass
from grpo.learner.loop import LoopState, RolloutBuffer, position_after_resume, schedule_length
from grpo.models import build as models
from grpo.models import vision
from grpo.models.modeling import generation_eos
from grpo.observe import reporting
from grpo.observe.callbacks import Callbacks
from grpo.observe.diagnostics import Diagnosis, Limits
from grpo.observe.metrics import CompletionLog
from grpo.observe.report import RunReport, run_facts
from grpo.perf import allocator, attention
from grpo.rewards.calling import RewardFunctions
from grpo.rollout import build_engine
from grpo.rounds import asynchronous, evaluation
from grpo.rounds.producer import Producer
from grpo.rounds.sequential import Rounds

logger = logging.getLogger("grpo")
T = TypeVar("T")


@dataclass(frozen=True)
class Parts:
    """A trainer's parts, built once by `assemble`."""

    # the run's settings, processes, data and rewards
    args: ResolvedConfig
    accelerator: Accelerator
    train_dataset: Any  # the checked training rows (a stream: read by position)
    eval_dataset: Any
    environments: Environments | None  # environment_factory's
    rewards: RewardFunctions
    # the policy, its reference and its optimization
    model: torch.nn.Module  # as prepared: wrapped, sharded or DeepSpeed's engine
    processing_class: Any  # the tokenizer, or a vision-language model's processor
    tokenizer: Any  # the text tokenizer (the processor's own, for a processor)
    ref_model: torch.nn.Module | None
    ref_from_adapters: bool  # the reference is the policy with its adapters disabled (LoRA)
    pixels: vision.Pixels | None  # image prompts' pixel inputs (None: a text model)
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    max_steps: int
    steps_per_epoch: int
    flop_parameters: int  # non-embedding parameters: total_flos, as the HF Trainer
    # generation: an engine, the prompts, the tool loop, the producer, rounds in turn or async
    engine_on: Callable[[torch.nn.Module, ResolvedConfig], Any]  # (model, settings) -> an engine of the run's kind
    stop_ids: list[int]
    prompts: data.PromptSource
    rollouts: Rollouts
    producer: Producer
    rounds: Rounds
    # learning: the training pass, the loop's position and buffer, the loss
    training_pass: TrainingPass
    loop: LoopState
    buffer: RolloutBuffer
    loss_params: LossParams
    loss_terms: LossTerms  # entropy bonus, router loss
    correction: SamplingCorrection  # sampling/* metrics, vLLM's importance weight, OPSM
    gradient_check: optimization.GradientCheck  # clip; non-finite norms
    # bookkeeping: callbacks, checkpoints, evaluation, what a run shows, the Hub
    callbacks: Callbacks
    saved: Saved  # what checkpoints save and load
    evaluations: dict[str | None, evaluation.Evaluation]  # the eval dataset's (one per key of a dict)
    evaluator: evaluation.Evaluator
    completion_log: CompletionLog | None  # log_completions
    diagnosis: Diagnosis  # what the logged metrics say is going wrong: one warning each
    run_report: RunReport  # <output_dir>/report.html
    hub: Hub

    @property
    def unwrapped_model(self) -> PreTrainedModel:
        return self.accelerator.unwrap_model(self.model)


class Part(Generic[T]):
    """A trainer attribute read from its parts, read-only as a property is: the part of the same name (TRL's
    `trainer.model` is `trainer.parts.model`), or what `of` reads from them."""

    def __init__(self, of: Callable[[Parts], T] | None = None) -> None:
        self.of = of
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: type | None = None) -> T:
        if trainer is None:  # on the class: the descriptor, as a property is
            return self  # type: ignore[return-value]
        return self.of(trainer.parts) if self.of is not None else getattr(trainer.parts, self.name)

    def __set__(self, trainer: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read from the trainer's parts, built once (`grpo.assembly.assemble`)")


@dataclass(frozen=True)
class _Policy:
    """The policy and what comes with it, prepared (`models.prepare`), before the parts that use it are built."""

    model: torch.nn.Module
    processing_class: Any
    tokenizer: Any
    ref_model: torch.nn.Module | None
    ref_from_adapters: bool
    processor: Any  # the image processor of a vision-language model (None: none)
    pixels: vision.Pixels | None  # image prompts' pixel inputs (None: a text model)
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    snapshot: torch.nn.Module | None  # async: a whole copy made before sharding, for the producer
    max_steps: int
    steps_per_epoch: int
    flop_parameters: int


@dataclass(frozen=True)
class _Generation:
    """The engine, prompts, tool loop, producer and rounds, and the training pass and loop they feed."""

    engine_on: Callable[[torch.nn.Module, ResolvedConfig], Any]
    stop_ids: list[int]
    training_pass: TrainingPass
    prompts: data.PromptSource
    rollouts: Rollouts
    producer: Producer
    loop: LoopState
    buffer: RolloutBuffer
    rounds: Rounds


def assemble(
    args: ResolvedConfig,
    state: TrainerState,
    trainer: Any,
    *,
    model: Any,
    reward_funcs: Any,
    train_dataset: Any,
    eval_dataset: Any,
    processing_class: Any,
    reward_processing_classes: Any,
    callbacks: Any,
    optimizers: tuple[Any, Any],
    peft_config: Any,
    tools: Any,
    rollout_func: Any,
    environment_factory: Any,
) -> Parts:
    """A trainer's parts from `GRPOTrainer`'s arguments and its resolved config, `args`. `state`: the trainer's
    TrainerState (read by the producer, the report and checkpoints; the trainer alone writes it); `trainer`: what
    `rollout_func(prompts, trainer)` is given, as TRL gives it."""
    environments = Environments(environment_factory) if environment_factory is not None else None
    rows = _training_data(args, train_dataset, eval_dataset, bool(tools), environment_factory, environments)
    warn_odd_combinations(args)
    models.default_unused_parameters(args, model)  # a vision-language model's DDP default
    acc = make_accelerator(args)
    reporting.configure_logging(args, acc)  # log_level(_replica), log_on_each_node
    if acc.device.type == "cpu" and args.cpu_keep_freed_memory:
        allocator.keep_freed_memory()
    env_rewards = environments.reward_functions() if environments else ()
    rewards = RewardFunctions.build(reward_funcs, args, reward_processing_classes, acc.device, env_rewards)
    seeding.seed_run(args.seed, args.full_determinism)  # full_determinism: deterministic algorithms too
    policy = _policy(args, acc, rows, model, processing_class, peft_config, optimizers)
    generation = _generation(args, acc, state, rows, rewards, environments, policy, tools, rollout_func, trainer)
    return _parts(args, acc, state, rows, eval_dataset, environments, rewards, policy, generation, callbacks)


def _training_data(
    args: ResolvedConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tools: bool,
    environment_factory: Any,
    environments: Environments | None,
) -> Any:
    """The training rows, checked (an environment's placeholder rows where it has none; a stream read by
    position)."""
    train_dataset = placeholder_dataset(datasets.load_local(train_dataset), args, environment_factory)
    data.check_dataset(train_dataset, tools or environments is not None, environments is not None)
    stream_settings(args, train_dataset, eval_dataset)  # dispatch_batches, dataloader_num_workers
    if datasets.is_stream(train_dataset):
        train_dataset = datasets.StreamRows(train_dataset, 4 * args.generation_batch_size)
    return train_dataset


def _policy(
    args: ResolvedConfig,
    acc: Accelerator,
    rows: Any,
    model: Any,
    processing_class: Any,
    peft_config: Any,
    optimizers: tuple[Any, Any],
) -> _Policy:
    """The policy, tokenizer and reference model, the schedule and optimizer (the given ones, or AdamW and the
    config's schedule), prepared by accelerate; the producer's snapshot (async: a whole copy made before sharding,
    else None); checked for what sync_ref_model and the best checkpoint need."""
    fsdp = getattr(acc.state, "fsdp_plugin", None)
    built = models.build(model, processing_class, peft_config, args, fsdp, acc.device)
    data.check_images(rows, built.processing_class)  # image columns need a processor; rows checked
    pixels = vision.Pixels.of(built.processor, built.model)
    flop_parameters = reporting.non_embedding_parameters(built.model)
    max_steps, steps_per_epoch = schedule_length(rows, args)
    optimizer, lr_scheduler = optimizers
    if optimizer is None:
        optimizer = optimization.default_optimizer(built.model, args)
    if lr_scheduler is None:
        lr_scheduler = optimization.default_scheduler(optimizer, args, max_steps)
    prepared, optimizer, ref_model, snapshot = models.prepare(acc, args, built.model, optimizer, built.ref_model)
    seeding.distinct_per_process(args.seed, acc.process_index)  # a group split over processes: distinct samples
    ref_sync.check(args, ref_model, built.ref_from_adapters)  # sync_ref_model needs a reference model of its own
    strategy.check(args, max_steps, steps_per_epoch, prepared, acc)  # the best checkpoint: knowable and loadable
    return _Policy(
        prepared,
        built.processing_class,
        built.tokenizer,
        ref_model,
        built.ref_from_adapters,
        built.processor,
        pixels,
        optimizer,
        lr_scheduler,
        snapshot,
        max_steps,
        steps_per_epoch,
        flop_parameters,
    )


def _generation(
    args: ResolvedConfig,
    acc: Accelerator,
    state: TrainerState,
    rows: Any,
    rewards: RewardFunctions,
    environments: Environments | None,
    policy: _Policy,
    tools: Any,
    rollout_func: Any,
    trainer: Any,
) -> _Generation:
    """The engine, prompts, tool loop and producer; the training pass; the rounds (in turn, or async)."""
    unwrapped = acc.unwrap_model(policy.model)
    stop_ids = data.end_of_turn_ids(policy.tokenizer, generation_eos(unwrapped))
    engine_on = functools.partial(_engine, tokenizer=policy.tokenizer, stop_ids=stop_ids, acc=acc, pixels=policy.pixels)
    engine = engine_on(unwrapped, args)
    attention.use_grouped_heads(policy.model)
    training_pass = TrainingPass(policy.model, args, acc.autocast, acc.mixed_precision, policy.pixels)
    prompts = _prompts(args, rows, policy, unwrapped)
    everywhere = functools.partial(collectives.any_process_or_preempted, acc)  # a tool loop's
    rollouts = Rollouts(engine, prompts, args, stop_ids, everywhere, tools, environments, rollout_func, trainer)
    producer = Producer(rollouts, rewards, rows, args, acc.process_index, acc.num_processes, state)
    loop = LoopState()
    buffer = RolloutBuffer(args.steps_per_generation, args.num_iterations, args.seed)
    learner = (producer, policy.model, training_pass, policy.tokenizer.pad_token_id, loop, engine_on)
    rounds = asynchronous.rounds_of(asynchronous.Learner(args, acc, *learner), policy.snapshot)  # in turn, or async
    return _Generation(engine_on, stop_ids, training_pass, prompts, rollouts, producer, loop, buffer, rounds)


def _parts(
    args: ResolvedConfig,
    acc: Accelerator,
    state: TrainerState,
    rows: Any,
    eval_dataset: Any,
    environments: Environments | None,
    rewards: RewardFunctions,
    policy: _Policy,
    g: _Generation,
    callbacks: Any,
) -> Parts:
    """The bookkeeping (the loss's parts, what checkpoints hold, evaluation, the report, the Hub, the callbacks),
    and all the parts together."""
    unwrapped = acc.unwrap_model(policy.model)
    loss_terms = LossTerms(args, g.training_pass.router_aux_coef)  # entropy bonus, router loss
    record = components.TrainingRecord(g.loop, g.buffer, loss_terms, _run_facts(args, acc, rows, policy))
    extra = [*ref_sync.MixedReference.of(args, policy.ref_model, acc), *([g.rounds] if args.async_generation else [])]
    handles = policy.model, policy.optimizer, policy.lr_scheduler
    state_components = components.of(args, acc, *handles, (g.buffer, g.loop), extra)
    evaluations = evaluation.build(eval_dataset, args, g.prompts, acc.num_processes)
    engine_with = functools.partial(g.engine_on, unwrapped)  # eval_greedy's engine on the policy
    evaluator = evaluation.Evaluator(args, acc, g.producer, g.rounds, g.prompts, engine_with)
    diagnosis = Diagnosis(Limits.of(args))
    facts = run_facts(unwrapped, rewards.names, g.rollouts.tool_names, policy.max_steps, acc.num_processes)
    report = RunReport(args.output_dir, bool(args.run_report), facts, diagnosis, acc.is_main_process)
    hub = Hub(HubSettings.of(args), acc.is_main_process)
    card = ModelCard.of(unwrapped, rows, rewards, args)
    hub.create_repo()  # with push_to_hub, as the HF Trainer: at construction
    callback_handler = Callbacks(callbacks, policy.model, policy.processing_class, *handles[1:])
    saved = _saved(args, acc, policy, state, card, callback_handler, record, state_components, bool(evaluations))
    return Parts(
        args=args,
        accelerator=acc,
        train_dataset=rows,
        eval_dataset=eval_dataset,
        environments=environments,
        rewards=rewards,
        model=policy.model,
        processing_class=policy.processing_class,
        tokenizer=policy.tokenizer,
        ref_model=policy.ref_model,
        ref_from_adapters=policy.ref_from_adapters,
        pixels=policy.pixels,
        optimizer=policy.optimizer,
        lr_scheduler=policy.lr_scheduler,
        max_steps=policy.max_steps,
        steps_per_epoch=policy.steps_per_epoch,
        flop_parameters=policy.flop_parameters,
        engine_on=g.engine_on,
        stop_ids=g.stop_ids,
        prompts=g.prompts,
        rollouts=g.rollouts,
        producer=g.producer,
        rounds=g.rounds,
        training_pass=g.training_pass,
        loop=g.loop,
        buffer=g.buffer,
        loss_params=LossParams.of(args),
        loss_terms=loss_terms,
        correction=SamplingCorrection.of(args, g.rollouts.engine),  # sampling/* metrics, vLLM's IS weight, OPSM
        gradient_check=optimization.GradientCheck(args.max_grad_norm),
        callbacks=callback_handler,
        saved=saved,
        evaluations=evaluations,
        evaluator=evaluator,
        completion_log=CompletionLog.of(args, rewards.names) if args.log_completions else None,
        diagnosis=diagnosis,
        run_report=report,
        hub=hub,
    )


def _engine(
    model: torch.nn.Module,
    settings: ResolvedConfig,
    tokenizer: Any,
    stop_ids: list[int],
    acc: Accelerator,
    pixels: vision.Pixels | None,
) -> Any:
    """An engine of the configured kind sampling `model` (the policy, or an async producer's snapshot), with
    `settings` (the run's, or eval_greedy's)."""
    return build_engine(model, tokenizer, settings, stop_ids, acc, pixels)


def _prompts(args: ResolvedConfig, rows: Any, policy: _Policy, unwrapped: Any) -> data.PromptSource:
    """The training rows as prompts, within the model's context (vLLM's own, if set)."""
    context = getattr(unwrapped.config.get_text_config(), "max_position_embeddings", None)
    context = (args.use_vllm and args.vllm_max_model_length) or context
    tokenizer, processor = policy.tokenizer, policy.processor
    return data.PromptSource(
        rows, tokenizer, args.chat_template_kwargs, context, args.max_completion_length, processor=processor
    )


def _run_facts(args: ResolvedConfig, acc: Accelerator, rows: Any, policy: _Policy) -> dict[str, Any]:
    """What trainer_state.json's record keeps of the run, and where a resume draws from (ignore_data_skip)."""
    return dict(
        max_steps=policy.max_steps,
        steps_per_epoch=policy.steps_per_epoch,
        num_processes=acc.num_processes,
        dataset_size=datasets.dataset_size(rows),
        args=args,
        resume_at=functools.partial(position_after_resume, args, rows),
    )


def _saved(
    args: ResolvedConfig,
    acc: Accelerator,
    policy: _Policy,
    state: TrainerState,
    card: ModelCard,
    callbacks: Callbacks,
    record: components.TrainingRecord,
    state_components: list[StateComponent],
    evaluated: bool,
) -> Saved:
    """What checkpoints save and load of the run (trainer_state.json's record first, then the components)."""
    return Saved(
        args=args,
        accelerator=acc,
        model=policy.model,
        optimizer=policy.optimizer,
        processing_class=policy.processing_class,
        write_card=functools.partial(card.write, state),
        state=state,
        callbacks=callbacks,
        record=record,
        components=state_components,
        max_steps=policy.max_steps,
        steps_per_epoch=policy.steps_per_epoch,
        evaluated=evaluated,
    )


def stream_settings(args: ResolvedConfig, train_dataset: Any, eval_dataset: Any) -> None:
    """TRL 1.16's settings for streaming datasets, kept in the config users read: `accelerator_config`'s
    dispatch_batches must not be True and becomes False, and a streaming train dataset sets dataloader_num_workers
    to 0 (with a warning). grpo reads rows itself, so neither shapes its reading; they say what the run did."""
    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    if not (datasets.is_stream(train_dataset) or any(datasets.is_stream(e) for e in evals)):
        return
    if args.accelerator_config.dispatch_batches:
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in `accelerator_config`: "
            "set it to False (a streaming dataset is read by each process, not dispatched from the first)."
        )
    args.accelerator_config.dispatch_batches = False
    if datasets.is_stream(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning(
            "Iterable datasets require `dataloader_num_workers=0` to keep each prompt's generations together; "
            "overriding the provided value (%s).",
            args.dataloader_num_workers,
        )
        args.dataloader_num_workers = 0
