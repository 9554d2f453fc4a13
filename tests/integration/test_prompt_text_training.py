"""A prompt the tokenizer cannot encode (a lone UTF-16 surrogate) through the trainer: refused at construction for
the rows it checks, and for a row it meets only later (here: changed after the check, as a stream's row or an
environment's prompt is) at the step that tokenizes it, naming the row and field; the steps before are kept."""

from __future__ import annotations

import json
import os

import pytest

from grpo import GRPOTrainer
from support.rewards import length_reward
from support.runs import cfg, chat_dataset

LONE = json.loads('"ab\\ud800c"')


def test_a_lone_surrogate_is_refused_at_construction(tiny_model_dir, tmp_path):
    rows = chat_dataset().to_list()
    rows[5]["prompt"][0]["content"] = LONE
    with pytest.raises(ValueError, match=r"train_dataset row 5: prompt\[0\]\['content'\] holds a lone UTF-16"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=rows, args=cfg(tmp_path))


def test_a_lone_surrogate_met_mid_run_stops_that_step_and_keeps_the_checkpoint(tiny_model_dir, tmp_path):
    rows = chat_dataset().to_list()
    args = cfg(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, shuffle_dataset=False)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=rows, args=args)
    rows[2]["prompt"][0]["content"] = LONE  # row 2: the first prompt of step 2 (in order, two prompts a step)
    with pytest.raises(ValueError, match=r"train_dataset row 2: prompt\[0\]\['content'\] holds a lone UTF-16"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert os.path.isdir(os.path.join(args.output_dir, "checkpoint-1"))
    assert not os.path.exists(os.path.join(args.output_dir, "checkpoint-2"))
