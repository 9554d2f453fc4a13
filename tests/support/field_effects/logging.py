"""Effects of the logging and tracker fields (`grpo.observe.reporting`, `grpo.observe.metrics`)."""

from __future__ import annotations

import contextlib
import logging
import os
from types import SimpleNamespace

import pytest

from support.field_effects import Setting, effect


def _steps(trainer) -> list[int]:
    return [row["step"] for row in trainer.state.log_history]


@contextlib.contextmanager
def _levels_restored():
    """The checks change process-wide log levels: put them back."""
    import transformers

    grpo_logger = logging.getLogger("grpo")
    level, handlers, verbosity = grpo_logger.level, list(grpo_logger.handlers), transformers.logging.get_verbosity()
    try:
        yield
    finally:
        grpo_logger.setLevel(level)
        grpo_logger.handlers[:] = handlers
        transformers.logging.set_verbosity(verbosity)


def _event_dirs(root) -> list[str]:
    return sorted(
        os.path.relpath(path, root) for path, _, files in os.walk(root) if any("tfevents" in f for f in files)
    )


def _finished(trainer) -> None:
    for tracker in trainer.accelerator.trackers:
        tracker.finish()


SUMMARY_KEYS = {
    "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss", "epoch", "step"
}  # fmt: skip


@effect("logging_strategy", "no")
def _logging_strategy(s: Setting):
    trainer = s.train(max_steps=2)
    # no step's row; as the HF Trainer, train() still ends log_history with its summary record
    assert [sorted(row) for row in trainer.state.log_history] == [sorted(SUMMARY_KEYS)]
    assert not os.path.exists(s.tmp_path / "out" / "metrics.jsonl")


@effect("logging_steps", 2)
def _logging_steps(s: Setting):
    assert _steps(s.train(max_steps=3)) == [2, 3]  # every 2 steps, and the last


@effect("logging_first_step", True)
def _logging_first_step(s: Setting):
    assert _steps(s.train(max_steps=3, logging_steps=3)) == [1, 3]


@effect("log_on_each_node", False)
def _log_on_each_node(s: Setting):
    from grpo.observe import reporting

    node_1_first = SimpleNamespace(is_main_process=False, is_local_main_process=True)
    args = s.config(log_level="error", log_level_replica="critical")
    assert reporting.process_log_level(args, reporting.is_logging_main(node_1_first, args.log_on_each_node)) == (
        logging.CRITICAL  # a replica: only the run's first process is a main one for logging
    )
    default = s.default_config(log_level="error")
    assert reporting.is_logging_main(node_1_first, default.log_on_each_node)


@effect("include_num_input_tokens_seen", "all")
def _include_num_input_tokens_seen(s: Setting):
    row = s.train().state.log_history[-1]
    assert row["num_input_tokens_seen"] >= row["num_tokens"] > 0  # the padded training batch's tokens


@effect("log_level", "error")
def _log_level(s: Setting):
    import transformers

    with _levels_restored():
        s.trainer()
        assert logging.getLogger("grpo").level == logging.ERROR == transformers.logging.get_verbosity()


@effect("log_level_replica", "error")
def _log_level_replica(s: Setting):
    import transformers

    from grpo.observe import reporting

    with _levels_restored():
        replica = SimpleNamespace(is_main_process=False, is_local_main_process=False)
        reporting.set_log_levels(s.config(), replica)
        assert logging.getLogger("grpo").level == logging.ERROR == transformers.logging.get_verbosity()


@effect("disable_tqdm", False)
def _disable_tqdm(s: Setting):
    assert s.train().metrics.progress is not None  # BASE turns it off


@effect("report_to", "tensorboard")
def _report_to(s: Setting):
    pytest.importorskip("tensorboardX")
    s.train()
    assert _event_dirs(s.tmp_path / "out")


@effect("run_name", "effect-run")
def _run_name(s: Setting):
    pytest.importorskip("tensorboardX")
    trainer = s.trainer(report_to="tensorboard")
    _finished(trainer)
    assert os.path.join("huggingface", "effect-run") in _event_dirs(s.tmp_path / "out")


@effect("project", "effect-project")
def _project(s: Setting):
    pytest.importorskip("tensorboardX")
    trainer = s.trainer(report_to="tensorboard", run_name="r")
    _finished(trainer)
    runs = _event_dirs(s.tmp_path / "out")  # the scalars' directory, and a subdirectory of the hyperparameters
    assert os.path.join("effect-project", "r") in runs
    assert all(run.startswith(os.path.join("effect-project", "r")) for run in runs)


@effect("log_unique_prompts", True)
def _log_unique_prompts(s: Setting):
    class Grab:
        def print(self, table):
            self.table = table

    trainer = s.train(log_completions=True)
    console = Grab()
    trainer.parts.completion_log.flush(1, console)
    assert console.table.row_count == 2  # 8 completions of 2 prompts: each prompt once


@effect("log_multimodal", False)
def _log_multimodal(s: Setting):
    import glob

    import pandas as pd

    from support.vision import idefics3, image

    model, processor = idefics3()
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}?"}], "image": image(i)} for i in range(2)]
    trainer = s.train(model=model, processor=processor, dataset=rows, log_completions=True, num_completions_to_print=0)
    table = pd.read_parquet(glob.glob(str(s.tmp_path / "out" / "completions" / "*.parquet"))[0])
    assert "image" not in table.columns and len(table) == 8  # logged with log_multimodal=True: test_vision
    assert trainer._logs["images"] == [] and len(trainer._logs["prompt"]) == 8  # TRL's buffer keeps no images


@effect("torch_empty_cache_steps", 2)
def _torch_empty_cache_steps(s: Setting):
    from grpo.perf import allocator

    released, original = [], allocator.release_cached_memory
    allocator.release_cached_memory = released.append
    try:
        s.train(max_steps=4)
    finally:
        allocator.release_cached_memory = original
    assert len(released) == 2  # after steps 2 and 4
