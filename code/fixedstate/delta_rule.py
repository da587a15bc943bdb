"""The delta rule family: DeltaNet, Gated DeltaNet and Kimi Delta Attention.

Chapter {ref}`chap-delta-rule`. Every layer here keeps a state ``S`` of shape
``(d_k, d_v)`` (the book's orientation: a write is ``k v^T``, a read is
``S^T q``) and updates it once per token with

    S_t = G_t S_{t-1} + beta_t k_t (v_t - (G_t S_{t-1})^T k_t)^T      (eq-dr-family)
    o_t = scale * S_t^T q_t                                              (eq-dr-readout)

where ``G_t`` is the identity (DeltaNet, ``eq-dr-delta``), a scalar gate
``g_t`` in (0, 1] (Gated DeltaNet, ``eq-dr-gated``) or ``Diag(alpha_t)`` with one
decay per key channel, scaling the rows of ``S`` (Kimi Delta Attention,
``eq-dr-kda``). The order matters: first decay, then correct, using the decayed
state both for what is erased and for what is kept. The output reads the
updated state.

Each layer comes in three forms that agree to float64 precision (the tests
prove it):

- ``*_step``: one token, the equation as written;
- ``*_recurrent``: a scan over a sequence, one token at a time (vectorised over
  the state, the fair baseline for timing);
- ``*_chunkwise``: the chunkwise-parallel training form (``eq-dr-ut``,
  ``eq-dr-chunk-out``, ``eq-dr-chunk-state``). Inside a chunk the product of
  the erase factors is represented in WY/UT form by one unit-lower-triangular
  solve; the state is carried from chunk to chunk; decay inside a chunk is
  handled with cumulative log-decays measured from the chunk start, so every
  exponent that is formed is <= 0 (no ``1/Gamma`` is ever formed).

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
import time

import numpy as np
from scipy.linalg import solve_triangular

from ._validate import as_float_array, as_token_sequences, check_interval, check_positive_int, check_same_length

__all__ = [
    "delta_rule_step", "gated_delta_rule_step", "kda_step",
    "delta_rule_recurrent", "gated_delta_rule_recurrent", "kda_recurrent",
    "delta_rule_chunkwise", "gated_delta_rule_chunkwise", "kda_chunkwise",
    "kda_decay", "additive_step", "erase_factor",
    "four_writes", "draw_four_writes", "FOUR_WRITES_KEYS",
    "time_forms",
]


# --------------------------------------------------------------------------- validation

def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number, got {scale!r}")
    return float(scale)


def _check_beta_scalar(beta) -> float:
    arr = as_float_array(beta, "beta", ndim=0)
    check_interval(arr, "beta", 0.0, 1.0)
    return float(arr)


def _check_step(state, query, key, value, beta, scale):
    state = as_float_array(state, "state", ndim=2)
    d_k, d_v = state.shape
    query = as_float_array(query, "query", shape=(d_k,))
    key = as_float_array(key, "key", shape=(d_k,))
    value = as_float_array(value, "value", shape=(d_v,))
    beta = _check_beta_scalar(beta)
    scale = _check_scale(scale)
    return state, query, key, value, beta, scale


def _check_sequence(queries, keys, values, betas, initial_state, scale):
    queries, keys, values = as_token_sequences(queries, keys, values, min_length=0)
    T, d_k = keys.shape
    d_v = values.shape[1]
    betas = as_float_array(betas, "betas", ndim=1)
    check_same_length("queries", queries, "betas", betas)
    check_interval(betas, "betas", 0.0, 1.0)
    if initial_state is None:
        state = None
    else:
        state = as_float_array(initial_state, "initial_state", shape=(d_k, d_v))
    scale = _check_scale(scale)
    return queries, keys, values, betas, state, scale


def _check_gates(gates, name, shape):
    gates = as_float_array(gates, name, shape=shape)
    check_interval(gates, name, 0.0, 1.0, low_closed=False)
    return gates


def _dtype(*arrays):
    return np.result_type(*[a for a in arrays if a is not None])


# --------------------------------------------------------------------------- one token

def _step(state, query, key, value, beta, decay, scale):
    """decay: None (identity), a scalar, or a (d_k,) vector scaling the rows."""
    if decay is None:
        decayed = state
    elif np.ndim(decay) == 0:
        decayed = decay * state
    else:
        decayed = decay[:, None] * state
    error = value - decayed.T @ key
    new_state = decayed + beta * np.outer(key, error)
    return scale * (new_state.T @ query), new_state


def delta_rule_step(state, query, key, value, beta, *, scale=1.0):
    """One DeltaNet step, ``eq-dr-delta`` then ``eq-dr-readout``.

    ``S_t = S_{t-1} + beta k (v - S_{t-1}^T k)^T`` and ``o = scale * S_t^T q``.

    Parameters
    ----------
    state : (d_k, d_v) array, the state before the token.
    query, key : (d_k,) arrays. value : (d_v,) array.
    beta : number in [0, 1], the write strength.
    scale : number multiplying the readout (default 1, no scaling).

    Returns
    -------
    output : (d_v,) array, read from the *updated* state.
    new_state : (d_k, d_v) array.
    """
    state, query, key, value, beta, scale = _check_step(state, query, key, value, beta, scale)
    return _step(state, query, key, value, beta, None, scale)


def gated_delta_rule_step(state, query, key, value, beta, gate, *, scale=1.0):
    """One Gated DeltaNet step, ``eq-dr-gated`` then ``eq-dr-readout``.

    ``S_t = g S_{t-1} + beta k (v - (g S_{t-1})^T k)^T``: decay first, then the
    delta correction computed from the decayed state.

    Parameters
    ----------
    state : (d_k, d_v) array. query, key : (d_k,). value : (d_v,).
    beta : number in [0, 1]. gate : number in (0, 1], the decay g.
    scale : readout scale.

    Returns
    -------
    output : (d_v,) array. new_state : (d_k, d_v) array.
    """
    state, query, key, value, beta, scale = _check_step(state, query, key, value, beta, scale)
    gate = as_float_array(gate, "gate", ndim=0)
    check_interval(gate, "gate", 0.0, 1.0, low_closed=False)
    return _step(state, query, key, value, beta, float(gate), scale)


def kda_step(state, query, key, value, beta, gate, *, scale=1.0):
    """One Kimi Delta Attention step, ``eq-dr-kda`` then ``eq-dr-readout``.

    ``S_t = Diag(a) S_{t-1} + beta k (v - (Diag(a) S_{t-1})^T k)^T``: one decay
    per key channel, scaling the rows of the ``(d_k, d_v)`` state.

    Parameters
    ----------
    state : (d_k, d_v) array. query, key : (d_k,). value : (d_v,).
    beta : number in [0, 1]. gate : (d_k,) array of decays in (0, 1].
    scale : readout scale.

    Returns
    -------
    output : (d_v,) array. new_state : (d_k, d_v) array.
    """
    state, query, key, value, beta, scale = _check_step(state, query, key, value, beta, scale)
    gate = _check_gates(gate, "gate", (state.shape[0],))
    return _step(state, query, key, value, beta, gate, scale)


def additive_step(state, key, value):
    """Plain linear attention's write, ``S + k v^T`` (eq-la-recurrent), for comparison.

    state : (d_k, d_v); key : (d_k,); value : (d_v,). Returns the new (d_k, d_v) state.
    """
    state = as_float_array(state, "state", ndim=2)
    key = as_float_array(key, "key", shape=(state.shape[0],))
    value = as_float_array(value, "value", shape=(state.shape[1],))
    return state + np.outer(key, value)


def erase_factor(key, beta):
    """The erase factor ``I - beta k k^T`` of ``eq-dr-erase``, a (d_k, d_k) array.

    Its eigenvalue along ``k`` is ``1 - beta |k|^2`` (all others are 1), so it
    shrinks the state's component along ``k`` for ``beta |k|^2 < 2`` and expands
    it beyond.
    """
    key = as_float_array(key, "key", ndim=1)
    beta = _check_beta_scalar(beta)
    return np.eye(key.shape[0], dtype=key.dtype) - beta * np.outer(key, key)


def kda_decay(z, g_min=-5.0):
    """KDA's lower-bounded decay, ``eq-dr-kda-decay``: ``alpha = exp(g_min * sigmoid(z))``.

    Every decay lies in ``[exp(g_min), 1)``, so the log-decay per token is at
    least ``g_min``.

    Parameters
    ----------
    z : array of any shape (the pre-activation, e.g. (T, d_k)).
    g_min : negative number, the lower bound of the log-decay (default -5).

    Returns
    -------
    alpha : array of the shape of ``z``.
    """
    z = as_float_array(z, "z")
    if isinstance(g_min, bool) or not isinstance(g_min, numbers.Real) or not (-math.inf < g_min < 0):
        raise ValueError(f"g_min: expected a finite negative number, got {g_min!r}")
    sig = 0.5 * (1.0 + np.tanh(0.5 * z))  # a sigmoid that never overflows
    return np.exp(g_min * sig)


# --------------------------------------------------------------------------- recurrent scans

def _recurrent(queries, keys, values, betas, decays, state, scale, channelwise):
    T, d_k = keys.shape
    d_v = values.shape[1]
    dtype = _dtype(queries, keys, values, betas, decays, state)
    S = np.zeros((d_k, d_v), dtype=dtype) if state is None else state.astype(dtype, copy=True)
    queries = queries.astype(dtype, copy=False)
    keys = keys.astype(dtype, copy=False)
    values = values.astype(dtype, copy=False)
    beta_keys = (betas.astype(dtype, copy=False)[:, None] * keys)
    if decays is not None:
        decays = decays.astype(dtype, copy=False)
        if channelwise:
            decays = decays[:, :, None]
    outputs = np.empty((T, d_v), dtype=dtype)
    for t in range(T):
        if decays is not None:
            S *= decays[t]
        error = values[t] - keys[t] @ S
        S += np.multiply.outer(beta_keys[t], error)
        outputs[t] = queries[t] @ S
    if scale != 1.0:
        outputs *= dtype.type(scale)
    return outputs, S


def delta_rule_recurrent(queries, keys, values, betas, *, initial_state=None, scale=1.0):
    """DeltaNet over a sequence, one token at a time (``eq-dr-delta``, ``eq-dr-readout``).

    Parameters
    ----------
    queries, keys : (T, d_k) arrays. values : (T, d_v). betas : (T,) in [0, 1].
    initial_state : (d_k, d_v) array or None (zeros).
    scale : readout scale.

    Returns
    -------
    outputs : (T, d_v) array. final_state : (d_k, d_v) array.
    """
    q, k, v, b, s, scale = _check_sequence(queries, keys, values, betas, initial_state, scale)
    return _recurrent(q, k, v, b, None, s, scale, False)


def gated_delta_rule_recurrent(queries, keys, values, betas, gates, *, initial_state=None, scale=1.0):
    """Gated DeltaNet over a sequence, one token at a time (``eq-dr-gated``).

    Parameters
    ----------
    queries, keys : (T, d_k). values : (T, d_v). betas : (T,) in [0, 1].
    gates : (T,) decays in (0, 1]. initial_state : (d_k, d_v) or None.
    scale : readout scale.

    Returns
    -------
    outputs : (T, d_v) array. final_state : (d_k, d_v) array.
    """
    q, k, v, b, s, scale = _check_sequence(queries, keys, values, betas, initial_state, scale)
    g = _check_gates(gates, "gates", (q.shape[0],))
    return _recurrent(q, k, v, b, g, s, scale, False)


def kda_recurrent(queries, keys, values, betas, gates, *, initial_state=None, scale=1.0):
    """Kimi Delta Attention over a sequence, one token at a time (``eq-dr-kda``).

    Parameters
    ----------
    queries, keys : (T, d_k). values : (T, d_v). betas : (T,) in [0, 1].
    gates : (T, d_k) per-channel decays in (0, 1], scaling the rows of S.
    initial_state : (d_k, d_v) or None. scale : readout scale.

    Returns
    -------
    outputs : (T, d_v) array. final_state : (d_k, d_v) array.
    """
    q, k, v, b, s, scale = _check_sequence(queries, keys, values, betas, initial_state, scale)
    g = _check_gates(gates, "gates", q.shape)
    return _recurrent(q, k, v, b, g, s, scale, True)


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
    """Chunkwise form for consecutive chunks q, k, v: (n, C, d), beta: (n, C, 1), b: cumulative log-decays.

    Returns the (n, C, d_v) outputs (unscaled) and the state after the last chunk.
    """
    n, C, d_k = k.shape
    d_v = v.shape[2]
    dtype = k.dtype
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
    u_free = uw[..., :d_v]                                                         # T (beta V)
    reads = np.empty((n, 2 * C, d_k), dtype=dtype)                                 # [W; Gamma Q]
    reads[:, :C] = uw[..., d_v:]                                                   # W = T (beta Gamma K)
    np.multiply(q, gamma, out=reads[:, C:])

    # The only sequential part: carry the state from chunk to chunk.
    S = S.copy()
    u = np.empty((n, C, d_v), dtype=dtype)
    out = np.empty((n, C, d_v), dtype=dtype)
    for j in range(n):
        read = reads[j] @ S                                                        # W S and Gamma Q S
        np.subtract(u_free[j], read[:C], out=u[j])                                 # eq-dr-ut
        out[j] = read[C:]
        S *= gamma_last[j]                                                         # eq-dr-chunk-state
        S += k_out[j].T @ u[j]
    out += np.matmul(qk, u)                                                        # eq-dr-chunk-out
    return out, S


def _chunkwise(queries, keys, values, betas, decays, state, scale, chunk_size, channelwise):
    T, d_k = keys.shape
    d_v = values.shape[1]
    dtype = _dtype(queries, keys, values, betas, decays, state)
    C = chunk_size
    n = max(1, -(-T // C))
    pad = n * C - T

    def padded(x, fill=0.0):
        x = x.astype(dtype, copy=False)
        if pad:
            x = np.concatenate([x, np.full((pad,) + x.shape[1:], fill, dtype=dtype)], axis=0)
        return x

    # Padding tokens have key 0, beta 0 and decay 1: they leave the state unchanged.
    q = padded(queries).reshape(n, C, d_k)
    k = padded(keys).reshape(n, C, d_k)
    v = padded(values).reshape(n, C, d_v)
    beta = padded(betas).reshape(n, C, 1)
    if decays is None:
        log_decay = np.zeros((n, C) + ((d_k,) if channelwise else ()), dtype=dtype)
    else:
        log_decay = np.log(padded(decays, 1.0)).reshape((n, C) + ((d_k,) if channelwise else ()))
    b = np.cumsum(log_decay, axis=1)                   # cumulative log-decay from the chunk start, <= 0

    # Chunks are processed in groups of about 256 tokens so that the intermediate
    # arrays stay in the processor's cache; the result does not depend on the grouping.
    S = np.zeros((d_k, d_v), dtype=dtype) if state is None else state.astype(dtype, copy=True)
    out = np.empty((n, C, d_v), dtype=dtype)
    group = max(1, _GROUP_TOKENS // C)
    for g0 in range(0, n, group):
        sl = slice(g0, min(n, g0 + group))
        out[sl], S = _chunk_group(q[sl], k[sl], v[sl], beta[sl], b[sl], S, channelwise)
    outputs = out.reshape(n * C, d_v)[:T]
    if scale != 1.0:
        outputs = outputs * dtype.type(scale)
    return outputs, S


def delta_rule_chunkwise(queries, keys, values, betas, *, initial_state=None, scale=1.0, chunk_size=64):
    """DeltaNet in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`delta_rule_recurrent`, plus
    ``chunk_size`` (an integer >= 1; the length need not be a multiple of it).
    """
    q, k, v, b, s, scale = _check_sequence(queries, keys, values, betas, initial_state, scale)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _chunkwise(q, k, v, b, None, s, scale, chunk_size, False)


def gated_delta_rule_chunkwise(queries, keys, values, betas, gates, *, initial_state=None, scale=1.0,
                               chunk_size=64):
    """Gated DeltaNet in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`gated_delta_rule_recurrent`, plus
    ``chunk_size``. Decay inside a chunk uses ``exp(b_r - b_i)`` with ``b`` the
    cumulative log-decay from the chunk start; all exponents are <= 0.
    """
    q, k, v, b, s, scale = _check_sequence(queries, keys, values, betas, initial_state, scale)
    g = _check_gates(gates, "gates", (q.shape[0],))
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _chunkwise(q, k, v, b, g, s, scale, chunk_size, False)


def kda_chunkwise(queries, keys, values, betas, gates, *, initial_state=None, scale=1.0, chunk_size=64):
    """Kimi Delta Attention in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`kda_recurrent`, plus ``chunk_size``.
    Per-channel decays between two positions of a chunk are ``exp(b_r - b_i)``
    with ``b`` the (C, d_k) cumulative log-decays from the chunk start. Pairs in
    different sub-blocks of 16 (or the largest divisor of ``chunk_size`` below
    16) factor through a reference point between them, so both factors have
    exponents <= 0; pairs inside one sub-block use the differences directly.
    """
    q, k, v, b, s, scale = _check_sequence(queries, keys, values, betas, initial_state, scale)
    g = _check_gates(gates, "gates", q.shape)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _chunkwise(q, k, v, b, g, s, scale, chunk_size, True)


# --------------------------------------------------------------------------- the four-writes figure

FOUR_WRITES_KEYS = ("a", "b", "c")


def four_writes(gate=1.0, beta=1.0, overlap=0.6):
    """The four writes of the interactive figure, in plain linear attention and the gated delta rule.

    Into a 4x4 state: value e1 under key a = e1, e2 under b = e2, e3 under
    c = overlap * e1 + sqrt(1 - overlap^2) * e3 (unit length, ``a . c = overlap``),
    then a new value e4 under a. Plain linear attention adds each ``k v^T``
    (eq-la-recurrent); the gated delta rule applies ``eq-dr-gated`` with the
    given gate and beta at every write.

    Returns a dict with ``keys`` (name -> (4,) key), ``targets`` (name -> the
    latest value written under it), ``linear`` and ``delta`` (name -> what each
    state recalls, ``S^T k``), and the two final states ``linear_state`` and
    ``delta_state``.
    """
    overlap = float(check_interval(as_float_array(overlap, "overlap", ndim=0), "overlap", 0.0, 1.0))
    eye = np.eye(4)
    keys = {"a": eye[0], "b": eye[1], "c": overlap * eye[0] + math.sqrt(1.0 - overlap ** 2) * eye[2]}
    writes = [("a", eye[0]), ("b", eye[1]), ("c", eye[2]), ("a", eye[3])]
    s_lin = np.zeros((4, 4))
    s_delta = np.zeros((4, 4))
    for name, value in writes:
        s_lin = additive_step(s_lin, keys[name], value)
        _, s_delta = gated_delta_rule_step(s_delta, keys[name], keys[name], value, beta, gate)
    targets = {"a": eye[3], "b": eye[1], "c": eye[2]}
    return {
        "keys": keys, "targets": targets,
        "linear": {n: s_lin.T @ keys[n] for n in FOUR_WRITES_KEYS},
        "delta": {n: s_delta.T @ keys[n] for n in FOUR_WRITES_KEYS},
        "linear_state": s_lin, "delta_state": s_delta,
    }


def draw_four_writes(gate=1.0, beta=1.0, overlap=0.6):
    """Draw the interactive delta-rule figure for one setting of the sliders.

    One panel per key (a, b, c): the four components of the value each layer
    recalls, as bars (plain linear attention, gated delta rule), with the target
    (the latest value written under that key) as black outlines. Returns the
    matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    res = four_writes(gate, beta, overlap)
    fig, axes = plt.subplots(1, 3, figsize=(7.2, 2.8), sharey=True)
    x = np.arange(4)
    for ax, name in zip(axes, FOUR_WRITES_KEYS):
        target = res["targets"][name]
        lin, dlt = res["linear"][name], res["delta"][name]
        ax.bar(x - 0.2, lin, width=0.38, color="tab:orange", label="linear attention")
        ax.bar(x + 0.2, dlt, width=0.38, color="tab:blue", label="delta rule")
        ax.bar(x, target, width=0.8, fill=False, edgecolor="black", linewidth=1.2, label="target")
        err_l = np.linalg.norm(lin - target)
        err_d = np.linalg.norm(dlt - target)
        ax.set_title(f"recall of {name}\nerror: linear {err_l:.2f}, delta {err_d:.2f}")
        ax.set_xticks(x, ["e1", "e2", "e3", "e4"])
        ax.set_ylim(-0.7, 2.1)
        ax.axhline(0.0, color="gray", linewidth=0.6)
    axes[0].set_ylabel("recalled component")
    axes[0].legend(loc="upper left", fontsize=7, frameon=False)
    fig.suptitle(f"gate {gate:g}, beta {beta:g}, overlap a.c = {overlap:g}", fontsize=9)
    return fig


# --------------------------------------------------------------------------- timing

def time_forms(T, d_k=128, d_v=128, *, dtype=np.float64, chunk_size=64, repeats=3, layer="gated", seed=0):
    """Time the recurrent and chunkwise forms of one layer on random data.

    Parameters
    ----------
    T, d_k, d_v : sizes. dtype : float32 or float64. chunk_size : for the chunkwise form.
    repeats : best of this many runs is reported. layer : "delta", "gated" or "kda".

    Returns
    -------
    dict with ``recurrent`` and ``chunkwise`` (seconds, best of ``repeats``),
    ``ratio`` (recurrent / chunkwise) and ``max_rel_diff`` between the outputs.
    """
    T = check_positive_int(T, "T")
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    q = rng.standard_normal((T, d_k)).astype(dtype)
    k = rng.standard_normal((T, d_k))
    k = (k / np.linalg.norm(k, axis=1, keepdims=True)).astype(dtype)
    v = rng.standard_normal((T, d_v)).astype(dtype)
    betas = rng.uniform(0.1, 0.9, T).astype(dtype)
    if layer == "delta":
        rec, chk, extra = delta_rule_recurrent, delta_rule_chunkwise, ()
    elif layer == "gated":
        rec, chk, extra = gated_delta_rule_recurrent, gated_delta_rule_chunkwise, (
            rng.uniform(0.9, 1.0, T).astype(dtype),)
    elif layer == "kda":
        rec, chk, extra = kda_recurrent, kda_chunkwise, (
            kda_decay(rng.standard_normal((T, d_k)) - 3.0).astype(dtype),)
    else:
        raise ValueError(f"layer: expected 'delta', 'gated' or 'kda', got {layer!r}")

    def best(fn, **kw):
        times, out = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn(q, k, v, betas, *extra, **kw)
            times.append(time.perf_counter() - t0)
        return min(times), out

    t_rec, (o_rec, _) = best(rec)
    t_chk, (o_chk, _) = best(chk, chunk_size=chunk_size)
    rel = float(np.max(np.abs(o_chk - o_rec)) / max(np.max(np.abs(o_rec)), np.finfo(dtype).tiny))
    return {"recurrent": t_rec, "chunkwise": t_chk, "ratio": t_rec / t_chk, "max_rel_diff": rel}
