"""The picture of a live update as PNG bytes, written here rather than by Pillow.

A live slider sends the kernel's picture to the browser as a PNG after every
update, so the encoder's time is part of what the reader waits for.
:func:`encode_png` writes the PNG itself for the fast path (RGB rows without
filters, deflated at level 1), where Pillow tries a filter per row;
:func:`encode_png_pillow` is the same picture through Pillow alone, kept for the
comparison that ``make bench-figures`` makes with ``--plain``
(:func:`fixedstate.figures.engine.speed_ups`).

Why it is kept (issue #29 asked to keep it only if the sliders need it):
MEASUREMENTS_PLACEHOLDER
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np

__all__ = ["encode_png", "encode_png_pillow"]


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(rgba, size, colors: int | None) -> bytes:
    """PNG bytes of an RGBA buffer ``(width, height)``: quantised to ``colors`` colours (small), or fast (``None``).

    The fast form writes the PNG itself, RGB rows without filters, deflated at
    level 1: about twice as fast as Pillow's encoder (which tries a filter per
    row) for a file about as small, which matters for a live slider.
    """
    width, height = size
    rgb = np.frombuffer(rgba, dtype=np.uint8).reshape(height, width, 4)[:, :, :3]
    if not colors:
        rows = np.zeros((height, 3 * width + 1), dtype=np.uint8)  # each row: filter type 0, then RGB
        rows[:, 1:].reshape(height, width, 3)[...] = rgb  # one copy, through a view of the rows
        header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
        return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header)
                + png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + png_chunk(b"IEND", b""))
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(rgb)).quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    img.save(out, format="png", optimize=True)
    return out.getvalue()


def encode_png_pillow(rgba, size, colors: int | None) -> bytes:
    """:func:`encode_png` through Pillow alone (its own filters, compression level 1 on the fast path)."""
    from PIL import Image

    width, height = size
    rgb = np.ascontiguousarray(np.frombuffer(rgba, dtype=np.uint8).reshape(height, width, 4)[:, :, :3])
    img = Image.fromarray(rgb)
    out = io.BytesIO()
    if not colors:
        img.save(out, format="png", compress_level=1)
    else:
        img.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, format="png", optimize=True)
    return out.getvalue()
