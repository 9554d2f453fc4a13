"""The checkpoint and resume fields with the HF Trainer's meanings: save_strategy ("epoch", "best"),
metric_for_best_model / greater_is_better and the best checkpoint (recorded, kept by rotation, persisted, loaded at
the end), save_only_model, save_on_each_node, resume_from_checkpoint in the config, ignore_data_skip, data_seed,
full_determinism, and enable_jit_checkpoint (SIGTERM saves)."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from grpo import GRPOTrainer
from grpo.checkpoint import CheckpointError, strategy
from grpo.data.prompts import generation_prompt_indices
from grpo.learner.loop import epoch_start
from support.rewards import length_reward, stepped
from support.runs import cfg, chat_dataset, state_of


def run(tiny_model_dir, tmp_path, reward=length_reward, dataset=None, resume=None, **kw):
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, train_dataset=dataset or chat_dataset(), args=cfg(tmp_path, **kw)
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def saved(tmp_path):
    out = tmp_path / "out"
    return sorted((p for p in os.listdir(out) if p.startswith("checkpoint-")), key=lambda p: int(p.split("-")[1]))


# ---- the decisions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy_, new_best, saved_steps",
    [
        ("steps", False, [2, 4, 6, 7]),  # save_steps 2, and the last step (as the HF Trainer)
        ("epoch", False, [3, 6, 7]),  # 3 steps an epoch, and the last step (the end of a partial epoch)
        ("best", True, [1, 2, 3, 4, 5, 6, 7]),
        ("best", False, []),
        ("no", True, []),
    ],
)
def test_when_each_save_strategy_saves(strategy_, new_best, saved_steps):
    due = [s for s in range(1, 8) if strategy.save_due(strategy_, s, 2, 3, 7, new_best)]
    assert due == saved_steps


def test_what_improves_and_which_metric_a_name_means():
    assert strategy.improves(0.5, None, True) and strategy.improves(-3.0, None, False)
    assert strategy.improves(0.6, 0.5, True) and not strategy.improves(0.5, 0.5, True)
    assert strategy.improves(0.4, 0.5, False) and not strategy.improves(0.6, 0.5, False)
    assert not strategy.improves(None, 0.5, True)
    row = {"step": 1, "reward": 0.3, "eval_special": 1.0}
    assert strategy.metric_key("reward", row) == "reward"
    assert strategy.metric_key("eval_reward", row) == "reward"  # the HF Trainer's prefix
    assert strategy.metric_key("eval_special", row) == "eval_special"
    assert strategy.metric_key("kl", row) is None


@pytest.mark.parametrize(
    "on_each_node, main, local_main, writes",
    [
        (False, True, True, True),
        (False, False, True, False),  # node 2's first process: only the global main writes
        (True, False, True, True),  # ... unless every node writes its own copy
        (True, False, False, False),
        (False, False, False, False),
    ],
)
def test_which_processes_write_checkpoints(on_each_node, main, local_main, writes):
    assert strategy.writes_files(on_each_node, main, local_main) is writes


def test_resume_targets_and_where_ignore_data_skip_restarts():
    assert strategy.resume_target(None, "true") is True and strategy.resume_target(None, "True") is True
    assert strategy.resume_target(None, "false") is None and strategy.resume_target(None, None) is None
    assert strategy.resume_target(None, "out/checkpoint-3") == "out/checkpoint-3"
    assert strategy.resume_target(False, "true") is None  # an explicit argument wins
    assert strategy.resume_target("a/checkpoint-1", "true") == "a/checkpoint-1"
    assert [epoch_start(p, 4) for p in (0, 3, 4, 6, 9)] == [0, 0, 4, 4, 8]


def fake_checkpoints(root, steps):
    for step in steps:
        os.makedirs(root / f"checkpoint-{step}")
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")


@pytest.mark.parametrize(
    "limit, best, kept",
    [
        (2, None, [3, 4]),
        (2, 1, [1, 4]),  # the best counts within the limit
        (2, 3, [3, 4]),
        (1, 1, [1, 4]),  # the newest and the best: more than the limit
        (1, None, [4]),
        (None, 1, [1, 2, 3, 4]),
    ],
)
def test_rotation_keeps_the_newest_and_the_best(tmp_path, limit, best, kept):
    fake_checkpoints(tmp_path, [1, 2, 3, 4])
    best_path = str(tmp_path / f"checkpoint-{best}") if best else None
    strategy.rotate(str(tmp_path), limit, str(tmp_path / "checkpoint-4"), best_path)
    assert sorted(int(p.split("-")[1]) for p in os.listdir(tmp_path)) == kept


# ---- save_strategy --------------------------------------------------------------------------------------------


def test_epoch_saves_at_the_end_of_every_epoch_and_at_the_last_step(tiny_model_dir, tmp_path):
    # 4 prompts, 2 per generation: an epoch is 2 optimizer steps
    trainer = run(tiny_model_dir, tmp_path, dataset=chat_dataset(4), max_steps=5, save_strategy="epoch")
    assert trainer.parts.steps_per_epoch == 2
    assert saved(tmp_path) == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]


@pytest.mark.parametrize("name", ["reward", "eval_reward"])
def test_best_saves_whenever_the_logged_metric_improves(tiny_model_dir, tmp_path, name):
    trainer = run(
        tiny_model_dir,
        tmp_path,
        reward=stepped([0.5, 0.2, 0.9, 0.7]),
        max_steps=4,
        save_strategy="best",
        metric_for_best_model=name,
    )
    assert trainer.args.greater_is_better is True
    assert saved(tmp_path) == ["checkpoint-1", "checkpoint-3"]
    best = str(tmp_path / "out" / "checkpoint-3")
    assert trainer.state.best_metric == pytest.approx(1.05, abs=1e-6)  # 0.9 + 0.15
    assert (trainer.state.best_global_step, trainer.state.best_model_checkpoint) == (3, best)
    first = state_of(tmp_path / "out" / "checkpoint-1")
    assert first["best_metric"] == pytest.approx(0.65, abs=1e-6) and first["best_global_step"] == 1
    assert state_of(best)["best_model_checkpoint"] == best  # a checkpoint knows it is the best


def test_greater_is_better_false_saves_on_decreases(tiny_model_dir, tmp_path):
    trainer = run(
        tiny_model_dir,
        tmp_path,
        reward=stepped([0.5, 0.2, 0.9, 0.1]),
        max_steps=4,
        save_strategy="best",
        metric_for_best_model="reward",
        greater_is_better=False,
    )
    assert saved(tmp_path) == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert trainer.state.best_metric == pytest.approx(0.25, abs=1e-6)


def test_a_metric_never_logged_is_one_error_naming_the_logged_ones(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=3, save_strategy="best", metric_for_best_model="rewrd"),
    )
    with pytest.raises(ValueError, match=r"metric_for_best_model='rewrd' is not a logged metric \(step 1 logged: .*"):
        trainer.train()
    assert trainer.state.global_step == 1 and not os.path.exists(tmp_path / "out" / "checkpoint-1")


def test_rotation_keeps_the_best_checkpoint(tiny_model_dir, tmp_path):
    trainer = run(
        tiny_model_dir,
        tmp_path,
        reward=stepped([0.9, 0.1, 0.2]),
        max_steps=3,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        metric_for_best_model="reward",
    )
    assert saved(tmp_path) == ["checkpoint-1", "checkpoint-3"]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-1")


# ---- load_best_model_at_end -------------------------------------------------------------------------------------


def test_load_best_model_at_end_loads_the_best_checkpoints_weights(tiny_model_dir, tmp_path):
    trainer = run(
        tiny_model_dir,
        tmp_path,
        reward=stepped([0.5, 0.9, 0.1]),
        max_steps=3,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="reward",
        load_best_model_at_end=True,
    )
    out = tmp_path / "out"
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")
    best, last = (
        load_file(out / "checkpoint-2" / "model.safetensors"),
        load_file(out / "checkpoint-3" / "model.safetensors"),
    )
    weights = trainer.unwrapped_model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in best.items())
    assert any(not torch.equal(weights[k], v) for k, v in last.items())  # not the last step's weights


def test_load_best_model_at_end_defaults_to_the_lowest_loss(tiny_model_dir, tmp_path):
    trainer = run(
        tiny_model_dir, tmp_path, max_steps=2, save_strategy="best", load_best_model_at_end=True
    )  # metric_for_best_model None -> "loss", greater_is_better -> False
    rows = trainer.state.log_history
    assert trainer.args.metric_for_best_model == "loss" and trainer.args.greater_is_better is False
    best = min(rows, key=lambda r: r["loss"])
    assert trainer.state.best_global_step == best["step"] and trainer.state.best_metric == best["loss"]


@pytest.mark.parametrize(
    "kw, problem",
    [
        (dict(save_strategy="no"), "save_strategy='no' writes none"),
        (
            dict(save_strategy="steps", save_steps=3, logging_steps=2),
            r"checkpoints of steps \[3\] \(save_steps=3\) fall on no logging step",
        ),
        (dict(save_strategy="best", logging_strategy="no"), "logging_strategy='no' logs none"),
    ],
)
def test_a_best_model_that_could_not_be_known_is_refused_at_construction(tiny_model_dir, tmp_path, kw, problem):
    with pytest.raises(ValueError, match=problem):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, max_steps=6, load_best_model_at_end=True, **kw),
        )


# ---- resuming ----------------------------------------------------------------------------------------------------


def test_resume_keeps_the_best_checkpoint_and_goes_on_comparing(tiny_model_dir, tmp_path):
    kw = dict(save_strategy="steps", save_steps=1, metric_for_best_model="reward")
    bases = [0.5, 0.9, 0.1, 1.5]
    run(tiny_model_dir, tmp_path, reward=stepped(bases), max_steps=3, **kw)
    out = tmp_path / "out"
    resumed = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=stepped(bases),
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=4, **kw),
    )
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))  # trains steps 3 and 4 again
    assert resumed.state.best_model_checkpoint == str(out / "checkpoint-4")
    assert resumed.state.best_metric == pytest.approx(1.65, abs=1e-6)
    assert state_of(out / "checkpoint-3")["best_model_checkpoint"] == str(out / "checkpoint-2")  # rewritten by resume


def test_hand_edited_best_fields_are_refused_and_a_deleted_best_is_forgotten(tiny_model_dir, tmp_path, caplog):
    kw = dict(save_strategy="steps", save_steps=1, metric_for_best_model="reward")
    run(tiny_model_dir, tmp_path, reward=stepped([0.9, 0.1]), max_steps=2, **kw)
    out = tmp_path / "out"
    state_file = out / "checkpoint-2" / "trainer_state.json"
    good = state_file.read_text()
    state_file.write_text(good.replace('"best_global_step": 1', '"best_global_step": "one"'))
    with pytest.raises(CheckpointError, match=r"best_global_step .* must be a number, a step and a path"):
        run(tiny_model_dir, tmp_path, reward=stepped([0.9, 0.1, 0.5]), max_steps=3, resume=True, **kw)
    state_file.write_text(good)
    shutil.rmtree(out / "checkpoint-1")  # the best one
    resumed = run(tiny_model_dir, tmp_path, reward=stepped([0.9, 0.1, 0.5]), max_steps=3, resume=True, **kw)
    assert "no longer exists" in caplog.text
    assert resumed.state.best_model_checkpoint is None  # step 3 (0.65) does not beat the recorded 1.05
    assert resumed.state.best_metric == pytest.approx(1.05, abs=1e-6)


def test_a_resume_with_another_data_seed_is_refused(tiny_model_dir, tmp_path):
    from grpo.checkpoint import CheckpointMismatchError

    run(tiny_model_dir, tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    with pytest.raises(CheckpointMismatchError, match="data_seed: checkpoint None, now 3"):
        run(tiny_model_dir, tmp_path, max_steps=2, data_seed=3, resume=True)


def test_a_model_only_checkpoint_holds_the_model_and_cannot_resume(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run(tiny_model_dir, tmp_path, max_steps=1, save_strategy="steps", save_steps=1, save_only_model=True)
    path = tmp_path / "out" / "checkpoint-1"
    names = set(os.listdir(path))
    assert {"model.safetensors", "config.json", "trainer_state.json", "tokenizer.json"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "rng_state_0.pt"}
    AutoModelForCausalLM.from_pretrained(path)  # a usable model directory
    with pytest.raises(CheckpointError, match=r"save_only_model=True: it holds the model only .* cannot resume"):
        run(tiny_model_dir, tmp_path, max_steps=2, resume=True)


def test_save_on_each_node_still_writes_on_one_node(tiny_model_dir, tmp_path):
    trainer = run(tiny_model_dir, tmp_path, max_steps=1, save_strategy="steps", save_steps=1, save_on_each_node=True)
    assert strategy.writer(trainer.args, trainer.accelerator) and saved(tmp_path) == ["checkpoint-1"]


@pytest.mark.parametrize("value", ["true", "checkpoint-1"])
def test_train_without_an_argument_resumes_from_the_config(tiny_model_dir, tmp_path, value):
    run(tiny_model_dir, tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    target = value if value == "true" else str(tmp_path / "out" / value)
    trainer = run(tiny_model_dir, tmp_path, max_steps=2, resume_from_checkpoint=target)
    assert trainer.state.global_step == 2 and [r["step"] for r in trainer.state.log_history] == [1, 2]
    assert trainer.parts.loop.data_position == 2  # the first run's generation and this one's


def prompts_seen(seen):
    def reward(completions, prompts, trainer_state, **kwargs):
        seen.setdefault(trainer_state.global_step + 1, []).extend(p[0]["content"] for p in prompts)
        return length_reward(completions)

    return reward


@pytest.mark.parametrize("ignore", [False, True])
def test_ignore_data_skip_restarts_the_prompt_order(tiny_model_dir, tmp_path, ignore):
    first, second = {}, {}
    run(tiny_model_dir, tmp_path, reward=prompts_seen(first), max_steps=2, save_strategy="steps", save_steps=2)
    resumed = run(
        tiny_model_dir, tmp_path, reward=prompts_seen(second), max_steps=3, ignore_data_skip=ignore, resume=True
    )
    order = [generation_prompt_indices(k, 8, 2, 0, True) for k in range(3)]
    assert [sorted(set(first[k])) for k in (1, 2)] == [sorted(f"Solve {i}+1" for i in order[k]) for k in (0, 1)]
    expected = order[0] if ignore else order[2]  # the epoch's first prompts again, or the next ones
    assert sorted(set(second[3])) == sorted(f"Solve {i}+1" for i in expected) and resumed.state.global_step == 3


# ---- seeds ----------------------------------------------------------------------------------------------------


def test_data_seed_seeds_the_prompt_order_only(tiny_model_dir, tmp_path):
    def build(**kw):
        return GRPOTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path, **kw)
        )

    plain = build()
    after_plain = torch.get_rng_state()
    seeded = build(data_seed=5)
    assert torch.equal(torch.get_rng_state(), after_plain)  # `seed` still seeds the generators
    rows = [generation_prompt_indices(k, 8, 2, 5, True) for k in range(4)]
    assert [sorted(set(seeded.parts.producer.rows(k))) for k in range(4)] == [sorted(r) for r in rows]
    rows = [generation_prompt_indices(k, 8, 2, 0, True) for k in range(4)]  # data_seed None: seed 0
    assert [sorted(set(plain.parts.producer.rows(k))) for k in range(4)] == [sorted(r) for r in rows]
    assert [plain.parts.producer.rows(k) for k in range(4)] != [seeded.parts.producer.rows(k) for k in range(4)]


def test_full_determinism_switches_torch_to_deterministic_algorithms(tiny_model_dir, tmp_path, restores_determinism):
    assert not torch.are_deterministic_algorithms_enabled()
    trainer = run(tiny_model_dir, tmp_path, max_steps=1, full_determinism=True)  # and training runs under it
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert trainer.state.global_step == 1


# ---- SIGTERM ----------------------------------------------------------------------------------------------------


def test_enable_jit_checkpoint_saves_the_last_step_on_sigterm(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=3, save_strategy="no", enable_jit_checkpoint=True),
    )
    step = trainer._step

    def step_then_sigterm():
        loss = step()
        os.kill(os.getpid(), signal.SIGTERM)  # seen between steps: the handler only sets a flag
        return loss

    trainer._step = step_then_sigterm
    with pytest.raises(SystemExit) as exited:
        trainer.train()
    assert exited.value.code == 143 and saved(tmp_path) == ["checkpoint-1"]
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back
