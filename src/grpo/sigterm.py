"""The SIGTERM flag: the low-level half of `grpo.preemption`, with nothing of grpo below it.

Inside `preemption_guard` SIGTERM only sets a flag; every wait that can last (a generation, a reward function, a
tool call) calls `check`, which raises `Preempted`, so the trainer sees the signal within a fraction of a second.
What happens then (which step is saved, the exit status) is `grpo.preemption`'s: engines, tools and reward
calling import this module only, so they stay below the trainer and its checkpoints.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_requested = threading.Event()
_thread = threading.local()  # a worker thread's own stop event and heartbeat (`watch`)


class Preempted(Exception):
    """SIGTERM arrived while a step was running; raised at the next point that checks (`check`)."""


class Cancelled(Exception):
    """The thread's stop event (`watch`) was set: raised at the next point that checks, so a worker ends mid-wait."""


def requested() -> bool:
    return _requested.is_set()


def check() -> None:
    """Raise `Preempted` if SIGTERM arrived inside `preemption_guard`; in a thread that `watch`es a stop event,
    raise `Cancelled` once it is set, and otherwise beat its heartbeat (every check is progress)."""
    if _requested.is_set():
        raise Preempted("SIGTERM received")
    stop = getattr(_thread, "stop", None)
    if stop is not None:
        if stop.is_set():
            raise Cancelled("stopped")
        _thread.beat()


def watch(stop: threading.Event, beat: Callable[[], None]) -> None:
    """In the calling thread (a worker), make `check` raise `Cancelled` once `stop` is set and call `beat` at
    every other check."""
    _thread.stop, _thread.beat = stop, beat


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
