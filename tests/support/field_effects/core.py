"""Effects of the output and completion-log fields."""

from __future__ import annotations

import os

import pytest

from support.field_effects import Setting, effect


@effect("output_dir", "elsewhere")
def _output_dir(s: Setting):
    s.value = str(s.tmp_path / "elsewhere")
    trainer = s.train(save_strategy="steps", save_steps=1)
    assert os.path.isdir(os.path.join(s.value, "checkpoint-1"))
    assert os.path.isfile(os.path.join(s.value, "metrics.jsonl"))
    assert not os.path.exists(s.tmp_path / "out")
    assert trainer.args.output_dir == s.value


@effect("auto_find_batch_size", True)
def _auto_find_batch_size(s: Setting):
    # TRL 1.16 refuses it too: halving the batch would split the groups that advantages compare
    with pytest.raises(ValueError, match="auto_find_batch_size is not supported.*groups"):
        s.config()


@effect("log_completions", True)
def _log_completions(s: Setting):
    s.train()
    written = os.listdir(s.tmp_path / "out" / "completions")
    assert written == ["completions_00001.parquet"]


@effect("num_completions_to_print", 2)
def _num_completions_to_print(s: Setting):
    import pandas as pd
    from rich.console import Console

    trainer = s.trainer(log_completions=True)
    trainer.train()  # the log is flushed at the logging step; flush the recorded rows again to a captured console
    console = Console(record=True, width=200)
    trainer.parts.completion_log.flush(1, console)
    printed = console.export_text()
    frame = pd.read_parquet(s.tmp_path / "out" / "completions" / "completions_00001.parquet")
    assert len(frame) == 8  # every row is saved, two are printed: rows are separated by lines starting with ├
    assert printed.count("\n├") + 1 == 2
