"""SIGTERM as a request, not a kill: clusters send it before preempting a job. While training, the signal
only sets a flag; the loop finishes the current step, saves a checkpoint and exits, and the next run resumes
from it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def preemption_guard() -> Iterator[threading.Event]:
    """An event set when SIGTERM arrives inside the block; the previous handler comes back on exit. Signal
    handlers can only be installed from the main thread: elsewhere the event simply never fires."""
    received = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.set())
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
