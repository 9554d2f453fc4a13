"""Float32 linears for decoding on CPUs: each weight packed once per rollout into MKL's sgemm layout for the
decode batch's row count.

Why: on a CPU without fast bfloat16 the policy decodes in float32, and a decode step of a GRPO rollout is matmuls
of a few rows (16 in the demo) against every weight. MKL's plain sgemm repacks its weight operand on every call;
`cblas_sgemm_pack` does it once (`torch.ops.mkl._mkl_reorder_linear_weight`, the packing torch.compile's freezing
uses) and the same float32 arithmetic then runs faster: measured with AVX2 kernels (an AVX512 machine capped to
AVX2), the bundled model's linears at 16 rows take 45.8 ms a step against 62.5 ms on 2 threads (79 against 109 ms
on one), and a whole decode step 60.8 ms against 74.5 ms. No weight is narrowed; the rounding differs from plain
sgemm in the last bits (another blocking), as sgemm's own results differ between row counts.

The layout serves one row count: `_mkl_linear` runs the plain matmul on the original weight for any other (so the
prefill takes the plain path). The lean decoder therefore keeps its batch at the packed size while more than half
its slots are live, then repacks for the rows left (`LeanDecoder.select`). Measured with AVX2 kernels on 2 threads,
the bundled model's linears per decode step (ms):

    rows            1     2-4     6-8     10-12    16
    plain sgemm    22    43-45     51       -       62
    packed         21    23-28    30-31   35-37     42

so plain sgemm at 2-8 rows costs what packed does at 16, and only a single row (a matrix-vector product) is as fast
plain. The packed layout is large: at least ~2.9M floats a matrix (the bundled model's MLP weights 3-4x their size,
the head 2x, the attention projections 5-9x), so the lean decoder packs the MLPs and the head only (1.3 GB for the
bundled model; the attention projections would add 0.65 GB for 1.7-3 ms a step). Packing them takes ~0.1 s once
that memory is warm (the first time up to 0.9 s, its pages faulted in), so a repack pays after ~10-20 steps.
"""

from __future__ import annotations

import torch

from grpo.perf.kernels import Linear

# The decoder packs its weights when a rollout has run PACK_AFTER steps with more than STEPS_AFTER_PACKING of its
# token budget left. Packing costs ~0.1 s for a 135M model once its memory is warm (about two 16-row steps) and a
# packed 16-row step is ~20 ms faster, so it pays from the first step: with AVX2 kernels, packing before the first
# step instead of after the 12th made the demo's training 116 s instead of 132 s (same completions and accuracy)
# and replayed 64-token rollouts 4% faster. A budget of at most STEPS_AFTER_PACKING tokens never packs.
PACK_AFTER = 0
STEPS_AFTER_PACKING = 8
# the fewest slots packed for (below 8 rows a step saves only a few ms more), and the token budget left that a repack
# needs (it costs about 0.12 s and saves ~10 ms a step)
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
