"""Low precision as the fused kernels run the layers: bfloat16 storage, float32 arithmetic and state.

Chapter {ref}`chap-shipped-layers`. A trained model stores its weights and activations
in bfloat16 (8 significant bits: a rounding error of up to ``2^-8`` of the value); the fused kernels of
the delta-rule family and of Mamba-2 read them, compute in float32, carry the recurrent
state from chunk to chunk in float32, and compute the gates' log-decays in float32 (``transformers``'
``-A_log.float().exp() * softplus(a.float() + dt_bias)``). numpy has no bfloat16; the
``ml_dtypes`` package gives one, and this module uses it only to round: every array
here is float32 or float64, holding values that bfloat16 can represent where the text
says so.

- :func:`round_to` rounds an array to a storage type (round to nearest even) and hands
  it back as float32;
- :func:`round_params` does so for a layer's parameters;
- :func:`gated_delta_rule_mixed` runs the gated delta rule (``eq-sl-gdn``'s core) with
  bfloat16 inputs, float32 arithmetic, and the state stored between steps (recurrent
  form) or between chunks (chunkwise form) in a type of the caller's choice: float32,
  as the kernels carry it, or bfloat16, to show what accumulating in it does; and, in
  the chunkwise form, the per-chunk states the output reads stored in another type
  (``read_dtype``). flash-linear-attention's chunkwise forward carries the state from
  chunk to chunk in float32 but stores the per-chunk states its output pass reads in
  the input dtype (bfloat16), and only the final state in float32: that scheme is
  ``state_dtype=float32, read_dtype=BFLOAT16``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import delta_rule as dr
from ._validate import as_float_array, check_positive_int

__all__ = ["BFLOAT16", "round_to", "round_params", "gated_delta_rule_mixed"]

#: numpy's bfloat16, from ``ml_dtypes``.
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

_STORAGE = (np.dtype(np.float64), np.dtype(np.float32), BFLOAT16)


def _storage(dtype, name):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in _STORAGE:
        raise ValueError(f"{name}: expected float64, float32 or bfloat16 (fixedstate.precision.BFLOAT16), "
                         f"got {dtype!r}")
    return dt


def round_to(x, dtype=BFLOAT16) -> np.ndarray:
    """``x`` rounded to ``dtype`` (bfloat16, float32 or float64; nearest, ties to even), returned as float32.

    (float64 when ``dtype`` is float64.) Any shape; the same shape out.
    """
    dt = _storage(dtype, "dtype")
    x = as_float_array(x, "x")
    out = np.float64 if dt == np.float64 else np.float32
    return x.astype(dt).astype(out)


def round_params(params, dtype=BFLOAT16) -> dict:
    """A layer's parameters (``fixedstate.layers.init_*``) with every array rounded to ``dtype``, held in float32.

    ``A_log`` and ``dt_bias`` stay float32 unrounded: the released checkpoints and the
    libraries keep the gate parameters in float32 (Qwen3.5 ships ``A_log`` in float32).
    """
    if not isinstance(params, dict) or "config" not in params:
        raise ValueError(f"params: expected a layer's params dict (from fixedstate.layers.init_*), got "
                         f"{type(params).__name__}")
    dt = _storage(dtype, "dtype")
    out = {"config": params["config"]}
    for name, a in params.items():
        if name != "config":
            out[name] = (as_float_array(a, f"params[{name!r}]").astype(np.float32) if name in ("A_log", "dt_bias")
                         else round_to(a, dt))
    return out


def gated_delta_rule_mixed(q, k, v, *, beta, log_gate, scale=1.0, form="chunkwise", chunk_size=64,
                           io_dtype=BFLOAT16, state_dtype=np.float32, read_dtype=None):
    """The gated delta rule as a fused kernel runs it (``eq-sl-gdn``'s state line): storage in ``io_dtype``, float32 arithmetic.

    ``q``, ``k`` ``(..., T, d_k)``, ``v`` ``(..., T, d_v)``, ``beta``, ``log_gate``
    ``(..., T)``. ``q``, ``k``, ``v`` and ``beta`` are rounded to ``io_dtype``; ``log_gate``
    is taken in float32 (the libraries compute it in float32). The arithmetic is
    float32. The state is rounded to ``state_dtype`` after every token
    (``form="recurrent"``, the one-token step) or after every chunk of ``chunk_size``
    tokens (``form="chunkwise"``, each chunk the chunkwise form from the stored state).
    ``read_dtype`` (chunkwise form only; ``None``: no rounding beyond ``state_dtype``)
    rounds the state each chunk's *output* reads, while the state carried to the next
    chunk is the unrounded one: the carry in float32 and the stored per-chunk states in
    bfloat16, as flash-linear-attention's chunkwise forward keeps them.

    Returns ``(outputs, final_state)`` in float32, the outputs before any rounding of
    their own, so that what is measured is the arithmetic and the state's storage.
    """
    io = _storage(io_dtype, "io_dtype")
    st = _storage(state_dtype, "state_dtype")
    if form not in ("recurrent", "chunkwise"):
        raise ValueError(f"form: expected 'recurrent' or 'chunkwise', got {form!r}")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    rd = None if read_dtype is None else _storage(read_dtype, "read_dtype")
    if rd is not None and form != "chunkwise":
        raise ValueError(f"read_dtype: expected None with form={form!r} (it rounds the per-chunk states the "
                         f"chunkwise form's output reads), got {read_dtype!r}")
    q, k, v, beta = (round_to(a, io).astype(np.float32) for a in (q, k, v, beta))
    log_gate = as_float_array(log_gate, "log_gate").astype(np.float32)
    T = q.shape[-2] if q.ndim >= 2 else 0
    if T < 1 or k.shape[-2] != T or v.shape[-2] != T or beta.shape[-1] != T or log_gate.shape[-1] != T:
        raise ValueError(f"q, k, v, beta, log_gate: expected one number of tokens T >= 1 (axis -2 of q, k, v, "
                         f"-1 of beta, log_gate), got shapes {q.shape}, {k.shape}, {v.shape}, {beta.shape}, "
                         f"{log_gate.shape}")
    state, outputs = None, []
    if form == "recurrent":
        for t in range(T):
            o, state = dr.gated_delta_rule_step(q[..., t, :], k[..., t, :], v[..., t, :], beta=beta[..., t],
                                                log_gate=log_gate[..., t], scale=scale, initial_state=state)
            state = state.astype(st).astype(np.float32)
            outputs.append(o[..., None, :])
    else:
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            piece = dict(beta=beta[..., s:e], log_gate=log_gate[..., s:e], scale=scale, chunk_size=e - s)
            qkv = (q[..., s:e, :], k[..., s:e, :], v[..., s:e, :])
            o, new_state = dr.gated_delta_rule_chunkwise(*qkv, initial_state=state, **piece)
            if rd is not None and state is not None:          # the output reads the stored, rounded state
                o, _ = dr.gated_delta_rule_chunkwise(*qkv, initial_state=state.astype(rd).astype(np.float32),
                                                     **piece)
            state = new_state.astype(st).astype(np.float32)
            outputs.append(o)
    return np.concatenate(outputs, axis=-2), state
