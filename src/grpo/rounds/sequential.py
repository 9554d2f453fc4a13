"""Where a generation batch comes from: one call, `Rounds.next`, for the sequential loop and the asynchronous one.

    generated = rounds.next(position, model, version, state)   # a frozen `GenerationBatch`

`next` takes this process's round (`_take`: here, sync the engine to the learner's weights and produce; in
`grpo.rounds.asynchronous`, the producer thread's round), agrees on SIGTERM with the other processes, gathers
every process's share in process order, keeps the groups with reward spread (DAPO's dynamic sampling, more rounds
while the batch is short) and times each part. The learner then reads the batch and changes nothing in it.

The other hooks (`running`, `paused`, `learning`) are the asynchronous producer's; here they do nothing.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from typing import Any

import torch

from grpo.base.sigterm import agreed_or_none
from grpo.rounds.groups import GenerationBatch, Scored, gather_scored, kept_rows, rows_with_spread
from grpo.rounds.producer import Produced, Producer


class Rounds:
    """A source of generation batches from this process's producer (see the module docstring)."""

    def __init__(self, producer: Producer, accelerator: Any) -> None:
        self.producer, self.accelerator = producer, accelerator

    def next(self, position: int, model: torch.nn.Module, version: int, state: Any) -> GenerationBatch:
        """The generation batch from data position `position` on, every process's rows, sampled from the weights of
        `version` (`model`'s now; an asynchronous producer's may be older). With dynamic_sampling, groups without
        reward spread are dropped and the next positions generated until the batch is full or
        dynamic_sampling_max_attempts rounds have run; `rounds` says how many positions it took."""
        a = self.producer.args
        attempts = a.dynamic_sampling_max_attempts if a.dynamic_sampling else 1
        several = self.accelerator.num_processes > 1
        kept: list[Scored] = []
        logged: list[tuple[str, float]] = []
        rounds = dropped = tokens = 0
        generation_s = scoring_s = gather_s = 0.0
        while rounds < attempts and sum(map(len, kept)) < a.generation_batch_size:
            # None where SIGTERM stopped this process's share, which every process then learns at the gather
            take = functools.partial(self._take, position + rounds, model, version, state)
            produced = agreed_or_none(take, several)
            start = time.perf_counter()
            scored = gather_scored(produced.scored if produced is not None else None, self.accelerator)
            gather_s += time.perf_counter() - start
            assert produced is not None  # one process: SIGTERM raised; several: the gather raised for all
            generation_s, scoring_s = generation_s + produced.generation_s, scoring_s + produced.scoring_s
            logged.extend(produced.logged)
            tokens += sum(sum(mask) for mask in produced.scored.rollout.loss_mask)  # tool results are not sampled
            rounds += 1
            last = scored
            if a.dynamic_sampling:
                keep = rows_with_spread(scored, self.producer.rewards.weights, a)
                dropped += (len(scored) - len(keep)) // a.num_generations
                scored = scored.select(keep)
            kept.append(scored)
        batch = kept_rows(kept, last, a.generation_batch_size, rounds, a.num_generations)
        return GenerationBatch(batch, rounds, dropped, generation_s, scoring_s, gather_s, tokens, tuple(logged))

    def _take(self, position: int, model: torch.nn.Module, version: int, state: Any) -> Produced:
        """This process's round `position`, generated from `model`'s weights (`version`) and scored."""
        raise NotImplementedError

    def running(self, position: int) -> Any:
        """The block in which rounds are made from `position` on (the producer thread runs in it)."""
        return nullcontext()

    def paused(self, step: int) -> Any:
        """An evaluation after optimizer step `step` (the producer waits between rounds)."""
        return nullcontext()

    def learning(self, micro_step: int) -> Any:
        """A micro-step's forward and backward (the global generator seeded from its position)."""
        return nullcontext()

    def halt(self) -> None:
        """Stop making rounds now (SIGTERM: before the processes settle and the group is torn down)."""


class Sequential(Rounds):
    """Rounds made in turn with training: sync the engine to the learner's weights, then produce."""

    def _take(self, position: int, model: torch.nn.Module, version: int, state: Any) -> Produced:
        start = time.perf_counter()
        self.producer.sync(model, version)  # lazily: with steps_per_generation > 1 not after every step
        return self.producer.produce(position, state, synced_s=time.perf_counter() - start)
