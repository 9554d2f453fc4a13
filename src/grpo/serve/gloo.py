"""Weights over a torch.distributed gloo group, the wire of grpo's `gloo` weight-transfer engine
(`grpo.serve.vllm_plugin`): the trainer's main process is rank 0 and sends, a vLLM server's workers are the other
ranks and receive. Plain torch, no vLLM: both sides import it.

    link = connect(address, port, rank, world_size, session, timeout_s)   # every rank; rank 0 hosts the store
    send(link, pairs, metadata)            # rank 0: (name, tensor) pairs in `metadata` order
    receive(link, metadata, load)          # the others: `load` gets (name, tensor) lists as they arrive
    link.shutdown()

What travels is fixed by `metadata` alone (names, dtypes, shapes), so both sides cut the stream the same way.

On one host (every rank sees the segment rank 0 made, `_agree_on_ring`), the bytes go through shared memory, as
NCCL's intra-node transport does: a ring of `SLOTS` slots of `SLOT_BYTES` (`grpo.serve.segment`) that every rank
maps once, when it connects. The sender casts each tensor straight into its place in a slot (`stream_plan`: the
tensors one after the other, cut at the slots' ends), the group carries only a tiny broadcast per slot ("slot
filled") and an all-reduce ("slot read by every receiver"), so casting, reading and loading overlap over the ring. A
receiver copies each tensor out of the ring before the slot is handed back (`load` may keep what it gets: vLLM's
layerwise reload keeps a layer's tensors until the layer is whole). The segment's name is gone from the file system
as soon as every rank has it mapped (or has failed to): nothing is left behind by a push, a crash or a timeout.

Across hosts (or containers with their own /dev/shm, or another user, or `GRPO_WEIGHTS_TRANSPORT=tcp` on either
side), the bytes go over the group's TCP connections (`plan`, in `grpo.serve.messages`): a tensor of `DIRECT_BYTES`
or more goes as broadcasts of its own bytes (no copy on either side when it is already contiguous in its wire dtype;
over `MAX_MESSAGE_BYTES` in several pieces), smaller ones are packed into buffers of up to `PACK_BYTES` (the sender
casts each straight into its place; the receiver hands views of the buffer on, no copy). Few, large messages: each
broadcast costs a round of gloo's protocol, and loopback TCP reached 2.2 GB/s with 32 MiB messages against 3-3.7
GB/s with 128 MiB on a 2-core machine. Up to `IN_FLIGHT_BYTES` are in flight at once, over two connections (gloo
devices), so casting, the wire and loading overlap.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from grpo.serve import segment
from grpo.serve.messages import Message, Meta, nbytes, plan, stream_plan

# the sender's casting threads: gloo's connections need cores of their own (on 2 cores, casting on one thread made
# the wire 2.85 GB/s against 2.2 on both: bench/push.py)
_CAST_THREADS = max(1, (os.cpu_count() or 1) // 4)
IN_FLIGHT_BYTES = 512 << 20  # broadcasts posted before the oldest is waited for
_CONNECTIONS = 2  # gloo devices: TCP connections (and threads) the broadcasts share

# Shared memory, on one host
TRANSPORT_ENV = "GRPO_WEIGHTS_TRANSPORT"  # "tcp": never shared memory (either side); "auto" (the default): on one host
TRANSPORTS = ("auto", "tcp")
_OFFER_BYTES = 512  # rank 0's offer of a segment (JSON, zero-padded)
_PROTOCOL = "v3"  # in the store's prefix: a peer speaking another version never joins the group (a timeout)


@dataclasses.dataclass
class Link:
    """A connected group of rank 0 (the sender) and the receivers: the gloo group, its store (hosted by rank 0's),
    and `ring` when every rank is on this host (the bytes then go through it; None: over TCP)."""

    group: Any
    store: Any = None
    ring: segment.Ring | None = None

    @property
    def transport(self) -> str:
        return "shared memory" if self.ring is not None else "TCP"

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        if self.ring is not None:
            self.ring.close()
        self.group = self.store = self.ring = None


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


def transport_setting(transport: str | None = None) -> str:
    """`transport`, or `GRPO_WEIGHTS_TRANSPORT` (default "auto"), checked."""
    value = (transport if transport is not None else os.environ.get(TRANSPORT_ENV) or "auto").strip().lower()
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={value!r}: one of {', '.join(TRANSPORTS)}")
    return value


def connect(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    session: str,
    timeout_s: float,
    peer: str | None = None,
    transport: str | None = None,
    cancelled: threading.Event | None = None,
) -> Link:
    """The group of rank 0 (which hosts its TCP store at `address:port`) and the receivers, each op of which fails
    after `timeout_s`. Blocks until all `world_size` ranks have joined and agreed on the transport (or raises after
    `timeout_s`). `peer`: an address of the other side, to bind this rank's gloo device to the interface that
    reaches it (default: `address`). `transport`: "auto" (shared memory when every rank can map rank 0's segment)
    or "tcp" (default: `GRPO_WEIGHTS_TRANSPORT`, else "auto"); any rank's "tcp" makes the link TCP. `cancelled`:
    set by a caller that no longer waits (rank 0: its server answered with an error), the connection ends at once
    with an error instead of waiting out `timeout_s` (`_join`)."""
    transport = transport_setting(transport)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack the options class
    options._timeout = timeout
    address_here = local_address(peer or address)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address_here) for _ in range(_CONNECTIONS)]
    options._threads = _CONNECTIONS
    prefix = dist.PrefixStore(f"grpo-weights/{_PROTOCOL}/{session}", store)
    _join(prefix, rank, world_size, timeout_s, cancelled)
    group = dist.ProcessGroupGloo(prefix, rank, world_size, options)
    try:
        ring = _agree_on_ring(group, rank, transport)
    except BaseException:
        group.shutdown()
        raise
    return Link(group, store, ring)


class JoinError(RuntimeError):
    """The receivers did not all join rank 0's group in time, or the caller gave the connection up."""


def _join(store: Any, rank: int, world_size: int, timeout_s: float, cancelled: threading.Event | None) -> None:
    """Every rank says it has come; rank 0 waits until all have, in short polls of the store, before gloo's
    rendezvous (which waits inside torch, out of reach). So a connection its caller gave up on ends within a poll: a
    thread left waiting in torch's store would wake at its timeout, maybe while the interpreter shuts down, and abort
    the process (a trainer whose server refused the connection, then exited)."""
    store.set(f"joined/{rank}", "1")
    if rank != 0:
        return
    keys = [f"joined/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if cancelled is not None and cancelled.is_set():
            raise JoinError("the connection was given up before the receivers joined")
        if time.monotonic() > deadline:
            came = sum(store.check([key]) for key in keys)
            raise JoinError(f"timed out after {timeout_s:g} s: {came} of the {len(keys)} receivers joined")
        time.sleep(0.02)


def _agree_on_ring(group: Any, rank: int, transport: str) -> segment.Ring | None:
    """Every rank of `group`: the ring when all of them have mapped rank 0's new segment, else None (TCP), agreed
    by all (a broadcast of rank 0's offer, an all-reduce of each rank's answer). The segment's name is removed by
    every rank that knows it as soon as the answers are in, or when this fails (a peer lost, a timeout)."""
    offer = torch.zeros(_OFFER_BYTES, dtype=torch.uint8)
    path, memory = None, None
    try:
        if rank == 0:
            created = segment.create(segment.SLOTS, segment.SLOT_BYTES) if transport == "auto" else None
            if created is not None:
                path, memory, slot_bytes = created
                nonce = secrets.token_bytes(16)
                memory[: len(nonce)] = nonce
                text = json.dumps(
                    dict(
                        name=os.path.basename(path),
                        nonce=nonce.hex(),
                        boot=segment.boot_id(),
                        slots=segment.SLOTS,
                        slot_bytes=slot_bytes,
                    )
                ).encode()
                offer[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        _broadcast(group, offer).wait()
        text = bytes(offer.numpy()).rstrip(b"\0")
        try:
            terms = json.loads(text) if text else None
        except ValueError:
            terms = None
        if rank != 0 and isinstance(terms, dict):
            path = segment.path_of(terms.get("name"))
            memory = segment.open_offered(terms) if transport == "auto" else None
        agreed = torch.tensor([1 if memory is not None else 0], dtype=torch.int32)
        _all_reduce(group, agreed, dist.ReduceOp.MIN).wait()
    finally:
        if path is not None:
            segment.unlink(path)
    if not agreed.item():
        if memory is not None:
            memory.close()
        return None
    assert memory is not None and terms is not None
    return segment.Ring(memory, terms["slots"], terms["slot_bytes"])


# ---- sending ---------------------------------------------------------------------------------------------------------


def send(link: Link, pairs: Iterable[tuple[str, torch.Tensor]], metadata: Sequence[Meta]) -> int:
    """Rank 0: send `pairs`, which must be `metadata`'s tensors in its order (each cast to its wire dtype, and
    brought to this machine's memory, on the way); returns the bytes sent. Casting runs on `_CAST_THREADS` threads
    (the calling thread's own setting, restored after: other threads keep theirs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, _CAST_THREADS))
    try:
        if link.ring is not None:
            return _send_ring(link.group, link.ring, pairs, metadata)
        return _send(link.group, pairs, metadata)
    finally:
        torch.set_num_threads(threads)


class _Fetched:
    """`metadata`'s tensors by index, taken from `pairs` (checked) as they are first asked for."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]], metadata: Sequence[Meta]) -> None:
        self.tensors = enumerate(_checked(pairs, metadata))
        self.count = len(metadata)
        self.fetched: dict[int, torch.Tensor] = {}  # tensors taken before the message that sends them

    def __call__(self, index: int) -> torch.Tensor:
        while index not in self.fetched:
            pair = next(self.tensors, None)
            if pair is None:
                raise ValueError(f"fewer tensors than the {self.count} the receivers were told of")
            self.fetched[pair[0]] = pair[1]
        return self.fetched.pop(index)

    def check_exhausted(self) -> None:
        if next(self.tensors, None) is not None:
            raise ValueError(f"more tensors than the {self.count} the receivers were told of")


def _send(group: Any, pairs: Iterable[tuple[str, torch.Tensor]], metadata: Sequence[Meta]) -> int:
    tensor = _Fetched(pairs, metadata)
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
    tensor.check_exhausted()
    return sent


def _send_ring(
    group: Any, ring: segment.Ring, pairs: Iterable[tuple[str, torch.Tensor]], metadata: Sequence[Meta]
) -> int:
    """Each chunk cast into its slot once every receiver has read the slot's previous chunk; then "chunk i is in"
    (a broadcast of i) and "chunk i was read" (an all-reduce, waited for before the slot is filled again)."""
    tensor = _Fetched(pairs, metadata)
    window: deque[tuple[dist.Work, dist.Work, torch.Tensor, torch.Tensor]] = deque()
    sent = 0
    current: tuple[int, torch.Tensor] | None = None  # (metadata index, flat elements) of the tensor being sent
    for i, chunk in enumerate(stream_plan(metadata, ring.slot_bytes)):
        if len(window) == ring.slots:
            _wait_slot(*window.popleft())
        slot = ring.slot(i)
        for index, start, offset, length in chunk.parts:
            if current is None or current[0] != index:
                current = (index, _flat(tensor(index)))
            dtype = metadata[index][1]
            size = dtype.itemsize
            slot[offset : offset + length].view(dtype).copy_(current[1][start // size : (start + length) // size])
        signal, flag = torch.tensor([i], dtype=torch.int64), torch.ones(1, dtype=torch.int32)
        window.append((_broadcast(group, signal), _all_reduce(group, flag), signal, flag))
        sent += chunk.size
    while window:
        _wait_slot(*window.popleft())
    tensor.check_exhausted()
    return sent


def _wait_slot(filled: dist.Work, read: dist.Work, *_tensors: torch.Tensor) -> None:
    filled.wait()
    read.wait()


# ---- receiving -------------------------------------------------------------------------------------------------------


def receive(
    link: Link,
    metadata: Sequence[Meta],
    load: Callable[[list[tuple[str, torch.Tensor]]], object],
    keep: bool = True,
) -> int:
    """A receiver: the tensors of `metadata` as rank 0 sends them, handed to `load` (lists of (name, tensor), whole
    tensors only, in the order they complete), which may keep them; returns the bytes received. Over TCP, packed
    tensors are views of their message's buffer. Through the ring they are copies, unless `keep` is False: then
    tensors that lie whole in a slot are views of it, valid only until `load` returns (the slot is reused)."""
    if link.ring is not None:
        return _receive_ring(link.group, link.ring, metadata, load, keep)
    return _receive(link.group, metadata, load)


def _receive(group: Any, metadata: Sequence[Meta], load: Callable[[list[tuple[str, torch.Tensor]]], object]) -> int:
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


def _receive_ring(
    group: Any,
    ring: segment.Ring,
    metadata: Sequence[Meta],
    load: Callable[[list[tuple[str, torch.Tensor]]], object],
    keep: bool,
) -> int:
    tensors: dict[int, torch.Tensor] = {}  # tensors over several slots, being assembled
    remaining = {i: nbytes(meta) for i, meta in enumerate(metadata)}
    read: deque[tuple[dist.Work, torch.Tensor]] = deque()
    received = 0
    for i, chunk in enumerate(stream_plan(metadata, ring.slot_bytes)):
        signal = torch.tensor([-1], dtype=torch.int64)
        _broadcast(group, signal).wait()
        if signal.item() != i:
            raise RuntimeError(f"the sender announced chunk {signal.item()} where this receiver expected {i}")
        slot = ring.slot(i)
        done = []
        for index, start, offset, length in chunk.parts:
            name, dtype, shape = metadata[index]
            piece = slot[offset : offset + length]
            if length == remaining[index] and start == 0:  # whole in this slot
                whole = piece.view(dtype).view(shape)
                done.append((name, whole.clone() if keep else whole))
                continue
            if index not in tensors:
                tensors[index] = torch.empty(shape, dtype=dtype)
            _flat_bytes(tensors[index])[start : start + length].copy_(piece)
            remaining[index] -= length
            if remaining[index] == 0:
                done.append((name, tensors.pop(index)))
        if keep:  # everything is copied out: the slot goes back before the load
            read.append(_read(group))
        if done:
            load(done)
        if not keep:
            read.append(_read(group))
        while len(read) > ring.slots:
            read.popleft()[0].wait()
        received += chunk.size
    while read:
        read.popleft()[0].wait()
    return received


def _read(group: Any) -> tuple[dist.Work, torch.Tensor]:
    """This receiver's "the slot is read" (its share of the sender's all-reduce)."""
    flag = torch.ones(1, dtype=torch.int32)
    return _all_reduce(group, flag), flag


# ---- helpers ---------------------------------------------------------------------------------------------------------


def _broadcast(group: Any, payload: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([payload], options)


def _all_reduce(group: Any, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> dist.Work:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return group.allreduce([tensor], options)


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


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements, flat, in its own dtype and device (a copy only when it is not contiguous)."""
    tensor = tensor.detach()
    return (tensor if tensor.is_contiguous() else tensor.contiguous()).reshape(-1)


def _pack(target: torch.Tensor, tensor: torch.Tensor, meta: Meta) -> None:
    """Copy (casting) `tensor` into `target`, a byte range of a packed buffer, aligned for its wire dtype."""
    dtype = meta[1]
    target.view(dtype).view(tensor.shape).copy_(tensor.detach())


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)
