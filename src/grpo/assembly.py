"""How a `GRPOTrainer` is assembled: the builders its constructor calls, in order (the training rows, the policy
and its optimizer, the engine and the rounds, the bookkeeping), and the handles they leave (`unwrapped_model`,
`engine`). The loop that uses the parts is `grpo.trainer`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerState

from grpo import checkpoint
from grpo.agent import Rollouts
from grpo.agent.environments import placeholder_dataset
from grpo.algo.loss_terms import LossTerms
from grpo.algo.losses import LossParams
from grpo.algo.sampling_correction import SamplingCorrection
from grpo.base import seeding
from grpo.checkpoint import components, hub
from grpo.checkpoint.hub import Hub, HubSettings
from grpo.config import ResolvedConfig
from grpo.data import datasets
from grpo.data import prompts as data
from grpo.distributed import collectives
from grpo.learner import optimization, ref_sync
from grpo.learner.forward import TrainingPass
from grpo.learner.loop import LoopState, RolloutBuffer, position_after_resume, schedule_length
from grpo.models import build as models
from grpo.models import vision
from grpo.models.modeling import generation_eos
from grpo.observe import reporting
from grpo.observe.callbacks import Callbacks
from grpo.observe.diagnostics import Diagnosis, Limits
from grpo.observe.metrics import CompletionLog, MetricsLogger
from grpo.observe.report import RunReport
from grpo.perf import attention
from grpo.rollout import build_engine
from grpo.rounds import asynchronous, evaluation
from grpo.rounds.groups import Scored
from grpo.rounds.producer import Producer
from grpo.trl_surface import TrlSurface, stream_settings


class Assembly(TrlSurface):
    """A trainer's parts and their builders; `GRPOTrainer` adds the loop, evaluation and the callbacks' events."""

    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    train_dataset: Any  # the checked training rows (`_training_data`)
    _eval_loss: Callable[..., float | None]  # the trainer's evaluation loss (evaluate() runs it)
    _fire: Callable[..., None]  # the trainer's callback events

    # ---- construction ----------------------------------------------------------------------------------------

    def _training_data(self, train_dataset: Any, eval_dataset: Any, tools: bool, environment_factory: Any) -> Any:
        """The training rows, checked (an environment's placeholder rows where it has none; a stream read by
        position)."""
        args, environments = self.args, self.environments is not None
        train_dataset = placeholder_dataset(datasets.load_local(train_dataset), args, environment_factory)
        data.check_dataset(train_dataset, tools or environments, environments)
        stream_settings(args, train_dataset, eval_dataset)  # dispatch_batches, dataloader_num_workers
        if datasets.is_stream(train_dataset):
            train_dataset = datasets.StreamRows(train_dataset, 4 * args.generation_batch_size)
        return train_dataset

    def _build_policy(
        self, model: Any, processing_class: Any, peft_config: Any, optimizers: tuple[Any, Any]
    ) -> tuple[Any, Any]:
        """The policy, tokenizer and reference model, the schedule and optimizer, prepared by accelerate; returns
        the producer's snapshot (async: a whole copy made before sharding, else None) and the image processor."""
        args, acc = self.args, self.accelerator
        fsdp = getattr(acc.state, "fsdp_plugin", None)
        built = models.build(model, processing_class, peft_config, args, fsdp, acc.device)
        self.model, self.processing_class, self.ref_model = built.model, built.processing_class, built.ref_model
        self.tokenizer, self.ref_from_adapters = built.tokenizer, built.ref_from_adapters
        data.check_images(self.train_dataset, self.processing_class)  # image columns need a processor; rows checked
        self.pixels = vision.Pixels.of(built.processor, built.model)  # image prompts' pixel inputs
        self.state = TrainerState()
        self.flop_parameters = reporting.non_embedding_parameters(self.model)  # total_flos, as the HF Trainer
        self.max_steps, self.steps_per_epoch = schedule_length(self.train_dataset, args)
        self.state.max_steps = self.max_steps
        self._build_optimization(*optimizers)
        self.model, self.optimizer, self.ref_model, snapshot = models.prepare(
            acc, args, self.model, self.optimizer, self.ref_model
        )
        seeding.distinct_per_process(args.seed, acc.process_index)  # a group split over processes: distinct samples
        ref_sync.check(self)  # sync_ref_model needs a reference model of its own
        checkpoint.strategy.check(self)  # the best checkpoint must be knowable and loadable
        return snapshot, built.processor

    def _build_rounds(self, tools: Any, rollout_func: Any, processor: Any, snapshot: Any) -> None:
        """The engine, prompts, tool loop and producer; the training pass; the rounds (in turn, or async)."""
        args, acc = self.args, self.accelerator
        self.stop_ids = data.end_of_turn_ids(self.tokenizer, generation_eos(self.unwrapped_model))
        engine = self._engine(self.unwrapped_model, args)
        attention.use_grouped_heads(self.model)
        self.training_pass = TrainingPass(self.model, args, acc.autocast, acc.mixed_precision, self.pixels)
        context = getattr(self.unwrapped_model.config.get_text_config(), "max_position_embeddings", None)
        context = (args.use_vllm and args.vllm_max_model_length) or context  # vLLM's own context, if set
        self.prompts = data.PromptSource(
            self.train_dataset,
            self.tokenizer,
            args.chat_template_kwargs,
            context,
            args.max_completion_length,
            processor=processor,
        )
        everywhere = functools.partial(collectives.any_process_or_preempted, acc)  # a tool loop's
        self.rollouts = Rollouts(
            engine, self.prompts, args, self.stop_ids, everywhere, tools, self.environments, rollout_func, self
        )
        ranks = acc.process_index, acc.num_processes
        self.producer = Producer(self.rollouts, self.rewards, self.train_dataset, args, *ranks, self.state)
        self.loop = LoopState()
        self.buffer = RolloutBuffer(args.steps_per_generation, args.num_iterations, args.seed)
        pad, learner = self.tokenizer.pad_token_id, (self.producer, self.model, self.training_pass)
        side = asynchronous.Learner(args, acc, *learner, pad, self.loop, self._engine)
        self.rounds = asynchronous.rounds_of(side, snapshot)  # generate -> score: in turn with training, or async

    def _build_bookkeeping(self, eval_dataset: Any, callbacks: Any) -> None:
        """The loss's parts, what checkpoints hold, metrics, evaluation, the report, the Hub and the callbacks."""
        args = self.args
        mixed_reference = ref_sync.MixedReference.of(args, self.ref_model, self.accelerator)
        extra = [*mixed_reference, *([self.rounds] if args.async_generation else [])]  # in-flight rounds
        self.loss_params = LossParams.of(args)
        self.loss_terms = LossTerms(args, self.training_pass.router_aux_coef)  # entropy bonus, router loss
        # what checkpoints save and load (trainer_state.json's record first)
        resume_at = functools.partial(position_after_resume, args, self.train_dataset)  # ignore_data_skip
        self.state_components = components.of_run(self, extra, datasets.dataset_size(self.train_dataset), resume_at)
        self.correction = SamplingCorrection.of(args, self.engine)  # sampling/* metrics, vLLM's IS weight, OPSM
        self.policy_version = 0  # a new number whenever the policy's weights change (the producer syncs on it)
        self.gradient_check = optimization.GradientCheck(args.max_grad_norm)  # clip; non-finite norms
        self.step_applied = False  # whether the current step's optimizer step has been applied
        self.metrics: MetricsLogger | None = None  # made by train()
        self.completion_log = CompletionLog.of(args, self.rewards.names) if args.log_completions else None
        self.latest_batch: tuple[Scored, torch.Tensor] | None = None  # the last generation batch and its advantages
        self.eval_dataset = eval_dataset
        self.evaluations = evaluation.build(eval_dataset, args, self.prompts, self.accelerator.num_processes)
        parts = (
            self.producer,
            self.rounds,
            self.prompts,
            self._eval_loss,
            functools.partial(self._engine, self.unwrapped_model),
        )
        self.evaluator = evaluation.Evaluator(args, self.accelerator, *parts)  # what evaluate() runs on
        self.diagnosis = Diagnosis(Limits.of(args))  # what the logged metrics say is going wrong: one warning each
        self.run_report = RunReport.of(self)  # <output_dir>/report.html
        self.hub = Hub(HubSettings.of(args), self.accelerator.is_main_process)
        self.write_model_card = functools.partial(hub.write_model_card, self)  # README.md of a saved model
        self.hub.create_repo()  # with push_to_hub, as the HF Trainer: at construction
        handles = self.model, self.processing_class, self.optimizer, self.lr_scheduler
        self.callback_handler = Callbacks(callbacks, *handles)

    def _build_optimization(self, optimizer: Any, lr_scheduler: Any) -> None:
        """The given optimizer and schedule, or AdamW and the config's schedule."""
        if optimizer is None:
            optimizer = optimization.default_optimizer(self.model, self.args)
        if lr_scheduler is None:
            lr_scheduler = optimization.default_scheduler(optimizer, self.args, self.max_steps)
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler

    def _engine(self, model: torch.nn.Module, settings: ResolvedConfig) -> Any:
        """An engine of the configured kind sampling `model` (the policy, or an async producer's snapshot), with
        `settings` (the run's, or eval_greedy's)."""
        return build_engine(model, self.tokenizer, settings, self.stop_ids, self.accelerator, self.pixels)

    @property
    def unwrapped_model(self) -> PreTrainedModel:
        return self.accelerator.unwrap_model(self.model)

    @property
    def engine(self) -> Any:
        """The generation engine (`grpo.rollout`); settable (tests give scripted ones)."""
        return self.rollouts.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.rollouts.engine = engine
