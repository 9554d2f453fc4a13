"""The lean decoder against the transformers forward: for a fixed prefix, the next-token log-prob vectors agree
(float32: rtol/atol 1e-5 on the CPU; bfloat16 against the forward under bfloat16 autocast: within 0.05 in every
log-prob, and the same argmax; `on_device` states the tolerances, and the device for the tests marked `device`),
through left-padded ragged prompts, prefix sharing and rows leaving the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from grpo.base.records import left_pad
from grpo.rollout import lean_decoder, lean_families
from grpo.rollout.cpu import packed, panels
from grpo.rollout.lean_decoder import LeanDecoder
from grpo.rollout.lean_families import unsupported_reason
from support import on_device
from support.tiny import make_gemma3, make_model, make_tokenizer, with_lora

PACKED_LINEAR = packed.packed_linear


def reference_logprobs(model, rows, dtype):
    """Next-token log-probs after each row's tokens, one unpadded transformers forward per row (on the model's
    device)."""
    out = []
    dev = next(model.parameters()).device
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        for row in rows:
            out.append(torch.log_softmax(model(torch.tensor([row], device=dev)).logits[0, -1].float(), -1))
    return torch.stack(out)


def check(model, dtype, max_new=6, judge=None):
    """Six decode steps (rows 1 and 4 leave after the third) against the transformers forward, on the model's
    device; a budget of `max_new` tokens (over packed.STEPS_AFTER_PACKING: the float32 panel kernel and fused
    steps, where they run). Tolerances: `on_device`'s for the dtype and device; `judge(got, rows)` instead, where
    given."""
    prompts = [[5, 9, 11, 13, 7], [8, 3], [21, 22, 23, 24, 25, 26, 27]]
    dev = next(model.parameters()).device
    owner = torch.tensor([0, 0, 1, 1, 2, 2], device=dev)
    ids, mask = left_pad(prompts, 0)
    dec = LeanDecoder(model, dtype)
    seqs = [list(prompts[o]) for o in owner.tolist()]
    logits = dec.prefill(ids.to(dev), mask.to(dev), owner, max_new=max_new)
    active = list(range(len(seqs)))
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        got = torch.log_softmax(logits, -1)
        if judge is not None:
            judge(got, [seqs[r] for r in active])
        else:
            expected = reference_logprobs(model, [seqs[r] for r in active], dtype)
            on_device.assert_next_token_logps_close(got, expected, dtype)
        tokens = torch.randint(5, 60, (len(active),), generator=g)
        for r, t in zip(active, tokens.tolist()):
            seqs[r].append(t)
        if step == 2:  # rows 1 and 4 finish and leave the batch
            keep = torch.tensor([i for i, r in enumerate(active) if r not in (1, 4)])
            dec.select(keep.to(dev))
            tokens = tokens[keep]
            active = [active[i] for i in keep.tolist()]
        logits = dec.step(tokens.to(dev))
    return dec


@on_device.mark
@on_device.dtypes
def test_llama_next_token_distributions_match(dtype):
    model = make_model(make_tokenizer(), hidden=64, layers=2).eval().to(on_device.device())
    check(model, dtype)


needs_panels = pytest.mark.skipif(
    not panels.available(torch.zeros(1)), reason="no AVX2/FMA here, or grpo was installed without its kernel"
)


def _qwen2_tied():
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
    return Qwen2ForCausalLM(config).eval()


def _llama_biased():
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
    return LlamaForCausalLM(config).eval()


def _qwen3():
    """Qwen3: per-head query and key RMSNorms (their weights made far from 1, so a norm left out or misplaced
    shows), grouped queries, a head size other than hidden / heads, a tied head."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.2, 3.0)
    return model


@on_device.mark
@on_device.dtypes
def test_qwen3_with_query_and_key_norms_matches(dtype):
    assert unsupported_reason(_qwen3()) is None
    check(_qwen3().to(on_device.device()), dtype)


@on_device.mark
@on_device.dtypes
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_gemma3_with_sliding_layers_and_sandwich_norms_matches(dtype, softcap):
    """Gemma 3: rows cross the sliding layers' window of 4 (prompts of 2 to 7 tokens and 6 steps), each kind of
    layer rotated at its own base, scaled embeddings, (1 + weight) norms around each sublayer, the tanh GELU, and
    the final soft-capping where configured."""
    model = make_gemma3(make_tokenizer(), final_logit_softcapping=softcap).eval()
    assert unsupported_reason(model) is None
    dec = check(model.to(on_device.device()), dtype)
    assert dec.windows == [4] and dec.fused is None


def test_gemma3_settings_the_lean_decoder_does_not_run_are_named():
    tok = make_tokenizer()
    assert "attn_logit_softcapping" in unsupported_reason(make_gemma3(tok, attn_logit_softcapping=50.0))
    assert "both ways" in unsupported_reason(make_gemma3(tok, use_bidirectional_attention=True))
    assert "'gelu' is not Gemma's tanh GELU" in unsupported_reason(make_gemma3(tok, hidden_activation="gelu"))
    assert lean_families.fixed_shape_reason(make_gemma3(tok)) is not None
    assert lean_families.fixed_shape_reason(make_model(tok)) is None


def _phi3(partial=1.0, **config):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    settings = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        partial_rotary_factor=partial,
        pad_token_id=0,
        **config,
    )
    return Phi3ForCausalLM(Phi3Config(**settings)).eval()


@on_device.mark
@on_device.dtypes
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_phi3_with_fused_projections_and_partial_rotation_matches(dtype, partial):
    """Phi-3 (and Phi-4-mini: a partial rotation of each head's first dimensions): q/k/v in one linear, gate and up
    in one, as the lean decoder's own stacked parts; a sliding window over every layer where configured."""
    model = _phi3(partial)
    assert unsupported_reason(model) is None
    dec = check(model.to(on_device.device()), dtype, max_new=30)
    assert (dec.fused is not None) == (partial == 1.0 and dtype == torch.float32 and panels.available(torch.zeros(1)))
    check(_phi3(partial, sliding_window=4).to(on_device.device()), dtype)


@on_device.mark
@on_device.dtypes
def test_olmo2_with_norms_after_each_sublayer_matches(dtype):
    """OLMo 2: no norm before attention or the MLP, one after each (weights drawn away from 1), and RMS norms over
    the whole query and key projections before the heads are split; it takes the per-step loop."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    config = Olmo2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    model = Olmo2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.3, 2.5)
    assert unsupported_reason(model) is None and lean_families.fixed_shape_reason(model) is not None
    dec = check(model.to(on_device.device()), dtype, max_new=30)
    assert dec.fused is None


def test_rotary_embeddings_that_change_with_the_length_are_named():
    for kind in ("dynamic", "longrope"):
        rope = {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}
        if kind == "longrope":
            rope.update(short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=64)
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, rope_parameters=rope
        )
        reason = unsupported_reason(LlamaForCausalLM(config))
        assert f"rotary embedding ({kind}) changes with the sequence's length" in reason


def _windowed(kind):
    """A 2-layer model of `kind` with a sliding window of 4 tokens (rows of 2 to 13 tokens cross it): Mistral's on
    every layer, Qwen2's past max_window_layers, Qwen3's by layer type; SmolLM3 with a layer without rotary
    embeddings (and no window)."""
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**sizes, sliding_window=4)).eval()
    if kind == "qwen2":
        config = Qwen2Config(**sizes, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        return Qwen2ForCausalLM(config).eval()
    if kind == "qwen3":
        layers = ["sliding_attention", "full_attention"]
        config = Qwen3Config(**sizes, use_sliding_window=True, sliding_window=4, layer_types=layers)
        return Qwen3ForCausalLM(config).eval()
    return SmolLM3ForCausalLM(SmolLM3Config(**sizes, no_rope_layers=[1, 0], pad_token_id=0)).eval()


@on_device.mark
@on_device.dtypes
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3", "smollm3"])
def test_sliding_windows_and_layers_without_rope_match(kind, dtype):
    """Sliding-window layers (keys at most 3 positions back, by position: rows are left-padded) beside full ones,
    and SmolLM3's layer without rotary embeddings, against the transformers forward; they take the per-step loop."""
    model = _windowed(kind)
    assert unsupported_reason(model) is None
    dec = check(model.to(on_device.device()), dtype)
    assert dec.windows == ([] if kind == "smollm3" else [4]) and dec.fused is None
    assert lean_families.fixed_shape_reason(model) is not None
    if kind == "qwen2":
        assert [layer["window"] for layer in dec.layers] == [None, 4]  # only past max_window_layers


@on_device.mark
@on_device.dtypes
def test_qwen2_with_qkv_bias_and_tied_head_matches(dtype):
    check(_qwen2_tied().to(on_device.device()), dtype)


@on_device.mark
@on_device.dtypes
def test_llama_with_biases_and_rope_scaling_matches(dtype):
    check(_llama_biased().to(on_device.device()), dtype)


@needs_panels
@pytest.mark.parametrize("make", [_qwen2_tied, _llama_biased, _qwen3, lambda: make_model(make_tokenizer(), hidden=64)])
def test_fused_float32_decode_steps_match_transformers(make, monkeypatch):
    """Float32 with the panel kernel: each decode step runs every layer in one call (panels.decode_layers: norms,
    q/k/v with biases, RoPE (scaled), grouped-query attention over the buffers, MLP), and matches the transformers
    forward as the unfused path does (rtol 1e-5), rows leaving included."""
    calls = []
    original = panels.decode_layers
    monkeypatch.setattr(panels, "decode_layers", lambda *a: calls.append(a[2].shape[0]) or original(*a))
    dec = check(make(), torch.float32, max_new=30)
    assert dec.fused is not None and calls == [6, 6, 4, 4, 4, 4]  # every step; rows 1 and 4 left after the third


@needs_panels
def test_fused_steps_equal_the_per_operator_steps_within_float32_rounding(monkeypatch):
    """The same rollout through the fused step and through the per-operator panel path: next-token log-probs
    within float32 rounding of each other at every step."""
    model = make_model(make_tokenizer(), hidden=64, layers=3).eval()
    prompts, owner = [[5, 9, 11, 13, 7], [8, 3]], torch.tensor([0, 0, 0, 1, 1, 1])
    ids, mask = left_pad(prompts, 0)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(lean_decoder, "FUSED", fused)
        dec = LeanDecoder(model, torch.float32)
        out = [dec.prefill(ids, mask, owner, max_new=20)]
        g = torch.Generator().manual_seed(0)
        for _ in range(12):
            out.append(dec.step(torch.randint(5, 60, (6,), generator=g)))
        assert (dec.fused is not None) == fused
        runs.append(torch.stack([torch.log_softmax(o, -1) for o in out]))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-5)


@needs_panels
def test_the_kernel_gives_the_same_bits_on_any_number_of_threads():
    """The kernel splits its panels (and the fused step its heads) over OpenMP threads, each output computed whole
    by one thread: the matmul and a fused rollout are bitwise the same on 1, 2 and 3 threads (the suite's workers
    run on one thread each: this test is where several meet)."""
    model = make_model(make_tokenizer(), hidden=64, layers=3).eval()
    prompts, owner = [[5, 9, 11, 13, 7], [8, 3]], torch.tensor([0, 0, 0, 1, 1, 1])
    ids, mask = left_pad(prompts, 0)
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(960, 576, generator=g), torch.randn(16, 576, generator=g)
    tokens = torch.randint(5, 60, (12, 6), generator=g)
    before, runs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            dec = LeanDecoder(model, torch.float32)
            out = [dec.prefill(ids, mask, owner, max_new=20)] + [dec.step(t) for t in tokens]
            assert dec.fused is not None
            runs.append((panels.panel_linear([weight], None)(x), torch.stack(out)))
    finally:
        torch.set_num_threads(before)
    for matmul, rollout in runs[1:]:
        assert torch.equal(matmul, runs[0][0]) and torch.equal(rollout, runs[0][1])


def test_unsupported_models_are_named():
    from peft import LoraConfig, get_peft_model

    model = make_model(make_tokenizer())
    assert unsupported_reason(model) is None
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert unsupported_reason(lora) is None  # merged per rollout
    dora = get_peft_model(make_model(make_tokenizer()), LoraConfig(r=2, target_modules=["v_proj"], use_dora=True))
    assert "LoRA adapter 'default' is a variant (DoRA" in unsupported_reason(dora)
    biased = get_peft_model(make_model(make_tokenizer()), LoraConfig(r=2, target_modules=["o_proj"], lora_bias=True))
    assert "has a bias (lora_bias=True)" in unsupported_reason(biased)
    embedded = get_peft_model(make_model(make_tokenizer()), LoraConfig(r=2, target_modules=["embed_tokens"]))
    assert "input embedding is a Embedding" in unsupported_reason(embedded)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "model type 'gpt2'" in unsupported_reason(gpt2)


def _lora(make, **config):
    return with_lora(make(), **config).eval()


def _snapshot(model, optimizer):
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for i, group in enumerate(optimizer.state.values()):
        state.update({f"optimizer.{i}.{k}": v.clone() for k, v in group.items() if torch.is_tensor(v)})
    return state


LORA_MODELS = {
    "gemma3, every linear": lambda: _lora(lambda: make_gemma3(make_tokenizer())),
    "llama, every linear": lambda: _lora(lambda: make_model(make_tokenizer(), hidden=64)),
    "qwen3, attention only": lambda: _lora(_qwen3, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qwen2 tied head, modules_to_save head and norm": lambda: _lora(
        _qwen2_tied, target_modules=["q_proj", "down_proj"], modules_to_save=["lm_head", "norm"]
    ),
    "llama, LoRA on the head": lambda: _lora(
        lambda: make_model(make_tokenizer(), hidden=64), target_modules=["lm_head", "gate_proj"]
    ),
}


@on_device.mark
@on_device.dtypes
@pytest.mark.parametrize("which", list(LORA_MODELS))
def test_lora_policies_decode_their_merged_weights_and_leave_everything_untouched(which, dtype):
    """A LoRA policy on the lean path: each rollout merges base + scaling * B A into the decoder's own copy (in
    float32, rounded once), so next-token log-probs match the PEFT model's own forward (adapters applied as they
    train, dropout off) within the dtype's tolerance; the policy's parameters (base, adapters, `modules_to_save`
    copies) and the optimizer's state are bitwise what they were."""
    model = LORA_MODELS[which]().to(on_device.device())
    assert unsupported_reason(model) is None
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = model(torch.tensor([[5, 9, 11]], device=on_device.device())).logits.float().logsumexp(-1).sum()
    loss.backward()
    optimizer.step()  # a state to keep
    before = _snapshot(model, optimizer)
    judge = None if dtype == torch.float32 else lambda got, rows: _as_close_as_autocast(model, got, rows)
    check(model, dtype, judge=judge)
    after = _snapshot(model, optimizer)
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed


def _as_close_as_autocast(model, got, rows):
    """bfloat16 with adapters: PEFT's own forward under autocast rounds the adapter branch apart from the base (a
    LoRA head's logits twice), where the merged copy rounds each weight once: neither is the other's reference.
    Both are judged against the float32 forward: the lean decoder's numbers within the bfloat16 tolerance of it
    (on_device.BFLOAT16_NATS), or, where the training pass's own autocast is further off than that, within twice
    the training pass's distance."""
    truth = reference_logprobs(model, rows, torch.float32)
    amp = (reference_logprobs(model, rows, torch.bfloat16) - truth).abs().max()
    worst = (got - truth).abs().max()
    assert worst < max(on_device.BFLOAT16_NATS, 2 * amp), (worst, amp)


@pytest.mark.parametrize("lora", [False, True])
def test_a_bfloat16_rollout_holds_no_float32_copy_of_a_weight(lora):
    """The GPU audit: q/k/v and gate/up were concatenated in float32 and then cast, the float32 concatenation held
    for the whole rollout (~30 GB at 7B), as were LoRA's merged float32 copies. Each part is now cast first: every
    weight the decoder made for itself is bfloat16 (the policy's own parameters are only referenced)."""
    model = LORA_MODELS["llama, every linear"]() if lora else make_model(make_tokenizer(), hidden=64).eval()
    own = {p.data_ptr() for p in model.parameters()}
    dec = LeanDecoder(model, torch.bfloat16)
    ids, mask = left_pad([[5, 9, 11, 13, 7]], 0)
    dec.prefill(ids, mask, torch.tensor([0, 0]), max_new=4)
    made = [w for layer in dec.parts for ws, _ in layer.values() for w in ws if w.data_ptr() not in own]
    made += [w for layer in dec.stacked for w, _ in layer.values() if w.data_ptr() not in own]
    assert made and all(w.dtype == torch.bfloat16 for w in made), {w.dtype for w in made}


def test_lora_deltas_matter_and_a_disabled_adapter_decodes_the_base():
    """The merged copy is what makes the log-probs match: the base weights alone are far off; with the adapters
    disabled (the reference policy), the decoder reads the base weights."""
    model = LORA_MODELS["llama, every linear"]()
    ids, mask = left_pad([[5, 9, 11, 13, 7]], 0)
    with_adapters = LeanDecoder(model, torch.float32).prefill(ids, mask, torch.tensor([0]), max_new=2)
    with model.disable_adapter():
        base = LeanDecoder(model, torch.float32).prefill(ids, mask, torch.tensor([0]), max_new=2)
        expected_base = model(ids).logits[:, -1]
    torch.testing.assert_close(base, expected_base, rtol=1e-5, atol=1e-5)
    assert (with_adapters - base).abs().max() > 0.1


def _decode_with_drops(prompts, owner, steps, max_new, drops, after_step):
    """Decode random tokens through a float32 LeanDecoder, dropping rows `drops[step]` (original row ids) after
    `step`; checks next-token log-probs against the transformers forward (rtol/atol 1e-5, as the plain path) at
    every step and calls `after_step(step, decoder, live rows)` after each."""
    torch.manual_seed(0)
    model = make_model(make_tokenizer(), hidden=64, layers=2).eval()
    ids, mask = left_pad(prompts, 0)
    dec = LeanDecoder(model, torch.float32)
    logits = dec.prefill(ids, mask, owner, max_new=max_new)
    seqs = [list(prompts[o]) for o in owner.tolist()]
    active = list(range(len(owner)))
    g = torch.Generator().manual_seed(0)
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
        logits = dec.step(tokens)
        after_step(step, dec, active)


needs_mkl = pytest.mark.skipif(not packed.available(torch.zeros(1)), reason="no MKL packed sgemm in this torch build")


@pytest.fixture
def mkl_path(monkeypatch):
    """The decoder where the panel kernel does not run: MKL's packed sgemm."""
    monkeypatch.setattr(panels, "available", lambda weight: False)


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 32, 81, 300])
def test_the_panel_kernel_computes_f_linear(rows):
    """Every row count (a block of 6 rows and the rest; more than MAX_ROWS: F.linear itself), widths that are not
    a multiple of 16, with and without bias: float32 sums of the same products, within rounding."""
    g = torch.Generator().manual_seed(rows)
    for n, k, bias in ((960, 576, False), (17, 37, True), (49, 1536, True), (1, 8, False)):
        weight, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        got = panels.panel_linear([weight], b)(x.view(rows, 1, k))
        assert got.shape == (rows, 1, n) and got.dtype == torch.float32
        torch.testing.assert_close(got[:, 0], torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@needs_panels
@pytest.mark.parametrize("rows", [3, 300])
def test_weights_in_parts_are_one_matmul_as_if_concatenated(rows):
    """q, k and v (gate and up) packed from their own tensors, row counts that do not fill a panel: the matmul of
    the concatenated weight, its rows in order (over MAX_ROWS: F.linear on the concatenation)."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 40, generator=g) for n in (23, 9, 16, 5)]
    x, b = torch.randn(rows, 40, generator=g), torch.randn(53, generator=g)
    assert panels.pack(parts).shape == (4, 40, 16)
    got = panels.panel_linear(parts, b)(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, torch.cat(parts), b), rtol=1e-5, atol=1e-4)
    assert torch.equal(panels.pack(parts), panels.pack([torch.cat(parts)]))  # the same panels, zero-padded


@needs_panels
def test_panels_refuse_parts_of_other_widths_and_a_bias_of_another_length():
    with pytest.raises(ValueError, match="one width"):
        panels.pack([torch.randn(4, 8), torch.randn(4, 9)])
    with pytest.raises(ValueError, match="bias"):
        panels.panel_linear([torch.randn(4, 8), torch.randn(3, 8)], torch.randn(4))


@needs_panels
@pytest.mark.parametrize("n, k", [(48, 64), (53, 40), (7, 37), (33, 19)])
def test_panels_hold_column_j_of_panel_p_as_row_16p_plus_j(n, k):
    """The C packing (8 x 8 blocks transposed in registers, element by element at the edges) against the layout
    written out in torch: panel p, row k, column j = W[16 p + j, k], zeros past N."""
    weight = torch.randn(n, k)
    padded = torch.zeros((n + 15) // 16 * 16, k)
    padded[:n] = weight
    assert torch.equal(panels.pack([weight]), padded.view(-1, 16, k).transpose(1, 2).contiguous())


@needs_panels
def test_the_kernel_is_the_extension_built_at_install():
    """No compiling or caching at run time: the library is the package's own extension, built by setup.py."""
    import importlib.util

    origin = importlib.util.find_spec(panels.EXTENSION).origin
    assert panels.library()._name == origin and origin.startswith(str(Path(panels.__file__).parent))
    assert Path(panels.__file__).with_name("panel_gemm.c").exists()


def test_without_the_built_kernel_float32_decoding_uses_mkl(monkeypatch, caplog, tmp_path):
    """An install without the kernel (no C compiler then) and a damaged kernel file (empty, or not a library)
    each fall back with one log line, nothing raised."""
    import importlib.machinery
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(panels, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(panels.platform, "machine", lambda: "x86_64")
    (tmp_path / "empty.so").write_bytes(b"")
    (tmp_path / "junk.so").write_bytes(b"\x7fELF not really a library")
    try:
        for origin in (None, tmp_path / "empty.so", tmp_path / "junk.so"):
            spec = (
                None if origin is None else importlib.machinery.ModuleSpec(panels.EXTENSION, None, origin=str(origin))
            )
            monkeypatch.setattr(
                importlib.util,
                "find_spec",
                lambda name, spec=spec: spec if name == panels.EXTENSION else find_spec(name),
            )
            panels.library.cache_clear()
            caplog.clear()
            with caplog.at_level("INFO", logger="grpo"):
                assert panels.library() is None and not panels.available(torch.zeros(1))
            assert "MKL's packed sgemm" in caplog.text
    finally:
        panels.library.cache_clear()


@needs_panels
def test_panel_float32_decode_matches_transformers_as_rows_leave(monkeypatch):
    """Float32 where the panel kernel runs: every linear and the head are in panels from the prefill on, packed
    once per rollout from the weights' parts (q/k/v and gate/up never concatenated); finished rows leave the batch
    (no slots kept), down to the last one. Next-token log-probs match the transformers forward throughout."""
    made = []
    original = panels.panel_linear
    monkeypatch.setattr(panels, "panel_linear", lambda w, b: made.append(len(w)) or original(w, b))
    monkeypatch.setattr(torch, "cat", _no_weight_concatenation(torch.cat))
    first = packed.PACK_AFTER
    drops = {first + 1: list(range(7)), first + 2: [7], first + 4: list(range(8, 15))}

    def after_step(step, dec, active):
        assert dec.slots == 0 and dec.live is None and dec.keys[0].shape[0] == len(active)
        assert dec.in_panels and dec.plain is None

    _decode_with_drops(
        [[5, 9, 11, 13, 7], [8, 3]], torch.tensor([0] * 8 + [1] * 8), first + 7, first + 30, drops, after_step
    )
    assert made == [3, 1, 2, 1] * 2 + [1]  # qkv, o, gate_up and down (in parts) in each layer, and the head: once


def _no_weight_concatenation(cat):
    """torch.cat that fails on a model weight (a 2-d tensor that requires grad)."""

    def checked(tensors, *args, **kwargs):
        assert not any(t.dim() == 2 and t.requires_grad for t in tensors), "a weight was concatenated"
        return cat(tensors, *args, **kwargs)

    return checked


@needs_mkl
def test_packed_float32_decode_matches_transformers_and_repacks_as_its_batch_empties(monkeypatch, mkl_path):
    """Float32 on a CPU with MKL: after PACK_AFTER steps the weights are packed for the decode batch
    (grpo.rollout.cpu.packed). Finished rows keep their slots while more than half the slots are live; then the batch
    is repacked at half as many slots (not below MIN_ROWS), and a last row alone takes the plain path. Next-token
    log-probs match the transformers forward throughout."""
    packs = []
    monkeypatch.setattr(packed, "packed_linear", lambda w, b, rows: packs.append(rows) or PACKED_LINEAR(w, b, rows))
    first = packed.PACK_AFTER
    # 16 rows: 9 go on (still packed at 16), 8 (repacked at 8), 2 (still 8 slots: MIN_ROWS), 1 (plain)
    drops = {first + 1: list(range(7)), first + 2: [7], first + 4: list(range(8, 14)), first + 6: [14]}
    slots = {first: 16, first + 1: 16, first + 2: 8, first + 3: 8, first + 4: 8, first + 5: 8, first + 6: 0}

    def after_step(step, dec, active):
        expected = slots.get(step, 0 if step < first else slots[max(k for k in slots if k <= step)])
        assert dec.slots == expected
        assert dec.keys[0].shape[0] == (expected or len(active))
        if expected:
            assert len(dec.live) == len(active)

    _decode_with_drops(
        [[5, 9, 11, 13, 7], [8, 3]],
        torch.tensor([0] * 8 + [1] * 8),
        first + 9,
        first + packed.STEPS_AFTER_REPACKING + 4,
        drops,
        after_step,
    )
    layers = 2
    per_pack = layers * 2 + 1  # gate_up and down per layer (lean_decoder.PACKED), and the head
    assert packs == [16] * per_pack + [8] * per_pack


@needs_mkl
def test_a_small_batch_packs_with_filler_slots_and_no_repack_without_budget(mkl_path):
    """Three rows pack at MIN_ROWS slots (the filler slots' logits unread); with too little budget left for a
    repack the batch keeps its slots until one row is left."""
    first = packed.PACK_AFTER
    seen = {}

    def after_step(step, dec, active):
        seen[step] = (dec.slots, len(active))

    _decode_with_drops(
        [[5, 9, 11, 13, 7], [8, 3]],
        torch.tensor([0, 0, 1]),
        first + 4,
        first + packed.STEPS_AFTER_PACKING + 2,
        {first + 1: [0], first + 2: [1]},
        after_step,
    )
    assert all(seen[step] == (0, 3) for step in range(first))  # the plain path before it packs
    assert seen[first] == (packed.MIN_ROWS, 3)
    assert seen[first + 1] == (packed.MIN_ROWS, 2)
    assert seen[first + 2] == (0, 1)


@needs_mkl
def test_sixteen_rows_with_little_budget_left_keep_their_slots(mkl_path):
    first = packed.PACK_AFTER
    seen = {}
    _decode_with_drops(
        [[5, 9, 11], [8, 3]],
        torch.tensor([0] * 8 + [1] * 8),
        first + 3,
        first + packed.STEPS_AFTER_PACKING + 2,  # enough to pack, not to repack
        {first + 1: list(range(12))},
        lambda step, dec, active: seen.__setitem__(step, (dec.slots, len(active))),
    )
    assert seen[first + 1] == (16, 4)


@needs_panels
def test_the_fused_step_refuses_inputs_of_other_sizes_before_any_c_code_runs():
    """The C step trusts its sizes: a residual stream, rotary table, mask or key/value buffer of another shape, dtype
    or layout is refused in Python with what was given and what is read."""
    model = make_model(make_tokenizer(), hidden=64, layers=2).eval()
    dec = LeanDecoder(model, torch.float32)
    dec.prefill(*left_pad([[5, 9, 11]], 0), torch.tensor([0, 0]), max_new=20)
    table, sizes = dec.fused
    rows, d = 2, sizes.head_dim
    good = dict(x=torch.zeros(rows, 64), cos=torch.ones(rows, d), sin=torch.zeros(rows, d), mask=torch.zeros(rows, 4))
    caches = dict(keys=dec.keys, values=dec.values, position=3)
    panels.decode_layers(table, sizes, **good, **caches)  # the right sizes run
    bad = [
        dict(good, x=torch.zeros(rows + 1, 64)),
        dict(good, cos=torch.ones(rows, d // 2)),
        dict(good, mask=torch.zeros(rows, 3)),
        dict(good, sin=torch.zeros(d, rows).T),  # not contiguous
        dict(good, x=torch.zeros(rows, 64, dtype=torch.float64)),
    ]
    for inputs in bad:
        with pytest.raises(ValueError, match="decode_layers"):
            panels.decode_layers(table, sizes, **inputs, **caches)
    for caches in (
        dict(keys=[k[:1] for k in dec.keys], values=dec.values, position=3),  # buffers of another row count
        dict(keys=dec.keys[:1], values=dec.values[:1], position=3),  # a layer missing
        dict(keys=dec.keys, values=dec.values, position=dec.keys[0].shape[2]),  # past the buffers' width
    ):
        with pytest.raises(ValueError, match="decode_layers"):
            panels.decode_layers(table, sizes, **dict(good, mask=torch.zeros(rows, caches["position"] + 1)), **caches)
