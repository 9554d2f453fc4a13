"""SIGTERM as a request, not a kill: clusters send it before preempting a job.

While training, the signal only sets a flag. Between steps the loop sees it, saves a checkpoint and exits. Inside
a step, every wait that can last (a reward function, a generation) checks the flag and raises `Preempted`, so a
hung reward function or a long rollout does not delay the exit; the trainer then saves the state at the end of
the previous step when nothing of it has changed yet (no optimizer step applied in this step), and exits.

A preempted run exits with status `EXIT_STATUS` (143, the shell's status for "terminated by SIGTERM"), never 0:
`python train.py && upload` does not upload a run that did not finish.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_STATUS = 143
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
