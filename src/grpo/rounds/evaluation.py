"""Evaluation: `trainer.evaluate()`, and during training by `eval_strategy` / `eval_steps` / `eval_on_start`.

Every prompt of the eval dataset gets `num_generations_eval` completions (default num_generations; with grpo's
`eval_greedy`, one greedy completion), tool rounds included, through the same engine as training, scored by the same
reward functions. The batches follow TRL 1.16: `per_device_eval_batch_size` completions per process per batch, a
prompt's completions consecutive in the global batch. Metrics, every process's completions together, prefixed
"eval_": `eval_loss` (the policy loss of each batch, on-policy, averaged over batches: the HF Trainer's
eval_loss), `eval_reward`, `eval_reward_std`, `eval_rewards/<function>/mean` and `/std`, `eval_completions/mean_length`
and `/clipped_ratio`, `eval_tools/*` with tools, what reward functions log with `log_metric`, `eval_runtime`, and,
beyond TRL, `eval_pass@k`: the fraction of prompts with at least one of their k completions whose weighted reward
sum reaches `eval_pass_threshold` (grpo, default 1.0: a correctness reward's full mark).

Evaluating changes nothing that training depends on: the random generators (Python, NumPy, torch, CUDA) are put
back as they were, the data position, rollout buffer, metrics window and completions log are untouched, and no
parameter moves; so a run with evaluations ends with the same weights as the same run without them, and resumes as
exactly. During training a step's checkpoint is written before its evaluation (`after_step`): an evaluation that
fails or is preempted loses no step. Errors about eval rows name eval_dataset (eval_dataset['<key>'] in a dict).
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch

from grpo import checkpoint
from grpo.algo.advantages import nanstd, weighted_sum
from grpo.algo.losses import policy_loss
from grpo.base.sigterm import agreed_or_none
from grpo.data import prompts as data
from grpo.distributed import collectives
from grpo.learner.batch import collate
from grpo.observe.metrics import reward_and_tool_stats
from grpo.rollout import build_engine
from grpo.rounds import preemption
from grpo.rounds.groups import Scored, gather_scored


class EvaluatedRun(Protocol):
    """What evaluation reads of the trainer (its `evaluate`, and the evaluation after a step, are the trainer's
    own, written here): settings, processes, state, callbacks, the policy and its producer, and the loss's parts
    (advantages, old and reference log-probs) that an evaluation batch's `eval_loss` takes."""

    args: Any
    accelerator: Any
    state: Any  # the HF TrainerState
    control: Any  # the HF TrainerControl: should_evaluate, should_save
    metrics: Any  # `grpo.observe.metrics.MetricsLogger` (None before training)
    max_steps: int
    steps_per_epoch: int
    model: torch.nn.Module
    unwrapped_model: torch.nn.Module
    policy_version: int
    producer: Any  # `grpo.rounds.producer.Producer`: sync, generate, score
    rounds: Any  # `grpo.rounds.asynchronous`: the producer thread paused while evaluating
    engine: Any
    rollouts: Any
    rewards: Any
    prompts: data.PromptSource
    evaluations: dict[str | None, Evaluation]
    training_pass: Any
    loss_params: Any
    tokenizer: Any
    stop_ids: list[int]
    pixels: Any

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict[str, float]: ...

    def _fire(self, event: str, **kwargs: Any) -> None: ...

    def _advantages(self, scored: Scored, group_size: int | None = None) -> Any: ...

    def _add_old_and_ref_logps(self, batch: Any, old: bool = True) -> Any: ...


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Every random generator training draws from, restored on exit."""
    python, numpy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def greedy(engine: Any, args: Any, rebuild: Any) -> Any:
    """The engine sampling greedily: vLLM engines (colocate, server) with temperature 0 on a copy sharing the engine;
    grpo's own engines rebuilt with top_k=1 (they sample from the training model, so that is cheap)."""
    import copy

    if isinstance(getattr(engine, "sampling", None), dict):
        twin = copy.copy(engine)
        twin.sampling = {**engine.sampling, "temperature": 0.0}
        return twin
    greedy_args = copy.copy(args)  # not dataclasses.replace: the config's derived fields are already set
    greedy_args.top_k = 1
    return rebuild(greedy_args)


def build(dataset: Any, args: Any, source: data.PromptSource, num_processes: int) -> dict[str | None, Evaluation]:
    """One Evaluation per eval dataset: {None: ...} for one dataset, {name: ...} for a dict of them (metrics then
    prefixed eval_<name>_, as the HF Trainer does); {} without one (eval_strategy then must be "no")."""
    if dataset is None:
        if args.eval_strategy != "no" or args.eval_on_start:
            raise ValueError(
                f"eval_strategy={args.eval_strategy!r} (or eval_on_start) evaluates, but there is no eval_dataset: "
                "pass GRPOTrainer(eval_dataset=...), or set eval_strategy='no'."
            )
        return {}
    named = dict(dataset) if isinstance(dataset, dict) else {None: dataset}
    out = {}
    for key, part in named.items():
        label = "eval_dataset" if key is None else f"eval_dataset[{key!r}]"  # what its errors call it
        part = data.load_local(part)
        if data.is_stream(part):  # evaluation reads every row, in order: an eval stream is read once, here
            part = list(part)
        data.check_dataset(part, bool(source.tools), name=label)
        own = data.PromptSource(
            part,
            source.tokenizer,
            source.chat_template_kwargs,
            source.context,
            source.max_completion_length,
            source.tools,
            source.processor,
            name=label,
        )
        data.check_images(part, source.processor or source.tokenizer, label)
        out[key] = Evaluation(part, args, own, num_processes)
    return out


class Evaluation:
    def __init__(self, dataset: Any, args: Any, source: data.PromptSource, num_processes: int) -> None:
        self.dataset = dataset
        self.args = args
        self.source = source
        self.k = 1 if args.eval_greedy else (args.num_generations_eval or args.num_generations)
        batch = args.per_device_eval_batch_size * num_processes
        if batch % self.k:
            raise ValueError(
                f"per_device_eval_batch_size ({args.per_device_eval_batch_size}) x {num_processes} process(es) must be "
                f"a multiple of num_generations_eval ({self.k}): an evaluation batch holds whole groups."
            )
        self.prompts_per_batch = batch // self.k

    def due(self, step: int, max_steps: int, steps_per_epoch: int) -> bool:
        """Whether evaluation runs after optimizer step `step` (eval_strategy, eval_steps, eval_delay)."""
        a = self.args
        if a.eval_strategy == "no" or step < (a.eval_delay or 0):
            return False
        if a.eval_strategy == "epoch":
            return step % steps_per_epoch == 0
        every = a.eval_steps if a.eval_steps is not None else a.logging_steps
        every = max(math.ceil(every * max_steps), 1) if every < 1 else int(every)
        return step % every == 0

    def run(self, trainer: EvaluatedRun, engine: Any) -> dict[str, float]:
        """The eval_ metrics (the same on every process)."""
        acc = trainer.accelerator
        start = time.perf_counter()
        logged: dict[str, list[float]] = {}
        parts, losses = [], []
        n = len(self.dataset)
        with random_state_kept(), torch.no_grad():
            for first in range(0, n, self.prompts_per_batch):
                rows = [i for i in range(first, min(first + self.prompts_per_batch, n)) for _ in range(self.k)]
                share = -(-len(rows) // acc.num_processes)  # every process runs every batch, maybe with no rows
                mine = rows[acc.process_index * share : (acc.process_index + 1) * share]
                examples = [self.dataset[i] for i in mine]
                make = functools.partial(self.share, trainer, mine, examples, engine, logged)
                local = agreed_or_none(make, acc.num_processes > 1)  # None: SIGTERM here, agreed at the gather
                parts.append(gather_scored(local, acc))
                losses.append(batch_loss(trainer, parts[-1], self.k))
        metrics = self.metrics(Scored.concat(parts), trainer.rewards, trainer.rollouts.uses_tools)
        losses = [loss for loss in losses if loss is not None]
        metrics["eval_loss"] = sum(losses) / len(losses) if losses else None
        for name in sorted(logged):  # every process logs the same names (the same functions ran everywhere)
            metrics[f"eval_{name}"] = collectives.process_mean(acc, sum(logged[name]) / len(logged[name]))
        metrics["eval_runtime"] = round(time.perf_counter() - start, 4)
        return metrics

    def share(self, trainer: EvaluatedRun, mine: list[int], examples: list, engine: Any, logged: dict) -> Scored:
        """This process's rows of an evaluation batch, generated and scored (their reward functions' `log_metric`
        calls into `logged`)."""
        generated = trainer.producer.generate(mine, examples, source=self.source, engine=engine)
        rewards = torch.zeros(0, len(trainer.rewards.names))
        if mine:
            log = lambda name, value: logged.setdefault(name, []).append(float(value))  # noqa: E731
            rewards = trainer.producer.score(examples, generated, log)
        return Scored(mine, generated.prompts, generated.rollout, rewards)

    def metrics(self, scored: Scored, rewards: Any, tools: bool) -> dict[str, float]:
        values = scored.rewards.float()
        unscorable = torch.isnan(values).all(dim=1)
        total = weighted_sum(values, rewards.weights.float(), unscorable)
        lengths = torch.tensor([sum(m) for m in scored.rollout.loss_mask], dtype=torch.float32)
        passed = (total >= self.args.eval_pass_threshold).view(-1, self.k).any(dim=1)
        out = {
            "eval_reward": torch.nanmean(total).item(),
            "eval_reward_std": nanstd(total).item(),
            f"eval_pass@{self.k}": passed.float().mean().item(),
            "eval_completions/mean_length": lengths.mean().item(),
            "eval_completions/clipped_ratio": torch.tensor(scored.rollout.truncated, dtype=torch.float32).mean().item(),
        }
        out.update({f"eval_{k}": v for k, v in reward_and_tool_stats(scored, rewards.names, tools).items()})
        return {k: v if math.isfinite(v) else None for k, v in out.items()}


def batch_loss(trainer: EvaluatedRun, scored: Scored, group_size: int) -> float | None:
    """The policy loss of one evaluation batch (every process's rows), as the HF Trainer's `eval_loss`: the batch's
    group advantages, on-policy (ratio 1; with beta > 0 the KL to the reference), each process's rows through the
    training pass without gradient, the processes' losses weighted by their rows. None for a batch some process
    has no rows of (a last, short batch): a sharded model's forward is collective, so all or none run it."""
    acc, a = trainer.accelerator, trainer.args
    mine = list(collectives.local_rows(len(scored), acc.process_index, acc.num_processes))
    if collectives.any_process(acc, not mine):
        return None
    advantages = trainer._advantages(scored, group_size).advantages[mine]
    batch = collate(
        scored.rollout.select(mine), advantages, trainer.tokenizer.pad_token_id, a.mask_truncated_completions
    )
    batch = trainer._add_old_and_ref_logps(batch.to(acc.device), old=False)
    logps = trainer.training_pass.logps(trainer.model, batch, a.per_device_eval_batch_size)
    loss, _ = policy_loss(logps, None, batch.advantages, batch.mask, trainer.loss_params, batch.ref_logps)
    rows = collectives.process_mean(acc, float(len(mine)))
    return collectives.process_mean(acc, loss.item() * len(mine)) / rows


def after_step(trainer: EvaluatedRun, evaluate_now: bool) -> str | None:
    """The end of an optimizer step (every process): its checkpoint when due, then its evaluation when due, in that
    order, so that an evaluation that fails (a reward function raising on an eval row) or is preempted loses no
    step. The events stay the HF Trainer's (on_evaluate, then on_save, which the caller fires): the evaluation's
    row, the best checkpoint it makes and the callbacks' states go into the checkpoint's trainer_state.json after
    it (`checkpoint.add_evaluation`), as the HF Trainer, which saves after evaluating, writes them. A checkpoint
    only the evaluation decides (save_strategy="best" on an eval_ metric, a callback's on_evaluate asking) is
    written after it. SIGTERM during the evaluation: the step is complete, so it is saved (unless saved already)
    and the run exits with status 143; by several processes when they stopped together (at a batch's gather or a
    tool loop's check, `grpo.base.sigterm`), otherwise they save nothing more.
    Returns the checkpoint written, if any."""
    step = trainer.state.global_step
    path = None
    if checkpoint.strategy.should_save(trainer) or trainer.control.should_save:
        path = checkpoint.save(trainer, step)
    if not evaluate_now:
        return path
    try:
        trainer.evaluate()
    except preemption.Preempted as stop:
        if trainer.accelerator.num_processes > 1 and not stop.agreed:
            raise
        preemption.save_and_exit(trainer, None)  # the step is complete: as between steps
    if path is not None:
        checkpoint.add_evaluation(trainer, path)
    elif checkpoint.strategy.should_save(trainer) or trainer.control.should_save:
        path = checkpoint.save(trainer, step)
    return path


def due(trainer: EvaluatedRun, step: int) -> bool:
    """Whether the trainer evaluates after optimizer step `step`: an eval dataset's strategy says so, or a callback
    set control.should_evaluate."""
    if not trainer.evaluations:
        return False
    strategy = any(e.due(step, trainer.max_steps, trainer.steps_per_epoch) for e in trainer.evaluations.values())
    return strategy or trainer.control.should_evaluate


def evaluate(trainer: EvaluatedRun, eval_dataset: Any, metric_key_prefix: str) -> dict[str, float]:
    """GRPOTrainer.evaluate: the trainer's eval datasets (or `eval_dataset`), from the policy's current weights; the
    metrics are logged (log_history, metrics.jsonl, trackers, on_log) and passed to on_evaluate."""
    runs = trainer.evaluations
    if eval_dataset is not None:
        runs = build(eval_dataset, trainer.args, trainer.prompts, trainer.accelerator.num_processes)
    if not runs:
        raise ValueError("evaluate() needs an eval_dataset: pass one to GRPOTrainer(eval_dataset=...) or here.")
    with trainer.rounds.paused(trainer.state.global_step):  # async_generation: the producer between rounds
        metrics = _run_all(trainer, runs, metric_key_prefix)
    state = trainer.state
    row = {**metrics, "epoch": round(state.epoch or 0.0, 4), "step": state.global_step}
    state.log_history.append(row)
    if trainer.metrics is not None:
        trainer.metrics.write_row(row)
    trainer._fire("log", logs=row)
    trainer._fire("evaluate", metrics=metrics)
    return metrics


def _run_all(trainer: EvaluatedRun, runs: dict[str, Any], metric_key_prefix: str) -> dict[str, float]:
    """Every eval dataset's metrics, from the policy's current weights."""
    trainer.producer.sync(trainer.unwrapped_model, trainer.policy_version)
    engine = trainer.engine
    if trainer.args.eval_greedy:
        model, tokenizer, stop_ids, acc = (
            trainer.unwrapped_model,
            trainer.tokenizer,
            trainer.stop_ids,
            trainer.accelerator,
        )
        engine = greedy(
            engine, trainer.args, lambda args: build_engine(model, tokenizer, args, stop_ids, acc, trainer.pixels)
        )
    metrics: dict[str, float] = {}
    for name, run in runs.items():
        prefix = metric_key_prefix + (f"_{name}" if name else "")
        metrics.update({prefix + key[len("eval") :]: value for key, value in run.run(trainer, engine).items()})
    return metrics
