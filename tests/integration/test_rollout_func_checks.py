"""rollout_func's output through the trainer: a malformed token id stops training with one error naming the row,
the value and the rule (the step before kept, its checkpoint intact); a further field named like a keyword the
trainer passes reward functions itself is refused, naming it, before any reward function runs."""

from __future__ import annotations

import os

import pytest

from grpo import GRPOTrainer
from support.rewards import length_reward
from support.runs import cfg, chat_dataset


def output(trainer, n, **change):
    tok = trainer.processing_class
    ids = tok("abc", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    out = {"prompt_ids": [[5, 6]] * n, "completion_ids": [ids] * n, "logprobs": [[-0.5] * len(ids)] * n}
    return {**out, **change}


def test_a_token_id_past_the_vocabulary_stops_training_naming_it(tiny_model_dir, tmp_path):
    calls = []

    def rollout_func(prompts, trainer):
        calls.append(1)
        if len(calls) == 1:
            return output(trainer, len(prompts))
        vocab = trainer.unwrapped_model.get_input_embeddings().num_embeddings
        return output(trainer, len(prompts), prompt_ids=[[5, 6]] * 3 + [[5, vocab]] + [[5, 6]] * (len(prompts) - 4))

    args = cfg(tmp_path, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=args,
        rollout_func=rollout_func,
    )
    vocab = trainer.unwrapped_model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"rollout_func returned prompt_ids\[3\]\[1\] = {vocab}, past the policy's"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert os.path.isdir(os.path.join(args.output_dir, "checkpoint-1"))
    assert not os.path.exists(os.path.join(args.output_dir, "checkpoint-2"))


@pytest.mark.parametrize("name", ["completions", "prompts", "trainer_state", "log_metric"])
def test_a_field_named_like_the_trainers_keyword_is_refused_before_rewards_run(tiny_model_dir, tmp_path, name):
    scored = []

    def reward(completions, **kwargs):
        scored.append(completions)
        return length_reward(completions)

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path),
        rollout_func=lambda prompts, trainer: output(trainer, len(prompts), **{name: ["mine"] * len(prompts)}),
    )
    with pytest.raises(ValueError, match=rf"rollout_func returned a field '{name}'.*Rename the field.*'my_{name}'"):
        trainer.train()
    assert scored == []
