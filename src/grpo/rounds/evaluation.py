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
exactly. During training a step's checkpoint is written before its evaluation (`GRPOTrainer._checkpoint`): an
evaluation that fails or is preempted loses no step. Errors about eval rows name eval_dataset
(eval_dataset['<key>'] in a dict).
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grpo.algo.advantages import nanstd, weighted_sum
from grpo.base.sigterm import agreed_or_none
from grpo.config import ResolvedConfig
from grpo.data import datasets
from grpo.data import prompts as data
from grpo.distributed import collectives
from grpo.observe.metrics import reward_and_tool_stats
from grpo.rounds.groups import Scored, gather_scored
from grpo.rounds.producer import Producer

# the policy loss of one evaluation batch: (every process's batch, group size) -> eval loss; None: none
EvalLoss = Callable[[Scored, int], float | None]


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


def greedy(engine: Any, args: ResolvedConfig, rebuild: Callable[[ResolvedConfig], Any]) -> Any:
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


def build(
    dataset: Any, args: ResolvedConfig, source: data.PromptSource, num_processes: int
) -> dict[str | None, Evaluation]:
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
        part = datasets.load_local(part)
        if datasets.is_stream(part):  # evaluation reads every row, in order: an eval stream is read once, here
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
    def __init__(self, dataset: Any, args: ResolvedConfig, source: data.PromptSource, num_processes: int) -> None:
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

    def run(self, evaluator: Evaluator, engine: Any, loss: EvalLoss) -> dict[str, float | None]:
        """The eval_ metrics (the same on every process; None where not finite); `loss`: each batch's eval_loss."""
        acc = evaluator.accelerator
        start = time.perf_counter()
        logged: dict[str, list[float]] = {}
        parts, losses = [], []
        n = len(self.dataset)
        with random_state_kept(), torch.no_grad():
            for first in range(0, n, self.prompts_per_batch):
                rows = [i for i in range(first, min(first + self.prompts_per_batch, n)) for _ in range(self.k)]
                # every process runs every batch, maybe with no rows
                mine = [rows[i] for i in collectives.local_rows(len(rows), acc.process_index, acc.num_processes)]
                examples = [self.dataset[i] for i in mine]
                make = functools.partial(self.share, evaluator.producer, mine, examples, engine, logged)
                local = agreed_or_none(make, acc.num_processes > 1)  # None: SIGTERM here, agreed at the gather
                parts.append(gather_scored(local, acc))
                losses.append(loss(parts[-1], self.k))
        producer = evaluator.producer
        metrics = self.metrics(Scored.concat(parts), producer.rewards, producer.rollouts.uses_tools)
        done = [loss for loss in losses if loss is not None]
        metrics["eval_loss"] = sum(done) / len(done) if done else None
        for name in sorted(logged):  # every process logs the same names (the same functions ran everywhere)
            metrics[f"eval_{name}"] = collectives.process_mean(acc, sum(logged[name]) / len(logged[name]))
        metrics["eval_runtime"] = round(time.perf_counter() - start, 4)
        return metrics

    def share(self, producer: Producer, mine: list[int], examples: list, engine: Any, logged: dict) -> Scored:
        """This process's rows of an evaluation batch, generated and scored (their reward functions' `log_metric`
        calls into `logged`)."""
        generated = producer.generate(mine, examples, source=self.source, engine=engine)
        rewards = torch.zeros(0, len(producer.rewards.names))
        if mine:
            log = lambda name, value: logged.setdefault(name, []).append(float(value))  # noqa: E731
            rewards = producer.score(examples, generated, log)
        return Scored(mine, generated.prompts, generated.rollout, rewards)

    def metrics(self, scored: Scored, rewards: Any, tools: bool) -> dict[str, float | None]:
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


@dataclass(frozen=True)
class Evaluator:
    """What an evaluation needs, and no more: the settings and processes, the producer (its engine, rewards and
    tool loop; evaluation generates and scores through it), the rounds (an asynchronous producer is paused while
    evaluating), the training prompts' settings (for an `eval_dataset` given to `evaluate`) and a builder of an
    engine from other settings (eval_greedy). `run` is given the policy loss of an evaluation batch (`eval_loss`:
    the learner's)."""

    args: ResolvedConfig
    accelerator: Any
    producer: Producer
    rounds: Any  # `grpo.rounds.sequential.Rounds`
    prompts: data.PromptSource
    engine_with: Callable[[ResolvedConfig], Any]  # settings -> an engine on the policy (eval_greedy's top_k=1 copy)

    def due(self, runs: dict[str | None, Evaluation], step: int, max_steps: int, steps_per_epoch: int) -> bool:
        """Whether an eval dataset's strategy evaluates after optimizer step `step`."""
        return any(e.due(step, max_steps, steps_per_epoch) for e in runs.values())

    def run(
        self,
        runs: dict[str | None, Evaluation],
        prefix: str,
        model: torch.nn.Module,
        version: int,
        step: int,
        loss: EvalLoss,
    ) -> dict[str, float | None]:
        """Every eval dataset's metrics (`runs`: the trainer's, or an `eval_dataset`'s built by `build`), from
        `model`'s weights (`version`), after optimizer step `step` (the generator's seed when async), with each
        batch's `loss`."""
        if not runs:
            raise ValueError("evaluate() needs an eval_dataset: pass one to GRPOTrainer(eval_dataset=...) or here.")
        with self.rounds.paused(step):  # async_generation: the producer between rounds
            self.producer.sync(model, version)
            engine = self.producer.engine
            if self.args.eval_greedy:
                engine = greedy(engine, self.args, self.engine_with)
            metrics: dict[str, float | None] = {}
            for name, run in runs.items():
                label = prefix + (f"_{name}" if name else "")
                found = run.run(self, engine, loss)
                metrics.update({label + key[len("eval") :]: value for key, value in found.items()})
        return metrics
