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
- :func:`gated_delta_rule_mixed`, :func:`kda_mixed`, :func:`ssd_mixed` and
  :func:`selective_scan_mixed` run the cores of the four shipped layers (Gated DeltaNet's
  gated delta rule, KDA's per-channel-gated delta rule, Mamba-2's SSD, Mamba's selective
  scan) with their token inputs rounded to ``io_dtype``, float32 arithmetic, and the
  state stored between tokens (``form="recurrent"``) or between chunks
  (``form="chunkwise"``) in a type of the caller's choice: float32, as the kernels carry
  it, or bfloat16, to show what accumulating in it does; and, in the chunkwise form, the
  per-chunk states the output reads stored in another type (``read_dtype``).
  flash-linear-attention's chunkwise forward carries the state from chunk to chunk in
  float32 but stores the per-chunk states its output pass reads in the input dtype
  (bfloat16), and only the final state in float32: that scheme is
  ``state_dtype=float32, read_dtype=BFLOAT16``.

All four share one driver: it cuts the sequence into pieces (one token, or one chunk),
runs the core's own public form on each piece from the stored state, and stores the
state it hands on. With every type float64 (``compute_dtype`` too) the driver is the
float64 core, which is what the tests check first.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import delta_rule as dr
from . import ssm
from ._validate import as_float_array, check_positive_int

__all__ = ["BFLOAT16", "round_to", "round_params", "gated_delta_rule_mixed", "kda_mixed", "ssd_mixed",
           "selective_scan_mixed"]

#: numpy's bfloat16, from ``ml_dtypes``.
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

_STORAGE = (np.dtype(np.float64), np.dtype(np.float32), BFLOAT16)
_COMPUTE = (np.dtype(np.float64), np.dtype(np.float32))


def _storage(dtype, name, allowed=_STORAGE):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in allowed:
        names = "float64, float32 or bfloat16 (fixedstate.precision.BFLOAT16)" if allowed is _STORAGE \
            else "float64 or float32"
        raise ValueError(f"{name}: expected {names}, got {dtype!r}")
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


# --------------------------------------------------------------------------- the shared driver

def _options(form, chunk_size, io_dtype, state_dtype, read_dtype, compute_dtype):
    """Check the options every ``*_mixed`` takes; return ``(io, state, read, compute, chunk_size)`` dtypes."""
    io = _storage(io_dtype, "io_dtype")
    st = _storage(state_dtype, "state_dtype")
    cd = _storage(compute_dtype, "compute_dtype", _COMPUTE)
    if form not in ("recurrent", "chunkwise"):
        raise ValueError(f"form: expected 'recurrent' or 'chunkwise', got {form!r}")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    rd = None if read_dtype is None else _storage(read_dtype, "read_dtype")
    if rd is not None and form != "chunkwise":
        raise ValueError(f"read_dtype: expected None with form={form!r} (it rounds the per-chunk states the "
                         f"chunkwise form's output reads), got {read_dtype!r}")
    return io, st, rd, cd, chunk_size


def _stored(a, name, storage, compute):
    """``a`` rounded to the storage type, held in the compute type."""
    return as_float_array(a, name).astype(storage).astype(compute)


def _tokens(*items):
    """The one number of tokens ``T >= 1`` of ``(name, array, time axis)`` items, or ``ValueError`` naming them."""
    lengths = [a.shape[axis] if a.ndim >= -axis else None for _, a, axis in items]
    if lengths[0] is None or lengths[0] < 1 or any(n != lengths[0] for n in lengths):
        names = ", ".join(name for name, _, _ in items)
        axes = ", ".join(f"{name} {axis}" for name, _, axis in items)
        shapes = ", ".join(str(a.shape) for _, a, _ in items)
        raise ValueError(f"{names}: expected one number of tokens T >= 1 (axis {axes}), got shapes {shapes}")
    return lengths[0]


def _piece(a, axis, s, e):
    """Tokens ``s:e`` of ``a`` along its time axis ``axis`` (negative)."""
    return a[(Ellipsis, slice(s, e)) + (slice(None),) * (-axis - 1)]


def _drive(run, T, step, st, rd, cd):
    """Run a core piece by piece (``step`` tokens each): ``run(s, e, state) -> (outputs, state)``.

    The state handed on is stored in ``st`` after every piece; with ``rd``, each piece's
    outputs are recomputed from the incoming state stored in ``rd``, the carry untouched.
    Returns the outputs, concatenated along axis -2, and the final state, in ``cd``.
    """
    state, outputs = None, []
    for s in range(0, T, step):
        e = min(s + step, T)
        o, new_state = run(s, e, state)
        if rd is not None and state is not None:          # the output reads the stored, rounded state
            o, _ = run(s, e, state.astype(rd).astype(cd))
        state = new_state.astype(st).astype(cd)
        outputs.append(o)
    return np.concatenate(outputs, axis=-2), state


def _delta_mixed(recurrent, chunkwise, q, k, v, beta, log_gate, gate_axis, scale, options, form):
    io, st, rd, cd, chunk_size = options
    q, k, v, beta = (_stored(a, name, io, cd) for a, name in ((q, "q"), (k, "k"), (v, "v"), (beta, "beta")))
    log_gate = as_float_array(log_gate, "log_gate").astype(cd)
    T = _tokens(("q", q, -2), ("k", k, -2), ("v", v, -2), ("beta", beta, -1), ("log_gate", log_gate, gate_axis))

    def run(s, e, state):
        qkv = (_piece(q, -2, s, e), _piece(k, -2, s, e), _piece(v, -2, s, e))
        gates = dict(beta=_piece(beta, -1, s, e), log_gate=_piece(log_gate, gate_axis, s, e), scale=scale,
                     initial_state=state)
        if form == "recurrent":
            return recurrent(*qkv, **gates)
        return chunkwise(*qkv, **gates, chunk_size=e - s)

    return _drive(run, T, 1 if form == "recurrent" else chunk_size, st, rd, cd)


def _state_space_mixed(core, x, delta, decay, B, C, D, delta_axis, options, form):
    io, st, rd, cd, chunk_size = options
    x, B, C = (_stored(m, name, io, cd) for m, name in ((x, "x"), (B, "B"), (C, "C")))
    delta = as_float_array(delta, "delta").astype(cd)
    rate = as_float_array(decay[0], decay[1]).astype(cd)
    D = None if D is None else as_float_array(D, "D").astype(cd)
    T = _tokens(("x", x, -2), ("delta", delta, delta_axis), ("B", B, -2), ("C", C, -2))

    def run(s, e, state):
        extra = {"chunk_size": e - s} if core is ssm.ssd_chunkwise else {}
        return core(_piece(x, -2, s, e), _piece(delta, delta_axis, s, e), rate, _piece(B, -2, s, e),
                    _piece(C, -2, s, e), D=D, initial_state=state, **extra)

    return _drive(run, T, 1 if form == "recurrent" else chunk_size, st, rd, cd)


# --------------------------------------------------------------------------- the four cores

def gated_delta_rule_mixed(q, k, v, *, beta, log_gate, scale=1.0, form="chunkwise", chunk_size=64,
                           io_dtype=BFLOAT16, state_dtype=np.float32, read_dtype=None, compute_dtype=np.float32):
    """The gated delta rule as a fused kernel runs it (``eq-sl-gdn``'s state line): storage in ``io_dtype``, float32 arithmetic.

    ``q``, ``k`` ``(..., T, d_k)``, ``v`` ``(..., T, d_v)``, ``beta``, ``log_gate``
    ``(..., T)``. ``q``, ``k``, ``v`` and ``beta`` are rounded to ``io_dtype``; ``log_gate``
    is taken in float32 (the libraries compute it in float32). The arithmetic is
    ``compute_dtype`` (float32; float64 to check the driver). The state is rounded to
    ``state_dtype`` after every token (``form="recurrent"``, the recurrent form on one
    token) or after every chunk of ``chunk_size`` tokens (``form="chunkwise"``, each chunk
    the chunkwise form from the stored state).
    ``read_dtype`` (chunkwise form only; ``None``: no rounding beyond ``state_dtype``)
    rounds the state each chunk's *output* reads, while the state carried to the next
    chunk is the unrounded one: the carry in float32 and the stored per-chunk states in
    bfloat16, as flash-linear-attention's chunkwise forward keeps them.

    Returns ``(outputs, final_state)`` in ``compute_dtype``, the outputs before any
    rounding of their own, so that what is measured is the arithmetic and the state's storage.
    """
    options = _options(form, chunk_size, io_dtype, state_dtype, read_dtype, compute_dtype)
    return _delta_mixed(dr.gated_delta_rule_recurrent, dr.gated_delta_rule_chunkwise, q, k, v, beta, log_gate, -1,
                        scale, options, form)


def kda_mixed(q, k, v, *, beta, log_gate, scale=1.0, form="chunkwise", chunk_size=64,
              io_dtype=BFLOAT16, state_dtype=np.float32, read_dtype=None, compute_dtype=np.float32):
    """Kimi Delta Attention as a fused kernel runs it (``eq-sl-kda``'s core): as :func:`gated_delta_rule_mixed`.

    The one difference is the gate: ``log_gate`` ``(..., T, d_k)``, one log-decay per key
    channel (:func:`fixedstate.delta_rule.kda_recurrent`, :func:`fixedstate.delta_rule.kda_chunkwise`),
    taken in ``compute_dtype`` unrounded. Same options and results.
    """
    options = _options(form, chunk_size, io_dtype, state_dtype, read_dtype, compute_dtype)
    return _delta_mixed(dr.kda_recurrent, dr.kda_chunkwise, q, k, v, beta, log_gate, -2, scale, options, form)


def ssd_mixed(x, delta, a, B, C, *, D=None, form="chunkwise", chunk_size=64, io_dtype=BFLOAT16,
              state_dtype=np.float32, read_dtype=None, compute_dtype=np.float32):
    """Mamba-2's SSD heads as a fused kernel runs them (``eq-ssm-ssd-recurrent``, ``eq-sl-mamba2``'s core).

    Arguments as :func:`fixedstate.ssm.ssd_recurrent`: ``x`` ``(..., T, P)``, ``delta``
    ``(..., T)`` positive, ``a <= 0`` a scalar per head, ``B``, ``C`` ``(..., T, N)``,
    ``D`` (default 0). ``x``, ``B`` and ``C`` are rounded to ``io_dtype``; ``delta``,
    ``a`` and ``D`` are taken in ``compute_dtype`` unrounded (the step and the decay are
    computed in float32; ``D``, a parameter, is the caller's to round). The state ``(..., N, P)``
    is stored in ``state_dtype`` after every token (``form="recurrent"``,
    :func:`fixedstate.ssm.ssd_recurrent` on one token) or after every chunk
    (``form="chunkwise"``, :func:`fixedstate.ssm.ssd_chunkwise` on one chunk from the
    stored state); ``read_dtype`` as in :func:`gated_delta_rule_mixed`. Returns
    ``(y, final_state)`` in ``compute_dtype``.
    """
    options = _options(form, chunk_size, io_dtype, state_dtype, read_dtype, compute_dtype)
    core = ssm.ssd_recurrent if form == "recurrent" else ssm.ssd_chunkwise
    return _state_space_mixed(core, x, delta, (a, "a"), B, C, D, -1, options, form)


def selective_scan_mixed(x, delta, A, B, C, *, D=None, form="chunkwise", chunk_size=64, io_dtype=BFLOAT16,
                         state_dtype=np.float32, read_dtype=None, compute_dtype=np.float32):
    """Mamba's selective scan in mixed precision (``eq-ssm-selective``, ``eq-sl-mamba``'s core).

    Arguments as :func:`fixedstate.ssm.selective_scan_sequential`: ``x`` and ``delta``
    ``(..., T, d)``, ``A`` ``(d, N)``, ``B``, ``C`` ``(..., T, N)``, ``D`` a scalar or
    ``(d,)``. ``x``, ``B`` and ``C`` are rounded to ``io_dtype``; ``delta``, ``A`` and ``D``
    are taken in ``compute_dtype`` unrounded. The state ``(..., d, N)`` is stored in
    ``state_dtype`` after every token (``form="recurrent"``,
    :func:`fixedstate.ssm.selective_scan_sequential` on one token) or after every chunk
    (``form="chunkwise"``: :func:`fixedstate.ssm.selective_scan_parallel`, the parallel
    scan, over each chunk from the stored state). ``mamba_ssm``'s CUDA kernel works this
    way with chunks of up to 2,048 tokens, a scan inside each in float32, and the state
    between chunks in float32. ``read_dtype`` as in :func:`gated_delta_rule_mixed`.
    Returns ``(y, final_state)`` in ``compute_dtype``.
    """
    options = _options(form, chunk_size, io_dtype, state_dtype, read_dtype, compute_dtype)
    core = ssm.selective_scan_sequential if form == "recurrent" else ssm.selective_scan_parallel
    return _state_space_mixed(core, x, delta, (A, "A"), B, C, D, -2, options, form)
