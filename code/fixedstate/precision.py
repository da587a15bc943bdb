"""Low precision as the fused kernels run the layers: bfloat16 storage, float32 arithmetic and state.

Chapter {ref}`chap-shipped-layers`. A trained model stores its weights and activations
in bfloat16 (8 significant bits: a rounding error of up to ``2^-8`` of the value); the fused kernels of
the delta-rule family and of Mamba-2 read them, compute in float32, carry the recurrent
state from chunk to chunk in float32, and compute the gates' log-decays in float32 (the Gated DeltaNet ports of ``transformers``,
Qwen3-Next and Qwen3.5, write ``-A_log.float().exp() * softplus(a.float() + dt_bias)``). numpy has no bfloat16; the
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
  per-chunk states stored in another type (``read_dtype``), as the libraries' chunked
  kernels store them. What ``read_dtype`` rounds follows the library of each core:

  * the delta-rule cores (flash-linear-attention's ``fla/ops/common/chunk_delta_h.py``,
    which its Gated DeltaNet and KDA call): the state is carried in float32 but stored
    per chunk in the input dtype, and that stored state is what both the output pass and
    the carry's own correction read (``v_new = u - w h`` with ``h`` cast to bfloat16); the
    corrected values ``v_new`` are rounded too, once as the output pass reads them and once
    (for the scalar gate after their decay to the chunk's end) as the carry adds them. So
    the rounding reaches the float32 carry;
  * Mamba-2's SSD (``mamba_ssm``'s ``_state_passing_fwd``): the carry stays float32 and
    only the per-chunk states the output reads are rounded; the same for the selective
    scan, whose kernel in fact stores them in float32.

  The rest of those kernels' bfloat16 intermediates (``w``, ``u``, the inverted
  triangular matrix, KDA's decayed keys, the attention scores, the outputs) stay in the compute type here.

All four share one driver: it cuts the sequence into pieces (one token, or one chunk),
runs the core's own public form on each piece from the stored state, and stores the
state it hands on. The delta-rule cores with ``read_dtype`` run their own loop over the
chunks instead, on the UT transform of :mod:`fixedstate.kernels`, because the rounding
sits inside a chunk. With every type float64 (``compute_dtype`` too) each is the
float64 core, which is what the tests check first.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import delta_rule as dr
from . import ssm
from ._validate import as_float_array, check_positive_int
from .kernels import kda_prep, matmul, scalar_prep, split_chunks
from .layers import GatedDeltaNetConfig

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
    """A layer's parameters (``fixedstate.layers.init_*``) rounded to ``dtype`` as a checkpoint stores them, held in float32.

    Every array is rounded but ``A_log`` and, in Gated DeltaNet, the gated norm's weight
    ``norm_weight``, which stay float32 unrounded: a pull request in vLLM (#51836)
    reports that Qwen3.5's checkpoint ships these two tensors of its linear-attention
    layers in float32 (``linear_attn.A_log`` and ``linear_attn.norm.weight``), and
    ``dt_bias`` in bfloat16, so ``dt_bias`` is rounded like the weights. Other layers' norm weights are rounded.
    """
    if not isinstance(params, dict) or "config" not in params:
        raise ValueError(f"params: expected a layer's params dict (from fixedstate.layers.init_*), got "
                         f"{type(params).__name__}")
    dt = _storage(dtype, "dtype")
    kept = ("A_log", "norm_weight") if isinstance(params["config"], GatedDeltaNetConfig) else ("A_log",)
    out = {"config": params["config"]}
    for name, a in params.items():
        if name != "config":
            out[name] = (as_float_array(a, f"params[{name!r}]").astype(np.float32) if name in kept
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

    The state handed on is stored in ``st`` after every piece; with ``rd`` (the state-space
    cores), each piece's outputs are recomputed from the incoming state stored in ``rd``,
    the carry untouched.
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


def _stored_chunks(q, k, v, beta, log_gate, scale, channelwise, st, rd, cd, chunk_size):
    """The delta rule's chunkwise form with flash-linear-attention's stored intermediates in ``rd``.

    ``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state`` for every chunk (the UT
    transform and the decays from :func:`fixedstate.kernels.scalar_prep` or
    :func:`fixedstate.kernels.kda_prep`, for all chunks at once), then the state carried
    from chunk to chunk as ``chunk_delta_h.py`` carries it: the incoming state ``S``
    (float32) is stored in ``rd`` as ``S_r``; the corrected values are ``U = U~ - W S_r``;
    the outputs read ``Gamma Q S_r + (QK^T . D) rd(U)``; the carry becomes
    ``gamma_C S + K^T rd(e^{b_C - b} U)`` (scalar gate) or ``gamma_C S + (e^{b_C - b} K)^T
    rd(U)`` (KDA), stored in ``st``. Arrays as the public forms take them, already in
    ``cd``; returns ``(outputs, final_state)``.
    """
    gate_core = (-2, -1) if channelwise else (-1,)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], beta.shape[:-1],
                               log_gate.shape[:len(log_gate.shape) - len(gate_core)])
    T, d_k, d_v = q.shape[-2], k.shape[-1], v.shape[-1]
    merged = lambda a, tail: np.broadcast_to(a, lead + tail).reshape((-1,) + tail)
    q, k, v, beta = merged(q, (T, d_k)), merged(k, (T, d_k)), merged(v, (T, d_v)), merged(beta, (T,))
    alpha = np.exp(merged(log_gate, (T, d_k) if channelwise else (T,)))      # per-token decays, exponents <= 0
    chunks = lambda a, fill=0.0: split_chunks(a, fill, chunk_size=chunk_size)  # (B, n, C2, ...), padding inert
    qc, kc, vc, bc, ac = chunks(q), chunks(k), chunks(v), chunks(beta)[..., None], chunks(alpha, 1.0)
    B, n, C2 = qc.shape[:3]
    qm, km, vm, bm, am = (a.reshape((B * n,) + a.shape[2:]) for a in (qc, kc, vc, bc, ac))
    if channelwise:
        qk, ut, gamma, to_end = kda_prep(qm, km, bm, am)
        u_free, w = matmul(ut, vm * bm), matmul(ut, km * (gamma * bm))       # eq-dr-ut: U~ and W
    else:
        decay, (ut_beta, ut_beta_gamma), gamma, to_end = scalar_prep(km, bm, am)
        qk = matmul(qm, km.swapaxes(-1, -2))
        qk *= decay
        u_free, w = matmul(ut_beta, vm), matmul(ut_beta_gamma, km)
    split = lambda a: a.reshape((B, n) + a.shape[1:])
    qk, u_free, w, q_read, to_end, k_t = map(split, (qk, u_free, w, qm * gamma, to_end, km.swapaxes(-1, -2)))
    decay_last = split(gamma[:, -1, :, None])                                 # (B, n, 1 or d_k, 1)
    rounded = lambda a: a.astype(rd).astype(cd)
    S = np.zeros((B, d_k, d_v), dtype=cd)
    out = np.empty((B, n, C2, d_v), dtype=cd)
    for j in range(n):
        S_read = rounded(S)                                                   # the stored per-chunk state
        U = u_free[:, j] - matmul(w[:, j], S_read)                           # v_new = u - w h, h in rd
        out[:, j] = matmul(q_read[:, j], S_read) + matmul(qk[:, j], rounded(U))    # eq-dr-chunk-out
        if channelwise:                                                      # eq-dr-chunk-state, adding rd(v_new)
            write = matmul((k_t[:, j] * to_end[:, j].swapaxes(-1, -2)), rounded(U))
        else:
            write = matmul(k_t[:, j], rounded(to_end[:, j] * U))
        S = (decay_last[:, j] * S + write).astype(st).astype(cd)
    outputs = out[:, :, :chunk_size].reshape(B, -1, d_v)[:, :T]
    if scale != 1.0:
        outputs = outputs * cd.type(scale)
    return outputs.reshape(lead + (T, d_v)), S.reshape(lead + (d_k, d_v))


def _delta_mixed(recurrent, chunkwise, q, k, v, beta, log_gate, gate_axis, scale, options, form):
    io, st, rd, cd, chunk_size = options
    q, k, v, beta = (_stored(a, name, io, cd) for a, name in ((q, "q"), (k, "k"), (v, "v"), (beta, "beta")))
    log_gate = as_float_array(log_gate, "log_gate").astype(cd)
    T = _tokens(("q", q, -2), ("k", k, -2), ("v", v, -2), ("beta", beta, -1), ("log_gate", log_gate, gate_axis))
    if rd is not None:                        # flash-linear-attention's stored intermediates (chunkwise form only)
        return _stored_chunks(q, k, v, beta, log_gate, scale, gate_axis == -2, st, rd, cd, chunk_size)

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
    is the type of flash-linear-attention's stored intermediates (``chunk_delta_h.py``):
    each chunk's incoming state is stored in it, and both the chunk's outputs and the
    carry's correction ``v_new = u - w h`` read that stored state; ``v_new`` is rounded
    to it as the outputs read it and, after its decay to the chunk's end, as the carry
    adds it. The carry itself stays in ``state_dtype`` (float32), but the rounding reaches it.

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
    stored state). ``read_dtype`` (chunkwise form only) rounds the per-chunk states the
    outputs read and nothing else, the carry untouched: ``mamba_ssm``'s state passing
    carries the state in float32 and writes the per-chunk states in ``out_dtype``
    (``state_dtype`` if given, else the dtype of ``C``; ``mamba_ssm``'s own ``state_dtype``
    argument is this module's ``read_dtype``). Returns ``(y, final_state)`` in
    ``compute_dtype``.
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
    between chunks in float32. ``read_dtype`` as in :func:`ssd_mixed` (the kernel itself
    saves its chunk states in float32). Returns ``(y, final_state)`` in ``compute_dtype``.
    """
    options = _options(form, chunk_size, io_dtype, state_dtype, read_dtype, compute_dtype)
    core = ssm.selective_scan_sequential if form == "recurrent" else ssm.selective_scan_parallel
    return _state_space_mixed(core, x, delta, (A, "A"), B, C, D, -2, options, form)
