"""grpo's optional float32 CPU kernel, built at install (the package's metadata is in pyproject.toml).

`grpo.rollout.cpu._panel_gemm` is a plain C library (no Python API: `grpo.rollout.cpu.panels` loads it with ctypes)
compiled with AVX2, FMA and OpenMP. It is optional: where it cannot be built (no C compiler, no OpenMP, another
architecture) pip installs grpo without it, and the lean decoder uses MKL's packed sgemm instead."""

import platform

from setuptools import Extension, setup

KERNEL = Extension(
    "grpo.rollout.cpu._panel_gemm",
    sources=["src/grpo/rollout/cpu/panel_gemm.c"],
    # the flags the kernel was tuned with (-fno-wrapv undoes the -fwrapv in Python's own CFLAGS)
    extra_compile_args=["-O3", "-mavx2", "-mfma", "-fopenmp", "-fno-wrapv"],
    extra_link_args=["-fopenmp"],
    optional=True,
)

setup(ext_modules=[KERNEL] if platform.machine() in ("x86_64", "AMD64") else [])
