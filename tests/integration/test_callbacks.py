"""transformers callbacks in grpo's loop: the events the HF Trainer fires, in its order (recorded on both trainers
on the same tiny setup), their keywords, what `control` asks for, add/pop/remove, and EarlyStoppingCallback."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments

from grpo import GRPOTrainer
from support.rewards import length_reward
from support.runs import Counting, cfg, chat_dataset

EVENTS = [
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_epoch_end",
    "on_train_end",
]


class Recorder(TrainerCallback):
    def __init__(self):
        self.events, self.kwargs = [], {}

    def __getattribute__(self, name):
        if name in EVENTS:

            def record(args, state, control, **kwargs):
                self.events.append((name, state.global_step))
                self.kwargs.setdefault(name, kwargs)

            return record
        return super().__getattribute__(name)


def grpo_events(tmp_path, model_dir, **kw):
    recorder = Recorder()
    args = cfg(
        tmp_path, max_steps=3, gradient_accumulation_steps=2, save_strategy="steps", save_steps=2, logging_steps=1, **kw
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(12),
        args=args,
        callbacks=[recorder],
    )
    trainer.train()
    return recorder, trainer


def test_the_event_sequence_is_the_hf_trainers(tiny_model_dir, tmp_path):
    """Both trainers: 3 optimizer steps of 2 accumulated micro-steps, one epoch, logging every step, saving every
    2 steps (and at the last, as the HF Trainer 5.x does)."""
    hf = Recorder()
    from transformers import AutoModelForCausalLM

    rows = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]} for _ in range(6)]
    Trainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=TrainingArguments(
            output_dir=str(tmp_path / "hf"),
            per_device_train_batch_size=1,
            gradient_accumulation_steps=2,
            max_steps=3,
            logging_steps=1,
            save_steps=2,
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
        ),
        train_dataset=Dataset.from_list(rows),
        callbacks=[hf],
    ).train()
    ours, _ = grpo_events(tmp_path / "grpo", model_dir=tiny_model_dir)
    # both fire on_log once more at the end with the train summary (train_runtime, ...)
    assert hf.events[-2] == ("on_log", 3) and hf.events.count(("on_log", 3)) == 2
    assert ours.events == hf.events
    kwargs = ours.kwargs["on_step_end"]
    assert {"model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"} <= set(
        kwargs
    )
    assert isinstance(kwargs["optimizer"], torch.optim.Optimizer)
    assert "loss" in ours.kwargs["on_log"]["logs"] and "reward" in ours.kwargs["on_log"]["logs"]


class Control(TrainerCallback):
    """Stops after step 3; asks for a log at step 2 and a save at step 1 whatever the strategies say."""

    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = state.global_step == 1
        control.should_log = state.global_step == 2
        control.should_training_stop = state.global_step == 3


def test_control_is_honoured(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        callbacks=[Control],
        args=cfg(tmp_path, max_steps=6, logging_strategy="no", save_strategy="no"),
    )
    trainer.train()
    assert trainer.state.global_step == 3
    assert [row["step"] for row in trainer.state.log_history] == [2, 3]  # step 2's row, then train()'s record
    assert "loss" in trainer.state.log_history[0] and "train_loss" in trainer.state.log_history[1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-1"]


def test_add_pop_remove_and_bad_callbacks(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path)
    )
    recorder = Recorder()
    trainer.add_callback(recorder)
    trainer.add_callback(Control)
    assert isinstance(trainer.pop_callback(Control), Control)
    trainer.train()
    assert ("on_step_end", 1) in recorder.events
    trainer.remove_callback(recorder)
    assert recorder not in trainer.callback_handler.callbacks
    with pytest.raises(TypeError, match="is not a transformers.TrainerCallback"):
        trainer.add_callback(print)


def test_early_stopping_stops_a_run(tiny_model_dir, tmp_path):
    """The evaluation's reward never improves (a constant reward): with patience 1 the run stops at the second
    evaluation."""
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **kw: [1.0] * len(completions),
        train_dataset=chat_dataset(),
        eval_dataset=chat_dataset(4),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=1)],
        args=cfg(
            tmp_path,
            max_steps=6,
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=1,
            metric_for_best_model="eval_reward",
            load_best_model_at_end=True,
            per_device_eval_batch_size=4,
        ),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.state.best_metric == 1.0 and trainer.state.best_global_step == 1


@pytest.mark.parametrize("restore", [True, False])
def test_stateful_callbacks_are_saved_and_restored(tiny_model_dir, tmp_path, restore):
    kw = dict(max_steps=2, save_strategy="steps", save_steps=1, restore_callback_states_from_checkpoint=restore)
    first = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, **kw),
        callbacks=[Counting()],
    )
    first.train()
    resumed = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path / "b", **kw),
        callbacks=[Counting(start=100)],
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    (counter,) = resumed.callback_handler.callbacks
    assert (counter.start, counter.steps) == ((0, 2) if restore else (100, 101))
