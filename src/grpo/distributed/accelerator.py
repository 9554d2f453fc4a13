"""The end of a run's process group: trackers finished, processes settled, the group torn down (the accelerator is
made in `grpo.learner.acceleration`)."""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable

import torch
from accelerate import Accelerator


def end_training(accelerator: Accelerator) -> None:
    """The end of `train()`: trackers finished. The process group stays up, so that calls after training that
    need every process (`save_model` gathers a sharded model) still work; it is torn down at exit, settled."""
    for tracker in accelerator.trackers:
        tracker.finish()
    if accelerator.num_processes > 1 and accelerator not in _TEARDOWN:
        _TEARDOWN.append(accelerator)
        atexit.register(_tear_down, accelerator)


def end_run(accelerator: Accelerator) -> None:
    """GRPOTrainer.end(): the trackers finished and the process group ended now (after train, evaluate, save and
    push, which need the other processes)."""
    for tracker in accelerator.trackers:
        tracker.finish()
    if accelerator in _TEARDOWN:
        _TEARDOWN.remove(accelerator)
    _tear_down(accelerator)


_TEARDOWN: list[Accelerator] = []
_BEFORE_TEARDOWN: list[Callable[[], None]] = []


def before_teardown(close: Callable[[], None]) -> None:
    """Call `close` when the process group is torn down, once the processes have settled and before the group goes:
    for what holds subgroups of it (a vLLM engine split across processes), which would otherwise tear them down at
    exit itself, after the group is gone (a traceback) or unsettled."""
    _BEFORE_TEARDOWN.append(close)


def _tear_down(accelerator: Accelerator) -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        settle_processes(accelerator)
        while _BEFORE_TEARDOWN:
            _BEFORE_TEARDOWN.pop()()
        if torch.distributed.is_initialized():  # a closed engine may have torn it down itself
            accelerator.state.destroy_process_group()


def settle_processes(accelerator: Accelerator) -> None:
    """Before the process group can be torn down: a barrier, then a moment without the GIL. gloo's worker threads
    need the GIL to drop the work objects of the last collectives, and torch's gloo destructor joins them while
    holding it: torn down too early, a CPU run hung at exit about one time in three."""
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        time.sleep(0.2)
