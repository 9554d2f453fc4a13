"""Several processes (torchrun, gloo on CPU): each samples its own share of a group from its own random streams
(sequential and async alike, TRL's device-specific seed), and async generation on two processes trains on every
process's gathered rounds, is reproducible and resumes exactly from a checkpoint (see ddp_async_job.py), with
the policy replicated (DDP) or sharded (FSDP2, DeepSpeed ZeRO-3: the producer samples a whole snapshot)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from support.launch import job_script, needs_deepspeed, terminated, torchrun
from support.runs import untimed

JOB = job_script("ddp_async_job.py")
STEPS = 4


def resumed_from(straight, out, model_dir, mode, checkpoint="checkpoint-2"):
    """`mode` run resumed in `out` from `straight`'s checkpoint (its in-flight rounds regenerated per process)."""
    out.mkdir()
    shutil.copytree(straight / checkpoint, out / checkpoint)
    return launch(out, model_dir, mode, checkpoint)


def launch(out, model_dir, mode, resume=None):
    torchrun(2, JOB, out, model_dir, mode, *([resume] if resume else []))
    return outcome(out)


def outcome(out):
    seen = [json.load(open(os.path.join(out, f"seen_{rank}.json"))) for rank in (0, 1)]
    rows = json.load(open(os.path.join(out, "log_history.json")))
    return seen, torch.load(os.path.join(out, "final_params.pt")), rows


@pytest.fixture(scope="module")
def straight_runs(tiny_model_dir, tmp_path_factory):
    """The straight sync and async runs, then the async run again and the async run resumed from its step 2, one
    after the other in a single launch (a trainer each; the other resumes below are fresh launches)."""
    out = tmp_path_factory.mktemp("straight")
    runs = ("sync", "async", "again=async", "resumed=async@async/checkpoint-2")
    torchrun(2, JOB, out, tiny_model_dir, "--runs", *runs)
    return out


@pytest.fixture(scope="module")
def async_run(straight_runs):
    return straight_runs / "async", outcome(straight_runs / "async")


@pytest.fixture(scope="module")
def sync_run(straight_runs):
    return outcome(straight_runs / "sync")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_group_straddling_two_processes_gets_distinct_samples(async_run, sync_run, mode):
    """Each group's 4 completions are 2 from each process: the two processes' halves differ (they were the same
    draws on both before each process had a stream of its own)."""
    seen, _, _ = async_run[1] if mode == "async" else sync_run
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


def test_async_on_two_processes_is_reproducible_and_resumes_exactly(straight_runs, async_run):
    straight, (_, params, rows) = async_run
    _, again, rows_again = outcome(straight_runs / "again")  # other timings, the same run
    assert all(torch.equal(again[n], params[n]) for n in params)
    assert untimed(rows_again) == untimed(rows)
    inflight = sorted(p for p in os.listdir(straight / "checkpoint-2") if p.startswith("inflight_"))
    assert inflight == ["inflight_0.json", "inflight_0.tensors", "inflight_1.json", "inflight_1.tensors"]
    _, after, rows_after = outcome(straight_runs / "resumed")
    assert all(torch.equal(after[n], params[n]) for n in params)
    assert untimed(rows_after, resumed=True) == untimed(rows, resumed=True)


@pytest.mark.parametrize("sharded", ["fsdp", pytest.param("zero3", marks=needs_deepspeed)])
def test_a_sharded_policy_trains_async_like_a_replicated_one_and_resumes_exactly(
    tiny_model_dir, tmp_path, async_run, sharded
):
    """FSDP2 or ZeRO-3 through accelerate: each publication gathers the policy whole (every process), the producer
    samples a whole snapshot made before sharding. The rounds are those of the DDP run (the first two sample the
    initial weights; the later ones weights equal up to the reduction order) and so are the updates; a resume from
    step 2 (sharded checkpoint, in-flight rounds) is bit-identical to the straight sharded run."""
    ddp_seen, ddp_params, ddp_rows = async_run[1]
    out = tmp_path / "straight"
    seen, params, rows = launch(out, tiny_model_dir, f"async+{sharded}")
    for rank in (0, 1):
        assert [r["completions"] for r in seen[rank][:2]] == [r["completions"] for r in ddp_seen[rank][:2]]
    steps, ddp_steps = ([r for r in h if "loss" in r] for h in (rows, ddp_rows))
    assert len(steps) == STEPS
    for row, ddp in zip(steps, ddp_steps):
        assert row["reward"] == pytest.approx(ddp["reward"], rel=1e-6)
        assert row["loss"] == pytest.approx(ddp["loss"], rel=1e-4, abs=1e-6)
    for name in ddp_params:
        torch.testing.assert_close(params[name], ddp_params[name], rtol=1e-4, atol=1e-4)
    _, after, rows_after = resumed_from(out, tmp_path / "resumed", tiny_model_dir, f"async+{sharded}")
    assert all(torch.equal(after[n], params[n]) for n in params)
    assert untimed(rows_after, resumed=True) == untimed(rows, resumed=True)


@pytest.mark.parametrize("delay", [0.2, 0.9])
def test_sigterm_on_two_async_processes_saves_and_the_resume_is_exact(tiny_model_dir, tmp_path, async_run, delay):
    """torchrun passes SIGTERM to both processes mid-run (a slow reward: mid-round): each saves the last complete
    step and exits 143 within seconds, nothing hangs; the resume from that checkpoint ends as the straight run."""
    _, params, rows = async_run[1]
    out = tmp_path / "run"
    terminated(JOB, out, tiny_model_dir, "async", ready="checkpoint-1", delay=delay, JOB_REWARD_SLEEP="0.3")
    checkpoints = sorted(p for p in os.listdir(out) if p.startswith("checkpoint-"))
    assert checkpoints and not (out / "final_params.pt").exists()
    _, after, rows_after = launch(out, tiny_model_dir, "async", checkpoints[-1])
    assert all(torch.equal(after[n], params[n]) for n in params)
    assert untimed(rows_after, resumed=True) == untimed(rows, resumed=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_while_one_process_waits_stops_both_together_and_saves_the_last_step(
    tiny_model_dir, tmp_path, async_run, sync_run, mode
):
    """SIGTERM while one process's reward function hangs in step 3 and the other waits for it in the round's
    gather: the hung one stops its wait and hands the gather nothing, so both stop there together (not one in a
    barrier, the other in the gather, until the launcher kills them), save step 2 (no periodic checkpoint is due)
    and exit 143; the resume from it ends as the straight run."""
    _, params, rows = async_run[1] if mode == "async" else sync_run
    out = tmp_path / "run"
    hang = dict(JOB_HANG_RANK="1", JOB_HANG_CALL="2", JOB_SAVE_STEPS="100")
    terminated(JOB, out, tiny_model_dir, mode, ready="hung", delay=0.5, **hang)
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-2"]
    _, after, rows_after = resumed_from(out, tmp_path / "resumed", tiny_model_dir, mode)
    assert all(torch.equal(after[n], params[n]) for n in params)
    assert untimed(rows_after, resumed=True) == untimed(rows, resumed=True)


def test_sigterm_while_one_process_waits_in_an_evaluation_saves_the_step_on_both(tiny_model_dir, tmp_path, async_run):
    """The evaluation after step 2: process 1's reward function hangs on an eval row, process 0 waits in the eval
    batch's gather. SIGTERM: both stop there together; step 2 is complete, so both save it (no periodic checkpoint
    was due) and exit 143; the resume from it ends as the straight run (evaluating changes nothing it trains)."""
    _, params, rows = async_run[1]
    out = tmp_path / "run"
    hang = dict(JOB_HANG_RANK="1", JOB_HANG_CALL="eval", JOB_SAVE_STEPS="100", JOB_EVAL="1")
    terminated(JOB, out, tiny_model_dir, "async", ready="hung", delay=0.5, **hang)
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-2"]
    _, after, rows_after = resumed_from(out, tmp_path / "resumed", tiny_model_dir, "async")
    assert all(torch.equal(after[n], params[n]) for n in params)
    trained = [r for r in untimed(rows_after, resumed=True) if not any(k.startswith("eval_") for k in r)]
    assert trained == untimed(rows, resumed=True)
