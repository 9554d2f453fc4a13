"""The prefix-shared training pass gives the plain pass's log-probs and gradients (float32: allclose at
rtol 1e-5 / atol 1e-6), with ragged prompts, ragged completions and shuffled rows."""

from __future__ import annotations

import os

import pytest
import torch

from grpo.algo.logprobs import chunked_logps_and_entropy, logps_and_entropy
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from support import on_device
from support.layouts import assert_same_pass, batch_and_model, logps_and_grads, turns_batch
from support.tiny import make_model, make_tokenizer


def test_shared_prefix_logps_and_gradients_match_plain():
    batch, model = batch_and_model()
    results = {share: logps_and_grads(model, batch, "shared_prefix" if share else "padded") for share in (False, True)}
    assert_same_pass(results[True], results[False], batch)
    assert any(g.abs().sum() > 0 for g in results[True][2].values())


def test_shared_prefix_bf16_within_tolerance():
    batch, model = batch_and_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = token_logps(model, batch, PassSettings(1.0, with_entropy=False)).logps
        shared = token_logps(model, batch, PassSettings(1.0, with_entropy=False, layouts=("shared_prefix",))).logps
    m = batch.mask.bool()
    # bfloat16 has an 8-bit mantissa: the two paths round differently; log-probs agree to 0.05 nats
    assert (plain[m] - shared[m]).abs().max() < 0.05


def backward_kinds(t):
    """The kinds of autograd node `t`'s gradient passes through."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


LAYOUTS = [("shared_prefix", False), ("trees", False), ("trees", True), ("padded", True)]  # (layout, rows with turns)


@pytest.mark.parametrize("layout, turns", LAYOUTS)
def test_copies_of_a_shared_position_add_their_gradients_in_a_fixed_order(layout, turns):
    """Where rows share positions (each row's copy of its prompt's cache and last output; a tree's positions, a
    prompt's last one every row's first; a turn's own row where turns are forked), the copies' gradients add back
    through no advanced-indexing backward (`IndexBackward0`), which on a multi-threaded CPU adds with atomic adds in
    thread order: the same batch gave gradients a rounding apart from run to run (resumes were not bit-identical).
    And repeated passes over prompts long enough for torch's threaded path give bit-identical gradients."""
    batch, model = turns_batch()[::4] if turns else batch_and_model()
    logps = token_logps(model, batch, PassSettings(0.9, layouts=(layout,))).logps
    assert "IndexBackward0" not in backward_kinds(logps)
    long = " ".join(["what is two plus two and then three?"] * 6)
    batch, _ = batch_and_model(texts=(long, long + " ok"), lengths=(4, 12))
    model = make_model(make_tokenizer(), hidden=128)
    first = logps_and_grads(model, batch, layout)[2]
    for _ in range(3):
        grads = logps_and_grads(model, batch, layout)[2]
        assert all(torch.equal(grads[n], g) for n, g in first.items())


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_head_matches_full_logits(share, dtype):
    """float64: the math is the same (1e-10). float32: log-probs and entropies at rtol 1e-5 / atol 1e-6;
    gradients at atol 1e-5, since the output projection's weight gradient sums the tokens in another order
    (one GEMM over the kept positions instead of over all of them) and float32 rounding differs by ~1e-6."""
    batch, model = batch_and_model()
    model = model.to(dtype)
    results = {}
    for chunked in (False, True):
        model.zero_grad()
        scored = token_logps(
            model,
            batch,
            PassSettings(temperature=0.7, chunked_head=chunked, layouts=("shared_prefix" if share else "padded",)),
        )
        logps, ent = scored.logps, scored.entropies
        (logps * batch.mask).sum().backward()
        results[chunked] = (logps.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()})
    m = batch.mask.bool()
    tight = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[True][0][m], results[False][0][m], **tight)
    torch.testing.assert_close(results[True][1][m], results[False][1][m], rtol=1e-5, atol=1e-5)
    grad_tol = tight if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for name, grad in results[False][2].items():
        torch.testing.assert_close(results[True][2][name], grad, **grad_tol)


@on_device.mark
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logps_function_matches_plain(bias, entropy_grad):
    """The hand-written backward against autograd through the plain path: log-probs, entropies and the
    gradients of hidden states, weight and bias, with a loss that uses both outputs; chunks of 4 rows over 15
    (the last one short), vocabulary blocks of 7 over 50. float64, on the tests' device."""
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64, device=on_device.device())
    hidden = torch.randn(3, 5, 16, **f64).requires_grad_()
    weight = torch.randn(50, 16, **f64).requires_grad_()
    b = torch.randn(50, **f64).requires_grad_() if bias else None
    ids = torch.randint(0, 50, (3, 5), device=on_device.device())
    coef = torch.randn(3, 5, **f64)
    lp, ent = chunked_logps_and_entropy(hidden, weight, b, ids, 0.8, entropy_grad=entropy_grad, chunk_rows=4, block=7)
    ref_lp, ref_ent = logps_and_entropy(
        torch.nn.functional.linear(hidden, weight, b) / 0.8, ids, entropy_grad=entropy_grad
    )
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    inputs = (hidden, weight) + ((b,) if bias else ())
    g = torch.autograd.grad((coef * lp).sum() + (ent * coef.flip(0)).sum() * entropy_grad, inputs)
    ref_g = torch.autograd.grad((coef * ref_lp).sum() + (ref_ent * coef.flip(0)).sum() * entropy_grad, inputs)
    for a, r in zip(g, ref_g):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


@on_device.mark
def test_chunked_logps_in_float32_with_the_default_tiles_match_full_logits():
    """The training pass's default tiling (CHUNK_ROWS rows, TILE_BYTES tiles: several chunks and vocabulary blocks
    here) against full float32 logits: log-probs, entropies and the hidden/weight gradients of a loss on both, at
    the float32 tolerance of the tests' device."""
    torch.manual_seed(0)
    dev = on_device.device()
    hidden = torch.randn(5000, 64, device=dev, requires_grad=True)
    weight = (torch.randn(3000, 64, device=dev) / 8).requires_grad_()
    ids = torch.randint(0, 3000, (5000,), device=dev)
    coef = torch.randn(5000, device=dev)
    lp, ent = chunked_logps_and_entropy(hidden, weight, None, ids, 0.9, entropy_grad=True)
    ref_lp, ref_ent = logps_and_entropy(torch.nn.functional.linear(hidden, weight) / 0.9, ids, entropy_grad=True)
    tolerance = on_device.float32_tolerance()
    torch.testing.assert_close(lp, ref_lp, **tolerance)
    torch.testing.assert_close(ent, ref_ent, **tolerance)
    g = torch.autograd.grad((coef * lp).sum() + (coef.flip(0) * ent).sum(), (hidden, weight))
    ref_g = torch.autograd.grad((coef * ref_lp).sum() + (coef.flip(0) * ref_ent).sum(), (hidden, weight))
    for a, r in zip(g, ref_g):
        torch.testing.assert_close(a, r, rtol=tolerance["rtol"], atol=tolerance["atol"] * r.abs().max().item())


def test_tiles_are_sized_for_the_device(monkeypatch):
    """A CPU keeps its cache-sized tile (the numbers of the pinned trajectory); a GPU's tile is GPU_TILE_BYTES, or
    1/64 of a smaller device's memory. Tiles of either size give the same log-probs, entropies and gradients."""
    from grpo.algo import logprobs

    assert logprobs.tile_bytes(torch.device("cpu")) == logprobs.TILE_BYTES == 8 * 2**20
    for total, expected in ((141 * 2**30, logprobs.GPU_TILE_BYTES), (16 * 2**30, 2**28)):
        props = type("Props", (), {"total_memory": total})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        assert logprobs.tile_bytes(torch.device("cuda")) == expected
    torch.manual_seed(0)
    hidden = torch.randn(300, 64, requires_grad=True)
    weight = (torch.randn(3000, 64) / 8).requires_grad_()
    ids = torch.randint(0, 3000, (300,))
    results = []
    for tile in (logprobs.TILE_BYTES // 64, logprobs.GPU_TILE_BYTES):  # 12 blocks of 256 columns; one block
        monkeypatch.setattr(logprobs, "tile_bytes", lambda device, tile=tile: tile)
        lp, ent = chunked_logps_and_entropy(hidden, weight, None, ids, 0.9, entropy_grad=True)
        results.append((lp, ent, *torch.autograd.grad((lp + ent).sum(), (hidden, weight))))
    for small, large in zip(*results):
        torch.testing.assert_close(small, large, rtol=1e-5, atol=1e-5)


@on_device.mark
def test_chunked_logps_in_bfloat16_are_within_the_stated_tolerance():
    """Under bfloat16 autocast the projection runs in bfloat16 like the model's head; log-probs agree with the
    plain autocast path to 0.05 nats (the plain path also rounds logits / temperature to bfloat16), gradients to
    2% of their scale. On the tests' device."""
    torch.manual_seed(0)
    dev = on_device.device()
    hidden = torch.randn(64, 32, device=dev, requires_grad=True)
    weight = (torch.randn(300, 32, device=dev) / 4).requires_grad_()
    ids = torch.randint(0, 300, (64,), device=dev)
    with on_device.autocast(torch.bfloat16):
        lp, ent = chunked_logps_and_entropy(hidden, weight, None, ids, 0.7, chunk_rows=16, block=64)
        ref_lp, ref_ent = logps_and_entropy(torch.nn.functional.linear(hidden, weight) / 0.7, ids)
    assert lp.dtype == torch.float32
    nats = on_device.BFLOAT16_NATS
    assert (lp - ref_lp).abs().max() < nats and (ent - ref_ent).abs().max() < nats
    g = torch.autograd.grad(lp.sum(), (hidden, weight))
    ref_g = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    for a, r in zip(g, ref_g):
        assert a.dtype == torch.float32
        assert (a - r).abs().max() < 0.02 * r.abs().max()


def reference_logps(model, batch, temperature):
    """The plainest path: one forward over the whole padded batch, full logits."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attn = torch.cat([batch.prompt_mask, batch.completion_attention], 1)
    logits = model(ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    c = batch.completion_ids.shape[1]
    return logps_and_entropy(logits[:, -c - 1 : -1] / temperature, batch.completion_ids)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_length_sorted_trimmed_pieces_match_one_padded_pass(chunk_size, monkeypatch):
    """On transformers' plain attention (repeated key/value heads), whatever an earlier trainer in this process
    set: the grouped-heads kernel is compared with it in test_grouped_kv_attention_matches_repeated_heads."""
    from grpo.perf.attention import SWITCH

    monkeypatch.delenv(SWITCH, raising=False)
    batch, model = batch_and_model()
    model.zero_grad()
    ref_lp, ref_ent = reference_logps(model, batch, 0.9)
    (ref_lp * batch.mask).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    scored = token_logps(model, batch, PassSettings(0.9, chunk_size=chunk_size, layouts=("shared_prefix",)))
    lp, ent = scored.logps, scored.entropies
    (lp * batch.mask).sum().backward()
    m = batch.mask.bool()
    torch.testing.assert_close(lp[m], ref_lp[m], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent[m], ref_ent[m], rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-6)


def test_pieces_are_length_sorted_chunks():
    from grpo.learner.forward import _pieces

    lengths = torch.tensor([30, 2, 3, 2, 31, 3])
    assert [p.tolist() for p in _pieces(lengths, 4)] == [[1, 3, 2, 5], [0, 4]]
    assert [p.tolist() for p in _pieces(lengths, None)] == [[1, 3, 2, 5, 0, 4]]


@pytest.mark.parametrize("share", [False, True])
def test_grouped_kv_attention_matches_repeated_heads(share, monkeypatch):
    """The tiny model has 4 query heads over 2 key/value heads: reading them grouped (CPU flash kernel with
    enable_gqa, transformers' TRANSFORMERS_SDPA_FORCE_GQA switch) gives the log-probs and gradients of repeating
    them (float32, rtol 1e-5 / atol 1e-6)."""
    from grpo.perf.attention import SWITCH

    batch, model = batch_and_model()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    results = {}
    for grouped in (False, True):
        if grouped:
            monkeypatch.setenv(SWITCH, "1")
        else:  # the plain path: transformers repeats the key/value heads
            monkeypatch.delenv(SWITCH, raising=False)
        results[grouped] = logps_and_grads(model, batch, "shared_prefix" if share else "padded", chunked_head=True)
    assert_same_pass(results[True], results[False], batch)


def test_grouped_heads_switch_is_set_once_for_cpu_models_with_grouped_heads(monkeypatch):
    """Set for a CPU model with grouped heads (and logged), never over the user's own value, not for a model with
    one key/value head per query head."""
    from grpo.perf import attention

    _, model = batch_and_model()
    monkeypatch.delenv(attention.SWITCH, raising=False)
    assert attention.use_grouped_heads(model) and os.environ[attention.SWITCH] == "1"
    monkeypatch.setenv(attention.SWITCH, "0")
    assert not attention.use_grouped_heads(model) and os.environ[attention.SWITCH] == "0"
    monkeypatch.delenv(attention.SWITCH)
    model.config.num_key_value_heads = model.config.num_attention_heads
    assert "one key/value head" in attention.unsupported_reason(model)
    assert not attention.use_grouped_heads(model) and attention.SWITCH not in os.environ
