"""The delta rule family: DeltaNet, Gated DeltaNet and Kimi Delta Attention.

Chapter {ref}`chap-delta-rule`. Every layer here keeps a state ``S`` of shape
``(d_k, d_v)`` (the book's orientation: a write is ``k v^T``, a read is
``S^T q``) and updates it once per token with

    S_t = G_t S_{t-1} + beta_t k_t (v_t - (G_t S_{t-1})^T k_t)^T      (eq-dr-gated, eq-dr-kda)
    o_t = scale * S_t^T q_t                                              (eq-dr-readout)

where ``G_t`` is the identity (DeltaNet, ``eq-dr-delta``), a scalar gate
``g_t = exp(log_gate_t)`` in [0, 1] (Gated DeltaNet, ``eq-dr-gated``) or
``Diag(alpha_t)`` with one decay ``alpha_t = exp(log_gate_t)`` per key channel,
scaling the rows of ``S`` (Kimi Delta Attention, ``eq-dr-kda``). The order
matters: first decay, then correct, using the decayed state both for what is
erased and for what is kept. The output reads the updated state.

Every function takes ``q, k, v`` positionally and the rest by keyword, in one
order: ``beta``, ``log_gate``, ``scale``, ``initial_state``, ``chunk_size``; and
every one returns ``(outputs, final_state)``. Gates are passed as log-decays
``log_gate <= 0``, as in the reference libraries (a decay that underflows to 0
is a log-decay of, say, -120, which every form handles). Shapes carry any
leading axes (batch, heads, ...), which broadcast together by numpy's rules:

- sequences: ``q, k`` ``(..., T, d_k)``, ``v`` ``(..., T, d_v)``, ``beta``
  ``(..., T)``, ``log_gate`` ``(..., T)`` (Gated DeltaNet) or ``(..., T, d_k)``
  (KDA), ``initial_state`` ``(..., d_k, d_v)``; outputs ``(..., T, d_v)``;
- one token (``*_step``): the same without the ``T`` axis.

The result keeps the inputs' floating precision (float32 in, float32 out).

Each layer comes in three forms that agree to float64 precision (the tests
prove it), and two reference functions are written to be read beside the
equations:

- ``*_step``: one token, the equation as written;
- ``*_recurrent``: a scan over a sequence, one token at a time (vectorised over
  the state and the leading axes, the fair baseline for timing);
- ``*_chunkwise``: the chunkwise-parallel training form (``eq-dr-ut``,
  ``eq-dr-chunk-out``, ``eq-dr-chunk-state``). Inside a chunk the product of
  the erase factors is represented in WY/UT form by one unit-lower-triangular
  solve; the state is carried from chunk to chunk; decay inside a chunk is
  handled with cumulative log-decays measured from the chunk start, so every
  exponent that is formed is <= 0 (no ``1/Gamma`` is ever formed);
- :func:`gated_delta_rule_loop`, :func:`kda_loop`: the token loop for one
  sequence, line by line the equations (DeltaNet is ``log_gate = 0``);
- :func:`gated_delta_rule_chunk`: one chunk of the chunkwise form, line by line
  ``eq-dr-ut``, ``eq-dr-chunk-out`` and ``eq-dr-chunk-state``.

Keys are not normalised here. The erase factor ``I - beta k k^T`` multiplies the
component of the state along ``k`` by ``1 - beta |k|^2``: with a unit key and
beta in [0, 1] that is a shrink factor in [0, 1]; if ``beta |k|^2`` lies in
(1, 2) it flips sign but still shrinks; if ``beta |k|^2 > 2`` it *expands*
(its magnitude exceeds 1), so repeated writes of one pair make the recall error
grow instead of vanish. The layers accept such keys and compute exactly that;
models avoid it by L2-normalising keys.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from scipy.linalg import solve_triangular
from scipy.special import expit

from ._validate import (as_float_array, as_float_batch, broadcast_leading, check_interval, check_log_gate,
                        check_positive_int, check_real_number, float_dtype)

__all__ = [
    "delta_rule_step", "gated_delta_rule_step", "kda_step",
    "delta_rule_recurrent", "gated_delta_rule_recurrent", "kda_recurrent",
    "delta_rule_chunkwise", "gated_delta_rule_chunkwise", "kda_chunkwise",
    "gated_delta_rule_loop", "gated_delta_rule_chunk", "kda_loop",
    "kda_log_gate", "additive_step", "erase_factor",
]


# --------------------------------------------------------------------------- validation

def _prepare(q, k, v, beta, log_gate, scale, initial_state, *, gate, tokens=True, one_sequence=False,
             min_length=0):
    """Validate the arguments of a core; broadcast and cast them.

    ``gate`` is None (DeltaNet), ``"scalar"`` (Gated DeltaNet) or ``"channel"``
    (KDA); ``tokens`` is False for the one-token forms. Returns the leading shape
    and ``q, k, v, beta, log_gate, initial_state`` broadcast to it (``log_gate`` and
    ``initial_state`` may be None), cast to the common dtype, and ``scale``.
    With ``one_sequence`` no leading axes are allowed (the reference functions).
    """
    dtype = float_dtype(q, k, v, beta, log_gate, initial_state)
    tok = ("T",) if tokens else ()
    q = as_float_batch(q, "q", (None,) * len(tok) + (None,), tok + ("d_k",))
    T = q.shape[-2] if tokens else None
    if tokens and T < min_length:
        raise ValueError(f"q: expected at least {min_length} token(s), got shape {q.shape}")
    d_k = q.shape[-1]
    tsize = (T,) if tokens else ()
    k = as_float_batch(k, "k", tsize + (d_k,), tok + ("d_k",))
    v = as_float_batch(v, "v", tsize + (None,), tok + ("d_v",))
    d_v = v.shape[-1]
    beta = check_interval(as_float_batch(beta, "beta", tsize, tok), "beta", 0.0, 1.0)
    items = [("q", q, len(tok) + 1), ("k", k, len(tok) + 1), ("v", v, len(tok) + 1), ("beta", beta, len(tok))]
    if gate is not None:
        core = tsize + ((d_k,) if gate == "channel" else ())
        names = tok + (("d_k",) if gate == "channel" else ())
        log_gate = check_log_gate(as_float_batch(log_gate, "log_gate", core, names))
        items.append(("log_gate", log_gate, len(core)))
    if initial_state is not None:
        initial_state = as_float_batch(initial_state, "initial_state", (d_k, d_v), ("d_k", "d_v"))
        items.append(("initial_state", initial_state, 2))
    scale = check_real_number(scale, "scale")
    lead = broadcast_leading(*items)
    if one_sequence:
        for name, arr, n_core in items:
            if arr.ndim > n_core:
                raise ValueError(f"{name}: the reference functions take one sequence with no leading "
                                 f"axes, got shape {arr.shape} (use the *_recurrent or *_chunkwise forms "
                                 "for batches)")

    def fit(arr, n_core):
        if arr is None:
            return None
        arr = arr.astype(dtype, copy=False)
        shape = lead + arr.shape[arr.ndim - n_core:]
        return arr if arr.shape == shape else np.broadcast_to(arr, shape)

    n = len(tok)
    return (lead, fit(q, n + 1), fit(k, n + 1), fit(v, n + 1), fit(beta, n),
            fit(log_gate, n + (gate == "channel")) if gate is not None else None,
            fit(initial_state, 2), scale)


def _flat(x, lead, n_core):
    """Merge the leading axes into one (a view when possible)."""
    return None if x is None else x.reshape((math.prod(lead),) + x.shape[x.ndim - n_core:])


# --------------------------------------------------------------------------- one token

def _step(q, k, v, beta, log_gate, S, scale, channelwise):
    """One token on arrays with leading axes; S None means zeros."""
    if S is None:
        S = np.zeros(q.shape[:-1] + (q.shape[-1], v.shape[-1]), dtype=q.dtype)
    if log_gate is not None:
        decay = np.exp(log_gate)                                       # exponent <= 0
        S = S * (decay[..., :, None] if channelwise else decay[..., None, None])
    error = v - np.matmul(k[..., None, :], S)[..., 0, :]              # v - (G S)^T k
    S = S + (beta[..., None] * k)[..., :, None] * error[..., None, :]  # + beta k error^T
    o = np.matmul(q[..., None, :], S)[..., 0, :]                       # S_t^T q
    return (o * o.dtype.type(scale) if scale != 1.0 else o), S


def delta_rule_step(q, k, v, *, beta, scale=1.0, initial_state=None):
    """One DeltaNet step, ``eq-dr-delta`` then ``eq-dr-readout``.

    ``S_t = S_{t-1} + beta k (v - S_{t-1}^T k)^T`` and ``o = scale * S_t^T q``.

    Parameters
    ----------
    q, k : (..., d_k) arrays. v : (..., d_v) array.
    beta : (...) array or number in [0, 1], the write strength.
    scale : number multiplying the readout (default 1, no scaling).
    initial_state : (..., d_k, d_v) array, the state before the token, or None (zeros).

    Returns
    -------
    o : (..., d_v) array, read from the *updated* state.
    state : (..., d_k, d_v) array, the new state (the one passed in is not modified).
    """
    lead, q, k, v, beta, _, S, scale = _prepare(q, k, v, beta, None, scale, initial_state,
                                                gate=None, tokens=False)
    return _step(q, k, v, beta, None, S, scale, False)


def gated_delta_rule_step(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None):
    """One Gated DeltaNet step, ``eq-dr-gated`` then ``eq-dr-readout``.

    ``S_t = g S_{t-1} + beta k (v - (g S_{t-1})^T k)^T`` with ``g = exp(log_gate)``:
    decay first, then the delta correction computed from the decayed state.

    Parameters
    ----------
    q, k : (..., d_k). v : (..., d_v). beta : (...) in [0, 1].
    log_gate : (...) log-decay <= 0. scale : readout scale.
    initial_state : (..., d_k, d_v) or None (zeros).

    Returns
    -------
    o : (..., d_v) array. state : (..., d_k, d_v) array.
    """
    lead, q, k, v, beta, g, S, scale = _prepare(q, k, v, beta, log_gate, scale, initial_state,
                                                gate="scalar", tokens=False)
    return _step(q, k, v, beta, g, S, scale, False)


def kda_step(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None):
    """One Kimi Delta Attention step, ``eq-dr-kda`` then ``eq-dr-readout``.

    ``S_t = Diag(a) S_{t-1} + beta k (v - (Diag(a) S_{t-1})^T k)^T`` with
    ``a = exp(log_gate)``: one decay per key channel, scaling the rows of the
    ``(d_k, d_v)`` state.

    Parameters
    ----------
    q, k : (..., d_k). v : (..., d_v). beta : (...) in [0, 1].
    log_gate : (..., d_k) log-decays <= 0. scale : readout scale.
    initial_state : (..., d_k, d_v) or None (zeros).

    Returns
    -------
    o : (..., d_v) array. state : (..., d_k, d_v) array.
    """
    lead, q, k, v, beta, g, S, scale = _prepare(q, k, v, beta, log_gate, scale, initial_state,
                                                gate="channel", tokens=False)
    return _step(q, k, v, beta, g, S, scale, True)


def additive_step(state, key, value):
    """Plain linear attention's write, ``S + k v^T`` (``eq-dr-additive``), for comparison.

    state : (..., d_k, d_v); key : (..., d_k); value : (..., d_v). Returns the new state.
    """
    state = as_float_batch(state, "state", (None, None), ("d_k", "d_v"))
    key = as_float_batch(key, "key", (state.shape[-2],), ("d_k",))
    value = as_float_batch(value, "value", (state.shape[-1],), ("d_v",))
    broadcast_leading(("state", state, 2), ("key", key, 1), ("value", value, 1))
    return state + key[..., :, None] * value[..., None, :]


def erase_factor(key, beta):
    """The erase factor ``I - beta k k^T`` of ``eq-dr-erase``, a (..., d_k, d_k) array.

    Its eigenvalue along ``k`` is ``1 - beta |k|^2`` (all others are 1), so it
    shrinks the state's component along ``k`` for ``beta |k|^2 < 2`` and expands
    it beyond. ``key`` is (..., d_k), ``beta`` a number or (...) array in [0, 1].
    """
    dtype = float_dtype(key, beta)
    key = as_float_batch(key, "key", (None,), ("d_k",)).astype(dtype, copy=False)
    beta = check_interval(as_float_array(beta, "beta"), "beta", 0.0, 1.0)
    broadcast_leading(("key", key, 1), ("beta", beta, 0))
    eye = np.eye(key.shape[-1], dtype=dtype)
    return eye - (np.asarray(beta, dtype=dtype)[..., None, None] * key[..., :, None] * key[..., None, :])


def kda_log_gate(z, g_min=-5.0):
    """KDA's lower-bounded log-decay, ``eq-dr-kda-decay``: ``log alpha = g_min * sigmoid(z)``.

    Every log-decay lies in ``(g_min, 0)`` (the decay ``alpha = exp(log_gate)``
    in ``[exp(g_min), 1]``), so the log-decay per token is at least ``g_min``.

    Parameters
    ----------
    z : array of any shape (the pre-activation, e.g. (..., T, d_k)).
    g_min : negative number, the lower bound of the log-decay (default -5).

    Returns
    -------
    log_gate : array of the shape and precision of ``z``, to pass as ``log_gate``.
    """
    z = as_float_array(z, "z")
    if isinstance(g_min, bool) or not isinstance(g_min, numbers.Real) or not (-math.inf < g_min < 0):
        raise ValueError(f"g_min: expected a finite negative number, got {g_min!r}")
    return (g_min * expit(z)).astype(z.dtype, copy=False)   # expit(z) = 1 / (1 + e^{-z}), never overflows


# --------------------------------------------------------------------------- recurrent scans

def _recurrent(q, k, v, beta, log_gate, S, scale, channelwise):
    """The scan over tokens; q, k, v: (B, T, d), beta: (B, T), log_gate: (B, T[, d_k]), S: (B, d_k, d_v)."""
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    beta_keys = beta[..., None] * k
    if log_gate is not None:
        decays = np.exp(log_gate)                                      # exponents <= 0
        decays = decays[..., None] if channelwise else decays[..., None, None]
    outputs = np.empty((B, T, d_v), dtype=dtype)
    if B == 1:  # one sequence: plain vector-matrix products are the fastest
        S2, q2, k2, v2, bk2, out2 = S[0], q[0], k[0], v[0], beta_keys[0], outputs[0]
        d2 = None if log_gate is None else decays[0]
        for t in range(T):
            if d2 is not None:
                S2 *= d2[t]
            error = v2[t] - k2[t] @ S2
            S2 += np.multiply.outer(bk2[t], error)
            out2[t] = q2[t] @ S2
    else:
        for t in range(T):
            if log_gate is not None:
                S *= decays[:, t]
            error = v[:, t] - np.matmul(k[:, t, None, :], S)[:, 0]
            S += beta_keys[:, t, :, None] * error[:, None, :]
            outputs[:, t] = np.matmul(q[:, t, None, :], S)[:, 0]
    if scale != 1.0:
        outputs *= dtype.type(scale)
    return outputs, S


def _run(form, q, k, v, beta, log_gate, scale, initial_state, gate, *extra):
    lead, q, k, v, beta, g, S, scale = _prepare(q, k, v, beta, log_gate, scale, initial_state, gate=gate)
    T = q.shape[-2]
    channelwise = gate == "channel"
    out, S = form(_flat(q, lead, 2), _flat(k, lead, 2), _flat(v, lead, 2), _flat(beta, lead, 1),
                  _flat(g, lead, 1 + channelwise), _flat(S, lead, 2), scale, *extra, channelwise)
    return out.reshape(lead + (T, v.shape[-1])), S.reshape(lead + S.shape[1:])


def delta_rule_recurrent(q, k, v, *, beta, scale=1.0, initial_state=None):
    """DeltaNet over a sequence, one token at a time (``eq-dr-delta``, ``eq-dr-readout``).

    Parameters
    ----------
    q, k : (..., T, d_k) arrays. v : (..., T, d_v). beta : (..., T) in [0, 1].
    scale : readout scale.
    initial_state : (..., d_k, d_v) array or None (zeros).

    Returns
    -------
    outputs : (..., T, d_v) array. final_state : (..., d_k, d_v) array.
    """
    return _run(_recurrent, q, k, v, beta, None, scale, initial_state, None)


def gated_delta_rule_recurrent(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None):
    """Gated DeltaNet over a sequence, one token at a time (``eq-dr-gated``, ``eq-dr-readout``).

    Parameters
    ----------
    q, k : (..., T, d_k). v : (..., T, d_v). beta : (..., T) in [0, 1].
    log_gate : (..., T) log-decays <= 0. scale : readout scale.
    initial_state : (..., d_k, d_v) or None.

    Returns
    -------
    outputs : (..., T, d_v) array. final_state : (..., d_k, d_v) array.
    """
    return _run(_recurrent, q, k, v, beta, log_gate, scale, initial_state, "scalar")


def kda_recurrent(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None):
    """Kimi Delta Attention over a sequence, one token at a time (``eq-dr-kda``, ``eq-dr-readout``).

    Parameters
    ----------
    q, k : (..., T, d_k). v : (..., T, d_v). beta : (..., T) in [0, 1].
    log_gate : (..., T, d_k) per-channel log-decays <= 0, scaling the rows of S.
    scale : readout scale. initial_state : (..., d_k, d_v) or None.

    Returns
    -------
    outputs : (..., T, d_v) array. final_state : (..., d_k, d_v) array.
    """
    return _run(_recurrent, q, k, v, beta, log_gate, scale, initial_state, "channel")


# --------------------------------------------------------------------------- reference functions

def gated_delta_rule_loop(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None):
    """The token loop of Gated DeltaNet for one sequence, ``eq-dr-gated`` and ``eq-dr-readout``.

    The reference the fast forms are tested against, written to be read beside
    the equations; DeltaNet (``eq-dr-delta``) is ``log_gate = 0``. ``q, k``
    (T, d_k), ``v`` (T, d_v), ``beta`` and ``log_gate`` (T,), no leading axes;
    ``initial_state`` (d_k, d_v) or None (zeros). Returns the outputs (T, d_v)
    and the final state (d_k, d_v).
    """
    _, q, k, v, beta, log_gate, S, c = _prepare(q, k, v, beta, log_gate, scale, initial_state,
                                                gate="scalar", one_sequence=True)
    S = np.zeros((k.shape[1], v.shape[1]), dtype=v.dtype) if S is None else S    # S_0
    o = np.empty_like(v)
    for t in range(len(q)):
        g = np.exp(log_gate[t])                           # the gate g_t = e^{gamma_t}, gamma_t = log g_t <= 0
        decayed = g * S                                   # decay first: g_t S_{t-1}
        delta = v[t] - decayed.T @ k[t]                   # the delta v_t - (g_t S_{t-1})^T k_t
        S = decayed + beta[t] * np.outer(k[t], delta)     # eq-dr-gated: S_t = g_t S_{t-1} + beta_t k_t delta^T
        o[t] = c * (S.T @ q[t])                           # eq-dr-readout: o_t = c S_t^T q_t
    return o, S


def kda_loop(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None):
    """The token loop of Kimi Delta Attention for one sequence, ``eq-dr-kda`` and ``eq-dr-readout``.

    As :func:`gated_delta_rule_loop`, with ``log_gate`` (T, d_k): one decay per
    key channel, scaling the rows of the state.
    """
    _, q, k, v, beta, log_gate, S, c = _prepare(q, k, v, beta, log_gate, scale, initial_state,
                                                gate="channel", one_sequence=True)
    S = np.zeros((k.shape[1], v.shape[1]), dtype=v.dtype) if S is None else S    # S_0
    o = np.empty_like(v)
    for t in range(len(q)):
        alpha = np.exp(log_gate[t])                       # the decays alpha_t, one per key channel
        decayed = alpha[:, None] * S                      # decay first: Diag(alpha_t) S_{t-1}, row i times alpha_ti
        delta = v[t] - decayed.T @ k[t]                   # the delta v_t - (Diag(alpha_t) S_{t-1})^T k_t
        S = decayed + beta[t] * np.outer(k[t], delta)     # eq-dr-kda: S_t = Diag(alpha_t) S_{t-1} + beta_t k_t delta^T
        o[t] = c * (S.T @ q[t])                           # eq-dr-readout: o_t = c S_t^T q_t
    return o, S


def gated_delta_rule_chunk(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None):
    """One chunk of the chunkwise form: ``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``.

    Given the chunk's ``C`` tokens (``q, k`` (C, d_k), ``v`` (C, d_v), ``beta`` and
    ``log_gate`` (C,), no leading axes) and the incoming state ``S_0``
    (``initial_state``, (d_k, d_v) or None for zeros), returns the chunk's outputs
    ``O`` (C, d_v) and the outgoing state ``S_C``. Applied chunk after chunk it is
    the whole sequence; :func:`gated_delta_rule_chunkwise` is the same computation
    for all chunks at once.
    """
    _, Q, K, V, beta, log_gate, S0, c = _prepare(q, k, v, beta, log_gate, scale, initial_state,
                                                 gate="scalar", one_sequence=True, min_length=1)
    S0 = np.zeros((K.shape[1], V.shape[1]), dtype=V.dtype) if S0 is None else S0
    C = len(Q)                                            # the chunk's tokens r = 1, ..., C are the rows
    b = np.cumsum(log_gate)                               # b_r = sum_{i<=r} gamma_i <= 0, gamma_i = log g_i
    Gamma = np.exp(b)                                     # Gamma_r = e^{b_r}, the decay since the chunk start
    i_le_r = np.tril(np.ones((C, C), dtype=bool))         # the pairs (r, i) with i <= r
    D = np.exp(np.where(i_le_r, b[:, None] - b[None, :], -np.inf))   # D_ri = e^{b_r - b_i} if i <= r, else 0
    A = np.tril(beta[:, None] * D * (K @ K.T), -1)       # A_ri = beta_r e^{b_r - b_i} k_r^T k_i if i < r, else 0
    I_plus_A = np.eye(C, dtype=V.dtype) + A               # unit lower triangular: forward substitution
    U_tilde = solve_triangular(I_plus_A, beta[:, None] * V, lower=True, unit_diagonal=True)
    W = solve_triangular(I_plus_A, (beta * Gamma)[:, None] * K, lower=True, unit_diagonal=True)
    U = U_tilde - W @ S0                                  # eq-dr-ut: U = U~ - W S_0
    O = c * ((Gamma[:, None] * Q) @ S0 + ((Q @ K.T) * D) @ U)        # eq-dr-chunk-out
    S_C = Gamma[-1] * S0 + (np.exp(b[-1] - b)[:, None] * K).T @ U   # eq-dr-chunk-state
    return O.astype(V.dtype, copy=False), S_C.astype(V.dtype, copy=False)


# --------------------------------------------------------------------------- chunkwise form

def _sub_block(chunk_size: int, limit: int = 16) -> int:
    """The largest divisor of chunk_size that is at most ``limit``."""
    return max(d for d in range(1, min(chunk_size, limit) + 1) if chunk_size % d == 0)


def _kda_pair_products(q, k, b, sub):
    """Intra-chunk products with per-channel decay, all exponents <= 0.

    Returns ``QK[n, r, i] = sum_c q_rc k_ic exp(b_rc - b_ic)`` and the same with
    ``k_r`` in place of ``q_r`` (``KK``), for i <= r, zero above the diagonal.
    ``q``, ``k`` and ``b`` are (n, C, d_k); ``b`` is the cumulative log-decay
    from the chunk start.

    Pairs in different sub-blocks factor through a reference point, the last
    position of the block before the row's block: exp(b_r - b_ref) and
    exp(b_ref - b_i) both have exponents <= 0, and the pair products become
    matrix products. Pairs inside one sub-block use the differences b_r - b_i
    directly, a (sub, sub, d_k) tensor per block.
    """
    n, C, d_k = b.shape
    P = C // sub
    dtype = b.dtype
    out = np.zeros((2, n, C, C), dtype=dtype)                               # [QK, KK]
    qb = q.reshape(n, P, sub, d_k)
    kb = k.reshape(n, P, sub, d_k)
    bb = b.reshape(n, P, sub, d_k)
    if P > 1:
        # reference log-decay for row block p: b at position p*sub - 1 (0 for p = 0)
        ref = np.concatenate([np.zeros((n, 1, d_k), dtype=dtype), b[:, sub - 1:C - 1:sub, :]], axis=1)
        row_scale = np.exp(bb - ref[:, :, None, :])                         # (n, P, sub, d_k), <= 1
        right = ref[:, :, None, :] - b[:, None, :, :]                       # (n, P, C, d_k)
        np.minimum(right, 0.0, out=right)                                   # only masked entries change
        np.exp(right, out=right)
        right *= k[:, None, :, :]
        earlier = np.arange(C)[None, :] < (np.arange(P) * sub)[:, None]    # (P, C): column i before block p
        right *= earlier[None, :, :, None]
        right_t = right.transpose(0, 1, 3, 2)
        out[0] += np.matmul(qb * row_scale, right_t).reshape(n, C, C)
        out[1] += np.matmul(kb * row_scale, right_t).reshape(n, C, C)
    # diagonal blocks: exact differences; entries above the diagonal are clipped, then masked
    diff = bb[:, :, :, None, :] - bb[:, :, None, :, :]                      # (n, P, sub, sub, d_k)
    np.minimum(diff, 0.0, out=diff)
    np.exp(diff, out=diff)
    diff *= kb[:, :, None, :, :]
    both = np.stack([qb, kb], axis=-1)                                      # (n, P, sub, d_k, 2)
    diag = np.matmul(diff, both)                                            # (n, P, sub, sub, 2)
    diag *= np.tril(np.ones((sub, sub), dtype=dtype))[None, None, :, :, None]
    view = out.reshape(2, n, P, sub, P, sub)
    idx = np.arange(P)
    view[:, :, idx, :, idx, :] += diag.transpose(1, 4, 0, 2, 3)
    return out[0], out[1]


_GROUP_TOKENS = 256


def _chunk_group(q, k, v, beta, b, S, channelwise):
    """Chunkwise form for a group of consecutive chunks of B sequences.

    ``q, k, v``: (B, g, C, d); ``beta``: (B, g, C, 1); ``b``: the cumulative
    log-decays from each chunk's start, (B, g, C[, d_k]); ``S``: the (B, d_k, d_v)
    states entering the group. Returns the (B, g, C, d_v) outputs (unscaled) and
    the states after the group's last chunk. Every product that does not involve
    the carried state is done for all B * g chunks at once.
    """
    B, g, C, d_k = k.shape
    d_v = v.shape[-1]
    dtype = k.dtype
    n = B * g
    q, k, v, beta, b = (x.reshape((n,) + x.shape[2:]) for x in (q, k, v, beta, b))
    if not channelwise:
        strictly_upper = ~np.tril(np.ones((C, C), dtype=bool))
        diff = b[:, :, None] - b[:, None, :]                                       # b_r - b_i
        diff[:, strictly_upper] = -np.inf                                          # i > r: no pair
        decay = np.exp(diff)                                                       # exponents <= 0
        qk = np.matmul(q, k.transpose(0, 2, 1))
        qk *= decay                                                                # (n, C, C)
        kk = np.matmul(k, k.transpose(0, 2, 1))
        kk *= decay
        gamma = np.exp(b)[:, :, None]                                              # (n, C, 1), <= 1
        k_out = k * np.exp(b[:, -1:] - b)[:, :, None]                              # exponent <= 0
        gamma_last = np.exp(b[:, -1])[:, None, None]                               # (n, 1, 1)
    else:
        qk, kk = _kda_pair_products(q, k, b, _sub_block(C))
        gamma = np.exp(b)                                                          # (n, C, d_k), <= 1
        k_out = k * np.exp(b[:, -1:, :] - b)
        gamma_last = np.exp(b[:, -1, :])[:, :, None]                               # (n, d_k, 1)

    # I + A with A strictly lower triangular, A[r, i] = beta_r k_r^T Gamma_{r/i} k_i (i < r).
    # Its inverse, one unit-lower-triangular solve per chunk, is the UT transform (eq-dr-ut).
    kk *= beta
    kk[:, np.arange(C), np.arange(C)] = 1.0
    ut = solve_triangular(kk, np.broadcast_to(np.eye(C, dtype=dtype), (n, C, C)), lower=True,
                          unit_diagonal=True, check_finite=False).astype(dtype, copy=False)
    rhs = np.empty((n, C, d_v + d_k), dtype=dtype)
    np.multiply(beta, v, out=rhs[..., :d_v])
    np.multiply(beta * gamma, k, out=rhs[..., d_v:])
    uw = np.matmul(ut, rhs)
    u_free = uw[..., :d_v].reshape(B, g, C, d_v)                                   # T (beta V)
    reads = np.empty((n, 2 * C, d_k), dtype=dtype)                                 # [W; Gamma Q]
    reads[:, :C] = uw[..., d_v:]                                                   # W = T (beta Gamma K)
    np.multiply(q, gamma, out=reads[:, C:])
    reads = reads.reshape(B, g, 2 * C, d_k)
    k_out_t = k_out.reshape(B, g, C, d_k).transpose(0, 1, 3, 2)
    gamma_last = gamma_last.reshape((B, g) + gamma_last.shape[1:])

    # The only sequential part: carry the state from chunk to chunk.
    S = S.copy()
    u = np.empty((B, g, C, d_v), dtype=dtype)
    out = np.empty((B, g, C, d_v), dtype=dtype)
    if B == 1:  # one sequence: plain matrix products
        S2 = S[0]
        for j in range(g):
            read = reads[0, j] @ S2                                                # W S and Gamma Q S
            np.subtract(u_free[0, j], read[:C], out=u[0, j])                       # eq-dr-ut
            out[0, j] = read[C:]
            S2 *= gamma_last[0, j]                                                 # eq-dr-chunk-state
            S2 += k_out_t[0, j] @ u[0, j]
    else:
        for j in range(g):
            read = np.matmul(reads[:, j], S)
            np.subtract(u_free[:, j], read[:, :C], out=u[:, j])                    # eq-dr-ut
            out[:, j] = read[:, C:]
            S *= gamma_last[:, j]                                                  # eq-dr-chunk-state
            S += np.matmul(k_out_t[:, j], u[:, j])
    out = out.reshape(n, C, d_v)
    out += np.matmul(qk, u.reshape(n, C, d_v))                                     # eq-dr-chunk-out
    return out.reshape(B, g, C, d_v), S


def _chunkwise(q, k, v, beta, log_gate, S, scale, chunk_size, channelwise):
    """q, k, v: (B, T, d); beta: (B, T); log_gate: (B, T[, d_k]) or None; S: (B, d_k, d_v) or None."""
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    C = chunk_size
    n = max(1, -(-T // C))
    pad = n * C - T

    def chunks(x):
        """(B, T, ...) -> (B, n, C, ...). Padding tokens are zeros."""
        if pad:
            x = np.concatenate([x, np.zeros((B, pad) + x.shape[2:], dtype=dtype)], axis=1)
        return x.reshape((B, n, C) + x.shape[2:])

    # Padding tokens have key 0, beta 0 and log-decay 0: they leave the state unchanged.
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    betac = chunks(beta)[..., None]
    if log_gate is None:
        b = np.zeros((B, n, C) + ((d_k,) if channelwise else ()), dtype=dtype)
    else:
        b = np.cumsum(chunks(log_gate), axis=2)        # cumulative log-decay from the chunk start, <= 0

    # Chunks are processed in groups of about 256 tokens (a block of sequences times
    # a few consecutive chunks) so that the intermediate arrays stay in the
    # processor's cache; the result does not depend on the grouping.
    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    out = np.empty((B, n, C, d_v), dtype=dtype)
    per_block = max(1, _GROUP_TOKENS // C)
    for i0 in range(0, B, per_block):
        items = slice(i0, min(B, i0 + per_block))
        group = max(1, _GROUP_TOKENS // (C * (items.stop - i0)))
        S_items = S[items]
        for g0 in range(0, n, group):
            sl = slice(g0, min(n, g0 + group))
            out[items, sl], S_items = _chunk_group(qc[items, sl], kc[items, sl], vc[items, sl], betac[items, sl],
                                                   b[items, sl], S_items, channelwise)
        S[items] = S_items
    outputs = out.reshape(B, n * C, d_v)[:, :T]
    if scale != 1.0:
        outputs = outputs * dtype.type(scale)
    return outputs, S


def delta_rule_chunkwise(q, k, v, *, beta, scale=1.0, initial_state=None, chunk_size=64):
    """DeltaNet in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`delta_rule_recurrent` (shapes with
    leading axes ``...``), plus ``chunk_size`` (an integer >= 1; the length need
    not be a multiple of it). The leading axes are processed inside the same
    matrix products, not one item at a time.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _run(_chunkwise, q, k, v, beta, None, scale, initial_state, None, chunk_size)


def gated_delta_rule_chunkwise(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None, chunk_size=64):
    """Gated DeltaNet in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`gated_delta_rule_recurrent`, plus
    ``chunk_size``. Decay inside a chunk uses ``exp(b_r - b_i)`` with ``b`` the
    cumulative log-decay from the chunk start; all exponents are <= 0.
    :func:`gated_delta_rule_chunk` is one chunk of it, written plainly.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _run(_chunkwise, q, k, v, beta, log_gate, scale, initial_state, "scalar", chunk_size)


def kda_chunkwise(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None, chunk_size=64):
    """Kimi Delta Attention in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`kda_recurrent`, plus ``chunk_size``.
    Per-channel decays between two positions of a chunk are ``exp(b_r - b_i)``
    with ``b`` the (C, d_k) cumulative log-decays from the chunk start. Pairs in
    different sub-blocks of 16 (or the largest divisor of ``chunk_size`` below
    16) factor through a reference point between them, so both factors have
    exponents <= 0; pairs inside one sub-block use the differences directly.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _run(_chunkwise, q, k, v, beta, log_gate, scale, initial_state, "channel", chunk_size)
