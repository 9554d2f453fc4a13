"""`lean_blocks` against the transformers blocks: the hand-written gradients, the training pass's log-probs and
every parameter's gradient on the tiny Llama (float32, bfloat16 autocast, LoRA), the memory it was written for
(saved tensors), and when the trainer uses it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from grpo.perf.blocks import _RMSNorm, _SiluMul, lean_blocks
from support.layouts import assert_same_pass, batch_and_model, logps_and_grads, saved_bytes


def pass_with(model, batch, lean, bf16=False, share=True):
    context = lean_blocks(model) if lean else contextlib.nullcontext()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), context:
        return logps_and_grads(model, batch, "shared_prefix" if share else "padded", chunked_head=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_is_autograd_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 37, 96, dtype=dtype, requires_grad=True)
    w = torch.randn(96, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 37, 96, dtype=dtype)
    reference = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # transformers' RMSNorm
    expected = torch.autograd.grad(reference, (x, w), grad)
    out = _RMSNorm.apply(x, w, 1e-5, None)
    assert torch.equal(out, reference)
    for got, want in zip(torch.autograd.grad(out, (x, w), grad), expected, strict=True):
        assert torch.equal(got, want)
    # with an output dtype: the same values rounded once
    assert torch.equal(
        _RMSNorm.apply(x.float(), w.float(), 1e-5, torch.bfloat16),
        _RMSNorm.apply(x.float(), w.float(), 1e-5, None).to(torch.bfloat16),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_autograd_bit_for_bit(dtype):
    torch.manual_seed(0)
    gate = torch.randn(4, 7, 24, dtype=dtype, requires_grad=True)
    up = torch.randn(4, 7, 24, dtype=dtype, requires_grad=True)
    grad = torch.randn(4, 7, 24, dtype=dtype)
    reference = F.silu(gate) * up
    out = _SiluMul.apply(gate, up)
    assert torch.equal(out, reference)
    for got, want in zip(
        torch.autograd.grad(out, (gate, up), grad), torch.autograd.grad(reference, (gate, up), grad), strict=True
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("share", [False, True])
def test_float32_pass_matches_plain(share):
    batch, model = batch_and_model()
    lean, plain = pass_with(model, batch, True, share=share), pass_with(model, batch, False, share=share)
    m = batch.mask.bool()
    assert torch.equal(lean[0][m], plain[0][m]) and torch.equal(lean[1][m], plain[1][m])
    # backward: autograd's operators, but the norm's two input-gradient terms are summed before the residual's
    # joins them (autograd sums the three in arrival order): float32 rounding
    assert_same_pass(lean, plain, batch)
    assert all(g.abs().sum() > 0 for g in lean[2].values())


def test_bfloat16_pass_matches_autocast_within_its_own_rounding():
    """Forward bit for bit. Gradients: the projections reading a norm's shared bfloat16 output have their input
    gradients summed in bfloat16 (autocast sums their float32 casts), so gradients move by bfloat16 rounding.
    Stated tolerance: within 2^-5 of each gradient's scale of autocast's, and no further from the float32
    gradients than autocast's own (mean relative error at most 1.25x autocast's)."""
    batch, model = batch_and_model()
    truth = pass_with(model, batch, False)
    lean, plain = pass_with(model, batch, True, bf16=True), pass_with(model, batch, False, bf16=True)
    m = batch.mask.bool()
    assert torch.equal(lean[0][m], plain[0][m]) and torch.equal(lean[1][m], plain[1][m])

    def error(result):
        return sum(float((result[2][n] - g).norm() / g.norm()) for n, g in truth[2].items()) / len(truth[2])

    for name, grad in plain[2].items():
        assert lean[2][name].dtype == torch.float32 and grad.abs().sum() > 0, name
        assert (lean[2][name] - grad).abs().max() <= 2**-5 * grad.abs().max(), name
    assert error(lean) <= 1.25 * error(plain)


def test_lora_pass_matches_plain():
    """The LoRA-wrapped projections inside the lean MLP and after the lean norms: the same pass."""
    from peft import LoraConfig, get_peft_model

    batch, model = batch_and_model()
    model = get_peft_model(
        model,
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0, init_lora_weights=False
        ),
    )
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    for p in model.parameters():  # frozen ones too, so that every gradient is compared
        p.requires_grad_(True)
    lean, plain = pass_with(model, batch, True), pass_with(model, batch, False)
    m = batch.mask.bool()
    assert torch.equal(lean[0][m], plain[0][m]) and torch.equal(lean[1][m], plain[1][m])
    for name, grad in plain[2].items():  # random adapters make gradients up to ~25: float32 rounding of that scale
        torch.testing.assert_close(lean[2][name], grad, rtol=1e-5, atol=1e-6 * max(1.0, float(grad.abs().max())))
    assert trained and all(lean[2][n].abs().sum() > 0 for n in trained)


def test_lean_blocks_keep_less_for_backward():
    """What each token of each layer no longer keeps: the norms' float32 normalized outputs and the SiLU output
    (both precisions), and under autocast the extra bfloat16 copies of the norms' outputs (q/k/v read one copy,
    gate/up one). Counted over the tokens the prefix-shared pass runs: every prompt once, every completion."""
    batch, model = batch_and_model()
    config = model.config
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    prompts = {int(g): int(a.sum()) for g, a in zip(batch.group, batch.prompt_mask, strict=True)}
    tokens = sum(prompts.values()) + int(batch.completion_attention.sum())
    for bf16 in (False, True):
        per_token = 2 * hidden * 4 + inner * (2 if bf16 else 4) + (3 * hidden * 2 if bf16 else 0)
        plain = saved_bytes(model, batch, contextlib.nullcontext(), autocast=bf16)
        lean = saved_bytes(model, batch, lean_blocks(model), autocast=bf16)
        assert plain - lean >= 0.9 * per_token * layers * tokens, bf16


def test_trainer_chooses_lean_blocks(tiny_model_dir, tmp_path, monkeypatch):
    """On by default for Llama-family models; off with gradient checkpointing (the recomputation runs outside
    the context); the training pass enters the context only when on."""
    import grpo.perf.blocks
    from grpo import GRPOTrainer
    from support.rewards import token_count_reward
    from support.runs import cfg, chat_dataset

    entered = []
    original = grpo.perf.blocks.lean_blocks
    monkeypatch.setattr(grpo.perf.blocks, "lean_blocks", lambda model: entered.append(1) or original(model))

    def trainer(**kwargs):
        args = cfg(tmp_path, **kwargs)
        return GRPOTrainer(
            model=tiny_model_dir, reward_funcs=token_count_reward, train_dataset=chat_dataset(), args=args
        )

    on = trainer(gradient_checkpointing=False)
    on.train()
    assert on.training_pass.lean_blocks and len(entered) == on.state.global_step > 0
    off = trainer(gradient_checkpointing=True)
    assert not off.training_pass.lean_blocks
    off.train()
    assert len(entered) == on.state.global_step


@pytest.mark.parametrize("share", [False, True])
def test_padding_positions_skip_the_linears_and_the_head(share, monkeypatch):
    """Padding's hidden states are never read by a real token (causal attention, masked keys): the lean MLPs and
    the attention projections run on the real positions only, the tiled head projects only real completion tokens;
    the values are those above (float32: the forward bit for bit)."""
    import grpo.learner.forward as forward

    batch, model = batch_and_model()
    rows, projected = [], []
    hook = model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape))
    queries = []
    attention = model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, args, out: queries.append(args[0].shape)
    )
    head = forward.chunked_logps_and_entropy

    def counting(hidden, *args, **kwargs):
        projected.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return head(hidden, *args, **kwargs)

    monkeypatch.setattr(forward, "chunked_logps_and_entropy", counting)
    pass_with(model, batch, True, share=share)
    hook.remove()
    attention.remove()
    assert queries == rows  # the attention projections too
    real = int(batch.completion_attention.sum())
    assert projected == [real] and real < batch.completion_attention.numel()
    if share:  # the prompt pass (each prompt's real tokens, once), then the completions' real tokens
        prompts = sum(int(batch.prompt_mask[batch.group == g][0].sum()) for g in batch.group.unique())
        assert [r[0] for r in rows] == [prompts, real]
    else:
        assert [r[0] for r in rows] == [int(batch.prompt_mask.sum()) + real]
