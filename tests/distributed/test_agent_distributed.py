"""Tool loops across processes: every process joins every round of the loop (a process whose rows are done still
takes part in the round's generation, whose collectives would otherwise hang), and two processes make the same
update and log the same tool metrics as one process on the same global batch."""

from __future__ import annotations

import json
import os

import pytest
import torch

from support import side_by_side, terminated, torchrun

JOB = os.path.join(os.path.dirname(os.path.dirname(__file__)), "agent_job.py")


def launch(nproc, out, *mode):
    torchrun(nproc, JOB, out, *mode)
    with open(os.path.join(out, "row.json")) as f:
        return torch.load(os.path.join(out, "update.pt")), json.load(f)


@pytest.mark.parametrize("mode", [(), pytest.param(("fsdp",), marks=pytest.mark.slow)])
def test_processes_whose_rows_finish_at_different_rounds(tmp_path, mode):
    (one, row1), (two, row2) = side_by_side(
        lambda: launch(1, tmp_path / "one", *mode), lambda: launch(2, tmp_path / "two", *mode)
    )
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
    the preemption together at the check; both exit 143 promptly, none killed by the launcher."""
    terminated(JOB, tmp_path, "hang", ready="hung", delay=0.5)  # process 0 reaches the loop's check meanwhile
