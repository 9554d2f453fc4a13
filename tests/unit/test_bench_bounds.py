"""`make bench`'s machine bounds (bench/bounds.py): the ratios against hand-computed values, and the float32 rows
only where bfloat16 is not fast (grpo's own test: AMX or AVX512-BF16 on a CPU, honouring a oneDNN instruction-set
cap; compute capability 8.0 on CUDA)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from grpo.models.modeling import fast_bf16_available

_spec = importlib.util.spec_from_file_location(
    "bench_bounds", os.path.join(os.path.dirname(os.path.dirname(__file__)), "..", "bench", "bounds.py")
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's test (CUDA decides so)")
@pytest.mark.parametrize(
    "flags, cap, fast",
    [
        ({"avx512f", "avx512_bf16"}, "", True),  # measured faster end to end than float32 (modeling's docstring)
        ({"avx512f", "avx512_bf16"}, "AVX512_CORE_BF16", True),
        ({"avx512f", "avx512_bf16"}, "AVX512_CORE", False),  # oneDNN capped below its bfloat16 instructions
        ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "", True),
        ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "ALL", True),
        ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "AVX2", False),
        ({"avx2", "fma"}, "", False),  # emulated: several times slower than float32
        ({"avx512f", "avx512_vnni"}, "", False),
    ],
)
def test_bf16_is_fast_on_cpus_with_bf16_units_and_bench_runs_float32_rows_elsewhere(monkeypatch, flags, cap, fast):
    from grpo.models import modeling

    monkeypatch.setattr(modeling, "cpu_flags", lambda: flags)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert fast_bf16_available(torch.device("cpu")) == fast
    assert bounds.precisions() == (("bf16", "fp32") if fast else ("fp32",))


def test_this_machines_cpu_flags_are_read_from_proc_cpuinfo():
    from grpo.models.modeling import cpu_flags

    if not os.path.exists("/proc/cpuinfo"):
        assert cpu_flags() == set()
        return
    with open("/proc/cpuinfo") as f:
        line = next((line for line in f if line.startswith("flags")), "flags:")
    assert cpu_flags() == set(line.split(":", 1)[1].split())


@pytest.mark.parametrize(
    "capability, native, fast",
    [((7, 0), True, False), ((7, 5), False, False), ((8, 0), True, True), ((9, 0), True, True)],
)
def test_bf16_is_fast_on_cuda_from_compute_capability_8(monkeypatch, capability, native, fast):
    """Ampere (8.0) on: native bfloat16. A V100 (7.0) or T4 (7.5) only emulates it, which torch's default
    `is_bf16_supported()` counts (including_emulation=True)."""
    asked = {}

    def supported(including_emulation=True):
        asked["including_emulation"] = including_emulation
        return native or including_emulation

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert fast_bf16_available(torch.device("cuda")) == fast
    assert asked.get("including_emulation", False) is False
