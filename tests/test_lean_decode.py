"""The lean decoder against the transformers forward: for a fixed prefix, the next-token log-prob vectors agree
(float32: rtol 1e-5/atol 1e-5; bfloat16 against the forward under bfloat16 autocast: within 0.05 in every
log-prob, and the same argmax), through left-padded ragged prompts, prefix sharing and rows leaving the batch."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpo.rollout import packed
from grpo.rollout.base import left_pad
from grpo.rollout.lean_decoder import LeanDecoder, unsupported_reason
from tiny import make_model, make_tokenizer


def reference_logprobs(model, rows, dtype):
    """Next-token log-probs after each row's tokens, one unpadded transformers forward per row."""
    out = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        for row in rows:
            out.append(torch.log_softmax(model(torch.tensor([row])).logits[0, -1].float(), -1))
    return torch.stack(out)


def check(model, dtype, atol):
    prompts = [[5, 9, 11, 13, 7], [8, 3], [21, 22, 23, 24, 25, 26, 27]]
    owner = torch.tensor([0, 0, 1, 1, 2, 2])
    ids, mask = left_pad(prompts, 0)
    dec = LeanDecoder(model, dtype)
    seqs = [list(prompts[o]) for o in owner.tolist()]
    logits = dec.prefill(ids, mask, owner, max_new=6)
    active = list(range(len(seqs)))
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        got = torch.log_softmax(logits, -1)
        expected = reference_logprobs(model, [seqs[r] for r in active], dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)
        else:
            assert (got - expected).abs().max() < atol
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
        tokens = torch.randint(5, 60, (len(active),), generator=g)
        for r, t in zip(active, tokens.tolist()):
            seqs[r].append(t)
        if step == 2:  # rows 1 and 4 finish and leave the batch
            keep = torch.tensor([i for i, r in enumerate(active) if r not in (1, 4)])
            dec.select(keep)
            tokens = tokens[keep]
            active = [active[i] for i in keep.tolist()]
        logits = dec.step(tokens)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_llama_next_token_distributions_match(dtype, atol):
    model = make_model(make_tokenizer(), hidden=64, layers=2).eval()
    check(model, dtype, atol)


def test_qwen2_with_qkv_bias_and_tied_head_matches():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    check(Qwen2ForCausalLM(config).eval(), torch.float32, 1e-5)


def test_llama_with_biases_and_rope_scaling_matches():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        attention_bias=True,
        mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    check(LlamaForCausalLM(config).eval(), torch.float32, 1e-5)


def test_unsupported_models_are_named():
    from peft import LoraConfig, get_peft_model

    model = make_model(make_tokenizer())
    assert unsupported_reason(model) is None
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert "projection is a peft.tuners.lora" in unsupported_reason(lora)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "model type 'gpt2'" in unsupported_reason(gpt2)


@pytest.mark.skipif(not packed.available(torch.zeros(1)), reason="no MKL packed sgemm in this torch build")
def test_packed_float32_decode_matches_transformers_and_keeps_then_leaves_its_batch():
    """Float32 on a CPU with MKL: after PACK_AFTER steps the weights are packed for the decode batch
    (grpo.rollout.packed). Finished rows keep their slots while more than a quarter of the batch is going, then the
    batch shrinks to the plain path; next-token log-probs match the transformers forward throughout (float32:
    rtol/atol 1e-5, as the plain path)."""
    torch.manual_seed(0)
    model = make_model(make_tokenizer(), hidden=64, layers=2).eval()
    prompts = [[5, 9, 11, 13, 7], [8, 3]]
    owner = torch.tensor([0] * 4 + [1] * 4)
    ids, mask = left_pad(prompts, 0)
    dec = LeanDecoder(model, torch.float32)
    steps = packed.PACK_AFTER + 6
    logits = dec.prefill(ids, mask, owner, max_new=packed.PACK_AFTER + packed.STEPS_AFTER_PACKING + 1)
    seqs = [list(prompts[o]) for o in owner.tolist()]
    active = list(range(8))
    g = torch.Generator().manual_seed(0)
    # after packing: 6 of 8 rows go on, then 4 (still packed), then 2 (a quarter): the batch shrinks
    drops = {packed.PACK_AFTER + 1: [0, 5], packed.PACK_AFTER + 2: [2, 7], packed.PACK_AFTER + 4: [1, 4]}
    for step in range(steps):
        expected = reference_logprobs(model, [seqs[r] for r in active], torch.float32)
        torch.testing.assert_close(torch.log_softmax(logits, -1), expected, rtol=1e-5, atol=1e-5)
        tokens = torch.randint(5, 60, (len(active),), generator=g)
        for r, t in zip(active, tokens.tolist()):
            seqs[r].append(t)
        if step in drops:
            keep = torch.tensor([i for i, r in enumerate(active) if r not in drops[step]])
            dec.select(keep)
            tokens, active = tokens[keep], [active[i] for i in keep.tolist()]
        packed_now = packed.PACK_AFTER <= step < packed.PACK_AFTER + 4
        assert (dec.live is not None) == (packed_now and step > packed.PACK_AFTER)  # packs in the step below
        logits = dec.step(tokens)
        assert (dec.live is not None) == packed_now
        assert dec.keys[0].shape[0] == (8 if packed_now else len(active))
