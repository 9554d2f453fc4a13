"""Tool loops across processes: every process joins every round of the loop (a process whose rows are done still
takes part in the round's generation, whose collectives would otherwise hang), and two processes make the same
update and log the same tool metrics as one process on the same global batch."""

from __future__ import annotations

import json
import os

import pytest
import torch

from support.launch import job_script, side_by_side, terminated, torchrun

JOB = job_script("agent_job.py")


def launch(nproc, out, *mode):
    torchrun(nproc, JOB, out, *mode)
    return launch_output(out)


def launch_output(out):
    with open(os.path.join(out, "row.json")) as f:
        return torch.load(os.path.join(out, "update.pt")), json.load(f)


@pytest.mark.parametrize("mode", [("rendered",), pytest.param(("fsdp",), marks=pytest.mark.slow)])
def test_processes_whose_rows_finish_at_different_rounds(tmp_path, mode):
    """Appended turns, then (in the same processes) turns sampled after rendered histories that drop each earlier
    turn's reasoning, trained as token trees: two processes update like one."""
    (one, row1), (two, row2) = side_by_side(
        lambda: launch(1, tmp_path / "one", *mode), lambda: launch(2, tmp_path / "two", *mode)
    )
    results = [(one, row1, two, row2)]
    if mode == ("rendered",):
        results.append((*launch_output(tmp_path / "one" / "rendered"), *launch_output(tmp_path / "two" / "rendered")))
    for k, (one, row1, two, row2) in enumerate(results):
        assert row1["rendered"] is row2["rendered"] is (k == 1) and row2["tree"] is (k == 1)
        if k == 1:  # no follow-up turn was sampled after an earlier turn's reasoning
            assert row1["kept_reasoning"] == row2["kept_reasoning"] == 0
        # process 1's rows were done after one round; it still joined rounds 2 and 3 (with no rows)
        assert row1["engine_calls"] == [4] and row2["engine_calls"] == [4, 4]
        assert row1["tools/call_frequency"] == row2["tools/call_frequency"] == 2.0  # (3 + 1) calls / 2 per group
        for key in ("reward", "reward_std", "completions/mean_length", "loss", "grad_norm"):
            assert row2[key] == pytest.approx(row1[key], rel=1e-5, abs=1e-7), key
        for name in one:
            torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-7)
        assert any(u.abs().sum() > 0 for u in one.values())


def test_sigterm_while_a_tool_hangs_on_one_process_stops_both_at_the_loops_check(tmp_path):
    """Process 1's tool call hangs while process 0 goes on to the turn's generation (a collective) and the loop's
    next check: on SIGTERM process 1 ends its wait, still joins the turn's generation with no rows, and both raise
    the preemption together at the check; both exit 143 promptly, none killed by the launcher. Under torchrun
    itself, which passes the SIGTERM on (the other SIGTERM tests fork their processes)."""
    # process 0 reaches the loop's check meanwhile
    terminated(JOB, tmp_path, "hang", ready="hung", delay=0.5, fresh=True)
