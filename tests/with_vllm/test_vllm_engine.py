"""The vLLM engine (colocate mode) on this CPU: its weights are the policy's after a sync (and not without one), for
plain, bfloat16 and LoRA policies; sampling parameters, stops and budgets mean what they mean in-process; bad
settings get one clear error."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from grpo.algo.sampling import SamplingSettings
from grpo.base.records import Request
from grpo.rollout.fast import logits_processors
from support.launch import job_script
from support.runs import generate
from support.vllm_runs import (
    BF16_MAX_TOL,
    BF16_MEAN_TOL,
    FP32_TOL,
    engine_logps,
    fixed_completion,
    make_trainer,
    perturb,
    policy_logps,
)


def test_after_a_sync_the_engine_scores_as_the_policy_and_without_one_it_does_not(vllm_model_dir, tmp_path):
    trainer = make_trainer(vllm_model_dir, tmp_path)
    prompt, completion = fixed_completion(trainer)
    trainer.engine.sync_weights(trainer.unwrapped_model)
    diff = (engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)).abs()
    assert diff.max() < FP32_TOL
    perturb(trainer.unwrapped_model)  # an optimizer step's worth of change, not synced
    stale = (engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)).abs()
    assert stale.mean() > 100 * FP32_TOL
    trainer.engine.sync_weights(trainer.unwrapped_model)
    fresh = (engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)).abs()
    assert fresh.max() < FP32_TOL


def test_a_tied_output_head_follows_the_embedding_through_every_sync(vllm_tied_model_dir, tmp_path):
    """vLLM's CPU backend packs the output head apart from the embedding it shares; each sync must repack it (at
    start the engine's weights are dummies: an unrepacked head samples noise)."""
    trainer = make_trainer(vllm_tied_model_dir, tmp_path)
    model = trainer.unwrapped_model
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    prompt, completion = fixed_completion(trainer)
    for _ in range(2):  # the first sync over dummy weights, then one over changed weights
        trainer.engine.sync_weights(model)
        diff = (engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)).abs()
        assert diff.max() < FP32_TOL
        perturb(model)


def test_sampled_log_probs_are_the_policys_processed_ones(vllm_model_dir, tmp_path):
    """temperature, top_k, top_p and repetition_penalty: the log-prob vLLM reports for each sampled token is the
    in-process engines' (transformers' processors over the policy's logits); min_p alone likewise."""
    for settings in (
        dict(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3),
        dict(temperature=1.3, min_p=0.02),
    ):
        trainer = make_trainer(vllm_model_dir, tmp_path, max_completion_length=12, **settings)
        rollout = generate(trainer, list(range(4))).rollout
        processors = logits_processors(SamplingSettings.of(trainer.args))
        for prompt, completion, logps in zip(rollout.prompt_ids, rollout.completion_ids, rollout.sampling_logps):
            expected = policy_logps(trainer, prompt, completion, processors)
            assert torch.allclose(torch.tensor(logps), expected, atol=FP32_TOL), settings


def test_a_gemma4s_layer_scalars_reach_the_engine(tmp_path):
    """Gemma 4 keeps a scalar per layer as a buffer (in its checkpoint, not among its parameters); an engine started
    from dummy weights has random ones until a sync brings them (`weights.persistent_buffers`): without them its
    log-probs were off by 0.45 here. Also Gemma 4's wider global heads with their own key-value heads, keys as
    values, per-layer inputs and sliding layer, through vLLM's transformers backend."""
    import transformers

    from support import tiny

    tokenizer = tiny.make_tokenizer()
    config = transformers.Gemma4TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention takes heads of 32 and 64
        global_head_dim=64,
        num_global_key_value_heads=1,  # as the larger Gemma 4s: global layers with their own key-value heads,
        attention_k_eq_v=True,  # whose keys are their values
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tokenizer),
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.Gemma4ForCausalLM(config).save_pretrained(tmp_path / "gemma4")
    tokenizer.save_pretrained(tmp_path / "gemma4")
    trainer = make_trainer(str(tmp_path / "gemma4"), tmp_path)
    with torch.no_grad():  # trained scalars, not the ones a fresh model starts with
        for i, layer in enumerate(trainer.unwrapped_model.model.layers):
            layer.layer_scalar.fill_(0.5 + i)
    prompt, completion = fixed_completion(trainer)
    trainer.engine.sync_weights(trainer.unwrapped_model)
    diff = (engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)).abs()
    assert diff.max() < FP32_TOL


def test_a_mixture_of_experts_reaches_the_engine(tmp_path):
    """vLLM's CPU experts kernel packs the experts' matrices once, and a reload does not pack them again
    (`serve.vllm_reload._repack_cpu_experts` does): without it the engine sampled from its start's experts,
    log-probs 0.69 off here. A tiny Qwen3-MoE whose experts change after the engine is built (moe_job.py, in a
    process of its own: a mixture-of-experts engine needs vLLM's expert-parallel group, which an earlier engine's
    process lacks)."""
    job = job_script("moe_job.py")
    done = subprocess.run([sys.executable, job, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    diff = json.loads((tmp_path / "diff.json").read_text())
    assert diff["synced"] < FP32_TOL and diff["stale"] > 100 * FP32_TOL


def test_bfloat16_engine_matches_the_bfloat16_policy_within_its_tolerance(vllm_model_dir, tmp_path):
    trainer = make_trainer(vllm_model_dir, tmp_path, bf16=True)
    assert trainer.engine.llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    prompt, completion = fixed_completion(trainer)
    trainer.engine.sync_weights(trainer.unwrapped_model)
    diff = (engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)).abs()
    assert diff.mean() < BF16_MEAN_TOL and diff.max() < BF16_MAX_TOL
    perturb(trainer.unwrapped_model)
    stale = (engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)).abs()
    assert stale.mean() > 4 * BF16_MEAN_TOL


def test_lora_policy_reaches_the_engine_merged_and_its_base_weights_stay_untouched(vllm_model_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    trainer = make_trainer(vllm_model_dir, tmp_path, peft_config=lora)
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}
    prompt, completion = fixed_completion(trainer)
    trainer.engine.sync_weights(trainer.unwrapped_model)
    for name, param in trainer.unwrapped_model.named_parameters():
        assert torch.equal(param, before[name]), name  # deltas added to copies, nothing merged in place
    merged = policy_logps(trainer, prompt, completion)  # the PEFT model's forward: base + adapters
    diff = (engine_logps(trainer.engine, prompt, completion) - merged).abs()
    assert diff.max() < FP32_TOL
    with trainer.unwrapped_model.disable_adapter():
        base = policy_logps(trainer, prompt, completion)
    assert (merged - base).abs().mean() > 100 * FP32_TOL  # the adapters matter, so the check can fail


def test_completions_stop_at_eos_and_end_of_turn_keep_the_stop_token_and_respect_budgets(vllm_model_dir, tmp_path):
    trainer = make_trainer(
        vllm_model_dir,
        tmp_path,
        max_completion_length=24,
        # make the chat template's end of turn likely, so both ways of ending occur
        generation_kwargs={"logit_bias": {5: 2.5}},
    )
    stops = set(trainer.parts.stop_ids)
    rollout = generate(trainer, list(range(8)) * 2).rollout
    assert any(not t for t in rollout.truncated) and all(len(c) <= 24 for c in rollout.completion_ids)
    for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
        assert truncated == (ids[-1] not in stops)
        assert not stops & set(ids[:-1])  # nothing after the first stop token
    short = trainer.engine.generate([Request(trainer.parts.prompts[0], num_samples=3, max_tokens=2)])
    assert [len(c) <= 2 for c in short.completion_ids] == [True] * 3 and len(short) == 3


def test_structured_outputs_regex_constrains_the_completions(vllm_model_dir, tmp_path):
    trainer = make_trainer(vllm_model_dir, tmp_path, max_completion_length=6, vllm_structured_outputs_regex="[0-9]{3}")
    rollout = generate(trainer, [0, 1, 2, 3]).rollout
    assert all(re.fullmatch("[0-9]{3}", text) for text in rollout.texts), rollout.texts


def test_unknown_or_owned_generation_kwargs_are_one_error_naming_vllm(vllm_model_dir, tmp_path):
    with pytest.raises(ValueError, match="not a parameter of vLLM's SamplingParams"):
        make_trainer(vllm_model_dir, tmp_path, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match="sets 'n', which grpo's vLLM engine sets itself"):
        make_trainer(vllm_model_dir, tmp_path, generation_kwargs={"n": 2})


def test_a_prompt_longer_than_vllm_max_model_length_is_an_error_naming_its_row(vllm_model_dir, tmp_path):
    from datasets import Dataset

    rows = [{"prompt": "short"}, {"prompt": "a much longer prompt " * 4}]  # one generation uses both
    trainer = make_trainer(vllm_model_dir, tmp_path, dataset=Dataset.from_list(rows), vllm_max_model_length=48)
    with pytest.raises(ValueError, match="train_dataset row 1: the prompt is 84 tokens, but the model's context is 48"):
        trainer.train()


def test_a_model_vllm_cannot_run_is_one_error_with_the_way_out(tiny_model_dir_h8, tmp_path):
    """vLLM's CPU attention has no kernel for head size 8: its error, deep in its stack, becomes one line."""
    trainer = make_trainer(tiny_model_dir_h8, tmp_path)  # it starts; its first generation finds no kernel
    with pytest.raises(RuntimeError, match=r"vLLM could not generate with this model.*head_dim=8.*use_vllm=False"):
        trainer.train()
