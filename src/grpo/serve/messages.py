"""What a push of weights is cut into, the same on both sides of `grpo.serve.gloo`'s wire, from the metadata alone
(names, dtypes, shapes): the broadcasts over TCP (`plan`: large tensors on their own, in pieces of at most
`MAX_MESSAGE_BYTES`; smaller ones packed into buffers of up to `PACK_BYTES`) and the chunks through the shared-memory
ring (`stream_plan`: the tensors one after the other, cut at the slots' ends)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from grpo.serve.segment import ALIGN

DIRECT_BYTES = 16 << 20  # tensors at least this large are broadcast on their own (no packing copy)
PACK_BYTES = 128 << 20  # the buffers the smaller ones are packed into
MAX_MESSAGE_BYTES = 256 << 20  # a larger tensor goes in pieces of at most this

Meta = tuple[str, torch.dtype, tuple[int, ...]]  # (name, wire dtype, shape)


@dataclasses.dataclass(frozen=True)
class Message:
    """One broadcast (or one slot of the ring): `size` bytes carrying byte ranges of tensors, `(index in metadata,
    first byte of the tensor, first byte in the message, length)`; `direct`: the bytes of one tensor, sent from (and
    received into) the tensor itself."""

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
    """The broadcasts that carry `metadata`'s tensors over TCP, in order (the same on both sides)."""
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
        offset = -(-used // ALIGN) * ALIGN
        if packed and offset + size > PACK_BYTES:
            messages.append(Message(used, tuple(packed), False))
            packed, offset = [], 0
        packed.append((index, 0, offset, size))
        used = offset + size
    if packed:
        messages.append(Message(used, tuple(packed), False))
    return messages


def stream_plan(metadata: Sequence[Meta], slot_bytes: int) -> list[Message]:
    """The chunks that carry `metadata`'s tensors through a ring of `slot_bytes` slots, in order (the same on both
    sides): the tensors one after the other, each from a multiple of `ALIGN`, cut at the slots' ends (always at an
    element's boundary: `slot_bytes` is a multiple of `ALIGN`)."""
    if slot_bytes <= 0 or slot_bytes % ALIGN:
        raise ValueError(f"a slot of {slot_bytes} bytes: not a positive multiple of {ALIGN}")
    chunks: list[list[tuple[int, int, int, int]]] = []
    position = 0  # in the stream
    for index, meta in enumerate(metadata):
        size = nbytes(meta)
        position = -(-position // ALIGN) * ALIGN
        start = 0
        while True:
            chunk, offset = divmod(position, slot_bytes)
            length = min(size - start, slot_bytes - offset)
            while len(chunks) <= chunk:
                chunks.append([])
            chunks[chunk].append((index, start, offset, length))
            start += length
            position += length
            if start >= size:
                break
    return [Message(max(o + n for _, _, o, n in parts), tuple(parts), False) for parts in chunks]
