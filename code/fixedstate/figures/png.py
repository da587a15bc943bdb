"""The picture of a live update as PNG bytes, written here rather than by Pillow.

A live slider sends the kernel's picture to the browser as a PNG after every
update, so the encoder's time is part of what the reader waits for.
:func:`encode_png` writes the PNG itself for the fast path (RGB rows without
filters, deflated at level 1), where Pillow tries a filter per row;
:func:`encode_png_pillow` is the same picture through Pillow alone, kept for the
comparison that ``make bench-figures`` makes with ``--plain``
(:func:`fixedstate.figures.engine.speed_ups`).

Why it is kept (issue #29 asked to keep it only if the sliders need it):
``make bench-figures`` on 2 December 2026, on the shared two-core machine the
book is built on, under a load average of 9 to 27 (other jobs running), the
minimum over two sweeps of each figure. Wall-clock 95th percentiles there are
ruled by the waits for a processor (they varied several-fold between sweeps of
the same figure with the same code), so the processor time of an update
(``cpu95``, which waiting does not inflate, near what an update takes on an idle
machine) is what separates the variants. With this encoder against Pillow's (the
glyph cache on in both), cpu95 in ms: draw_kv 4.4 / 6.8, draw_crossover 5.6 /
7.4, draw_four_writes 10.2 / 10.5, draw_selectivity 8.9 / 9.9, draw_lab 19.2 /
21.1, draw_capacity 23.9 / 27.7, draw_memory 6.7 / 7.0; on its own a 576 x 224
picture takes 2.0 ms here against Pillow's 4.0 ms (medians). It saves 0.3 to 4 ms
of an update; no figure's cpu95 passes 50 ms without it. On this machine the
sliders missed 50 ms (wall clock) with and without it, so the measurement does
not decide; it is kept until a sweep on a quiet machine shows a figure missing
50 ms without it, or none.
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
