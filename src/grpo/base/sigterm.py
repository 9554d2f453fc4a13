"""The SIGTERM flag: the low-level half of `grpo.rounds.preemption`, with nothing of grpo below it.

Inside `preemption_guard` SIGTERM only sets a flag; every wait that can last (a generation, a reward function, a
tool call) calls `check`, which raises `Preempted`, so the trainer sees the signal within a fraction of a second.
What happens then (which step is saved, the exit status) is `grpo.rounds.preemption`'s: engines, tools and reward
calling import this module only, so they stay below the trainer and its checkpoints.

Several processes: each one's SIGTERM arrives on its own, and a process that stops in a wait may leave the others
in the collective that follows it (a round's gather, a tool loop's check), hung until the launcher kills them.
So inside a step a process that stops hands None to that collective instead (`agreed_or_none`), where every
process learns it and raises `Preempted(agreed=True)` at the same point.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
_requested = threading.Event()
_thread = threading.local()  # a worker thread's own stop event and heartbeat (`watch`)


class Preempted(Exception):
    """SIGTERM arrived while a step was running; raised at the next point that checks (`check`). `agreed`: raised
    on every process at the same collective (`agreed_or_none`), so all of them are at the same point of the step."""

    def __init__(self, message: str = "SIGTERM received", agreed: bool = False) -> None:
        super().__init__(message)
        self.agreed = agreed


def agreed_or_none(make: Callable[[], T], several: bool) -> T | None:
    """`make()`, or None where SIGTERM interrupted it on this process, one of `several`: the caller hands None to
    the collective that follows (a round's gather, a tool loop's check), where every process learns it and raises
    `Preempted(agreed=True)` together, instead of leaving the others waiting in that collective. On one process,
    or once agreed, the error goes on as it is."""
    try:
        return make()
    except Preempted as stop:
        if stop.agreed or not several:
            raise
        return None


class Cancelled(Exception):
    """The thread's stop event (`watch`) was set: raised at the next point that checks, so a worker ends mid-wait."""


def requested() -> bool:
    return _requested.is_set()


def check(progress: bool = True) -> None:
    """Raise `Preempted` if SIGTERM arrived inside `preemption_guard`; in a thread that `watch`es a stop event,
    raise `Cancelled` once it is set, and otherwise beat its heartbeat: a check made at a step of work (a token
    sampled, a call finished) is progress; a poll while waiting for user code (a reward function, a tool) is
    not (`progress=False`), so code that hangs there is seen as a stall."""
    if _requested.is_set():
        raise Preempted("SIGTERM received")
    stop = getattr(_thread, "stop", None)
    if stop is not None:
        if stop.is_set():
            raise Cancelled("stopped")
        if progress:
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
