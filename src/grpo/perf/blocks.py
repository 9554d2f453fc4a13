"""Decoder-block pieces for the training pass that keep less for backward than the transformers forward does.

Autograd keeps every intermediate an operator asks for. In a Llama-family block much of that is redundant:
- RMSNorm keeps its float32 input *and* its float32 normalized output (for the weight's gradient), and under
  bfloat16 autocast each projection reading the norm's output (q, k, v; gate, up) keeps its own bfloat16 copy
  of it. `_RMSNorm` keeps the input and one float per row (the inverse RMS); under autocast it hands its
  consumers the bfloat16 rounding autocast would have made, once, so they all keep the same copy.
- SiLU-gating keeps the gate, the SiLU output and the up projection. `_SiluMul` keeps the gate and the up
  projection and recomputes the SiLU in backward (one cheap elementwise pass).
Forward values are bit-identical to the transformers forward. Backward runs autograd's own operators in
autograd's order (both Functions are bit-identical to autograd on their own, tested). Two differences remain:
- float32: the norm's two input-gradient terms are summed before the residual's gradient joins them, where
  autograd sums the three in arrival order: float32 rounding (tested at rtol 1e-5 / atol 1e-6);
- under autocast, the gradients of the projections reading the shared bfloat16 copy are summed in bfloat16
  before the norm's backward, where autocast sums their float32 casts: one bfloat16 rounding on gradients that
  are bfloat16 already (tested: within 2^-5 of autocast's, and no further from float32 gradients than autocast's
  own).
It lowers the training pass's peak memory at the same speed (`bench/RESULTS.md`).
Padding (`real_tokens`, set by the training pass around each forward): the MLPs and the attention's q/k/v/o
projections (through hooks, which compose with lean_linears and LoRA layers) run on the real positions only and
give 0 at padding, whose hidden states no real token reads (causal attention, masked keys); the demo's
completions are about 40% padding. Float32 forward
values are bit-identical (a row's matmul does not depend on the other rows here); weight gradients sum the same
terms in another blocking (float32 rounding). With the head skipping padding too (`grpo.learner.forward`), the
time per trained token falls by about the padding's share (`bench/RESULTS.md`).
Not used with gradient checkpointing (its recomputation runs outside the context and must see the same blocks).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from grpo.models.modeling import recomputes_activations, swapped_forwards, unwrap
from grpo.perf.kernels import rms_norm

NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # per-token linears: padding's rows are skipped


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        out, rstd = rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out if out_dtype is None else out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        # autograd's own backward of those operators, in its order (bit-identical in float32): nothing kept but
        # the input and the inverse RMS, the normalized input is recomputed
        x, weight, rstd = ctx.saved_tensors
        grad = grad.to(x.dtype)
        normed = x * rstd
        grad_w = (grad * normed).sum_to_size(weight.shape) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_n = grad * weight
            grad_r = (grad_n * x).sum(-1, keepdim=True)
            grad_var = -0.5 * grad_r * rstd.pow(3)
            grad_x = grad_n * rstd + grad_var.expand_as(x) / x.shape[-1] * (2 * x)
        return grad_x, grad_w, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def _norm_forward(module: torch.nn.Module, feeds_linears: bool):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or module.weight.dtype != torch.float32:
            return type(module).forward(module, x)
        device = x.device.type
        # under autocast the projections reading this output would each round it to the autocast dtype
        low = torch.get_autocast_dtype(device) if feeds_linears and torch.is_autocast_enabled(device) else None
        with torch.autocast(device, enabled=False):
            return _RMSNorm.apply(x, module.weight, module.variance_epsilon, low)

    return forward


_pass = threading.local()  # the current pass's real (not padding) token positions (`real_tokens`)


@contextlib.contextmanager
def real_tokens(mask: torch.Tensor):
    """Within the context, the lean blocks' per-token modules (MLPs, attention projections) given (B, T) hidden states
    of `mask`'s shape run on the positions where `mask` is 1 only, and give 0 at the others (padding: no real token
    attends to it, so its value is never read)."""
    previous = getattr(_pass, "real", None)
    flat = mask.reshape(-1).bool()
    _pass.real = None if bool(flat.all()) else (tuple(mask.shape), flat.nonzero().squeeze(1))
    try:
        yield
    finally:
        _pass.real = previous


def _mlp_forward(module: Any):  # a Llama-family MLP: gate_proj, up_proj, down_proj, act_fn
    def forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(_SiluMul.apply(module.gate_proj(x), module.up_proj(x)))

    return forward


def _pack_input(module: Any, args: tuple) -> tuple | None:
    """Forward pre-hook: a per-token module's (B, T, H) input as the (N, H) real positions (`real_tokens`). The
    module (Any: it is given a `_packed_shape` attribute, which torch types as a tensor or module) keeps its shape."""
    real = getattr(_pass, "real", None)
    x = args[0]
    if real is None or x.dim() != 3 or tuple(x.shape[:2]) != real[0]:
        module._packed_shape = None
        return None
    module._packed_shape = tuple(x.shape[:2])
    return (x.reshape(-1, x.shape[-1]).index_select(0, real[1]), *args[1:])


def _unpack_output(module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Forward hook: the (N, out) output back at its positions, 0 at padding."""
    shape = module._packed_shape
    if shape is None:
        return None
    full = out.new_zeros(shape[0] * shape[1], out.shape[-1]).index_copy(0, _pass.real[1], out)
    return full.view(*shape, -1)


def unsupported_reason(model: Any) -> str | None:
    """Why `lean_blocks` cannot be used for this model's training pass (None when it can)."""
    if recomputes_activations(model):
        return "gradient checkpointing recomputes the forward outside the context"
    config = getattr(unwrap(model), "config", None)
    if getattr(config, "hidden_act", None) != "silu":
        return "the model's MLP activation is not SiLU"
    if not any(type(m).__name__ in NORMS + MLPS for m in model.modules()):
        return "the model has no Llama-family RMSNorm or MLP blocks"
    return None


@contextlib.contextmanager
def lean_blocks(model: torch.nn.Module):
    """Within the context, the model's Llama-family RMSNorm and SiLU-gated MLP blocks compute as before but keep
    less for backward; under autocast the norms that feed projections output the autocast dtype's rounding once.
    Use around the forward only: backward needs nothing from the context."""
    forwards, per_token = [], []  # per_token: run on real positions only (hooks: they compose with the swapped
    for layer in model.modules():  # forwards, lean_linears' and LoRA's layers)
        if type(layer).__name__ in ATTENTIONS:
            per_token += [getattr(layer, name) for name in PROJECTIONS if getattr(layer, name, None) is not None]
        for name, sub in layer.named_children():
            if type(sub).__name__ in NORMS and hasattr(sub, "variance_epsilon"):
                # the block's norms feed projections; the model's final norm feeds the head (keeps float32)
                forwards.append((sub, _norm_forward(sub, name in ("input_layernorm", "post_attention_layernorm"))))
            elif type(sub).__name__ in MLPS and type(sub.act_fn).__name__ in ("SiLU", "SiLUActivation"):
                forwards.append((sub, _mlp_forward(sub)))
                per_token.append(sub)
    hooks = [
        h
        for m in per_token
        for h in (m.register_forward_pre_hook(_pack_input), m.register_forward_hook(_unpack_output))
    ]
    try:
        with swapped_forwards(forwards):
            yield
    finally:
        for hook in hooks:
            hook.remove()
