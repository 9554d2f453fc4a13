"""Weights over a torch.distributed gloo group, the wire of grpo's `gloo` weight-transfer engine
(`grpo.serve.vllm_plugin`): the trainer's main process is rank 0 and sends, a vLLM server's workers are the other
ranks and receive. Plain torch, no vLLM: both sides import it.

    group = connect(address, port, rank, world_size, session, timeout_s)   # every rank; rank 0 hosts the store
    send(group, pairs, metadata)            # rank 0: (name, tensor) pairs in `metadata` order
    receive(group, metadata, load)          # the others: `load` gets (name, tensor) lists as they arrive

What travels is fixed by `metadata` alone (names, dtypes, shapes), so both sides cut the stream the same way
(`plan`): a tensor of `DIRECT_BYTES` or more goes as broadcasts of its own bytes (no copy on either side when it is
already contiguous in its wire dtype; over `MAX_MESSAGE_BYTES` in several pieces), smaller ones are packed into
buffers of up to `PACK_BYTES` (the sender casts each straight into its place; the receiver hands views of the
buffer on, no copy). Few, large messages: each broadcast costs a round of gloo's protocol, and loopback TCP reached
2.2 GB/s with 32 MiB messages against 3-3.7 GB/s with 128 MiB on a 2-core machine. Up to `IN_FLIGHT_BYTES` are in
flight at once, over two connections (gloo devices), so casting, the wire and loading overlap.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

DIRECT_BYTES = 16 << 20  # tensors at least this large are broadcast on their own (no packing copy)
PACK_BYTES = 128 << 20  # the buffers the smaller ones are packed into
MAX_MESSAGE_BYTES = 256 << 20  # a larger tensor goes in pieces of at most this
# the sender's casting threads: gloo's connections need cores of their own (on 2 cores, casting on one thread made
# the wire 2.85 GB/s against 2.2 on both: bench/push.py)
_CAST_THREADS = max(1, (os.cpu_count() or 1) // 4)
IN_FLIGHT_BYTES = 512 << 20  # broadcasts posted before the oldest is waited for
_ALIGN = 16  # packed tensors start at multiples of this (every dtype's element size divides it)
_CONNECTIONS = 2  # gloo devices: TCP connections (and threads) the broadcasts share

Meta = tuple[str, torch.dtype, tuple[int, ...]]  # (name, wire dtype, shape)


@dataclasses.dataclass(frozen=True)
class Message:
    """One broadcast: `size` bytes carrying byte ranges of tensors, `(index in metadata, first byte of the
    tensor, first byte in the message, length)`; `direct`: the bytes of one tensor, sent from (and received into)
    the tensor itself."""

    size: int
    parts: tuple[tuple[int, int, int, int], ...]
    direct: bool


def nbytes(meta: Meta) -> int:
    _, dtype, shape = meta
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.itemsize


def plan(metadata: Sequence[Meta]) -> list[Message]:
    """The broadcasts that carry `metadata`'s tensors, in order (the same on both sides)."""
    messages: list[Message] = []
    packed: list[tuple[int, int, int, int]] = []
    used = 0
    for index, meta in enumerate(metadata):
        size = nbytes(meta)
        if size >= DIRECT_BYTES:
            for start in range(0, size, MAX_MESSAGE_BYTES):
                length = min(MAX_MESSAGE_BYTES, size - start)
                messages.append(Message(length, ((index, start, 0, length),), True))
            continue
        offset = -(-used // _ALIGN) * _ALIGN
        if packed and offset + size > PACK_BYTES:
            messages.append(Message(used, tuple(packed), False))
            packed, offset = [], 0
        packed.append((index, 0, offset, size))
        used = offset + size
    if packed:
        messages.append(Message(used, tuple(packed), False))
    return messages


def local_address(peer: str) -> str:
    """This machine's address on the route to `peer` (a UDP socket's, connected but never sent on): where the
    other side of the group can reach this process."""
    with socket.socket(socket.AF_INET6 if ":" in peer else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def free_port(first: int, tries: int = 64) -> int:
    """The first port from `first` on that this machine can listen on (a group's store binds every interface)."""
    for port in range(first, min(first + tries, 65536)):
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
                return port
            except OSError:
                continue
    raise OSError(f"no free port among {first}..{first + tries - 1}")


def connect(
    address: str, port: int, rank: int, world_size: int, session: str, timeout_s: float, peer: str | None = None
) -> tuple[dist.ProcessGroupGloo, dist.TCPStore]:
    """The group of rank 0 (which hosts its TCP store at `address:port`) and the receivers, each op of which fails
    after `timeout_s`. Blocks until all `world_size` ranks have joined (or raises after `timeout_s`). `peer`: an
    address of the other side, to bind this rank's gloo device to the interface that reaches it (default:
    `address`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack the options class
    options._timeout = timeout
    address_here = local_address(peer or address)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address_here) for _ in range(_CONNECTIONS)]
    options._threads = _CONNECTIONS
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"grpo-weights/{session}", store), rank, world_size, options)
    return group, store


def send(group: dist.ProcessGroupGloo, pairs: Iterable[tuple[str, torch.Tensor]], metadata: Sequence[Meta]) -> int:
    """Rank 0: broadcast `pairs`, which must be `metadata`'s tensors in its order (each cast to its wire dtype, and
    brought to this machine's memory, on the way); returns the bytes sent. Casting runs on `_CAST_THREADS` threads
    (the calling thread's own setting, restored after: other threads keep theirs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, _CAST_THREADS))
    try:
        return _send(group, pairs, metadata)
    finally:
        torch.set_num_threads(threads)


def _send(group: dist.ProcessGroupGloo, pairs: Iterable[tuple[str, torch.Tensor]], metadata: Sequence[Meta]) -> int:
    tensors = enumerate(_checked(pairs, metadata))
    fetched: dict[int, torch.Tensor] = {}  # tensors taken from `pairs` before the message that sends them

    def tensor(index: int) -> torch.Tensor:
        while index not in fetched:
            pair = next(tensors, None)
            if pair is None:
                raise ValueError(f"fewer tensors than the {len(metadata)} the receivers were told of")
            fetched[pair[0]] = pair[1]
        return fetched.pop(index)

    window: deque[tuple[dist.Work, int, object]] = deque()
    in_flight = sent = 0
    current: tuple[int, torch.Tensor] | None = None  # (metadata index, flat bytes) of the tensor being sent
    for message in plan(metadata):
        if message.direct:
            index, start, _, length = message.parts[0]
            if current is None or current[0] != index:
                current = (index, _as_bytes(tensor(index), metadata[index]))
            payload = current[1][start : start + length]
        else:
            payload = torch.empty(message.size, dtype=torch.uint8)
            for index, _, offset, length in message.parts:
                _pack(payload[offset : offset + length], tensor(index), metadata[index])
        window.append((_broadcast(group, payload), message.size, payload))
        in_flight += message.size
        sent += message.size
        while in_flight > IN_FLIGHT_BYTES and len(window) > 1:
            work, size, _ = window.popleft()
            work.wait()
            in_flight -= size
    for work, _, _ in window:
        work.wait()
    if next(tensors, None) is not None:
        raise ValueError(f"more tensors than the {len(metadata)} the receivers were told of")
    return sent


def receive(
    group: dist.ProcessGroupGloo,
    metadata: Sequence[Meta],
    load: Callable[[list[tuple[str, torch.Tensor]]], object],
) -> int:
    """A receiver: the tensors of `metadata` as rank 0 broadcasts them, handed to `load` (lists of (name, tensor),
    whole tensors only, in the order they complete; packed ones are views of their message's buffer, which `load`
    may keep); returns the bytes received."""
    tensors: dict[int, torch.Tensor] = {}  # direct tensors being received
    remaining = {i: nbytes(meta) for i, meta in enumerate(metadata)}
    window: deque[tuple[dist.Work, Message, torch.Tensor]] = deque()
    in_flight = received = 0

    def finish(work: dist.Work, message: Message, payload: torch.Tensor) -> None:
        work.wait()
        done = []
        for index, _, offset, length in message.parts:
            name, dtype, shape = metadata[index]
            if not message.direct:  # a view of the buffer: no copy
                done.append((name, payload[offset : offset + length].view(dtype).view(shape)))
                continue
            remaining[index] -= length
            if remaining[index] == 0:
                done.append((name, tensors.pop(index)))
        if done:
            load(done)

    for message in plan(metadata):
        if message.direct:
            index, start, _, length = message.parts[0]
            if index not in tensors:
                _, dtype, shape = metadata[index]
                tensors[index] = torch.empty(shape, dtype=dtype)
            payload = _flat_bytes(tensors[index])[start : start + length]
        else:
            payload = torch.empty(message.size, dtype=torch.uint8)
        window.append((_broadcast(group, payload), message, payload))
        in_flight += message.size
        received += message.size
        while in_flight > IN_FLIGHT_BYTES and len(window) > 1:
            work, done_message, done_payload = window.popleft()
            finish(work, done_message, done_payload)
            in_flight -= done_message.size
    while window:
        finish(*window.popleft())
    return received


def _broadcast(group: Any, payload: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([payload], options)


def _checked(pairs: Iterable[tuple[str, torch.Tensor]], metadata: Sequence[Meta]) -> Iterator[torch.Tensor]:
    """The tensors of `pairs`, each checked against the metadata the receivers were told of: a disagreement would
    cut the stream differently on the two sides, so it is an error naming the tensor, before it is sent."""
    for index, (name, tensor) in enumerate(pairs):
        if index >= len(metadata):
            raise ValueError(f"more tensors than the {len(metadata)} the receivers were told of (first extra: {name})")
        expected_name, _, shape = metadata[index]
        if name != expected_name or tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"tensor {index} is {name} {tuple(tensor.shape)}, the receivers were told {expected_name} {shape}"
            )
        yield tensor


def _as_bytes(tensor: torch.Tensor, meta: Meta) -> torch.Tensor:
    """The tensor's flat bytes in its wire dtype, in this machine's memory: itself when it already is so."""
    wire = tensor.detach().to("cpu", meta[1])
    return _flat_bytes(wire if wire.is_contiguous() else wire.contiguous())


def _pack(target: torch.Tensor, tensor: torch.Tensor, meta: Meta) -> None:
    """Copy (casting) `tensor` into `target`, a byte range of a packed buffer, aligned for its wire dtype."""
    dtype = meta[1]
    target.view(dtype).view(tensor.shape).copy_(tensor.detach())


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)
