"""The logging fields of GRPOConfig (HF Trainer meaning, `grpo.observe.reporting`): when rows are logged
(logging_strategy, logging_first_step), what a row says about tokens (num_tokens, include_num_input_tokens_seen),
log levels per process (log_level, log_level_replica, log_on_each_node), the progress display (disable_tqdm),
trackers (report_to, project, run_name), the completions table (log_unique_prompts), torch_empty_cache_steps, and
the fields grpo only warns about."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform
import re
import socket
import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers

from grpo import GRPOConfig, GRPOTrainer
from grpo.base.records import Rollout
from grpo.learner.batch import collate
from grpo.observe import reporting
from grpo.observe.metrics import CompletionLog, MetricsLogger, start_trackers, tensorboard_run_dir, tracker_init_kwargs
from grpo.perf import allocator
from support.rewards import length_reward
from support.runs import cfg, chat_dataset


def trained(tmp_path, model_dir, **kw):
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path, **kw)
    )
    trainer.train()
    return trainer


def logged_steps(trainer):
    return [row["step"] for row in trainer.state.log_history]


def jsonl_steps(trainer):
    path = os.path.join(trainer.args.output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["step"] for line in open(path)]


# ---- when a row is logged -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, first, expected",
    [
        ("steps", False, [2, 4, 6, 7]),  # every logging_steps, and the last step
        ("steps", True, [1, 2, 4, 6, 7]),
        ("epoch", False, [3, 6, 7]),  # each epoch's end (3 steps), and the last, partial epoch's
        ("epoch", True, [1, 3, 6, 7]),
        ("no", False, []),
        ("no", True, [1]),  # the HF Trainer logs the first step whatever the strategy
    ],
)
def test_which_steps_log(strategy, first, expected):
    args = SimpleNamespace(logging_strategy=strategy, logging_first_step=first, logging_steps=2)
    assert [s for s in range(1, 8) if reporting.should_log(args, s, max_steps=7, steps_per_epoch=3)] == expected


def test_a_fractional_logging_steps_is_a_share_of_the_run():
    args = SimpleNamespace(logging_strategy="steps", logging_first_step=False, logging_steps=0.25)
    assert [s for s in range(1, 9) if reporting.should_log(args, s, max_steps=8, steps_per_epoch=8)] == [2, 4, 6, 8]


def test_epoch_strategy_logs_each_epoch_with_the_mean_of_its_steps(tiny_model_dir, tmp_path):
    args = cfg(tmp_path, max_steps=6, logging_strategy="epoch")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    # 8 prompts, 2 per generation batch (8 completions / 4 per group), one batch per step: 4 steps an epoch
    assert trainer.parts.steps_per_epoch == 4
    losses = []
    trainer._update = _recording(trainer._update, losses)
    trainer.train()
    assert logged_steps(trainer) == jsonl_steps(trainer) == [4, 6]
    first, second = trainer.state.log_history
    assert first["epoch"] == 1.0 and second["epoch"] == 1.5
    assert first["loss"] == pytest.approx(sum(losses[:4]) / 4) and second["loss"] == pytest.approx(sum(losses[4:]) / 2)


def _recording(update, losses):
    def recorded(step_losses):
        result = update(step_losses)
        losses.append(result.loss)
        return result

    return recorded


def test_logging_strategy_no_writes_no_rows(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=2, logging_strategy="no"),
    )
    output = trainer.train()
    summary = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "epoch"}
    summary.add("total_flos")
    # no step's row: only the end-of-training summary, in the output and as log_history's one record (HF Trainer)
    assert set(output.metrics) == summary and output.global_step == 2
    assert [set(row) for row in trainer.state.log_history] == [summary | {"step"}]
    assert not os.path.exists(os.path.join(trainer.args.output_dir, "metrics.jsonl"))
    assert trainer.metrics.values == {}  # the window is not kept growing for a row that never comes


def test_logging_first_step_adds_step_one(tiny_model_dir, tmp_path):
    trainer = trained(tmp_path, tiny_model_dir, max_steps=4, logging_steps=3, logging_first_step=True)
    assert logged_steps(trainer) == jsonl_steps(trainer) == [1, 3, 4]
    only_first = trained(tmp_path / "no", tiny_model_dir, max_steps=2, logging_strategy="no", logging_first_step=True)
    assert jsonl_steps(only_first) == [1]
    assert logged_steps(only_first) == [1, 2] and "train_loss" in only_first.state.log_history[-1]  # the record


def test_log_completions_with_nothing_logged_warns(tiny_model_dir, tmp_path):
    args = cfg(tmp_path, logging_strategy="no", log_completions=True)
    with pytest.warns(UserWarning, match="log_completions=True.*logging_strategy='no'"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)


# ---- tokens -------------------------------------------------------------------------------------------------


def _rollout():
    prompts = [[5, 6, 7], [5, 6, 7, 8, 9], [10, 11], [10, 11]]
    completions = [[1, 2, 3, 4], [1], [], [1, 2, 3, 4, 5, 6]]
    return Rollout(
        prompt_ids=prompts,
        completion_ids=completions,
        sampling_logps=[[0.0] * len(c) for c in completions],
        truncated=[False] * 4,
    )


@pytest.mark.parametrize("mode, seen", [("non_padding", 23), ("all", 44), ("no", None)])
def test_tokens_seen_hand_counted(tmp_path, mode, seen):
    rollout = _rollout()
    batch = collate(rollout, torch.zeros(4), pad_id=0, mask_truncated=False)
    accelerator = SimpleNamespace(device=torch.device("cpu"), reduce=lambda t, reduction: t)
    metrics = MetricsLogger(None, SimpleNamespace(is_main_process=True, trackers=[]), 1, False)
    seen_so_far = 0
    for _ in range(2):  # two generation batches: running totals
        seen_so_far = reporting.count_tokens(metrics, seen_so_far, rollout, batch, accelerator, mode)
    # without padding 3+5+2+2 prompt + 4+1+0+6 completion tokens = 23; padded, 4 rows x (5 + 6) = 44
    assert seen_so_far == 46
    row = metrics.log(step=1, epoch=0.0)
    assert row["num_tokens"] == 46
    assert row.get("num_input_tokens_seen") == (None if seen is None else 2 * seen)


def test_totals_are_the_latest_value_and_survive_a_checkpoint(tmp_path):
    metrics = MetricsLogger(str(tmp_path), SimpleNamespace(is_main_process=True, trackers=[]), 2, False)
    metrics.set_total("num_tokens", 10)
    metrics.add("loss", 1.0)
    metrics.set_total("num_tokens", 30)
    saved = json.loads(json.dumps(metrics.state_dict()))  # as trainer_state.json holds it
    assert metrics.log(1, 0.5) == {"step": 1, "epoch": 0.5, "loss": 1.0, "num_tokens": 30}  # not the mean, 20
    assert metrics.log(2, 1.0) == {"step": 2, "epoch": 1.0, "num_tokens": 30}  # every row carries it
    resumed = MetricsLogger(str(tmp_path), SimpleNamespace(is_main_process=True, trackers=[]), 2, False)
    resumed.load_state_dict(saved)
    assert resumed.totals == {"num_tokens": 30} and resumed.state_dict() == saved


@pytest.mark.parametrize("mode", ["no", "non_padding", "all"])
def test_num_input_tokens_seen_in_each_row(tiny_model_dir, tmp_path, mode):
    args = cfg(tmp_path, max_steps=2, include_num_input_tokens_seen=mode)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    padded = []
    log_generation = trainer._log_generation

    def recorded(generated, advantages, batch):
        padded.append(batch.prompt_ids.numel() + batch.completion_ids.numel())
        log_generation(generated, advantages, batch)

    trainer._log_generation = recorded
    trainer.train()
    rows = trainer.state.log_history
    assert rows[-1]["num_tokens"] == trainer.state.num_input_tokens_seen > rows[0]["num_tokens"]
    if mode == "no":
        assert all("num_input_tokens_seen" not in r for r in rows)
    elif mode == "non_padding":
        assert [r["num_input_tokens_seen"] for r in rows] == [r["num_tokens"] for r in rows]
    else:
        assert [r["num_input_tokens_seen"] for r in rows] == [padded[0], padded[0] + padded[1]]
        assert rows[-1]["num_input_tokens_seen"] >= rows[-1]["num_tokens"]


def test_num_tokens_in_a_row_is_the_running_total_not_a_window_mean(tiny_model_dir, tmp_path):
    trainer = trained(tmp_path, tiny_model_dir, max_steps=2, logging_steps=2)
    assert trainer.state.log_history[-1]["num_tokens"] == trainer.state.num_input_tokens_seen


# ---- log levels -----------------------------------------------------------------------------------------------


@pytest.fixture
def restore_levels():
    grpo_logger = logging.getLogger("grpo")
    level, handlers, verbosity = grpo_logger.level, list(grpo_logger.handlers), transformers.logging.get_verbosity()
    yield
    grpo_logger.setLevel(level)
    grpo_logger.handlers[:] = handlers
    transformers.logging.set_verbosity(verbosity)


def process(main, local_main):
    return SimpleNamespace(is_main_process=main, is_local_main_process=local_main)


@pytest.mark.parametrize(
    "on_each_node, proc, expected",
    [
        (True, process(True, True), logging.ERROR),  # the first process of the run: log_level
        (True, process(False, True), logging.ERROR),  # node 1's first process is a main one too
        (False, process(False, True), logging.DEBUG),  # ... unless only the global first process logs
        (True, process(False, False), logging.DEBUG),  # any other process: log_level_replica
    ],
)
def test_log_level_of_each_process(on_each_node, proc, expected):
    args = GRPOConfig(output_dir="unused", log_level="error", log_level_replica="debug", log_on_each_node=on_each_node)
    main = reporting.is_logging_main(proc, args.log_on_each_node)
    assert reporting.process_log_level(args, main) == expected


def test_log_levels_are_applied_to_grpo_and_transformers(restore_levels):
    args = GRPOConfig(output_dir="unused", log_level="info", log_level_replica="critical")
    assert reporting.set_log_levels(args, process(True, True)) == logging.INFO
    assert logging.getLogger("grpo").getEffectiveLevel() == logging.INFO
    assert transformers.logging.get_verbosity() == logging.INFO
    assert reporting.set_log_levels(args, process(False, False)) == logging.CRITICAL
    assert logging.getLogger("grpo").level == logging.CRITICAL == transformers.logging.get_verbosity()


def test_passive_leaves_the_levels_alone(restore_levels):
    logging.getLogger("grpo").setLevel(logging.ERROR)
    transformers.logging.set_verbosity(logging.ERROR)
    assert reporting.set_log_levels(GRPOConfig(output_dir="unused"), process(True, True)) is None
    assert logging.getLogger("grpo").level == logging.ERROR == transformers.logging.get_verbosity()


def test_a_level_below_warning_gets_a_handler_when_none_would_print(restore_levels, monkeypatch):
    grpo_logger = logging.getLogger("grpo")
    monkeypatch.setattr(grpo_logger, "hasHandlers", lambda: False)  # pytest's capture handlers sit on the root
    reporting.set_log_levels(GRPOConfig(output_dir="unused", log_level="debug"), process(True, True))
    assert any(isinstance(h, logging.StreamHandler) for h in grpo_logger.handlers)


def test_the_trainer_sets_the_main_process_level(tiny_model_dir, tmp_path, restore_levels):
    GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, log_level="error"),
    )
    assert logging.getLogger("grpo").level == logging.ERROR == transformers.logging.get_verbosity()


# ---- progress display -------------------------------------------------------------------------------------------


def test_disable_tqdm_none_follows_the_log_level(restore_levels):
    assert GRPOConfig(output_dir="unused").disable_tqdm is False
    logging.getLogger("grpo").setLevel(logging.ERROR)
    assert GRPOConfig(output_dir="unused").disable_tqdm is True


@pytest.mark.parametrize("disable", [True, False])
def test_disable_tqdm_turns_the_progress_display_off(tiny_model_dir, tmp_path, disable, capsys):
    trainer = trained(tmp_path, tiny_model_dir, disable_tqdm=disable)
    assert (trainer.metrics.progress is None) == disable
    assert ("GRPO" in capsys.readouterr().err) != disable


# ---- trackers ---------------------------------------------------------------------------------------------------


def test_run_name_reaches_each_tracker_by_its_own_argument():
    assert tracker_init_kwargs("exp") == {
        "wandb": {"name": "exp"},
        "trackio": {"name": "exp"},
        "mlflow": {"run_name": "exp"},
        "swanlab": {"experiment_name": "exp"},
    }
    assert tracker_init_kwargs(None) == {}  # the trackers name an unnamed run themselves, as in transformers
    assert tensorboard_run_dir("proj", "exp") == os.path.join("proj", "exp")
    assert re.fullmatch(r"proj/[A-Z][a-z]{2}\d\d_\d\d-\d\d-\d\d_.+", tensorboard_run_dir("proj", None))


class FakeAccelerator:
    def __init__(self, trackers, logging_dir):
        self.log_with, self.logging_dir, self.started = trackers, logging_dir, None

    def init_trackers(self, project_name, config=None, init_kwargs=None):
        self.started = (project_name, config, init_kwargs)


def test_start_trackers_passes_the_project_and_the_run_name():
    accelerator = FakeAccelerator(["wandb", "trackio"], "out")
    start_trackers(accelerator, GRPOConfig(output_dir="out", project="my-project", run_name="exp-1"))
    project, config, init_kwargs = accelerator.started
    assert project == "my-project" and config["run_name"] == "exp-1"
    assert init_kwargs["wandb"] == {"name": "exp-1"} and init_kwargs["trackio"] == {"name": "exp-1"}


def test_wandb_project_from_the_environment_while_project_is_default(monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "from-env")  # transformers' wandb integration reads it
    accelerator = FakeAccelerator(["wandb"], "out")
    start_trackers(accelerator, GRPOConfig(output_dir="out", run_name="exp"))
    (wandb,) = accelerator.log_with
    assert (wandb.name, wandb.run_name, wandb.init_kwargs) == ("wandb", "from-env", {"name": "exp"})
    explicit = FakeAccelerator(["wandb"], "out")
    start_trackers(explicit, GRPOConfig(output_dir="out", project="chosen"))
    assert explicit.log_with == ["wandb"] and explicit.started[0] == "chosen"


def test_a_run_name_a_tracker_cannot_take_is_said():
    with pytest.warns(UserWarning, match="run_name='exp'.*comet_ml"):
        start_trackers(FakeAccelerator(["comet_ml"], "out"), GRPOConfig(output_dir="out", run_name="exp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        start_trackers(FakeAccelerator(["comet_ml"], "out"), GRPOConfig(output_dir="out"))


def _event_dirs(root):
    return sorted(
        os.path.relpath(dirpath, root)
        for dirpath, _, files in os.walk(root)
        if any(f.startswith("events.out.tfevents") for f in files)
    )


def test_tensorboard_writes_under_the_project_and_the_run(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboardX")
    trainer = trained(tmp_path, tiny_model_dir, report_to="tensorboard", project="proj", run_name="exp-1")
    scalars = os.path.join(trainer.args.output_dir, "proj", "exp-1")
    assert os.path.join("proj", "exp-1") in _event_dirs(trainer.args.output_dir)
    content = b"".join(open(os.path.join(scalars, f), "rb").read() for f in os.listdir(scalars) if "tfevents" in f)
    assert b"loss" in content


def test_an_unnamed_tensorboard_run_gets_a_time_and_host_name(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboardX")
    trainer = trained(tmp_path, tiny_model_dir, report_to="tensorboard")
    runs = os.listdir(os.path.join(trainer.args.output_dir, "huggingface"))  # TRL's default project
    assert len(runs) == 1 and runs[0].endswith("_" + socket.gethostname())


# ---- completions table ----------------------------------------------------------------------------------------


class Grab:
    """A console that keeps the table printed."""

    def print(self, table):
        self.table = table


def completion_log(tmp_path, unique_prompts):
    log = CompletionLog(str(tmp_path), ["r"], rows=8, seed=0, unique_prompts=unique_prompts)
    prompts = [[1, 2]] * 4 + [[3, 4]] * 4  # two groups of 4
    scored = SimpleNamespace(
        rollout=SimpleNamespace(prompt_ids=prompts, texts=[f"c{i}" for i in range(8)], vision=[]),
        rewards=torch.arange(8, dtype=torch.float32).unsqueeze(1),
        extra={},
    )
    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [f"p{row[0]}" for row in ids])
    log.record(scored, torch.zeros(8), tokenizer)
    return log


@pytest.mark.parametrize("unique, shown", [(False, 8), (True, 2)])
def test_log_unique_prompts_shows_each_prompt_once(tmp_path, unique, shown):
    import pandas as pd

    console = Grab()
    path = completion_log(tmp_path, unique).flush(3, console)
    assert console.table.row_count == shown
    completions = console.table.columns[1]._cells
    assert completions == (["c0", "c4"] if unique else [f"c{i}" for i in range(8)])  # each group's first row
    assert len(pd.read_parquet(path)) == 8  # the file keeps every completion


def test_unique_prompts_then_sampled(tmp_path):
    log = completion_log(tmp_path, True)
    log.num_to_print = 1
    console = Grab()
    log.flush(1, console)
    assert console.table.row_count == 1 and console.table.columns[1]._cells[0] in ("c0", "c4")


# ---- torch_empty_cache_steps --------------------------------------------------------------------------------


@pytest.mark.parametrize("every, calls", [(None, 0), (2, 2), (1, 4)])
def test_torch_empty_cache_steps_releases_memory_every_n_steps(tiny_model_dir, tmp_path, monkeypatch, every, calls):
    released = []
    monkeypatch.setattr(allocator, "release_cached_memory", lambda device: released.append(torch.device(device).type))
    trained(tmp_path, tiny_model_dir, max_steps=4, torch_empty_cache_steps=every)
    assert released == ["cpu"] * calls


def test_release_cached_memory_per_device(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("cuda"))
    assert allocator.release_cached_memory("cuda") and emptied == ["cuda"]
    assert allocator.release_cached_memory("cpu") == (platform.libc_ver()[0] == "glibc")  # malloc_trim


# ---- fields grpo only warns about ---------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("skip_memory_metrics", False), ("logging_nan_inf_filter", False)])
def test_fields_that_do_not_apply_warn(field, value):
    with pytest.warns(UserWarning, match=f"{field}={value!r} \\(not applicable in grpo: .+\\); it has no effect"):
        GRPOConfig(output_dir="unused", **{field: value})


def test_a_tracker_that_is_not_installed_is_an_error():
    """accelerate would warn and train without it; the HF Trainer refuses, and so does grpo."""
    from grpo.observe.metrics import check_trackers_installed

    pytest.importorskip("tensorboardX")
    check_trackers_installed(["tensorboard"])  # installed: fine
    check_trackers_installed(None)
    missing = [n for n in ("wandb", "comet_ml", "swanlab") if importlib.util.find_spec(n) is None]
    if not missing:
        pytest.skip("every tracker probed is installed")
    with pytest.raises(ValueError, match=rf"report_to names {missing[0]}, which is not installed: `pip install"):
        check_trackers_installed(["tensorboard", missing[0]])


def test_train_returns_the_hf_trainer_s_summary_metrics(tiny_model_dir, tmp_path):
    args = cfg(tmp_path, max_steps=2, gradient_accumulation_steps=2, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    out = trainer.train()
    m = out.metrics
    assert m["loss"] == trainer.state.log_history[-1]["loss"]  # the last logged row is still there
    assert m["train_runtime"] > 0 and m["train_loss"] == out.training_loss and m["epoch"] == trainer.state.epoch
    samples = 2 * 8 * 2  # steps x per_device_train_batch_size x gradient_accumulation_steps (one process)
    # (train_runtime is rounded to 4 decimals, the rates are computed before that)
    assert m["train_samples_per_second"] == pytest.approx(samples / m["train_runtime"], rel=1e-2)
    assert m["train_steps_per_second"] == pytest.approx(2 / m["train_runtime"], rel=1e-2)
    again = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=2, gradient_accumulation_steps=2, save_strategy="no"),
    )
    resumed = again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    rate = resumed.metrics["train_steps_per_second"]
    assert rate == pytest.approx(1 / resumed.metrics["train_runtime"], rel=1e-2)  # the one step this call ran
