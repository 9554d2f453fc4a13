"""The run's output directory: checked before any work, and held by one run at a time.

`check_output_dir` makes the directory and proves it writable at construction, so a path that is a file or a
read-only place fails before a step is trained. `RunLock` is an exclusive `flock` on `<output_dir>/.grpo.lock`,
taken by the main process for the length of `train()`: a second run in the same directory is refused with the
holder's pid, host and start time. The kernel drops the lock when its process ends, however it ends, so a lock
left by a crashed run is never in the way (the file stays; only the lock on it counts).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from grpo.distributed import collectives

LOCK_NAME = ".grpo.lock"


class OutputDirError(OSError):
    """output_dir cannot be used (not a directory, not writable); the message says why and what to do."""


class RunDirectoryBusy(RuntimeError):
    """Another run holds output_dir; the message names it."""


def check_output_dir(path: str) -> None:
    """Create `path` if needed and prove that files can be written in it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputDirError(
            f"output_dir {path!r} is a file, not a directory: pass a directory for checkpoints, "
            "metrics and the model (it is created if missing)."
        )
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".grpo-write-test-"):
            pass
    except OSError as err:
        raise OutputDirError(
            f"output_dir {path!r} is not writable ({err.strerror or err}): pass a directory this user can write to."
        ) from None


class RunLock:
    """An exclusive lock on an output directory for one run (see the module docstring)."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirectoryBusy(
                f"{os.path.dirname(self.path)} is in use by another grpo run ({holder}): two runs in one output_dir "
                "would overwrite each other's checkpoints and metrics. Wait for it to finish, or pass another "
                "output_dir."
            ) from None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv)[:300],
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(record).encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def is_held(output_dir: str) -> bool:
    """Whether a run holds output_dir's lock now (this process's own run included)."""
    try:
        fd = os.open(os.path.join(output_dir, LOCK_NAME), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: {holder['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its details could not be read"


@contextlib.contextmanager
def holding(output_dir: str, accelerator: Any) -> Iterator[None]:
    """The run lock on output_dir for the block, held by the main process; every process refuses when it is
    taken (so that none goes on to wait in a collective)."""
    lock = RunLock(output_dir) if accelerator.is_main_process else None
    busy = None
    if lock is not None:
        try:
            lock.acquire()
        except RunDirectoryBusy as err:
            busy = err
    if collectives.any_process(accelerator, busy is not None):
        raise busy or RunDirectoryBusy(f"{output_dir} is in use by another grpo run (see the main process's error).")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
