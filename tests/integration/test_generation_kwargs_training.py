"""Training through the plain engine under TRL's own beam-search generation_kwargs (TRL's
test_train_with_generation_kwargs): it trains, the sampler's log-probs are absent (NaN, never misread), and the
loss uses the trainer's own old log-probs."""

from __future__ import annotations

import math

import torch

from grpo import GRPOTrainer
from support.rewards import length_reward
from support.runs import cfg, chat_dataset, params


def test_training_with_beam_search_generation_kwargs(tiny_model_dir, tmp_path):
    args = cfg(
        tmp_path,
        per_device_train_batch_size=3,
        num_generations=3,
        max_steps=2,
        learning_rate=0.1,
        generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1},
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    assert trainer.engine.name == "transformers" and trainer.engine.beams
    before = params(trainer.unwrapped_model)
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(math.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)
    after = params(trainer.unwrapped_model)
    assert any(not torch.equal(before[n], after[n]) for n in before)
