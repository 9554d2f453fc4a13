"""Image files for the pixel-budget tests (unit/test_image_budget.py, integration/test_image_budget_at_build.py;
their `bombs` and `never_decoded` fixtures are tests/conftest.py's): PNGs of any size written row by row, never held
decoded, and the one-turn chat their rows ask."""

from __future__ import annotations

import struct
import zlib

CHAT = [{"role": "user", "content": "Look."}]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(width: int, height: int) -> bytes:
    """A valid one-colour greyscale PNG of width x height pixels, written row by row (never held decoded): 20000 x
    20000 is 0.4 MB."""
    compress, row = zlib.compressobj(9), b"\0" * (width + 1)
    pixels = b"".join([*(compress.compress(row) for _ in range(height)), compress.flush()])
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", pixels) + _chunk(b"IEND", b"")
