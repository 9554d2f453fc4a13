"""A step's checkpoint is written before its evaluation (#32 item 6): an evaluation that fails (a reward function
raising on an eval row) or is preempted (SIGTERM) loses no step, while the callbacks still see the HF Trainer's
order (on_log -> on_evaluate -> on_save), the best checkpoint is ranked by the evaluation of its step, and the
checkpoint's trainer_state.json ends holding the evaluation's row. Eval dataset problems name eval_dataset."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from grpo import GRPOTrainer
from grpo.rewards.calling import RewardFunctionError
from support.rewards import length_reward
from support.runs import cfg, chat_dataset, state_of, weights


def eval_dataset(n=4):
    """Eval rows carry split="eval", so that a reward function can tell an evaluation from a training step."""
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Add {i}+2"}], "split": "eval"} for i in range(n)]
    )


def run(tmp_path, model_dir, reward=length_reward, callbacks=None, **kw):
    kw = {"max_steps": 4, "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2, **kw}
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        train_dataset=chat_dataset(),
        eval_dataset=eval_dataset(),
        callbacks=callbacks,
        args=cfg(tmp_path, per_device_eval_batch_size=4, **kw),
    )


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """The uninterrupted 4-step run's final weights (evaluations change nothing training depends on)."""
    trainer = run(tmp_path_factory.mktemp("straight"), tiny_model_dir, eval_strategy="no")
    trainer.train()
    return weights(trainer)


def resumed_weights(tmp_path, model_dir, path):
    trainer = run(tmp_path / "resumed", model_dir)
    trainer.train(resume_from_checkpoint=str(path))
    assert trainer.state.global_step == 4
    return weights(trainer)


def assert_same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_failing_evaluation_keeps_the_checkpoint_of_its_step(tiny_model_dir, tmp_path, straight):
    def fails_on_eval_rows(completions, split=None, **kw):
        if split and "eval" in split:
            raise ValueError("cannot score this eval row")
        return length_reward(completions)

    trainer = run(tmp_path, tiny_model_dir, reward=fails_on_eval_rows)
    with pytest.raises(RewardFunctionError, match="cannot score this eval row"):
        trainer.train()
    saved = tmp_path / "out" / "checkpoint-2"
    assert saved.is_dir() and not (tmp_path / "out" / ".tmp-checkpoint-2").exists()
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pt"):
        assert (saved / name).is_file(), name
    state = state_of(saved)
    assert state["global_step"] == 2 and [r["step"] for r in state["log_history"]] == [1, 2]
    assert_same(resumed_weights(tmp_path, tiny_model_dir, saved), straight)


def sigterm_on_eval_rows(completions, split=None, **kw):
    if split and "eval" in split:
        os.kill(os.getpid(), signal.SIGTERM)
    return length_reward(completions)


@pytest.mark.parametrize("save_steps", [2, 3])
def test_sigterm_during_an_evaluation_exits_with_the_step_saved(tiny_model_dir, tmp_path, straight, save_steps):
    """save_steps 2: the step's checkpoint was written before the evaluation, which SIGTERM ends (status 143).
    save_steps 3: no checkpoint was due at step 2, but the step is complete, so it is saved before exiting."""
    trainer = run(tmp_path, tiny_model_dir, reward=sigterm_on_eval_rows, save_steps=save_steps)
    with pytest.raises(SystemExit) as exit_:
        trainer.train()
    assert exit_.value.code == 143
    out = tmp_path / "out"
    assert sorted(p for p in os.listdir(out) if "checkpoint" in p) == ["checkpoint-2"]
    assert state_of(out / "checkpoint-2")["global_step"] == 2
    assert_same(resumed_weights(tmp_path, tiny_model_dir, out / "checkpoint-2"), straight)


def test_sigterm_during_eval_on_start_exits_with_143(tiny_model_dir, tmp_path):
    """The evaluation before the first step: nothing to save, and the exit is the preempted run's 143, not a
    traceback."""
    trainer = run(tmp_path, tiny_model_dir, reward=sigterm_on_eval_rows, eval_on_start=True)
    with pytest.raises(SystemExit) as exit_:
        trainer.train()
    assert exit_.value.code == 143 and trainer.state.global_step == 0
    assert not [p for p in os.listdir(tmp_path / "out") if "checkpoint" in p]


class Recorder(TrainerCallback):
    """The events of each step, and whether the step's checkpoint existed (and held the eval row) at each."""

    def __init__(self):
        self.events = []

    def record(self, name, args, state):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        saved = os.path.isdir(path)
        evaluated = saved and any("eval_reward" in r for r in state_of(path)["log_history"])
        self.events.append((name, state.global_step, saved, evaluated))

    def on_log(self, args, state, control, **kw):
        self.record("on_log", args, state)

    def on_evaluate(self, args, state, control, **kw):
        self.record("on_evaluate", args, state)

    def on_save(self, args, state, control, **kw):
        self.record("on_save", args, state)


def test_events_keep_the_hf_order_and_the_checkpoint_ends_with_the_eval_row(tiny_model_dir, tmp_path):
    recorder = Recorder()
    run(tmp_path, tiny_model_dir, callbacks=[recorder], max_steps=2).train()
    at_2 = [e for e in recorder.events if e[1] == 2]
    # the training row, the eval row, on_evaluate (the checkpoint already on disk), then on_save: the checkpoint
    # now holds the evaluation's row, as the HF Trainer (which saves after evaluating) writes it
    assert [e[0] for e in at_2][:4] == ["on_log", "on_log", "on_evaluate", "on_save"]
    assert at_2[2][2] is True and at_2[3][3] is True


def test_the_best_checkpoint_is_ranked_by_the_evaluation_of_its_step(tiny_model_dir, tmp_path):
    by_step = {1: 0.5, 2: 2.0, 3: 1.0}  # what the evaluation after step N scores: step 2's is the best

    def scripted_eval(completions, split=None, trainer_state=None, **kw):
        if split and "eval" in split:
            return [by_step[trainer_state.global_step]] * len(completions)
        return length_reward(completions)

    trainer = run(
        tmp_path,
        tiny_model_dir,
        reward=scripted_eval,
        max_steps=3,
        eval_steps=1,
        save_steps=1,
        save_total_limit=1,
        metric_for_best_model="eval_reward",
        load_best_model_at_end=True,
    )
    trainer.train()
    out = tmp_path / "out"
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2") and trainer.state.best_metric == 2.0
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-2", "checkpoint-3"]
    for step in (2, 3):  # each checkpoint names the best as the HF Trainer's would, its own eval row included
        state = state_of(out / f"checkpoint-{step}")
        assert state["best_model_checkpoint"] == str(out / "checkpoint-2") and state["best_metric"] == 2.0
        assert state["log_history"][-1] == {**state["log_history"][-1], "step": step, "eval_reward": by_step[step]}


def test_save_strategy_best_on_an_eval_metric_saves_only_improvements(tiny_model_dir, tmp_path):
    by_step = {1: 0.5, 2: 0.25, 3: 1.0}

    def scripted_eval(completions, split=None, trainer_state=None, **kw):
        if split and "eval" in split:
            return [by_step[trainer_state.global_step]] * len(completions)
        return length_reward(completions)

    trainer = run(
        tmp_path,
        tiny_model_dir,
        reward=scripted_eval,
        max_steps=3,
        eval_steps=1,
        save_strategy="best",
        metric_for_best_model="eval_reward",
    )
    trainer.train()
    out = tmp_path / "out"
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-1", "checkpoint-3"]
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-3")
    assert state_of(out / "checkpoint-3")["log_history"][-1]["eval_reward"] == 1.0


def test_a_training_metric_ranks_checkpoints_on_evaluation_steps_too(tiny_model_dir, tmp_path):
    """metric_for_best_model="reward" (the training reward) with an evaluation at every save: the checkpoint is
    ranked by its step's training row, not lost behind the evaluation's row."""
    trainer = run(tmp_path, tiny_model_dir, max_steps=2, eval_steps=1, save_steps=1, metric_for_best_model="reward")
    trainer.train()
    rewards = {r["step"]: r["reward"] for r in trainer.state.log_history if "reward" in r}
    best = max(rewards, key=lambda s: (rewards[s], -s))
    assert trainer.state.best_metric == rewards[best]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / f"checkpoint-{best}")


# ---- eval dataset problems name eval_dataset ---------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, problem",
    [
        ([{"prompt": "ok"}, {"prompt": ""}], r"eval_dataset row 1: the prompt is empty"),
        ([{"prompt": "ok"}, {"prompt": [{"content": "x"}]}], r"eval_dataset row 1: message 0 of the prompt has no"),
        ([{"prompt": "ok"}, {"prompt": None}], r"eval_dataset row 1: the prompt is NoneType"),
        ([{"question": "x"}], r"eval_dataset has no 'prompt' column"),
        ([{"prompt": "x", "completions": "y"}], r"eval_dataset has a 'completions' column"),
    ],
)
def test_eval_dataset_problems_name_the_eval_dataset(tiny_model_dir, tmp_path, rows, problem):
    with pytest.raises(ValueError, match=problem):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            eval_dataset=rows,
            args=cfg(tmp_path),
        )
    with pytest.raises(ValueError, match=problem.replace("eval_dataset", r"eval_dataset\['b'\]")):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            eval_dataset={"a": eval_dataset(), "b": rows},
            args=cfg(tmp_path),
        )


def test_an_eval_prompt_past_the_context_names_the_eval_dataset(tiny_model_dir, tmp_path):
    long = [{"prompt": "ok"}, {"prompt": "x" * 600}]  # the tiny model's context is 512
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        eval_dataset={"long": long},
        args=cfg(tmp_path, per_device_eval_batch_size=4),
    )
    with pytest.raises(ValueError, match=r"eval_dataset\['long'\] row 1: the prompt is 60\d tokens"):
        trainer.evaluate()


def test_an_eval_rows_missing_image_names_the_eval_dataset(tmp_path):
    from support.vision import BUILDERS, image

    model, processor = BUILDERS[sorted(BUILDERS)[0]](0)
    chat = [{"role": "user", "content": "Look."}]
    missing = str(tmp_path / "nowhere.png")
    with pytest.raises(ValueError, match=rf"eval_dataset\['pics'\] row 1: the image file {missing} does not exist"):
        GRPOTrainer(
            model=model,
            processing_class=processor,
            reward_funcs=length_reward,
            train_dataset=[{"prompt": chat, "image": image(0)}] * 4,
            eval_dataset={"pics": [{"prompt": chat, "image": image(1)}, {"prompt": chat, "image": missing}]},
            args=cfg(tmp_path, per_device_train_batch_size=4),
        )
    later = tmp_path / "later.png"  # readable when the trainer is built, gone when the evaluation reads it
    image(2).save(later)
    trainer = GRPOTrainer(
        model=model,
        processing_class=processor,
        reward_funcs=length_reward,
        train_dataset=[{"prompt": chat, "image": image(0)}] * 4,
        eval_dataset={"pics": [{"prompt": chat, "image": image(1)}, {"prompt": chat, "image": str(later)}]},
        args=cfg(tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=4),
    )
    later.unlink()
    with pytest.raises(ValueError, match=rf"eval_dataset\['pics'\] row 1: the image file {later} does not exist"):
        trainer.evaluate()
