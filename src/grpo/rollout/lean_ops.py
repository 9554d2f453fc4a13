"""The arithmetic of the lean decoder's layers (`grpo.rollout.lean_decoder`), family by family: the RMSNorms (Llama's,
Gemma's of 1 + weight, OLMo 2's), the per-head query/key norms and the rotation, and one query's grouped attention.
Each follows the transformers module it stands for, operator for operator where rounding could differ."""

from __future__ import annotations

from typing import Any

import torch

from grpo.models.lora import active_module
from grpo.perf.kernels import Linear, rms_norm
from grpo.rollout.lean_families import norm_eps


def same(x: torch.Tensor) -> torch.Tensor:
    return x


def olmo_norm(module: Any) -> Linear:
    """OLMo 2's RMSNorm, as transformers computes it: float32 statistics, times the weight, then back to the input's
    dtype."""
    weight, eps = module.weight, module.variance_epsilon

    def norm(x: torch.Tensor) -> torch.Tensor:
        return (weight * normed(x.float(), eps)).to(x.dtype)

    return norm


def gemma_norm(module: Any) -> Linear:
    """Gemma's RMSNorm, as transformers computes it: float32 statistics, times (1 + weight) in float32, then back to
    the input's dtype."""
    weight, eps = module.weight, module.eps

    def norm(x: torch.Tensor) -> torch.Tensor:
        return (normed(x.float(), eps) * (1.0 + weight.float())).to(x.dtype)

    return norm


def llama_norm(module: Any, weight: torch.Tensor | None = None) -> Linear:  # a Llama-family RMSNorm
    """The RMSNorm module's arithmetic on its weight as it is now (the module's forward is not called: under FSDP
    that would run its sharding hooks outside the model's forward), or on `weight`, the fixed-shape loop's held
    copy of it. Float32 input, as in the lean forward."""
    weight, eps = module.weight if weight is None else weight, module.variance_epsilon
    return lambda x: rms_norm(x, weight, eps)[0]


def rotated(qk: torch.Tensor, layer: dict[str, Any], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Queries and keys (rows, heads + kv_heads, tokens, head_dim) rotated (not in a layer without rotary
    embeddings: SmolLM3's), each head RMS-normed first where the layer has query/key norms: Qwen3's (rounded to the
    input's dtype, then times the weight) or Gemma's (times 1 + weight in float32, then rounded)."""
    if layer["qk_norm"] is not None:
        weight, eps, gemma = layer["qk_norm"]
        if gemma:
            qk = (normed(qk.float(), eps) * weight).to(qk.dtype)
        else:
            qk = weight * normed(qk.float(), eps).to(qk.dtype)
    return rope(qk, cos, sin) if layer.get("rope", True) else qk


def head_norms(attn: Any, heads: int, kv_heads: int, gemma: bool = False) -> tuple[torch.Tensor, float, bool] | None:
    """The per-head query and key RMSNorms as one (heads + kv_heads, 1, head_dim) weight table (the query norm's
    weight for each query head, the key norm's for each key head; Gemma's: 1 + weight, in float32), their epsilon,
    and whether they are Gemma's; None without them."""
    q_norm, k_norm = active_module(getattr(attn, "q_norm", None)), active_module(getattr(attn, "k_norm", None))
    if q_norm is None:
        return None
    q, k = q_norm.weight.detach(), k_norm.weight.detach()
    if gemma:
        q, k = 1.0 + q.float(), 1.0 + k.float()
    table = torch.cat([q.expand(heads, -1), k.expand(kv_heads, -1)])
    return table.unsqueeze(1), norm_eps(q_norm), gemma


def normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, as transformers' RMSNorm computes it before its weight (float32 in)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, without building rotate_half(x): the same products and sums (a + (-b) * c is
    a - b * c exactly in floating point). A partial rotation (Phi-3's `partial_rotary_factor`: cos and sin narrower
    than the head) rotates the head's first dimensions and passes the rest as they are."""
    if cos.shape[-1] < x.shape[-1]:
        rotary = cos.shape[-1]
        return torch.cat([rope(x[..., :rotary], cos, sin), x[..., rotary:].to(torch.result_type(x, cos))], dim=-1)
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query per row (a decode step) as two batched matmuls: q (b, heads, 1, d) against keys and
    values (b, kv_heads, width, d), a query head reading its group's key head (the cache read once, no head
    repeated), `bias` (b, 1, 1, width) added to the scores; scores and softmax in float32 (`scores`), the
    probabilities rounded to the values' dtype for their product, as the training pass's attention kernels compute
    them. Float32 on a CPU: measured faster than scaled_dot_product_attention's kernel at decode shapes
    (`bench/RESULTS.md`)."""
    b, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads, d)  # query heads of one key head: rows of one matmul
    attended = scores(grouped, keys).mul_(scale).add_(bias)
    return torch.matmul(attended.softmax(-1).to(values.dtype), values).reshape(b, heads, 1, d)


def scores(grouped: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q . k for each query head of a group (b, kv_heads, group, d) and key (b, kv_heads, width, d), in float32. The
    product of two bfloat16 numbers is exact in float32, so these are the scores the training pass's kernels (flash,
    memory-efficient) sum in float32; a bfloat16 product would round each score to 8 bits, a wider gap between the
    sampler's log-probs and the trainer's. On CUDA the GEMM writes float32 from bfloat16 inputs (`out_dtype`), where
    the build has it; elsewhere the inputs are widened first."""
    if keys.dtype == torch.float32:
        return torch.matmul(grouped, keys.transpose(-1, -2))
    b, kv_heads, group, d = grouped.shape
    if keys.is_cuda and _float32_gemm(keys.device):
        flat = torch.bmm(
            grouped.reshape(b * kv_heads, group, d),
            keys.reshape(b * kv_heads, -1, d).transpose(1, 2),
            out_dtype=torch.float32,
        )
        return flat.view(b, kv_heads, group, -1)
    return torch.matmul(grouped.float(), keys.float().transpose(-1, -2))


_FLOAT32_GEMM: dict[torch.device, bool] = {}


def _float32_gemm(device: torch.device) -> bool:
    """Whether this torch build's bfloat16 batched matmul writes float32 on `device` (tried once, eagerly: the first
    decode step runs before any capture)."""
    if device not in _FLOAT32_GEMM:
        try:
            a = torch.zeros(1, 1, 8, dtype=torch.bfloat16, device=device)
            _FLOAT32_GEMM[device] = torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _FLOAT32_GEMM[device] = False
    return _FLOAT32_GEMM[device]
