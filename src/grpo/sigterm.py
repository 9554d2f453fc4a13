"""The SIGTERM flag: the low-level half of `grpo.preemption`, with nothing of grpo below it.

Inside `preemption_guard` SIGTERM only sets a flag; every wait that can last (a generation, a reward function, a
tool call) calls `check`, which raises `Preempted`, so the trainer sees the signal within a fraction of a second.
What happens then (which step is saved, the exit status) is `grpo.preemption`'s: engines, tools and reward
calling import this module only, so they stay below the trainer and its checkpoints.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_requested = threading.Event()


class Preempted(Exception):
    """SIGTERM arrived while a step was running; raised at the next point that checks (`check`)."""


def requested() -> bool:
    return _requested.is_set()


def check() -> None:
    """Raise `Preempted` if SIGTERM arrived inside `preemption_guard`."""
    if _requested.is_set():
        raise Preempted("SIGTERM received")


@contextmanager
def preemption_guard() -> Iterator[threading.Event]:
    """An event set when SIGTERM arrives inside the block (also what `requested` and `check` read); the previous
    handler comes back on exit. Signal handlers can only be installed from the main thread: elsewhere the event
    simply never fires."""
    _requested.clear()
    if threading.current_thread() is not threading.main_thread():
        yield _requested
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _requested.set())
    try:
        yield _requested
    finally:
        signal.signal(signal.SIGTERM, previous)
        _requested.clear()
