"""Float32 linears for decoding on CPUs: each weight packed once per rollout into MKL's sgemm layout for the
decode batch's row count.

Why: on a CPU without fast bfloat16 the policy decodes in float32, and a decode step of a GRPO rollout is matmuls
of a few rows (16 in the demo) against every weight. MKL's plain sgemm repacks its weight operand on every call;
`cblas_sgemm_pack` does it once (`torch.ops.mkl._mkl_reorder_linear_weight`, the packing torch.compile's freezing
uses) and the same float32 arithmetic then runs faster. No weight is narrowed; the rounding differs from plain
sgemm in the last bits (another blocking), as sgemm's own results differ between row counts.

The layout serves one row count: `_mkl_linear` runs the plain matmul on the original weight for any other (so the
prefill takes the plain path). Plain sgemm at 2-8 rows costs about what packed does at 16, so the lean decoder
keeps its batch at the packed size while more than half its slots are live, then repacks for the rows left
(`LeanDecoder.select`). The packed layout is several times a weight's size, so the lean decoder packs the MLPs and
the head only; packing takes a fraction of a second, so a repack pays after a few dozen steps. Measurements:
`bench/RESULTS.md`.
"""

from __future__ import annotations

import torch

from grpo.perf.kernels import Linear

# The decoder packs its weights when a rollout has run PACK_AFTER steps with more than STEPS_AFTER_PACKING of its
# token budget left: packing costs about two 16-row steps and pays from the first step (`bench/RESULTS.md`). A
# budget of at most STEPS_AFTER_PACKING tokens never packs.
PACK_AFTER = 0
STEPS_AFTER_PACKING = 8
# the fewest slots packed for (below 8 rows packing saves little more), and the token budget left that a repack
# needs to pay for itself
MIN_ROWS = 8
STEPS_AFTER_REPACKING = 16


def available(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed here: a float32 CPU tensor, in a torch build with MKL's packed sgemm."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> Linear:
    """x -> x @ weight.T + bias in float32, with `weight` packed for inputs of `rows` rows (an input with another row
    count takes the plain matmul on `weight` itself)."""
    weight = weight.detach().contiguous()
    bias = bias.detach() if bias is not None else None
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward
