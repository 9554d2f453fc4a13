"""Reward models in reward_funcs: a sequence-classification model (directory or module) scores prompt +
completion, tokenized right-padded without special tokens; the reward is logit 0 (shared spec §5.6)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from grpo import GRPOTrainer
from grpo.rewards.models import RewardModel
from support.rewards import length_reward
from support.runs import cfg, chat_dataset, text_dataset
from support.tiny import make_tokenizer


def tiny_classifier(tok, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForSequenceClassification(config).eval()


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge")
    tok = make_tokenizer()
    tiny_classifier(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def one_by_one(model, tok, texts):
    """Each text alone (no padding at all), the reference values."""
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        out.append(model(**ids).logits[0, 0].item())
    return out


def test_conversational_text_is_the_chat_template_of_prompt_plus_completion():
    tok = make_tokenizer()
    rm = RewardModel(tiny_classifier(tok), tok)
    prompts = [[{"role": "user", "content": "Add 2 and 3"}], [{"role": "user", "content": "Hi"}]]
    completions = [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "Hello there!"}]]
    texts = rm.texts(prompts, completions)
    assert texts[0] == "<|im_start|>user\nAdd 2 and 3<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    with torch.no_grad():
        expected = one_by_one(rm.model, tok, texts)
    got = rm(prompts=prompts, completions=completions)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)  # right padding does not change a row's logit
    assert rm.__name__ == "LlamaForSequenceClassification"  # a module without a path: its class name


def test_standard_text_is_the_plain_concatenation():
    tok = make_tokenizer()
    rm = RewardModel(tiny_classifier(tok), tok)
    assert rm.texts(["Solve x = 1.", "Why?"], [" x is 1", " Because."]) == ["Solve x = 1. x is 1", "Why? Because."]
    with torch.no_grad():
        expected = one_by_one(rm.model, tok, ["Solve x = 1. x is 1", "Why? Because."])
    assert rm(prompts=["Solve x = 1.", "Why?"], completions=[" x is 1", " Because."]) == pytest.approx(
        expected, rel=1e-5, abs=1e-6
    )


def test_reward_model_directory_trains_next_to_a_function(tiny_model_dir, classifier_dir, tmp_path):
    """A directory in reward_funcs is loaded at construction with its own tokenizer; its rewards are the model's
    logits for the sampled completions and are logged under the directory's name."""
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[length_reward, classifier_dir],
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, reward_weights=[0.0, 1.0]),
    )
    judge = trainer.parts.rewards.funcs[1]
    assert isinstance(judge, RewardModel) and judge.__name__ == "judge0"
    seen = {}
    original = judge.__call__

    def spy(**kwargs):
        seen["rewards"] = original(**kwargs)
        seen["texts"] = judge.texts(kwargs["prompts"], kwargs["completions"])
        return seen["rewards"]

    trainer.parts.rewards.funcs[1] = spy
    trainer.train()
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    with torch.no_grad():
        expected = one_by_one(judge.model, judge.tokenizer, seen["texts"])
    assert seen["rewards"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert row["rewards/judge0/mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_reward_model_module_with_processing_class(tiny_model_dir, tmp_path):
    tok = make_tokenizer()
    tok.pad_token = None  # a reward tokenizer without a pad token: EOS pads, and the model is told
    module = tiny_classifier(tok, seed=1)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[module],
        train_dataset=text_dataset(),
        args=cfg(tmp_path),
        reward_processing_classes=[tok],
    )
    judge = trainer.parts.rewards.funcs[0]
    assert judge.tokenizer.pad_token == tok.eos_token and module.config.pad_token_id == tok.eos_token_id
    seen = {}
    original = judge.__call__

    def spy(**kwargs):  # standard prompts: the text scored is prompt + completion, padded with EOS
        seen["rewards"] = original(**kwargs)
        seen["texts"] = [p + c for p, c in zip(kwargs["prompts"], kwargs["completions"])]
        return seen["rewards"]

    trainer.parts.rewards.funcs[0] = spy
    trainer.train()
    with torch.no_grad():
        expected = one_by_one(module, tok, seen["texts"])
    assert seen["rewards"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    row = trainer.state.log_history[-1]
    assert row[f"rewards/{judge.__name__}/mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_module_without_tokenizer_or_config_is_rejected_clearly(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="No tokenizer for the reward model"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=[tiny_classifier(make_tokenizer())],
            train_dataset=text_dataset(),
            args=cfg(tmp_path),
        )
    with pytest.raises(ValueError, match="without a transformers config"):
        GRPOTrainer(
            model=tiny_model_dir, reward_funcs=[torch.nn.Linear(2, 1)], train_dataset=text_dataset(), args=cfg(tmp_path)
        )
