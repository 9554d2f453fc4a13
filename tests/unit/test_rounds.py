"""One round path (`grpo.rounds.sequential.Rounds.next`): a generation batch comes back from one call, gathered,
filtered (DAPO), timed and frozen, the same for the sequential and the asynchronous loop. Here with a scripted
producer on one process: no trainer is built."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from grpo.base.records import Rollout
from grpo.rounds.groups import GenerationBatch, Scored
from grpo.rounds.producer import Produced
from grpo.rounds.sequential import Sequential

G = 2


class ScriptedProducer:
    """Rounds whose rewards are scripted per data position: a (rows,) list each; rows are 2 groups of G."""

    def __init__(self, rewards_by_position, dynamic=False, attempts=4, batch=4):
        self.args = SimpleNamespace(
            dynamic_sampling=dynamic,
            dynamic_sampling_max_attempts=attempts,
            dynamic_sampling_std_threshold=1e-6,
            generation_batch_size=batch,
            num_generations=G,
        )
        self.rewards = SimpleNamespace(weights=torch.ones(1))
        self.script = rewards_by_position
        self.synced, self.states = [], []

    def sync(self, model, version):
        self.synced.append(version)

    def produce(self, position, state=None, synced_s=0.0):
        self.states.append(state)
        values = self.script[position]
        rows = [10 * position + i // G for i in range(len(values))]
        rollout = Rollout(
            [[1]] * len(values), [[2, 3]] * len(values), [[0.0, 0.0]] * len(values), [False] * len(values)
        )
        scored = Scored(rows, ["p"] * len(values), rollout, torch.tensor(values).unsqueeze(1))
        return Produced(scored, version=7, generation_s=1.0 + synced_s, scoring_s=0.5, logged=(("r", position),))


ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0)


def test_a_round_comes_back_whole_and_frozen():
    producer = ScriptedProducer({3: [0.0, 1.0, 1.0, 0.0]})
    state = object()
    generated = Sequential(producer, ONE_PROCESS).next(3, None, 5, state)
    assert isinstance(generated, GenerationBatch)
    assert generated.batch.rows == [30, 30, 31, 31] and generated.rounds == 1 and generated.groups_dropped == 0
    assert generated.tokens == 8 and generated.logged == (("r", 3),)
    assert generated.generation_s >= 1.0 and generated.scoring_s == 0.5 and generated.gather_s >= 0.0
    assert producer.synced == [5] and producer.states == [state]  # synced to the version asked; the state given
    with pytest.raises(dataclasses.FrozenInstanceError):
        generated.rounds = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        Produced(generated.batch, 1, 0.0, 0.0).version = 2


def test_dynamic_sampling_draws_positions_until_the_batch_is_full():
    # position 0: group 0 flat, group 1 spread; position 1: both flat; position 2: both spread
    script = {0: [1.0, 1.0, 0.0, 1.0], 1: [0.0, 0.0, 1.0, 1.0], 2: [0.0, 1.0, 1.0, 0.0]}
    producer = ScriptedProducer(script, dynamic=True)
    generated = Sequential(producer, ONE_PROCESS).next(0, None, 1, None)
    assert generated.rounds == 3 and generated.groups_dropped == 3
    assert generated.batch.rows == [1, 1, 20, 20]  # the kept groups in order, cut at the batch size
    assert generated.logged == (("r", 0), ("r", 1), ("r", 2))
    assert generated.scoring_s == 1.5 and generated.tokens == 24


def test_dynamic_sampling_without_spread_trains_the_last_round_and_says_so(caplog):
    producer = ScriptedProducer({0: [1.0] * 4, 1: [0.0] * 4}, dynamic=True, attempts=2)
    with caplog.at_level(logging.WARNING, logger="grpo"):
        generated = Sequential(producer, ONE_PROCESS).next(0, None, 1, None)
    assert generated.rounds == 2 and generated.batch.rows == [10, 10, 11, 11]
    assert "no group had reward spread in 2 rounds" in caplog.text
