"""What the machine allows, measured, and how far the fast engine's float32 run is from it (`make bench`).

- Memory bound of a decode step: reading every weight a step multiplies by once, in float32, at the bandwidth of a
  streaming read of a buffer that size (`torch.Tensor.sum`, best of 5). A decode step of the demo's 16 rows cannot
  be faster than that, whatever the kernels (at 16 rows it is also near the compute bound on a 2-core CPU: 2 x 16
  FLOPs per weight).
- FLOP bound of a training pass: 6 x those weights x the tokens the pass must run (each group's prompt once,
  prefix sharing, plus every completion token) at the peak of a float32 matmul here (2048^3, best of 5).

Also printed, not a ratio of the issue's: the FLOP bound of a decode step, 2 x weights x the rows a step decodes on
average (completion tokens / decode steps) at the matmul peak. On a 2-core AVX2 CPU at the demo's 16 rows it is
about the memory bound (~20 ms each), so a 16-row step is compute-limited there too; fewer rows are memory-limited.

`decode_vs_bound` = measured decode step / memory bound, with the step measured end to end in the trainer (a
rollout's generation time over its decode steps: prefill and sampling included), after the warm-up step.
`train_vs_bound` = measured training pass (forward, loss, backward) / FLOP bound, over the same steps. 1.0 would
be the machine's limit.
"""

from __future__ import annotations

import time

import torch

from grpo.models.modeling import fast_bf16_available


def precisions() -> tuple[str, ...]:
    """The benchmark's precisions here: bfloat16 only where it is fast (grpo's own test, which the trainer's bf16=None
    uses); emulated bfloat16 takes minutes a step for both frameworks."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return ("bf16", "fp32") if fast_bf16_available(device) else ("fp32",)


def _best(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(nbytes: int) -> float:
    """Bytes per second of a streaming read of a float32 buffer of `nbytes`."""
    buffer = torch.ones(nbytes // 4)
    return buffer.numel() * 4 / _best(buffer.sum)


def matmul_flops(n: int = 2048) -> float:
    """Float32 FLOP/s of an n x n x n matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best(lambda: a @ b)


def decode_vs_bound(step_s: float, weights: int, bandwidth: float) -> float:
    """A decode step's time over the time to read `weights` float32 numbers at `bandwidth` bytes/s."""
    return step_s / (4 * weights / bandwidth)


def train_vs_bound(pass_s: float, weights: int, tokens: int, flops: float) -> float:
    """A training pass's time over 6 x `weights` x `tokens` FLOPs at `flops` FLOP/s."""
    return pass_s / (6 * weights * tokens / flops)


def machine(weights: int, samples: int = 3) -> dict:
    """The two bounds' inputs, measured now (run while nothing else does): the best of `samples` measurements, each
    best-of-5 on fresh buffers. On a shared VM one streaming read measured 31-47 GB/s from one process to the next
    (the host's other tenants), so one sample can flatter a ratio by 1.5x: the best is what the machine allows, and
    the spread is printed beside it."""
    reads = [read_bandwidth(4 * weights) / 1e9 for _ in range(samples)]
    flops = [matmul_flops() / 1e9 for _ in range(samples)]
    return {
        "read_gb_per_s": max(reads),
        "matmul_gflop_per_s": max(flops),
        "read_gb_per_s_low": min(reads),
        "matmul_gflop_per_s_low": min(flops),
        "threads": torch.get_num_threads(),
    }


def ratios(run: dict, measured: dict) -> dict:
    """decode_vs_bound and train_vs_bound of a grpo run (run_grpo.py's result), from `machine`'s figures."""
    keep = slice(1, None)  # after the warm-up step
    steps = sum(run["decode_steps"][keep])
    step_s, rows = sum(run["generation_s"][keep]) / steps, sum(run["completion_tokens"][keep]) / steps
    pass_s, tokens = sum(run["train_pass_s"][keep]), sum(run["train_tokens"][keep])
    weights = run["decode_weights"]
    return {
        "decode_rows_mean": rows,
        "decode_flop_bound_ms": 1e3 * 2 * weights * rows / (measured["matmul_gflop_per_s"] * 1e9),
        "decode_step_ms": 1e3 * step_s,
        "decode_bound_ms": 1e3 * 4 * weights / (measured["read_gb_per_s"] * 1e9),
        "decode_vs_bound": decode_vs_bound(step_s, weights, measured["read_gb_per_s"] * 1e9),
        "train_vs_bound": train_vs_bound(pass_s, weights, tokens, measured["matmul_gflop_per_s"] * 1e9),
    }
