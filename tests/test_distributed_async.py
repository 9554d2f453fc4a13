"""Several processes (torchrun, gloo on CPU): each samples its own share of a group from its own random streams
(sequential and async alike, TRL's device-specific seed), and async generation on two processes trains on every
process's gathered rounds, is reproducible and resumes exactly from a checkpoint (see ddp_async_job.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from test_async import untimed
from test_distributed import torchrun

JOB = os.path.join(os.path.dirname(__file__), "ddp_async_job.py")
STEPS = 4


def launch(out, model_dir, mode, resume=None):
    torchrun(2, JOB, out, model_dir, mode, *([resume] if resume else []))
    seen = [json.load(open(os.path.join(out, f"seen_{rank}.json"))) for rank in (0, 1)]
    rows = json.load(open(os.path.join(out, "log_history.json")))
    return seen, torch.load(os.path.join(out, "final_params.pt")), rows


@pytest.fixture(scope="module")
def async_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    return out, launch(out, tiny_model_dir, "async")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_group_straddling_two_processes_gets_distinct_samples(tiny_model_dir, tmp_path, async_run, mode):
    """Each group's 4 completions are 2 from each process: the two processes' halves differ (they were the same
    draws on both before each process had a stream of its own)."""
    seen, _, _ = async_run[1] if mode == "async" else launch(tmp_path, tiny_model_dir, mode)
    for first, second in list(zip(*seen))[:STEPS]:
        assert len(first["completions"]) == len(second["completions"]) == 2
        assert first["completions"] != second["completions"]


def test_async_on_two_processes_trains_on_both_processes_rounds(async_run):
    """Every step's logged reward is the mean over both processes' completions of the round it trained on, and
    round q sampled the policy of step q - 1 (max_staleness 1)."""
    _, params, rows = async_run[1]
    seen = async_run[1][0]
    steps = [row for row in rows if "reward" in row]
    assert len(steps) == STEPS
    for k, row in enumerate(steps):
        rewards = seen[0][k]["rewards"] + seen[1][k]["rewards"]
        assert row["reward"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
        assert seen[0][k]["step"] == seen[1][k]["step"] == max(k - 1, 0)  # the publication's trainer state
        assert row["sample/staleness_max"] == min(k, 1)
    assert any(p.abs().sum() > 0 for p in params.values())


def test_async_on_two_processes_is_reproducible_and_resumes_exactly(tiny_model_dir, tmp_path, async_run):
    straight, (_, params, rows) = async_run
    _, again, rows_again = launch(tmp_path / "again", tiny_model_dir, "async")  # other timings, the same run
    assert all(torch.equal(again[n], params[n]) for n in params)
    assert untimed(rows_again) == untimed(rows)
    resumed = tmp_path / "resumed"  # from step 2 of the first run: its in-flight rounds regenerated per process
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    assert sorted(p for p in os.listdir(resumed / "checkpoint-2") if p.startswith("inflight_")) == [
        "inflight_0.json",
        "inflight_0.tensors",
        "inflight_1.json",
        "inflight_1.tensors",
    ]
    _, after, rows_after = launch(resumed, tiny_model_dir, "async", "checkpoint-2")
    assert all(torch.equal(after[n], params[n]) for n in params)
    assert untimed(rows_after, resumed=True) == untimed(rows, resumed=True)
