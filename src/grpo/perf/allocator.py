"""The CPU allocator policy for training (freed memory kept for reuse, glibc), handing cached memory back, and the
lock between CUDA graph captures and what acts on the whole device."""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
from typing import Any

import torch

logger = logging.getLogger("grpo")

# Held by a CUDA graph capture (`grpo.rollout.graphed`: an asynchronous run's producer captures in its own thread)
# and by everything that acts on the whole device from another thread while it may: emptying the allocator's cache
# (which asserts that no capture is under way), and the learner's micro-steps (a compiled pass synchronizes the
# device when Inductor autotunes a kernel's first run; an allocation that fails retries after freeing cached blocks,
# which a capture under way forbids). A capture is short and, with graphs kept for the run, rare.
DEVICE_WIDE = threading.RLock()

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of handing it back to the kernel (CPU training).

    By default glibc serves every allocation over a few MiB with a fresh mmap and unmaps it on free, so each
    step's logits, activations and gradients are faulted in page by page again (about a third of a CPU training
    pass's time in kernel page faults: `bench/RESULTS.md`). With mmap disabled and trimming off, large blocks
    come from the heap and are reused from the second step on; the peak resident size is the heap's high-water
    mark, no larger. Same numbers, only where memory comes from. `GRPOConfig(cpu_keep_freed_memory=False)` keeps
    the system's policy. Returns whether the policy was applied (glibc only); it holds for the whole process, and
    is logged."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    if applied:
        logger.info(
            "CPU allocator (process-wide): glibc keeps freed memory for reuse instead of returning it to the "
            "kernel (GRPOConfig.cpu_keep_freed_memory=False turns this off)."
        )
    return applied


def release_cached_memory(device: Any) -> bool:
    """Hand the memory the allocator keeps cached but unused back (`torch_empty_cache_steps`): to the GPU's
    other users on CUDA (empty_cache), to the system on the CPU (glibc's malloc_trim, which returns freed heap
    pages even when `keep_freed_memory` turned automatic trimming off). Returns whether anything was asked."""
    kind = torch.device(device).type
    if kind == "cuda":
        with DEVICE_WIDE:  # never while a graph is being captured (another thread's)
            torch.cuda.empty_cache()
        return True
    if kind == "mps":
        torch.mps.empty_cache()
        return True
    if kind == "xpu":
        torch.xpu.empty_cache()
        return True
    if kind != "cpu" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim(0)
    return True
