"""DAPO dynamic sampling (groups without reward spread dropped, more prompts generated until the batch is full)
and the completions table/parquet of log_completions."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
import torch
from datasets import Dataset

from grpo import GRPOTrainer
from grpo.distributed.collectives import local_rows
from grpo.rounds.groups import groups_with_spread, rows_of_groups
from support.rewards import text_of
from support.runs import cfg, params


def test_groups_with_spread_hand_computed():
    nan = float("nan")
    rewards = torch.tensor(
        [
            [1.0],
            [1.0],
            [1.0],
            [1.0],  # no spread
            [0.0],
            [1.0],
            [0.0],
            [1.0],  # std 0.577
            [nan],
            [nan],
            [nan],
            [2.0],  # one scorable completion: no std
            [0.5],
            [0.5],
            [0.5],
            [0.5 + 1e-3],
        ]
    )  # std 5e-4
    keep = groups_with_spread(rewards, torch.ones(1), 4, threshold=1e-6)
    assert keep.tolist() == [False, True, False, True]
    assert groups_with_spread(rewards, torch.ones(1), 4, threshold=1e-3).tolist() == [False, True, False, False]
    # two functions: the weighted sum decides (here the second cancels the first's spread)
    two = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    assert groups_with_spread(two, torch.tensor([1.0, 1.0]), 4, 1e-6).tolist() == [False]
    assert groups_with_spread(two, torch.tensor([1.0, 2.0]), 4, 1e-6).tolist() == [True]
    assert rows_of_groups(torch.tensor([False, True, True]), 2) == [2, 3, 4, 5]
    assert [list(local_rows(10, p, 3)) for p in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


def mixed_dataset(n=16):
    """Even rows: every completion gets the same reward. Odd rows: the reward follows the completion length."""
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"Say {i}"}], "kind": "flat" if i % 2 == 0 else "spread"}
            for i in range(n)
        ]
    )


def kind_reward(completions, kind, log_extra=None, **kwargs):
    if log_extra is not None:
        log_extra("kind", kind)
    return [1.0 if k == "flat" else len(text_of(c)) / 8.0 for c, k in zip(completions, kind)]


def train_and_watch(trainer):
    seen = []
    original = trainer._loss_and_backward

    def spy(batch):
        seen.append(batch)
        return original(batch)

    trainer._loss_and_backward = spy
    trainer.train()
    return seen


def test_dynamic_sampling_trains_only_groups_with_spread(tiny_model_dir, tmp_path):
    # 2 prompts x 4 completions per batch, shuffled prompts: flat groups are dropped and refilled
    args = cfg(tmp_path, dynamic_sampling=True, dynamic_sampling_max_attempts=8, max_steps=3)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=kind_reward, train_dataset=mixed_dataset(), args=args)
    drawn = []  # every round scored (one process: this process's round is the whole round)
    take = trainer.parts.rounds._take
    trainer.parts.rounds._take = lambda *a: (produced := take(*a), drawn.append(produced.scored))[0]
    batches = train_and_watch(trainer)
    data = mixed_dataset()
    for batch in batches:
        assert len(batch.group) == 8  # full
        assert {data[int(row)]["kind"] for row in batch.group} == {"spread"}
    for batch in batches:  # the dapo token count N is the kept batch's (spg = 1: the micro-batch is the batch)
        assert batch.num_items_in_batch == batch.mask.sum().item() > 0
    rows = trainer.state.log_history
    # every flat group drawn is dropped, and so is a spread-kind group whose completions all scored the same
    groups = [part.rewards[k : k + 4, 0] for part in drawn for k in range(0, len(part), 4)]
    flat = sum(data[r]["kind"] == "flat" for part in drawn for r in part.rows[::4])
    all_equal = sum(bool((g == g[0]).all()) for g in groups)
    assert sum(r["dynamic_sampling/groups_dropped"] for r in rows) == all_equal >= flat > 0
    # the data position moved by every round run, more than one per step
    assert trainer.parts.loop.data_position == len(drawn) == sum(r["dynamic_sampling/rounds"] for r in rows) > 3


def test_dynamic_sampling_short_batch_trains_on_what_it_has(tiny_model_dir, tmp_path, caplog):
    def spread_only_for_row_1(completions, kind, **kwargs):
        return kind_reward(completions, kind)

    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"Say {i}"}], "kind": "spread" if i == 1 else "flat"}
            for i in range(8)
        ]
    )
    args = cfg(tmp_path, dynamic_sampling=True, dynamic_sampling_max_attempts=2, shuffle_dataset=False)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=spread_only_for_row_1, train_dataset=data, args=args)
    with caplog.at_level(logging.WARNING, logger="grpo"):
        batches = train_and_watch(trainer)
    assert len(batches[0].group) == 4 and set(batches[0].group.tolist()) == {1}  # one group of two wanted
    assert "1 of 2 groups have reward spread after 2 rounds" in caplog.text


def test_dynamic_sampling_without_any_spread_makes_a_zero_update(tiny_model_dir, tmp_path, caplog):
    data = Dataset.from_list([{"prompt": f"Say {i}", "kind": "flat"} for i in range(8)])
    args = cfg(tmp_path, dynamic_sampling=True, dynamic_sampling_max_attempts=2)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=kind_reward, train_dataset=data, args=args)
    before = params(trainer.model)
    with caplog.at_level(logging.WARNING, logger="grpo"):
        trainer.train()
    assert "no group had reward spread in 2 rounds" in caplog.text
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_log_completions_prints_a_table_and_writes_parquet(tiny_model_dir, tmp_path, capsys):
    args = cfg(tmp_path, log_completions=True, num_completions_to_print=3, max_steps=2, disable_tqdm=False)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=kind_reward, train_dataset=mixed_dataset(), args=args)
    trainer.train()
    out = tmp_path / "out" / "completions"
    assert sorted(p.name for p in out.iterdir()) == ["completions_00001.parquet", "completions_00002.parquet"]
    frame = pd.read_parquet(out / "completions_00002.parquet")
    assert list(frame.columns) == ["step", "prompt", "completion", "kind_reward", "kind", "advantage"]
    assert len(frame) == 8 and (frame["step"] == 2).all()
    assert frame["prompt"].str.contains("<|im_start|>assistant", regex=False).all()  # the prompt as the model saw it
    flat = frame[frame["kind"] == "flat"]
    assert (flat["kind_reward"] == 1.0).all() and (flat["advantage"] == 0.0).all()
    printed = capsys.readouterr().err
    assert "Completions at step 1" in printed and "Completions at step 2" in printed


@pytest.mark.parametrize(
    "field, value", [("dynamic_sampling_max_attempts", 0), ("dynamic_sampling_std_threshold", -1.0)]
)
def test_dynamic_sampling_settings_checked(field, value, tmp_path):
    with pytest.raises(ValueError, match=field):
        cfg(tmp_path, **{field: value})
