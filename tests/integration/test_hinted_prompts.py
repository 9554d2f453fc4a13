"""A rollout_func whose samples of one prompt come with different prompt ids (a hint of their own) trains the numbers
it sampled: the padded pass that shares a group's prompt through a KV cache ran the group's first prompt for every
row (0.21 off the sampler's log-probs, under packing="padded" and "auto"); now rows share a prompt only where its
tokens are equal, and trees merge only equal tokens."""

from __future__ import annotations

import pytest
import torch

from grpo import GRPOTrainer
from grpo.base.records import Rollout
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from support.rewards import length_reward
from support.runs import cfg, chat_dataset


def hinted(prompts, trainer):
    """Each sample's prompt is the chat prompt and a hint of its own (none for every fourth); its completion fixed
    text; its log-probs the policy's own, each row scored alone."""
    tok = trainer.processing_class
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        hint = tok(f"hint {i}: {'x' * i}", add_special_tokens=False)["input_ids"] if i % 4 else []
        prompt_ids.append(list(ids) + hint)
        completion_ids.append(tok(f"ans {i * 7}", add_special_tokens=False)["input_ids"][: 2 + i % 5] + [end])
    model = trainer.unwrapped_model
    logprobs = []
    with torch.no_grad():
        for p, c in zip(prompt_ids, completion_ids):  # one row at a time: no padding, no sharing
            rollout = Rollout(prompt_ids=[p], completion_ids=[c], sampling_logps=[[0.0] * len(c)], truncated=[False])
            batch = collate(rollout, torch.zeros(1), tok.pad_token_id, mask_truncated=False)
            logps = token_logps(model, batch, PassSettings(trainer.args.temperature, with_entropy=False)).logps
            logprobs.append(logps[0].tolist())
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


@pytest.mark.parametrize("packing", ["padded", "auto", "tree"])
def test_samples_with_their_own_prompts_train_the_sampled_log_probs(tiny_model_dir, tmp_path, packing):
    args = cfg(tmp_path, gradient_checkpointing=False, packing=packing, logging_steps=1)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=args,
        rollout_func=hinted,
    )
    assert trainer.training_pass.share_prefix  # the KV-cache pass where rows share a prompt
    trainer.train()
    row = next(r for r in reversed(trainer.state.log_history) if "loss" in r)
    assert row["sampling/sampling_logp_difference/max"] < 1e-4
