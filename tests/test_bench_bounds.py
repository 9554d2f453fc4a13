"""`make bench`'s machine bounds (bench/bounds.py): the ratios against hand-computed values, and the float32 rows
only where bfloat16 is not fast (grpo's own test, which honours a oneDNN instruction-set cap)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from grpo.modeling import fast_bf16_available

_spec = importlib.util.spec_from_file_location(
    "bench_bounds", os.path.join(os.path.dirname(__file__), "..", "bench", "bounds.py")
)
bounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bounds)


def test_ratios_by_hand():
    # 135M float32 weights (540 MB) at 20 GB/s: 27 ms; a 54 ms step is 2x the bound
    assert bounds.decode_vs_bound(0.054, 135_000_000, 20e9) == pytest.approx(2.0)
    # 6 x 100M x 300 tokens = 180 GFLOP at 100 GFLOP/s: 1.8 s; a 2.7 s pass is 1.5x
    assert bounds.train_vs_bound(2.7, 100_000_000, 300, 100e9) == pytest.approx(1.5)
    run = {  # the warm-up step (the first) is left out
        "generation_s": [9.0, 2.0, 2.0],
        "decode_steps": [10, 20, 20],
        "completion_tokens": [50, 200, 120],
        "train_pass_s": [5.0, 1.0, 1.7],
        "train_tokens": [100, 150, 150],
        "decode_weights": 100_000_000,
    }
    got = bounds.ratios(run, {"read_gb_per_s": 40.0, "matmul_gflop_per_s": 100.0})
    assert got["decode_step_ms"] == pytest.approx(100.0)  # 4 s over 40 steps
    assert got["decode_bound_ms"] == pytest.approx(10.0)  # 400 MB at 40 GB/s
    assert got["decode_vs_bound"] == pytest.approx(10.0)
    assert got["decode_rows_mean"] == pytest.approx(8.0)  # 320 tokens over 40 steps
    assert got["decode_flop_bound_ms"] == pytest.approx(16.0)  # 2 x 1e8 x 8 FLOPs at 100 GFLOP/s
    assert got["train_vs_bound"] == pytest.approx(2.7 / 1.8)


def test_measurements_are_positive():
    assert bounds.read_bandwidth(4_000_000) > 0 and bounds.matmul_flops(64) > 0


def test_the_machine_bounds_are_the_best_of_their_samples(monkeypatch):
    reads, flops = iter([30e9, 45e9, 31e9]), iter([150e9, 140e9, 180e9])
    monkeypatch.setattr(bounds, "read_bandwidth", lambda nbytes: next(reads))
    monkeypatch.setattr(bounds, "matmul_flops", lambda: next(flops))
    got = bounds.machine(1000)
    assert (got["read_gb_per_s"], got["read_gb_per_s_low"]) == (45.0, 30.0)
    assert (got["matmul_gflop_per_s"], got["matmul_gflop_per_s_low"]) == (180.0, 140.0)


@pytest.mark.skipif(
    torch.cuda.is_available() or not os.path.exists("/proc/cpuinfo"), reason="the Linux CPU's test (CUDA decides so)"
)
def test_a_onednn_cap_below_bf16_means_float32_rows_only(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not fast_bf16_available(torch.device("cpu"))
    assert bounds.precisions() == ("fp32",)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    with open("/proc/cpuinfo") as f:
        flags = f.read()  # read once (read again inside the generator, a second flag would see an empty string)
    has_bf16 = any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))
    assert fast_bf16_available(torch.device("cpu")) == has_bf16
    assert bounds.precisions() == (("bf16", "fp32") if has_bf16 else ("fp32",))
