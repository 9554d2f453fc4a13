"""Float32 decode linears on x86 CPUs with AVX2 and FMA: grpo's own kernel (`panel_gemm.c`), the weights kept in
16-column panels.

Why: a float32 decode step of the demo's 16 rows is bound by reading the weights and by the arithmetic at once,
and MKL's sgemm (packed or not) does one after the other: measured with AVX2 kernels on 2 threads (an AVX512
machine capped to AVX2), the bundled model's gate/up matmul at 16 rows reads its weights at 12-13 GB/s and
computes at ~100 GFLOP/s, against 30 GB/s and ~195 GFLOP/s for each alone. The panel kernel prefetches the next
panels while it multiplies the current one (`panel_gemm.c`). Per matmul at 16 rows (AVX2, 2 threads, µs; MKL
packed for 16 rows / the panel kernel): qkv 120 / 118, o 66 / 75, gate/up 534 / 445, down 264 / 228, head 7828 /
6832; at 3 rows gate/up 309 / 243. The layout serves every row count (no repacking as rows finish) and costs the
weight's own size (MKL's packed layout: at least ~11.6 MB a matrix, 1.3 GB for the bundled model's MLPs and head).

No weight is narrowed: every output is one float32 sum of fused multiply-adds in order over k, so results differ
from MKL's blocked sums in the last bits only (tests: against `F.linear`, and the lean decoder against the
transformers forward).

The C source is compiled once per machine with the system's C compiler (`cc`, or $CC) into a cache directory
($GRPO_KERNEL_CACHE, else ~/.cache/grpo/kernels; a library there that another user could have written is never
loaded); without a compiler, on other CPUs, or with GRPO_PANEL_KERNEL=0, the
lean decoder keeps MKL's packed sgemm (`grpo.rollout.packed`), and `available()` says so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

from grpo.perf.kernels import Linear

logger = logging.getLogger("grpo")
SOURCE = Path(__file__).with_name("panel_gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
MAX_ROWS = 256  # more rows (a long prefill) take the plain matmul on the weight itself


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, then cached), or None where it cannot run here (logged once)."""
    if os.environ.get("GRPO_PANEL_KERNEL", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("No C compiler (cc): float32 decoding uses MKL's packed sgemm instead of grpo's panel kernel.")
        return None
    key = build_key(compiler)
    cache = Path(os.environ.get("GRPO_KERNEL_CACHE") or Path.home() / ".cache" / "grpo" / "kernels")
    try:
        path = _built(compiler, cache, key)
    except (OSError, subprocess.SubprocessError) as err:
        logger.info("grpo's panel kernel could not be built (%s): float32 decoding uses MKL's packed sgemm.", err)
        return None
    lib = ctypes.CDLL(str(path))
    lib.grpo_panel_gemm.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4
    lib.grpo_panel_gemm.restype = ctypes.c_int
    lib.grpo_pack_panels.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.grpo_pack_panels.restype = ctypes.c_int
    return lib


def build_key(compiler: str) -> str:
    """The cached library's name for this source, compiler and flags."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]


def _built(compiler: str, cache: Path, key: str) -> Path:
    """The shared library for this source and compiler: from `cache` when it holds one that only this user can
    have written, else compiled there (under a temporary name, then renamed: concurrent processes never load half a
    file), or, where `cache` is not writable, into a private temporary directory. A library another user could
    have placed is never loaded."""
    target = cache / f"panel_gemm-{key}.so"
    if target.exists() and _private(target) and _private(cache):
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not _private(cache):
            raise PermissionError(f"{cache} is writable by other users")
        return _compile(compiler, target)
    except PermissionError:
        return _compile(compiler, Path(tempfile.mkdtemp(prefix="grpo-kernel-")) / target.name)


def _compile(compiler: str, target: Path) -> Path:
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], check=True, capture_output=True, timeout=120)
    os.replace(partial, target)
    return target


def _private(path: Path) -> bool:
    """Owned by this user and writable by no one else."""
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def available(weight: torch.Tensor) -> bool:
    """Whether `weight` can take the panel kernel here: a float32 CPU tensor, on a CPU and machine that build it."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and library() is not None


def pack(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """(N_i, K) weights, stacked by rows as one (sum N_i, K) matrix -> its panels (ceil(N / 16), K, 16): column j
    of panel p is row 16 p + j (zeros past N). The C library reads the parts in place: nothing is concatenated."""
    parts = [w.detach().float().contiguous() for w in parts]
    n, k = sum(w.shape[0] for w in parts), parts[0].shape[1]
    panels = torch.empty((n + 15) // 16, k, 16, dtype=torch.float32)
    pointers = (ctypes.c_void_p * len(parts))(*[w.data_ptr() for w in parts])
    rows = (ctypes.c_int * len(parts))(*[w.shape[0] for w in parts])
    library().grpo_pack_panels(len(parts), pointers, rows, k, panels.data_ptr())
    return panels


def panel_linear(parts: Sequence[torch.Tensor], bias: torch.Tensor | None) -> Linear:
    """x -> x @ W.T + bias in float32 by the panel kernel, W the `parts` stacked by rows (q, k and v: one matmul),
    for inputs of up to MAX_ROWS rows (more: F.linear on W, stacked then, once). The panels are a copy: later
    changes to the parts are not seen."""
    lib = library()
    bias = bias.detach().float().contiguous() if bias is not None else None
    panels = pack(parts)
    n, k = sum(w.shape[0] for w in parts), parts[0].shape[1]
    stacked: list[torch.Tensor] = []  # W itself, made on the first input of over MAX_ROWS rows

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, k)
        rows = flat.shape[0]
        if rows > MAX_ROWS or flat.dtype != torch.float32:
            if not stacked:
                stacked.append(torch.cat([w.detach() for w in parts]) if len(parts) > 1 else parts[0].detach())
            return F.linear(x, stacked[0], bias)
        flat = flat.contiguous()
        out = torch.empty(rows, n, dtype=torch.float32)
        extra = bias.data_ptr() if bias is not None else None
        lib.grpo_panel_gemm(rows, n, k, flat.data_ptr(), panels.data_ptr(), extra, out.data_ptr())
        return out.reshape(*x.shape[:-1], n)

    return forward
