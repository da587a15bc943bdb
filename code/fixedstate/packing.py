"""Packed sequences and padding: the variable-length batches of the fused kernels.

Chapter {ref}`chap-shipped-layers`. A training or serving batch rarely holds sequences
of one length. The fused kernels of flash-linear-attention and ``mamba_ssm`` take
several sequences *packed* end to end along the time axis of one row, with the
offsets of their starts, ``cu_seqlens = [0, T_1, T_1 + T_2, ..., T]`` (the cumulative
sequence lengths, as FlashAttention's variable-length interface names them), and
reset the recurrent state and the convolution's window at every start. A batch of
rows of one length instead pads the short ones and masks the padding.

This module gives both to the book's layers, built on public forms only:

- :func:`pack`, :func:`unpack`, :func:`check_cu_seqlens`, :func:`segment_ids`: the
  bookkeeping;
- :func:`short_conv_varlen`: the short convolution over a packed row, each tap that
  would reach into the previous sequence dropped;
- :func:`varlen_mixer`: a fixed-state core of :data:`fixedstate.mixers.MIXERS` (linear
  attention, the delta rule, Gated DeltaNet, KDA) over a packed row, in its recurrent
  form (one step a token, the state zeroed at each start) or its chunkwise form on one
  grid of chunks laid over the whole packed row, so that a boundary can fall inside a
  chunk. The libraries differ here: flash-linear-attention's variable-length path
  starts fresh chunks at every sequence's start (its chunk indices pair a sequence with
  a chunk within it, and each sequence's last chunk is short), so no chunk holds a
  boundary; ``mamba_ssm``'s ``seq_idx`` path keeps one grid over the row and masks, inside
  a chunk, the terms that cross a boundary. This module does neither as a kernel
  would: it cuts a chunk that holds a boundary there and runs each piece as a separate
  call of the core's chunkwise form, the piece before the boundary finishing one
  sequence and the piece after it starting the next from a zero state. That is
  equivalent to the masked chunk, not a masked intra-chunk computation
  (:mod:`fixedstate.kernels` and :mod:`fixedstate.delta_rule` are used through their
  public forms, unchanged).

The padding mask of the short convolution is :func:`fixedstate.blocks.short_conv`'s
``mask``. ``tests/test_packing.py`` checks every packed form against running each
sequence alone, to float64 precision, on drawn lengths, chunk sizes and cores.
"""

from __future__ import annotations

import numpy as np

from . import blocks, mixers
from ._validate import as_float_array, check_positive_int
from .layer_ids import DELTA, GATED_DELTA, KDA, LINEAR, check_layer_id

__all__ = ["VARLEN_MIXERS", "pack", "unpack", "check_cu_seqlens", "segment_ids", "short_conv_varlen",
           "varlen_mixer"]

#: The mixers :func:`varlen_mixer` runs: the fixed-state cores with a chunkwise form.
VARLEN_MIXERS = (LINEAR, DELTA, GATED_DELTA, KDA)

def check_cu_seqlens(cu_seqlens, total: int | None = None) -> np.ndarray:
    """``cu_seqlens`` as an int64 array, checked: 1-D, starting at 0, strictly increasing, ending at ``total``.

    ``cu_seqlens`` ``(N + 1,)`` for ``N`` sequences of at least one token each; ``total``
    the length of the packed time axis (None: not checked).
    """
    arr = np.asarray(cu_seqlens)
    if arr.ndim != 1 or arr.size < 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"cu_seqlens: expected a 1-D array of integers [0, T_1, T_1 + T_2, ..., T] with at least "
                         f"two entries, got {cu_seqlens!r}")
    arr = arr.astype(np.int64)
    if arr[0] != 0 or np.any(np.diff(arr) <= 0):
        raise ValueError(f"cu_seqlens: expected 0 first and strictly increasing offsets (every sequence at least "
                         f"one token), got {arr.tolist()}")
    if total is not None and arr[-1] != total:
        raise ValueError(f"cu_seqlens: expected the last offset to be the packed length {total}, got {arr[-1]}")
    return arr


def pack(sequences, *, axis: int = -2):
    """Pack sequences end to end along their time axis: ``(packed, cu_seqlens)``.

    ``sequences``: a non-empty list of arrays ``(..., T_i, d)`` (``axis=-2``, the default)
    or ``(..., T_i)`` (``axis=-1``, per-token gates), equal in every other axis. Returns
    the concatenation and ``cu_seqlens`` ``(N + 1,)``.
    """
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise ValueError(f"sequences: expected a non-empty list of arrays, got {type(sequences).__name__}")
    if axis not in (-1, -2):
        raise ValueError(f"axis: expected -2 (tokens as rows) or -1 (per-token scalars), got {axis!r}")
    arrays = [as_float_array(s, f"sequences[{i}]") for i, s in enumerate(sequences)]
    rest = [a.shape[:a.ndim + axis] + a.shape[a.ndim + axis + 1:] if a.ndim >= -axis else None for a in arrays]
    if any(r is None for r in rest) or any(r != rest[0] for r in rest) or any(a.shape[axis] < 1 for a in arrays):
        raise ValueError(f"sequences: expected arrays equal in every axis but the time axis {axis}, each with at "
                         f"least one token, got shapes {[a.shape for a in arrays]}")
    lengths = [a.shape[axis] for a in arrays]
    return np.concatenate(arrays, axis=axis), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def unpack(packed, cu_seqlens, *, axis: int = -2) -> list:
    """The sequences of a packed array, a list of views: the inverse of :func:`pack`."""
    packed = as_float_array(packed, "packed")
    if axis not in (-1, -2) or packed.ndim < -axis:
        raise ValueError(f"axis: expected -2 or -1 within packed's {packed.ndim} axes, got {axis!r}")
    cu = check_cu_seqlens(cu_seqlens, packed.shape[axis])
    index = [slice(None)] * packed.ndim
    out = []
    for s, e in zip(cu[:-1], cu[1:]):
        index[axis] = slice(int(s), int(e))
        out.append(packed[tuple(index)])
    return out


def segment_ids(cu_seqlens) -> np.ndarray:
    """The sequence each packed token belongs to: ``(T,)`` int64, 0 for the first sequence's tokens."""
    cu = check_cu_seqlens(cu_seqlens)
    return np.repeat(np.arange(cu.size - 1), np.diff(cu))


def short_conv_varlen(x, weight, *, cu_seqlens, bias=None):
    """:func:`fixedstate.blocks.short_conv` over packed sequences (``eq-sl-conv`` per sequence).

    ``y_t[c] = sum_j weight[c, j] x_{t-K+1+j}[c] [seq(t-K+1+j) = seq(t)] (+ bias[c])``:
    a tap that would reach back into the previous sequence reads zero, as if each
    sequence started from an empty cache. ``x`` ``(..., T, d)``, ``weight`` ``(d, K)``,
    ``cu_seqlens`` ``(N + 1,)`` ending at ``T``, ``bias`` ``(d,)`` or None.

    Returns ``(y, conv_states)``: ``y`` ``(..., T, d)``; ``conv_states`` ``(N, ..., K-1, d)``,
    each sequence's decode cache, its last ``K - 1`` inputs (zeros before its start).
    """
    y0, _ = blocks.short_conv(x, weight, bias=bias)                 # validates x, weight and bias
    x = as_float_array(x, "x")
    w = as_float_array(weight, "weight")
    T, K = x.shape[-2], w.shape[1]
    cu = check_cu_seqlens(cu_seqlens, T)
    seg = segment_ids(cu)
    y = np.zeros_like(y0) if bias is None else np.broadcast_to(np.asarray(bias, dtype=y0.dtype), y0.shape).copy()
    for j in range(K):
        lag = K - 1 - j                                             # tap j reads token t - lag
        if lag >= T:                                                # reaches before the first token: reads zero
            continue
        same = np.zeros(T, dtype=bool)
        same[lag:] = seg[lag:] == seg[:T - lag]
        shifted = np.zeros_like(x)
        shifted[..., lag:, :] = x[..., :T - lag, :]
        y = y + w[:, j] * np.where(same[:, None], shifted, 0.0)
    states = []
    for s, e in zip(cu[:-1], cu[1:]):
        _, state = blocks.short_conv(x[..., s:e, :], w)
        states.append(state)
    return y, np.stack(states)


def _time_slice(gate, q_ndim, start, stop):
    """Tokens start..stop of a per-token gate: time is axis -2 when the gate has a channel axis (KDA), else -1."""
    if gate.ndim == q_ndim:
        return gate[..., start:stop, :]
    return gate[..., start:stop]


def varlen_mixer(layer_id, q, k, v, gates, *, cu_seqlens, scale=1.0, form="chunkwise", chunk_size=64):
    """A fixed-state core over packed sequences, the state reset at each start (``eq-sl-gdn`` per sequence).

    ``layer_id`` one of :data:`VARLEN_MIXERS`; ``q``, ``k`` ``(..., T, d_k)``, ``v``
    ``(..., T, d_v)``, the sequences packed along ``T``; ``gates`` the core's per-token
    gates (``{"beta": (..., T), "log_gate": (..., T)}`` for Gated DeltaNet, ``log_gate``
    ``(..., T, d_k)`` for KDA, ``{}`` for linear attention); ``cu_seqlens`` ``(N + 1,)``.

    ``form="recurrent"`` runs the core's one-token step over the packed row, zeroing
    the state at every start. ``form="chunkwise"`` lays chunks of ``chunk_size`` tokens
    over the whole packed row (``[0, C)``, ``[C, 2C)``, ...), one grid as ``mamba_ssm``'s
    ``seq_idx`` path lays it, cuts a chunk at each boundary inside it, and runs every piece
    as a separate call of the core's chunkwise form, from the state the previous piece
    left, or from zeros where a sequence starts (equivalent to masking inside the chunk).

    Returns ``(outputs, final_states)``: ``outputs`` ``(..., T, d_v)``, ``final_states``
    ``(N, ..., d_k, d_v)``, the state each sequence ends with.
    """
    check_layer_id(layer_id, VARLEN_MIXERS)
    entry = mixers.mixer(layer_id)
    if form not in ("recurrent", "chunkwise"):
        raise ValueError(f"form: expected 'recurrent' or 'chunkwise', got {form!r}")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    q, k, v = (as_float_array(a, name) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    if q.ndim < 2 or q.shape[-2] != k.shape[-2] or q.shape[-2] != v.shape[-2]:
        raise ValueError(f"q, k, v: expected shapes (..., T, d) with one T, got {q.shape}, {k.shape}, {v.shape}")
    if not isinstance(gates, dict) or set(gates) != set(entry.gates):
        raise ValueError(f"gates: expected a dict with keys {sorted(entry.gates)} for the {layer_id!r} core, "
                         f"got {sorted(gates) if isinstance(gates, dict) else type(gates).__name__}")
    gates = {name: as_float_array(g, f"gates[{name!r}]") for name, g in gates.items()}
    T = q.shape[-2]
    cu = check_cu_seqlens(cu_seqlens, T)
    starts, ends = set(cu[:-1].tolist()), set(cu[1:].tolist())
    finals = []
    if form == "recurrent":
        outputs, state = [], None
        for t in range(T):
            if t in starts:
                state = None
            g_t = {name: g[..., t, :] if g.ndim == q.ndim else g[..., t] for name, g in gates.items()}
            o, state = entry.step(q[..., t, :], k[..., t, :], v[..., t, :], g_t, state, scale=scale)
            outputs.append(o)
            if t + 1 in ends:
                finals.append(state)
        return np.stack(outputs, axis=-2), np.stack(finals)
    cuts = sorted(set(range(0, T, chunk_size)) | starts | {T})
    pieces, state = [], None
    for s, e in zip(cuts[:-1], cuts[1:]):                   # each piece lies inside one grid chunk and one sequence
        if s in starts:
            state = None
        g_piece = {name: _time_slice(g, q.ndim, s, e) for name, g in gates.items()}
        o, state = entry.forward(q[..., s:e, :], k[..., s:e, :], v[..., s:e, :], g_piece, scale=scale,
                                 chunk_size=e - s, initial_state=state)
        pieces.append(o)
        if e in ends:
            finals.append(state)
    return np.concatenate(pieces, axis=-2), np.stack(finals)
