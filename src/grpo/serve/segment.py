"""The shared-memory segment of the `gloo` engine's ring (`grpo.serve.gloo`, on one host): rank 0 makes it in
`SHM_DIR` under a random name that only its user may open, with its pages reserved (a full /dev/shm is a refusal at
once, never a SIGBUS later) and a nonce at its start; a receiver maps it only when it is on the same kernel (its boot
id) and sees the very file (the nonce); the name is removed as soon as every rank has answered. Anything else
(another host, another container's /dev/shm, another user, an offer it cannot read) is None here, and the link
goes over TCP."""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
from typing import Any

import numpy as np
import torch

SHM_DIR = "/dev/shm"
SLOT_BYTES = 32 << 20  # a slot of the ring (halved, down to `MIN_SLOT_BYTES`, where /dev/shm is smaller)
SLOTS = 4
MIN_SLOT_BYTES = 1 << 20
ALIGN = 16  # slots' sizes and tensors' places in them are multiples of this (every dtype's element size divides it)
_NAME = re.compile(r"grpo-weights-[0-9]+-[0-9a-f]{32}")


class Ring:
    """`slots` slots of `slot_bytes` in a shared-memory segment that every rank of a link has mapped."""

    def __init__(self, memory: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.memory, self.slots, self.slot_bytes = memory, slots, slot_bytes
        # through numpy: its array holds the mapping's buffer, and every view of the tensor holds the array, so the
        # mapping cannot go (`close`, or the mmap collected) while a thread still writes or reads a slot
        # (torch.frombuffer holds nothing: a view of it would outlive the mapping)
        self.buffer: torch.Tensor | None = torch.from_numpy(np.frombuffer(memory, dtype=np.uint8))

    def slot(self, chunk: int) -> torch.Tensor:
        """The bytes of the slot that the `chunk`-th chunk of a push goes through."""
        assert self.buffer is not None, "the ring was closed"
        start = (chunk % self.slots) * self.slot_bytes
        return self.buffer[start : start + self.slot_bytes]

    def close(self) -> None:
        self.buffer = None
        try:
            self.memory.close()
        except BufferError:  # a view of it is still alive (a send or receive still running): unmapped after it
            pass


def boot_id() -> str:
    """This kernel's boot id: the same for every process (and container) on one host, different on another."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def create(slots: int, slot_bytes: int) -> tuple[str, mmap.mmap, int] | None:
    """Rank 0: a new segment in `SHM_DIR` (a random name, only this user may open it), its pages reserved (so a
    full /dev/shm is a refusal here, never a SIGBUS later; a smaller ring is tried down to `MIN_SLOT_BYTES`
    slots), mapped: (its path, the mapping, the slots' size). None where this machine has no room, no /dev/shm
    or no way to reserve pages: the link is then TCP."""
    fallocate = getattr(os, "posix_fallocate", None)
    while fallocate is not None and slot_bytes >= MIN_SLOT_BYTES:
        path = os.path.join(SHM_DIR, f"grpo-weights-{os.getpid()}-{secrets.token_hex(16)}")  # `_NAME`
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            fallocate(fd, 0, slots * slot_bytes)
            return path, mmap.mmap(fd, slots * slot_bytes), slot_bytes
        except OSError as err:
            unlink(path)
            if err.errno != errno.ENOSPC:
                return None
            slot_bytes = slot_bytes // 2 // ALIGN * ALIGN  # no room: a ring half the size
        except BaseException:
            unlink(path)
            raise
        finally:
            os.close(fd)
    return None


def open_offered(offer: dict) -> mmap.mmap | None:
    """A receiver: rank 0's segment mapped, when this process is on rank 0's host (the same kernel) and sees the
    very file rank 0 made (its nonce), else None (another host, another container's /dev/shm, another user, an
    offer it cannot read)."""
    try:
        path, slots, slot_bytes = path_of(offer["name"]), int(offer["slots"]), int(offer["slot_bytes"])
        nonce = bytes.fromhex(offer["nonce"])
        if path is None or offer.get("boot") != boot_id() or slots < 1 or slot_bytes < 1 or slot_bytes % ALIGN:
            return None
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, KeyError, TypeError, ValueError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != slots * slot_bytes:
            return None
        memory = mmap.mmap(fd, slots * slot_bytes)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if len(nonce) != 16 or memory[: len(nonce)] != nonce:
        memory.close()
        return None
    return memory


def path_of(name: Any) -> str | None:
    """The path of a segment named `name` in `SHM_DIR`, if `name` is one that grpo makes (else None)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return None
    return os.path.join(SHM_DIR, name)


def unlink(path: str) -> None:
    """Remove a segment's name: every rank that knows it tries, so that it goes even when rank 0 is lost; a rank
    that may not (another user's, in the sticky /dev/shm, before rank 0 has removed it) leaves it to rank 0."""
    try:
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        pass
