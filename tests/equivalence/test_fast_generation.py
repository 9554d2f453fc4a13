"""The fast engine against the plain path: same tokens greedily, same next-token distributions with and
without prefix sharing, sampling log-probs equal to the training pass's, and the same sampling distribution.
The tests marked `device` run on `on_device.device()` (the CPU unless --device / GRPO_TEST_DEVICE says otherwise),
at its stated tolerances."""

from __future__ import annotations

import pytest
import torch

from grpo.algo.sampling import SamplingSettings
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from grpo.rollout import fast
from grpo.rollout.fast import FastEngine, low_precision_linears, sample_from
from grpo.rollout.plain import TransformersEngine
from support import on_device
from support.decode import MODELS, greedy, setup

models = pytest.mark.parametrize("family", list(MODELS))


@on_device.mark
@models
@pytest.mark.parametrize("share", [True, False])
def test_greedy_tokens_equal_plain_generate(share, family):
    tok, model, args, stop, rows = setup(on_device.device(), family)
    # make rows finish at different steps so finished rows leave the batch mid-way
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    calls = {"n": 0}

    def ending(logprobs):
        """Greedy, but the first batch row ends now and then (the lean path calls no module hook: a sampler
        decides), so that finished rows leave the batch mid-way."""
        calls["n"] += 1
        tokens = greedy(logprobs)
        if len(tokens) > 1 and calls["n"] % 3 == 0:
            tokens[0] = im_end
        return tokens

    fast = FastEngine(model, tok, args, stop, share_prefix=share, sampler=greedy)
    plain = TransformersEngine(
        model,
        tok,
        SamplingSettings(max_completion_length=16, generation_kwargs={"do_sample": False}),
        stop,
    )
    a = fast.generate(rows)
    b = plain.generate(rows)
    assert a.completion_ids == b.completion_ids
    assert a.truncated == b.truncated
    c = FastEngine(model, tok, args, stop, share_prefix=share, sampler=ending).generate(rows)
    assert any(not t for t in c.truncated) and any(t for t in c.truncated)  # some rows stopped early


@on_device.mark
def test_shared_and_unshared_next_token_distributions_match():
    """Greedy sampling records each step's processed distribution; with the same tokens chosen, the rows still
    going are the same at every step, so the distributions compare row for row."""
    tok, model, args, stop, rows = setup(on_device.device(), temperature=0.7, top_k=20, top_p=0.9)
    seen, tokens = {}, {}
    for share in (True, False):
        steps = []

        def recording_greedy(logprobs, steps=steps):
            steps.append(logprobs.clone())
            return greedy(logprobs)

        engine = FastEngine(model, tok, args, stop, share_prefix=share, sampler=recording_greedy)
        tokens[share] = engine.generate(rows).completion_ids
        seen[share] = steps
    assert tokens[True] == tokens[False] and len(seen[True]) == len(seen[False]) > 1
    for lp_a, lp_b in zip(seen[True], seen[False]):
        assert lp_a.shape == lp_b.shape
        tolerance = on_device.float32_tolerance(lp_a.device)
        torch.testing.assert_close(lp_a.exp(), lp_b.exp(), rtol=tolerance["rtol"], atol=tolerance["atol"] / 10)


@on_device.mark
@models
@on_device.dtypes
def test_sampling_logps_equal_training_logps(dtype, family):
    """The sampler's log-probs against the training pass's, as the trainer runs both: float32, or the engine on
    bfloat16 weights against the pass under bfloat16 autocast (0.01 nats on average). A LoRA policy in bfloat16:
    the pass under autocast rounds the adapter branch apart from the base (0.011 nats off its own float32 numbers
    here), where the engine's merged copy rounds each weight once, so both are held to the float32 pass: the
    sampler within 0.01 nats of it on average, and no further than the bfloat16 pass is."""
    tok, model, args, stop, rows = setup(on_device.device(), family, temperature=0.8)
    torch.manual_seed(0)
    low = dtype if dtype == torch.bfloat16 else None
    engine = FastEngine(model, tok, args, stop, autocast=lambda: on_device.autocast(dtype), compute_dtype=low)
    assert engine.lean_reason is None
    rollout = engine.generate(rows)
    if family != "lora" or dtype == torch.float32:
        on_device.assert_sampling_logps_match_training(model, tok.pad_token_id, rollout, args.temperature, dtype)
        return
    batch = collate(rollout, torch.zeros(len(rollout)), tok.pad_token_id, mask_truncated=False).to(model.device)
    with torch.no_grad():
        exact = token_logps(model, batch, PassSettings(args.temperature, with_entropy=False)).logps
        with on_device.autocast(dtype):
            rounded = token_logps(model, batch, PassSettings(args.temperature, with_entropy=False)).logps
    m = batch.mask.bool()
    sampler = (batch.sampling_logps[m] - exact[m]).abs().mean()
    assert sampler < on_device.BFLOAT16_MEAN_NATS and sampler <= (rounded[m] - exact[m]).abs().mean()


@on_device.mark
def test_exponential_race_samples_the_distribution():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], device=on_device.device())
    draws = sample_from(p.log().expand(200_000, -1).clone())
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, p, atol=4e-3, rtol=0)


def _full_cdf_inversion(logprobs, generator):
    """The plain inversion: one float64 cumulative sum over the whole vocabulary, the same uniform numbers."""
    cdf = logprobs.double().exp().cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


@on_device.mark
@pytest.mark.parametrize("vocab", [7, fast.SAMPLE_BLOCK, 3 * fast.SAMPLE_BLOCK + 5])
def test_blockwise_inversion_draws_what_the_full_cumulative_sum_draws(vocab):
    torch.manual_seed(0)
    dev = on_device.device()
    logprobs = (torch.randn(4000, vocab) * 2).log_softmax(-1).to(dev)
    with fast.own_generator(torch.Generator(dev).manual_seed(5)):
        blockwise = sample_from(logprobs)
    full = _full_cdf_inversion(logprobs, torch.Generator(dev).manual_seed(5))
    # the same uniform number lands in the same token (another summation order moves a boundary by ~1e-16)
    assert torch.equal(blockwise, full)


@on_device.mark
def test_blockwise_inversion_never_draws_a_zero_probability_token():
    vocab = 2 * fast.SAMPLE_BLOCK + 3
    logprobs = torch.full((3000, vocab), float("-inf"))
    logprobs[:, fast.SAMPLE_BLOCK - 1] = 0.0  # all the mass on a block's last entry
    logprobs[1000:2000] = float("-inf")
    logprobs[1000:2000, [3, vocab - 1]] = torch.tensor([0.9, 0.1]).log()  # and in the partial last block
    logprobs[2000:] = float("-inf")
    logprobs[2000:, fast.SAMPLE_BLOCK : fast.SAMPLE_BLOCK + 2] = torch.tensor([1e-30, 1.0]).log()
    torch.manual_seed(0)
    logprobs = logprobs.to(on_device.device())
    draws = sample_from(logprobs)
    assert torch.isfinite(logprobs.gather(1, draws[:, None])).all()
    assert (draws[:1000] == fast.SAMPLE_BLOCK - 1).all()
    assert set(draws[1000:2000].tolist()) == {3, vocab - 1}


@on_device.mark
def test_repetition_penalty_matches_plain_path_greedily():
    tok, model, args, stop, rows = setup(on_device.device(), repetition_penalty=1.3)
    fast = FastEngine(model, tok, args, stop, sampler=greedy).generate(rows)
    plain_args = SamplingSettings(
        max_completion_length=16, repetition_penalty=1.3, generation_kwargs={"do_sample": False}
    )
    plain = TransformersEngine(model, tok, plain_args, stop).generate(rows)
    assert fast.completion_ids == plain.completion_ids


def test_settings_the_fast_path_does_not_cover_fall_back():
    from grpo.rollout.fast import unsupported_reason as supports

    tok, model, args, stop, rows = setup()
    assert supports(model, args) is None
    assert "generation_kwargs" in supports(model, SamplingSettings(generation_kwargs={"top_k": 3}))
    assert "cache_implementation" in supports(model, SamplingSettings(cache_implementation="static"))


RECURRENT = ["Mamba", "Mamba2", "Jamba", "Bamba", "FalconH1", "NemotronH", "Qwen3Next", "Zamba2", "RecurrentGemma"]
RECURRENT += ["Rwkv", "GraniteMoeHybrid", "xLSTM", "Qwen3_5"]


@pytest.mark.parametrize("stateful_marker", [True, False], ids=["transformers-5.19", "without-_is_stateful"])
@pytest.mark.parametrize("kind", RECURRENT + ["Llama", "Qwen2", "Qwen3", "Gemma2", "Gemma3", "Mistral"])
def test_models_with_recurrent_state_keep_the_plain_engine_without_transformers_private_marker(
    kind, stateful_marker, monkeypatch
):
    """Mamba, linear-attention, RWKV, xLSTM and Griffin layers keep state the fast engine's shared-prefix cache does
    not hold: such models sample with the plain engine, found from their layers and parameters even where
    transformers no longer has `_is_stateful` (5.25 removed it); attention-only models keep the fast engine.
    Models built on the meta device from their default configs (4 layers): nothing is allocated."""
    import transformers

    from grpo.rollout.fast import unsupported_reason as supports

    cls = getattr(transformers, f"{kind}ForCausalLM")
    config = cls.config_class()
    config.num_hidden_layers = 4
    with torch.device("meta"):
        model = cls(config)
    if not stateful_marker:  # as on transformers 5.25
        monkeypatch.setattr(cls, "_is_stateful", False, raising=False)
    reason = supports(model, SamplingSettings())
    if kind in RECURRENT:
        assert reason is not None and "recurrent state" in reason
    else:
        assert reason is None


@pytest.mark.parametrize("bias", [False, True])
def test_low_precision_linears_give_autocasts_logits_exactly(bias):
    """Weights cast (and on CPU pre-packed) once give the very numbers bfloat16 autocast computes per forward;
    on exit every linear is back to its own forward."""
    tok, model, args, stop, rows = setup()
    if bias:
        for module in model.modules():
            if type(module) is torch.nn.Linear and module.bias is None:
                module.bias = torch.nn.Parameter(torch.randn(module.out_features) * 0.1)
    short, long = rows[0].prompt.ids, rows[1].prompt.ids
    ids = torch.tensor([short, long[: len(short)]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(ids).logits
        with low_precision_linears(model, torch.bfloat16) as ctx:
            assert ctx.patched  # every plain linear
            got = model(ids).logits
        after = model(ids).logits
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert torch.equal(after, expected)
    assert all("forward" not in vars(m) for m in model.modules())


def test_low_precision_linears_do_nothing_in_float32():
    tok, model, args, stop, rows = setup()
    with low_precision_linears(model, None) as ctx:
        assert not ctx.patched
