"""`disable_dropout=True` turns off every dropout the policy trains with: Dropout modules, LoRA's `lora_dropout`
(the adapters are made first), and the probabilities transformers' layers pass to functional dropout (Llama-style
`attention_dropout`, Seed-OSS's `residual_dropout`), which no Dropout module holds and TRL's setting leaves on.
A policy left training with dropout gets one warning naming where."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from grpo import GRPOTrainer
from grpo.models.modeling import active_dropout
from support.families import FAMILIES
from support.rewards import length_reward
from support.runs import cfg, chat_dataset
from support.tiny import make_tokenizer


def trainer_with_dropout(tiny_model_dir, tmp_path, disable):
    """The tiny Llama with attention dropout 0.2, a dropout module (p=0.3) and LoRA adapters with dropout 0.1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.2)
    model.model.probe = torch.nn.Dropout1d(0.3)  # any kind of dropout module (not an nn.Dropout subclass)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, task_type="CAUSAL_LM")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, disable_dropout=disable),
            peft_config=lora,
        )
    said = [str(w.message) for w in caught if "trains with dropout" in str(w.message)]
    return trainer, said


def test_disable_dropout_turns_off_modules_adapters_and_functional_dropout(tiny_model_dir, tmp_path):
    trainer, said = trainer_with_dropout(tiny_model_dir, tmp_path, disable=True)
    model = trainer.unwrapped_model
    assert active_dropout(model) == {} and said == []
    attention = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    assert attention and all(m.attention_dropout == 0.0 for m in attention)
    adapters = [m for n, m in model.named_modules() if ".lora_dropout." in n]
    assert adapters and all(m.p == 0.0 for m in adapters)


def test_a_policy_training_with_dropout_is_named_once(tiny_model_dir, tmp_path):
    trainer, said = trainer_with_dropout(tiny_model_dir, tmp_path, disable=False)
    assert active_dropout(trainer.unwrapped_model) == {"attention_dropout": 0.2, "probe": 0.3, "lora_dropout": 0.1}
    assert len(said) == 1 and all(name in said[0] for name in ("attention_dropout=0.2", "lora_dropout=0.1"))


@pytest.mark.parametrize("disable", [True, False])
def test_seed_oss_samples_what_it_trains_once_its_dropout_is_off(tmp_path, disable):
    """Seed-OSS's config drops out in attention and after each block (0.1 each by default), as functional dropout
    only: with disable_dropout its training pass scores what the engine sampled; without, it does not."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config = transformers.SeedOssConfig(vocab_size=len(tokenizer), **FAMILIES["SeedOss"], **ids)  # the table's
    assert config.attention_dropout > 0 and config.residual_dropout > 0
    transformers.SeedOssForCausalLM(config).save_pretrained(tmp_path / "seed")
    tokenizer.save_pretrained(tmp_path / "seed")
    args = cfg(tmp_path, max_steps=1, logging_steps=1, disable_dropout=disable)
    trainer = GRPOTrainer(
        model=str(tmp_path / "seed"), reward_funcs=length_reward, train_dataset=chat_dataset(), args=args
    )
    trainer.train()
    row = next(r for r in reversed(trainer.state.log_history) if "loss" in r)
    assert (row["sampling/sampling_logp_difference/max"] < 1e-3) == disable
