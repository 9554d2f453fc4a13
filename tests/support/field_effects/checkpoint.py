"""Effects of the checkpoint and resume fields (tests/integration/test_checkpoint_fields.py tests them further)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from support.field_effects import Setting, effect
from support.rewards import stepped
from support.runs import chat_dataset


def saved(s: Setting) -> list[int]:
    out = s.tmp_path / "out"
    return sorted(int(p.split("-")[1]) for p in os.listdir(out) if p.startswith("checkpoint-"))


@effect("save_strategy", "epoch")
def _save_strategy(s: Setting):
    trainer = s.train(dataset=chat_dataset(4, tasks=False), max_steps=3)  # 4 prompts, 2 a generation: 2 steps an epoch
    assert trainer.parts.steps_per_epoch == 2 and saved(s) == [2, 3]  # each epoch's end, and the last step


@effect("save_steps", 2)
def _save_steps(s: Setting):
    s.train(max_steps=5, save_strategy="steps")
    assert saved(s) == [2, 4, 5]  # and the last step, as the HF Trainer


@effect("metric_for_best_model", "reward")
def _metric_for_best_model(s: Setting):
    trainer = s.train(reward_funcs=stepped([0.5, 0.9, 0.1]), max_steps=3, save_strategy="steps", save_steps=1)
    assert trainer.state.best_model_checkpoint == str(s.tmp_path / "out" / "checkpoint-2")
    assert trainer.state.best_global_step == 2 and trainer.state.best_metric == pytest.approx(1.05, abs=1e-6)


@effect("greater_is_better", False)
def _greater_is_better(s: Setting):
    s.train(reward_funcs=stepped([0.5, 0.9, 0.1]), max_steps=3, save_strategy="best", metric_for_best_model="reward")
    assert saved(s) == [1, 3]  # the reward went down at steps 1 (first) and 3


@effect("save_total_limit", 1)
def _save_total_limit(s: Setting):
    trainer = s.train(
        reward_funcs=stepped([0.9, 0.1, 0.2]),
        max_steps=3,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="reward",
    )
    assert saved(s) == [1, 3]  # the best and the newest survive rotation
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")


@effect("load_best_model_at_end", True)
def _load_best_model_at_end(s: Setting):
    trainer = s.train(
        reward_funcs=stepped([0.5, 0.9, 0.1]),
        max_steps=3,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="reward",
    )
    best = load_file(s.tmp_path / "out" / "checkpoint-2" / "model.safetensors")
    last = load_file(s.tmp_path / "out" / "checkpoint-3" / "model.safetensors")
    weights = trainer.unwrapped_model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in best.items())
    assert any(not torch.equal(weights[k], v) for k, v in last.items())


@effect("save_only_model", True)
def _save_only_model(s: Setting):
    from grpo.checkpoint import CheckpointError

    s.train(save_strategy="steps", save_steps=1)
    names = set(os.listdir(s.tmp_path / "out" / "checkpoint-1"))
    assert "model.safetensors" in names and not names & {"optimizer.pt", "scheduler.pt", "rng_state_0.pt"}
    with pytest.raises(CheckpointError, match="save_only_model=True: it holds the model only"):
        s.default_trainer(max_steps=2).train(resume_from_checkpoint=True)


@effect("save_on_each_node", True)
def _save_on_each_node(s: Setting):
    from grpo.checkpoint import strategy

    # the first process of a second node: it writes its node's copy only with save_on_each_node
    assert strategy.writes_files(s.config().save_on_each_node, is_main_process=False, is_local_main_process=True)
    assert not strategy.writes_files(s.default_config().save_on_each_node, False, True)
    trainer = s.train(save_strategy="steps", save_steps=1)  # on one node: written as always
    assert strategy.writer(trainer.args, trainer.accelerator) and saved(s) == [1]


@effect("resume_from_checkpoint", "true")
def _resume_from_checkpoint(s: Setting):
    s.default_trainer(save_strategy="steps", save_steps=1).train()
    trainer = s.train(max_steps=2)  # train() without an argument: resumed at step 1, trains step 2 only
    assert [r["step"] for r in trainer.state.log_history] == [1, 2] and trainer.parts.loop.data_position == 2


@effect("ignore_data_skip", True)
def _ignore_data_skip(s: Setting):
    s.default_trainer(save_strategy="steps", save_steps=1).train()
    trainer = s.trainer(max_steps=2)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.parts.loop.data_position == 1  # step 2 drew the first prompts again (without the field: 2)


@effect("data_seed", 7)
def _data_seed(s: Setting):
    from grpo.data.prompts import generation_prompt_indices

    trainer = s.trainer()
    order = [sorted(set(trainer.parts.producer.rows(k))) for k in range(4)]
    assert order == [sorted(generation_prompt_indices(k, 8, 2, 7, True)) for k in range(4)]
    assert order != [sorted(generation_prompt_indices(k, 8, 2, 0, True)) for k in range(4)]  # seed's order


@effect("full_determinism", True)
def _full_determinism(s: Setting):
    env = dict(os.environ)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    try:
        s.trainer()
        assert torch.are_deterministic_algorithms_enabled() and not before[0]
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, before[1]
        os.environ.clear()
        os.environ.update(env)


@effect("enable_jit_checkpoint", True)
def _enable_jit_checkpoint(s: Setting):
    trainer = s.trainer(max_steps=3)  # save_strategy "no": only SIGTERM saves
    step = trainer._step

    def step_then_sigterm():
        loss = step()
        os.kill(os.getpid(), signal.SIGTERM)  # seen between steps
        return loss

    trainer._step = step_then_sigterm
    with pytest.raises(SystemExit) as exited:
        trainer.train()
    assert exited.value.code == 143 and saved(s) == [1]
