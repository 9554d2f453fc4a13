"""Arithmetic shared by the fast paths: a linear layer with its weight cast (and pre-packed) once, and
transformers' Llama RMSNorm written out. The lean decoder (sampling) and the lean blocks (training pass) both use
them, so each computes exactly what transformers computes, written once."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

Linear = Callable[[torch.Tensor], torch.Tensor]


def fixed_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, pack: bool = True) -> Linear:
    """x -> x @ weight.T + bias computed in `dtype`, with the weight cast once now (and on CPUs with oneDNN,
    pre-packed for bfloat16 unless `pack` is off: the same kernel, without a per-call reorder). Output in `dtype`."""
    weight = weight.detach().to(dtype)
    bias = bias.detach().to(dtype) if bias is not None else None
    if pack and weight.device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        except (RuntimeError, AttributeError):  # a torch build without the op: plain bfloat16 matmul
            packed = None
        if packed is not None:

            def packed_forward(x: torch.Tensor) -> torch.Tensor:
                flat = x.reshape(-1, x.shape[-1]).to(dtype)
                out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
                return out.reshape(*x.shape[:-1], out.shape[-1])

            return packed_forward

    def plain_forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(dtype), weight, bias)

    return plain_forward


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama RMSNorm on a float32 input, operator for operator (its cast back to the input dtype is
    then a no-op): the output, and the inverse RMS per row."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x * rstd), rstd
