"""The rollout side of training behind one seam: dataset rows in, this process's completions out, generated and
scored, from the policy weights it was explicitly given.

    producer.sync(model, version)          # the engine samples `model`, known as weight version `version`
    produced = producer.produce(position)  # data position -> this process's rows, generated and scored

`grpo.rounds.sequential.Rounds.next` turns rounds into the learner's generation batch: it gathers every process's
round (`grpo.rounds.groups.gather_scored`) and keeps or drops groups (dynamic sampling); the learner (the trainer)
computes advantages and trains. Evaluation generates and scores through the same producer (`generate` and `score`,
with its own rows, prompts and engine). A `Produced` round is frozen: whoever adds to it makes a new one.

Weight versions: the learner numbers its policy (`GRPOTrainer.policy_version`: a new number whenever the weights
change, by an optimizer step or a load); `sync` pushes the weights to the engine only when the version differs
from the one it last pushed, and every `Produced` says which version sampled it. What reward functions log with
`log_metric` travels with the round (`Produced.logged`) instead of being written into the learner's window from
inside the producer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo.agent import Generated, Rollouts
from grpo.base.records import Rollout
from grpo.config import ResolvedConfig
from grpo.data import datasets
from grpo.data import prompts as data
from grpo.rewards.calling import RewardFunctions
from grpo.rounds.groups import Scored


@dataclass(frozen=True)
class Produced:
    """One round of this process's rows: generated (tool rounds included) and scored, not gathered."""

    scored: Scored  # this process's rows, prompts, rollout, rewards and log_extra columns
    version: int | None  # the weight version that sampled it (None: never synced, the engine's own weights)
    generation_s: float  # generating, and bringing the engine the weights it samples
    scoring_s: float
    logged: tuple[tuple[str, float], ...] = ()  # reward functions' log_metric calls, in order (then the rounds')
    producer_wait_s: float = 0.0  # an asynchronous producer's wait for the learner's weights before this round


class Producer:
    """Generates and scores this process's share of the data positions (see the module docstring)."""

    def __init__(
        self,
        rollouts: Rollouts,
        rewards: RewardFunctions,
        dataset: Any,
        args: ResolvedConfig,
        process_index: int,
        num_processes: int,
        trainer_state: Any,
        engine: Any = None,
    ) -> None:
        self.rollouts = rollouts
        self.own_engine = engine  # None: the rollouts' engine (the trainer's); an asynchronous producer's own
        self.rewards = rewards
        self.dataset = dataset
        self.args = args
        self.process_index, self.num_processes = process_index, num_processes
        self.trainer_state = trainer_state  # what reward functions get as `trainer_state` (a copy each)
        self.version: int | None = None  # the weight version the engine holds (None: not synced yet)

    @property
    def engine(self) -> Any:
        return self.own_engine or self.rollouts.engine

    def sync(self, model: torch.nn.Module, version: int, group: Any = None) -> None:
        """Make the engine sample `model`'s current weights, known as `version` (nothing to do when it holds that
        version already). Every process calls it: gathering a sharded model is collective; a server's push is
        shared over `group` when given (`grpo.rounds.asynchronous`)."""
        if self.version != version:
            self.engine.sync_weights(model, **({"group": group} if group is not None else {}))
            self.version = version

    def rows(self, position: int) -> list[int]:
        """This process's share of data position `position`'s rows (`data.generation_rows`)."""
        size = datasets.dataset_size(self.dataset)
        return data.generation_rows(position, size, self.args, self.process_index, self.num_processes)

    def generate(
        self, rows: Sequence[int], examples: Sequence[dict] | None = None, source: Any = None, engine: Any = None
    ) -> Generated:
        """Completions of `rows` (their `examples`: the training dataset's by default) with the engine's current
        weights; an evaluation passes its own prompt source and engine."""
        if examples is None:
            examples = [self.dataset[i] for i in rows]
        return self.rollouts(rows, examples, source=source, engine=engine or self.own_engine)

    def score(
        self,
        examples: Sequence[dict],
        generated: Generated,
        log_metric: Callable[[str, float], None],
        log_extra: Callable[[str, list], None] | None = None,
        state: Any = None,
    ) -> torch.Tensor:
        """(rows, functions) rewards of `generated`'s completions of `examples`; reward functions' log_metric calls
        go to `log_metric`, their log_extra columns to `log_extra`; they get `state` as `trainer_state` (None: the
        producer's, the trainer's own)."""
        extra = log_extra or (lambda name, values: None)
        g, state = generated, self.trainer_state if state is None else state
        return self.rewards(list(examples), g.rollout, state, log_metric, extra, g.prompts, g.columns)

    def produce(
        self,
        position: int,
        state: Any = None,
        behaviour: Callable[[Rollout], list[torch.Tensor | None]] | None = None,
        synced_s: float = 0.0,
    ) -> Produced:
        """Data position `position`: this process's rows, generated with the weights of the last `sync` (which took
        `synced_s`, counted as generation), scored with `state` as the reward functions' `trainer_state` (None: the
        trainer's); `behaviour` gives each row's behaviour-policy log-probs (an asynchronous producer's)."""
        rows = self.rows(position)
        examples = [self.dataset[i] for i in rows]
        start = time.perf_counter()
        generated = self.generate(rows, examples)
        rollout = generated.rollout
        if behaviour is not None:
            rollout = dataclasses.replace(rollout, behaviour_logps=behaviour(rollout))
        scoring = time.perf_counter()
        logged: list[tuple[str, float]] = []
        columns: dict[str, list] = {}
        rewards = self.score(
            examples,
            generated,
            lambda name, value: logged.append((name, float(value))),
            lambda name, values: columns.__setitem__(name, list(values)),
            state,
        )
        scored = Scored(rows, generated.prompts, rollout, rewards, columns)
        end = time.perf_counter()
        return Produced(scored, self.version, synced_s + scoring - start, end - scoring, tuple(logged))
