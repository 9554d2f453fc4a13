"""LoRA through peft_config or a PEFT model: only adapters train, the reference (beta > 0) is the base model
with adapters disabled (no second copy), saving writes the adapter, gradient checkpointing works, the fast
engine samples from the adapted model, and a resume restores the adapter exactly."""

from __future__ import annotations

import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from grpo import GRPOTrainer
from grpo.algo.sampling import SamplingSettings
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from grpo.rollout.fast import FastEngine
from grpo.rollout.plain import TransformersEngine
from support.rewards import length_reward
from support.runs import cfg, chat_dataset


def lora_config():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def lora_trainer(tiny_model_dir, tmp_path, **kw):
    return GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, **kw),
        peft_config=lora_config(),
    )


@pytest.mark.parametrize("checkpointing", [False, True])
def test_only_adapters_train(tiny_model_dir, tmp_path, checkpointing):
    trainer = lora_trainer(tiny_model_dir, tmp_path, gradient_checkpointing=checkpointing)
    model = trainer.unwrapped_model
    assert isinstance(model, PeftModel) and isinstance(trainer.engine, FastEngine)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    for name, p in model.named_parameters():
        changed = not torch.equal(before[name], p)
        # lora_B starts at zero, so after one step A may not have moved yet; B must have
        if "lora_B" in name:
            assert changed, name
        elif "lora_" not in name:
            assert not changed, name


def test_reference_is_the_base_model_with_adapters_disabled(tiny_model_dir, tmp_path):
    trainer = lora_trainer(tiny_model_dir, tmp_path, beta=0.1, max_steps=2)
    assert trainer.ref_model is None and trainer.parts.ref_from_adapters
    seen = []
    original = trainer._add_old_and_ref_logps

    def spy(batch):
        seen.append(original(batch))
        return seen[-1]

    trainer._add_old_and_ref_logps = spy
    trainer.train()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        expected = token_logps(base, seen[-1], PassSettings(1.0, with_entropy=False)).logps
    mask = seen[-1].mask.bool()
    torch.testing.assert_close(seen[-1].ref_logps[mask], expected[mask], rtol=1e-5, atol=1e-6)
    kl = trainer.state.log_history[-1]["kl"]
    assert kl > 0  # the adapters moved the policy away from the base after step 1


def test_save_writes_the_adapter(tiny_model_dir, tmp_path):
    trainer = lora_trainer(tiny_model_dir, tmp_path)
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    assert "model.safetensors" not in os.listdir(out)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out)).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    trained = trainer.unwrapped_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained(ids).logits)


def test_a_peft_model_as_model(tiny_model_dir, tmp_path):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_config())
    from support.tiny import make_tokenizer

    trainer = GRPOTrainer(
        model=model,
        processing_class=make_tokenizer(),
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, beta=0.1),
    )
    assert trainer.ref_model is None and trainer.parts.ref_from_adapters
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    for name, p in model.named_parameters():  # the given model is the one trained: only its adapters move
        assert torch.equal(before[name], p) != ("lora_B" in name), name
    # lora_B starts at zero: at step 1 the policy is exactly the adapter-less reference
    assert trainer.state.log_history[-1]["kl"] == 0.0
    with pytest.raises(ValueError, match="already is a PEFT model"):
        GRPOTrainer(
            model=model,
            processing_class=make_tokenizer(),
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path),
            peft_config=lora_config(),
        )


def test_fast_engine_on_the_adapted_model_matches_plain_generate(tiny_model_dir, tmp_path):
    trainer = lora_trainer(tiny_model_dir, tmp_path, temperature=1.0)
    model = trainer.unwrapped_model
    with torch.no_grad():  # make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    prompts = trainer.parts.prompts.requests([0, 0, 1, 1])
    tok = trainer.processing_class
    sampling = SamplingSettings.of(trainer.args)
    fast = FastEngine(model, tok, sampling, trainer.parts.stop_ids, sampler=lambda logprobs: logprobs.argmax(-1))
    greedy = SamplingSettings.of(cfg(tmp_path, generation_kwargs={"do_sample": False}))
    plain = TransformersEngine(model, tok, greedy, trainer.parts.stop_ids)
    expected = plain.generate(prompts).completion_ids
    assert fast.generate(prompts).completion_ids == expected
    with model.disable_adapter():  # and the adapters do change what is generated
        assert plain.generate(prompts).completion_ids != expected


def test_resume_restores_the_adapter_exactly(tiny_model_dir, tmp_path):
    straight = lora_trainer(tiny_model_dir, tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=1)
    straight.train()
    resumed = lora_trainer(tiny_model_dir, tmp_path / "b", max_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    for (name, p), q in zip(straight.unwrapped_model.named_parameters(), resumed.unwrapped_model.parameters()):
        assert torch.equal(p, q), name


# ---- grpo.models.lora on its own -------------------------------------------------------------------------------


class Wrapper(torch.nn.Module):
    """What DDP and DeepSpeed look like from outside: the model under `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_wrap_adds_trainable_adapters_and_is_seen_through_wrappers(tiny_model_dir):
    from grpo.models import lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not lora.is_peft_model(base) and not lora.is_peft_model(Wrapper(base))
    model = lora.wrap(base, lora_config(), gradient_checkpointing=False)
    assert lora.is_peft_model(model) and lora.is_peft_model(Wrapper(model))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with pytest.raises(ValueError, match="already is a PEFT model"):
        lora.wrap(model, lora_config(), gradient_checkpointing=False)
    with pytest.raises(TypeError, match="pass a peft.PeftConfig"):
        lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir), {"r": 4}, gradient_checkpointing=False)


def test_adapters_disabled_gives_the_base_model_through_a_wrapper(tiny_model_dir):
    from grpo.models import lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = base(ids).logits
        model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_config(), False).eval()
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
        adapted = model(ids).logits
        with lora.adapters_disabled(Wrapper(model)):
            disabled = model(ids).logits
        assert not torch.allclose(adapted, expected)
        torch.testing.assert_close(disabled, expected)
        torch.testing.assert_close(model(ids).logits, adapted)  # enabled again after the block


def test_load_adapter_restores_saved_weights_and_names_what_does_not_fit(tiny_model_dir, tmp_path):
    from grpo.models import lora

    def adapted(seed):
        torch.manual_seed(seed)
        model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_config(), False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_()
        return model

    saved = adapted(0)
    saved.save_pretrained(tmp_path / "adapter")
    target = adapted(1)
    assert lora.load_adapter(Wrapper(target), str(tmp_path / "adapter")) == []
    for (name, p), q in zip(saved.named_parameters(), target.parameters()):
        assert torch.equal(p, q), name
    wider = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "k_proj"], task_type="CAUSAL_LM")
    wide = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir), wider, False)
    wide.save_pretrained(tmp_path / "wide")
    assert any("k_proj" in key for key in lora.load_adapter(target, str(tmp_path / "wide")))
    with pytest.raises(FileNotFoundError, match="holds no LoRA adapter"):
        lora.load_adapter(target, str(tmp_path))
