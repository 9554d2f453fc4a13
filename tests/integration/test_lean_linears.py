"""`lean_linears` against autocast: the training pass's log-probs and every parameter's gradient, on the tiny
Llama (shared prefix, tiled head) under bfloat16; and the memory it was written for (saved tensors)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from grpo.perf.linears import lean_linears
from support.layouts import batch_and_model, saved_bytes


def run(model, batch, lean, share=True):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        context = lean_linears(model, torch.bfloat16) if lean else torch.autocast("cpu", dtype=torch.bfloat16)
        with context:
            scored = token_logps(
                model, batch, PassSettings(0.9, chunked_head=True, layouts=("shared_prefix" if share else "padded",))
            )
            logps, ent = scored.logps, scored.entropies
    (logps * batch.mask).sum().backward()
    return logps.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("share", [False, True])
def test_lean_linears_match_autocast(share):
    """Bit for bit, except one thing with the prefix-shared pass, where each weight serves two forward calls:
    autocast sums the two bfloat16 weight gradients in bfloat16 (at its one cached cast), lean_linears in float32;
    those gradients then differ by at most about one bfloat16 rounding (2^-8 of their scale)."""
    batch, model = batch_and_model()
    lean, plain = run(model, batch, True, share), run(model, batch, False, share)
    m = batch.mask.bool()
    torch.testing.assert_close(lean[0][m], plain[0][m], rtol=0, atol=0)
    torch.testing.assert_close(lean[1][m], plain[1][m], rtol=0, atol=0)
    for name, grad in plain[2].items():
        assert lean[2][name].dtype == torch.float32
        assert grad.abs().sum() > 0, name
        two_pass_weight = share and name.endswith("proj.weight")
        if two_pass_weight:
            assert (lean[2][name] - grad).abs().max() <= 2**-8 * grad.abs().max(), name
        else:
            torch.testing.assert_close(lean[2][name], grad, rtol=0, atol=0)


def test_lean_linears_keep_less_for_backward():
    batch, model = batch_and_model()
    weights = sum(m.weight.numel() * 2 for m in model.modules() if type(m) is torch.nn.Linear)
    # at least the bfloat16 copies of the weights are no longer kept
    plain = saved_bytes(model, batch, contextlib.nullcontext())
    assert plain - saved_bytes(model, batch, lean_linears(model, torch.bfloat16)) >= weights * 0.9


def test_trainer_uses_lean_linears_when_asked(tiny_model_dir, tmp_path, monkeypatch):
    """Opt-in: with lean_linears=True and bf16 the training pass runs inside `lean_linears` (its numbers are
    the tests above); without it, it does not."""
    import grpo.perf.linears
    from grpo import GRPOTrainer
    from support.rewards import token_count_reward
    from support.runs import cfg, chat_dataset

    entered = []
    original = grpo.perf.linears.lean_linears

    def counting(model, dtype):
        entered.append(dtype)
        return original(model, dtype)

    monkeypatch.setattr(grpo.perf.linears, "lean_linears", counting)
    args = cfg(tmp_path, bf16=True, gradient_checkpointing=False, lean_linears=True)
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=token_count_reward, train_dataset=chat_dataset(), args=args
    )
    trainer.train()
    assert entered == [torch.bfloat16] and trainer.training_pass.lean_dtype == torch.bfloat16
    args = cfg(tmp_path, bf16=True, gradient_checkpointing=False)
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=token_count_reward, train_dataset=chat_dataset(), args=args
    )
    trainer.train()
    assert entered == [torch.bfloat16] and trainer.training_pass.lean_dtype is None
