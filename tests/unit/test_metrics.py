"""`grpo.observe.metrics` on its own: a logging window's averages, the rows of metrics.jsonl, the window a checkpoint
keeps, and a resume dropping the rows a killed run wrote after its checkpoint."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from grpo.observe.metrics import MetricsLogger


def logger(tmp_path):
    accelerator = SimpleNamespace(is_main_process=True, trackers=[])
    return MetricsLogger(str(tmp_path), accelerator, total_steps=10, show_progress=False)


def rows(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_window_is_averaged_ignoring_nan_and_reset(tmp_path):
    m = logger(tmp_path)
    m.add("loss", 1.0)
    m.add_many({"loss": 2.0, "grad_norm": 0.5})
    m.add("grad_norm", math.nan)  # a skipped fp16 step: no norm
    m.add("kl", math.nan)
    row = m.log(step=2, epoch=0.123456)
    assert row == {"step": 2, "epoch": 0.1235, "loss": 1.5, "grad_norm": 0.5, "kl": None}
    assert m.state_dict() == {}  # the window starts afresh
    m.add("loss", 4.0)
    m.log(step=4, epoch=0.25)
    assert rows(tmp_path) == [row, {"step": 4, "epoch": 0.25, "loss": 4.0}]


def test_the_window_round_trips_through_a_checkpoint(tmp_path):
    m = logger(tmp_path)
    m.add_many({"loss": 1.0, "reward": 0.25})
    saved = json.loads(json.dumps(m.state_dict()))  # as trainer_state.json holds it
    m.add("loss", 100.0)  # after the checkpoint: lost with the killed run
    fresh = logger(tmp_path)
    fresh.load_state_dict(saved)
    fresh.add("loss", 3.0)
    assert fresh.log(step=2, epoch=0.2) == {"step": 2, "epoch": 0.2, "loss": 2.0, "reward": 0.25}


def test_resume_drops_rows_written_after_the_checkpoint(tmp_path):
    m = logger(tmp_path)
    for step in (1, 2, 3, 4):
        m.add("loss", float(step))
        m.log(step, step / 10)
    resumed = logger(tmp_path)
    resumed.resume(2)  # the run is resumed from checkpoint-2: steps 3 and 4 will be logged again
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]
    resumed.add("loss", 30.0)
    resumed.log(3, 0.3)
    assert [(r["step"], r["loss"]) for r in rows(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_only_the_main_process_writes(tmp_path):
    accelerator = SimpleNamespace(is_main_process=False, trackers=[])
    m = MetricsLogger(str(tmp_path), accelerator, total_steps=1, show_progress=False)
    m.add("loss", 1.0)
    assert m.log(1, 1.0)["loss"] == 1.0  # every process computes the row (the trainer keeps it in log_history)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("show", [False, True])
def test_progress_shows_the_logged_values(tmp_path, show, capsys):
    accelerator = SimpleNamespace(is_main_process=True, trackers=[])
    with MetricsLogger(str(tmp_path), accelerator, total_steps=1, show_progress=show) as m:
        m.add_many({"reward": 0.75, "loss": -0.5})
        m.log(1, 1.0)
    shown = capsys.readouterr().err
    assert ("reward=0.75" in shown and "loss=-0.5" in shown) == show
