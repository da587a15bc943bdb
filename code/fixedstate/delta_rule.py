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
  built from products of the per-token decays ``exp(log_gate) <= 1``, level by
  level over halves of the chunk, so no exponent is ever positive (no
  ``1/Gamma`` is ever formed). These forms run their matrix products with one
  BLAS thread whatever the caller's setting, restored on return (see
  ``fixedstate._threads``);
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

import functools
import math
import numbers

import numpy as np
from scipy.linalg import blas as scipy_blas
from scipy.linalg import solve_triangular
from scipy.special import expit

from ._threads import one_blas_thread
from ._validate import (Arg, as_float_array, as_float_batch, broadcast_leading, check_interval, check_log_gate,
                        check_positive_int, float_dtype, prepare_layer_args)

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
    args = [Arg("q", q, ("T", "d_k")), Arg("k", k, ("T", "d_k")), Arg("v", v, ("T", "d_v")),
            Arg("beta", beta, ("T",), lambda x: check_interval(x, "beta", 0.0, 1.0))]
    if gate is not None:
        args.append(Arg("log_gate", log_gate, ("T", "d_k") if gate == "channel" else ("T",), check_log_gate,
                        allow_nonfinite=True))
    lead, arrays, initial_state, scale = prepare_layer_args(
        args, initial_state=initial_state, scale=scale, tokens=tokens, min_length=min_length,
        one_sequence="use the *_recurrent or *_chunkwise forms for batches" if one_sequence else None)
    q, k, v, beta = arrays[:4]
    return lead, q, k, v, beta, arrays[4] if gate is not None else None, initial_state, scale


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

@one_blas_thread
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
#
# How the fast form computes the decays inside a chunk. The decay between tokens i <= r
# of one chunk is e^{b_r - b_i} = alpha_{i+1} ... alpha_r, a product of per-token decays
# alpha_t = e^{log_gate_t} <= 1 (one per key channel for KDA). The products are built
# level by level. At level h the chunk is cut into aligned blocks of 2h tokens, each a
# first half F and a second half G of h tokens, and two running products are kept:
#
#   fwd[r]  = alpha_s ... alpha_r         (s the first token of r's block of h)
#   bwd[i]  = alpha_{i+1} ... alpha_e     (e the last token of i's block of h)
#
# For r in G and i in F the decay factors through the boundary between the halves:
# e^{b_r - b_i} = bwd[i] * fwd[r], two factors <= 1. Then the halves merge (fwd on G is
# multiplied by F's product, bwd on F by G's product) and h doubles. Every pair i < r
# meets at exactly one level. For Gated DeltaNet the factors are numbers: they fill the
# C x C decay matrix, which scales the products q_r^T k_i. For KDA they are vectors over
# the key channels and scale the rows of Q, K before the products, so each level's
# pairs are one batched matrix product (secondary chunking, down to single tokens).
# The only exponentials are alpha_t = e^{log_gate_t}: no exponent is ever positive, and
# no 1/Gamma is formed. At the top level fwd is Gamma_r = e^{b_r} and bwd is
# e^{b_C - b_i}, the two decays of eq-dr-chunk-out and eq-dr-chunk-state.
#
# The same levels invert the unit lower-triangular I + A of the UT transform: the inverse
# of a block of 2h tokens is [[T_F, 0], [-T_G A_GF T_F, T_G]] with T_F, T_G the inverses
# of its halves. Chunks that are not a power of two long get padding tokens (key 0,
# beta 0, log-decay 0) at their end, which change nothing.

_matmul = np.matmul   # every matrix product of the chunkwise form goes through this name or _matmul_add
# The products that _matmul_add does in one gemm call. scipy's BLAS (its own OpenBLAS build) is
# used for float64 only: in float32 its gemm ran about a fifth slower than numpy's on these shapes
# (64 to 128 rows and columns), more than the passes over the result that it saves.
_GEMM = {np.dtype(np.float64): scipy_blas.dgemm}


def _fortran(x):
    """``(y, trans)`` with ``y`` F-contiguous and ``op(y) = x^T`` for BLAS, or None if x is neither layout."""
    if x.flags.c_contiguous:
        return x.T, 0
    if x.flags.f_contiguous:
        return x, 1
    return None


def _matmul_add(a, b, out, keep, sign=1.0):
    """``out <- keep * out + sign * (a @ b)`` for 2-D arrays in one BLAS call (gemm's alpha and beta).

    ``out`` C-contiguous. A state update ``S <- g S + K^T U`` or ``U <- U~ - W S``
    without the passes over the result that scaling, adding or subtracting
    would take. Counted like a product of ``a`` and ``b``.
    """
    gemm = _GEMM.get(out.dtype)
    fa, fb = _fortran(a), _fortran(b)
    if gemm is None or fa is None or fb is None or not out.flags.c_contiguous or a.dtype != out.dtype \
            or b.dtype != out.dtype:
        product = np.matmul(a, b)
        if keep != 1.0:
            out *= keep
        if sign != 1.0:
            product *= sign
        out += product
        return out
    # in Fortran's column-major view out is out^T: out^T <- keep out^T + sign b^T a^T
    (y_b, trans_b), (y_a, trans_a) = fb, fa
    res = gemm(float(sign), y_b, y_a, beta=float(keep), c=out.T, trans_a=trans_b, trans_b=trans_a, overwrite_c=1)
    if not np.shares_memory(res, out):
        out[...] = res.T
    return out


def _levels(C):
    """The half-block sizes h = 1, 2, 4, ..., C/2 of a chunk of C (a power of two) tokens."""
    h = 1
    while h < C:
        yield h
        h *= 2


def _blocks(x, h, row0, col0):
    """A writable view (N, C/(2h), h, h) of blocks of x (N, R, C), a C-contiguous array.

    Block j is x[:, row0 + 2hj : row0 + 2hj + h, col0 + 2hj : col0 + 2hj + h]: with
    (row0, col0) = (h, 0) the lower-left quarters of the diagonal blocks of 2h, with
    (0, 0) and (h, h) their two diagonal halves.
    """
    N, R, C = x.shape
    item = x.itemsize
    return np.ndarray((N, C // (2 * h), h, h), x.dtype, x, offset=(row0 * C + col0) * item,
                      strides=(R * C * item, 2 * h * (C + 1) * item, C * item, item))


def _chunk_decays(alpha, decay=None, q=None, k=None, qk=None, kk=None):
    """Decays inside each chunk, level by level; for KDA also the decayed pair products.

    ``alpha``: (N, C) per-token decays (Gated DeltaNet) or (N, C, d_k) (KDA), C a
    power of two. Returns ``gamma`` (e^{b_r}, shaped like alpha) and ``to_end``
    (e^{b_C - b_i}). Scalar gates: writes e^{b_r - b_i} (i < r) into ``decay``
    (N, C, C). Per-channel gates: writes the decayed products sum_c q_rc k_ic
    e^{b_rc - b_ic} (i < r) into ``qk`` and the same with k_r into ``kk``.
    """
    N, C = alpha.shape[:2]
    channels = alpha.shape[2:]
    fwd = alpha.copy()
    bwd = np.ones_like(alpha)
    for h in _levels(C):
        shape = (N, C // (2 * h), 2, h) + channels
        f, b = fwd.reshape(shape), bwd.reshape(shape)
        if not channels:
            np.multiply(f[:, :, 1, :, None], b[:, :, 0, None, :], out=_blocks(decay, h, h, 0))
        else:
            qb, kb = q.reshape(shape), k.reshape(shape)
            left = np.empty((N, C // (2 * h), 2 * h) + channels, dtype=alpha.dtype)
            np.multiply(qb[:, :, 1], f[:, :, 1], out=left[:, :, :h])       # q_r fwd[r], r in G
            np.multiply(kb[:, :, 1], f[:, :, 1], out=left[:, :, h:])       # k_r fwd[r]
            right = kb[:, :, 0] * b[:, :, 0]                                 # k_i bwd[i], i in F
            both = _matmul(left, right.swapaxes(-1, -2))                     # (N, C/2h, 2h, h)
            _blocks(qk, h, h, 0)[...] = both[:, :, :h]
            _blocks(kk, h, h, 0)[...] = both[:, :, h:]
        b[:, :, 0] *= f[:, :, 1, -1:]                                        # bwd over F: times G's product
        f[:, :, 1] *= f[:, :, 0, -1:]                                        # fwd over G: times F's product
    return fwd, bwd


def _unit_lower_inverse(a):
    """(I + A)^{-1} for A the strictly lower part of ``a`` (N, C, C), by doubling blocks.

    The blocks of 4 on the diagonal are written entry by entry (forward
    substitution, each entry one array over all blocks); from there the blocks
    double by products.
    """
    N, C, _ = a.shape
    inv = np.zeros((N, C, C), dtype=a.dtype)
    inv.reshape(N, C * C)[:, ::C + 1] = 1.0
    first = 1
    if C >= 4:
        item = a.itemsize
        strides = (C * C * item, 4 * (C + 1) * item, C * item, item)     # the (N, C/4, 4, 4) diagonal blocks
        d = np.ndarray((N, C // 4, 4, 4), a.dtype, a, strides=strides)
        t = np.ndarray((N, C // 4, 4, 4), a.dtype, inv, strides=strides)
        for r in range(1, 4):                                             # t_rc = -(a_rc + sum_{c<j<r} a_rj t_jc)
            for c in range(r - 1, -1, -1):
                acc = t[..., r, c]
                np.multiply(d[..., r, c], -1.0, out=acc)
                for j in range(c + 1, r):
                    acc -= d[..., r, j] * t[..., j, c]
        first = 4
    for h in _levels(C):
        if h < first:
            continue
        a_gf = _blocks(a, h, h, 0)
        t_gf = _blocks(inv, h, h, 0)
        # (np.multiply by -1, not np.negative: numpy 2.4's negative misreads some strided views)
        if h == 1:
            np.multiply(a_gf, -1.0, out=t_gf)
        else:
            a_t = _matmul(a_gf, _blocks(inv, h, 0, 0))
            a_t *= -1.0
            _matmul(_blocks(inv, h, h, h), a_t, out=t_gf)
    return inv


def _scalar_prep(k, beta, alpha):
    """Gated DeltaNet (and DeltaNet): the chunkwise form's C x C work that does not involve Q.

    ``k``: (n, C, d_k) with C a power of two; ``beta``: (n, C, 1); ``alpha``: the
    per-token decays e^{log_gate}, (n, C). Returns the decay matrices
    e^{b_r - b_i} (n, C, C; one on the diagonal, zero above it); the UT transform
    T = (I + A)^{-1} with A_ri = beta_r e^{b_r - b_i} k_r^T k_i for i < r (eq-dr-ut),
    its columns scaled by beta and by beta Gamma (T diag(beta) V is U~, T diag(beta
    Gamma) K is W); and ``gamma`` = e^{b_r}, ``to_end`` = e^{b_C - b_r}, (n, C, 1).
    """
    n, C = alpha.shape
    decay = np.zeros((n, C, C), dtype=alpha.dtype)
    decay.reshape(n, C * C)[:, ::C + 1] = 1.0
    gamma, to_end = _chunk_decays(alpha, decay=decay)
    a = _matmul(k, k.swapaxes(-1, -2))
    a *= decay
    a *= beta
    ut_beta = _unit_lower_inverse(a)
    ut_beta *= beta.swapaxes(-1, -2)
    ut_beta_gamma = ut_beta * gamma[:, None, :]
    return decay, (ut_beta, ut_beta_gamma), gamma[..., None], to_end[..., None]


def _kda_prep(q, k, beta, alpha):
    """KDA: the chunkwise form's C x C work, the pair products with per-channel decays.

    ``q, k``: (n, C, d_k) with C a power of two; ``beta``: (n, C, 1); ``alpha``:
    (n, C, d_k). Returns ``qk`` (the decayed q_r^T k_i for i <= r, zero above the
    diagonal), the UT transform (eq-dr-ut), and ``gamma``, ``to_end`` (n, C, d_k).
    """
    n, C, d_k = k.shape
    qk = np.zeros((n, C, C), dtype=k.dtype)
    a = np.zeros((n, C, C), dtype=k.dtype)
    gamma, to_end = _chunk_decays(alpha, q=q, k=k, qk=qk, kk=a)
    qk.reshape(n, C * C)[:, ::C + 1] = np.einsum("nrc,nrc->nr", q, k)
    a *= beta
    return qk, _unit_lower_inverse(a), gamma, to_end


def _state_pass(q, k, v, beta, qk, ut, gamma, to_end, S, channelwise):
    """The rest of the chunkwise form for a group of consecutive chunks of B sequences.

    ``q, k, v``: (B, g, C, d); ``beta``: (B, g, C, 1); ``qk``, ``ut``, ``gamma``,
    ``to_end``: as :func:`_kda_prep` returns them, for the B * g chunks (for
    scalar gates ``ut`` is the pair T diag(beta), T diag(beta Gamma) of
    :func:`_scalar_prep`); ``S``: the
    (B, d_k, d_v) states entering the group, updated in place. Returns the
    (B, g, C, d_v) outputs (unscaled). Every product that does not involve the
    carried state is done for all B * g chunks at once.
    """
    B, g, C, d_k = k.shape
    d_v = v.shape[-1]
    dtype = k.dtype
    n = B * g
    q, k, v, beta = (x.reshape((n,) + x.shape[2:]) for x in (q, k, v, beta))
    # eq-dr-ut: U~ = T diag(beta) V and W = T diag(beta Gamma) K; W and Gamma Q both read the state
    reads = np.empty((n, 2 * C, d_k), dtype=dtype)                                # [W; Gamma Q]
    np.multiply(q, gamma, out=reads[:, C:])
    if not channelwise:                                                           # T's columns scaled, not V and K
        u_free = _matmul(ut[0], v)
        _matmul(ut[1], k, out=reads[:, :C])
    else:
        u_free = _matmul(ut, v * beta)
        _matmul(ut, k * (gamma * beta), out=reads[:, :C])
    k_out_t = (k * to_end).swapaxes(-1, -2)                                      # (e^{b_C - b_i} k_i)^T
    decay_last = gamma[:, -1, :, None]                                            # (n, 1 or d_k, 1)

    # The only sequential part: carry the state from chunk to chunk.
    reads, u_free, k_out_t, decay_last = (x.reshape((B, g) + x.shape[1:])
                                          for x in (reads, u_free, k_out_t, decay_last))
    read = np.empty((B, g, 2 * C, d_v), dtype=dtype)                             # [W S; Gamma Q S]
    u = np.empty((B, g, C, d_v), dtype=dtype)
    write = np.empty((B, d_k, d_v), dtype=dtype)
    if B == 1:  # one sequence: plain matrix products
        S2, write2 = S[0], write[0]
        for j in range(g):
            _matmul(reads[0, j], S2, out=read[0, j])
            np.subtract(u_free[0, j], read[0, j, :C], out=u[0, j])               # U = U~ - W S
            if channelwise:                                                       # eq-dr-chunk-state
                S2 *= decay_last[0, j]
                S2 += _matmul(k_out_t[0, j], u[0, j], out=write2)
            else:                                                                 # S <- g S + K_out^T U
                _matmul_add(k_out_t[0, j], u[0, j], S2, decay_last[0, j, 0, 0])
    else:
        for j in range(g):
            _matmul(reads[:, j], S, out=read[:, j])
            np.subtract(u_free[:, j], read[:, j, :C], out=u[:, j])
            S *= decay_last[:, j]
            S += _matmul(k_out_t[:, j], u[:, j], out=write)
    out = _matmul(qk, u.reshape(n, C, d_v))                                       # eq-dr-chunk-out
    out += read.reshape(n, 2 * C, d_v)[:, C:]
    return out.reshape(B, g, C, d_v)


# The chunks of a call are processed in groups: a block of sequences times consecutive
# chunks whose (tokens x d) arrays take about _GROUP_BYTES (256 tokens of d = 128 in
# float64, 512 in float32), so that a group's intermediate arrays stay in the processor's
# cache while numpy's per-call overhead is spread over several chunks. For Gated DeltaNet
# the C x C work that does not involve the queries (decays, UT transform: many small
# calls) is done for ranges of chunks whose C x C arrays take up to _RANGE_BYTES. The
# result depends on neither size.
_GROUP_BYTES = 256 * 1024
_RANGE_BYTES = 8 * 1024 * 1024


def _split_chunks(x, fill=0.0, *, chunk_size):
    """``x`` (B, T, ...) as (B, n, C2, ...): n = ceil(T / C) chunks of C = ``chunk_size`` tokens, each padded
    with ``fill`` to C2, C rounded up to a power of two (a view when no padding is needed).

    The chunkwise forms pad with tokens that change nothing (key 0, decay 1).
    """
    B, T = x.shape[:2]
    C = chunk_size
    C2 = 1 << (C - 1).bit_length()
    n = max(1, -(-T // C))
    if n * C == T and C2 == C:
        return x.reshape((B, n, C) + x.shape[2:])
    out = np.full((B, n, C2) + x.shape[2:], fill, dtype=x.dtype)
    full = (T // C) * C
    out[:, :T // C, :C] = x[:, :full].reshape((B, T // C, C) + x.shape[2:])
    if full < T:
        out[:, -1, :T - full] = x[:, full:]
    return out


@one_blas_thread
def _chunkwise(q, k, v, beta, log_gate, S, scale, chunk_size, channelwise):
    """q, k, v: (B, T, d); beta: (B, T); log_gate: (B, T[, d_k]) or None; S: (B, d_k, d_v) or None."""
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    C = chunk_size
    C2 = 1 << (C - 1).bit_length()                  # C rounded up to a power of two
    n = max(1, -(-T // C))

    chunks = functools.partial(_split_chunks, chunk_size=C)

    # Padding tokens have key 0, beta 0 and decay 1: they leave the state unchanged.
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    betac = chunks(beta)[..., None]
    if log_gate is None:
        alpha = np.ones((B, n, C2) + ((d_k,) if channelwise else ()), dtype=dtype)
    else:
        alpha = chunks(np.exp(log_gate), fill=1.0)   # the per-token decays, exponents <= 0

    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    out = np.empty((B, n, C2, d_v), dtype=dtype)
    group_tokens = max(C2, _GROUP_BYTES // (max(d_k, d_v) * dtype.itemsize))
    per_block = max(1, group_tokens // C2)                          # sequences side by side
    for i0 in range(0, B, per_block):
        items = slice(i0, min(B, i0 + per_block))
        m = items.stop - i0
        group = max(1, group_tokens // (C2 * m))                    # consecutive chunks
        span = group * max(1, _RANGE_BYTES // (group * m * C2 * C2 * dtype.itemsize))
        S_items = S[items]
        for r0 in range(0, n, span):
            r = slice(r0, min(n, r0 + span))
            flat = lambda x: x.reshape((-1,) + x.shape[2:])      # (m, chunks, ...) -> (m * chunks, ...)
            if not channelwise:
                decay, (ut_beta, ut_beta_gamma), gamma, to_end = _scalar_prep(
                    flat(kc[items, r]), flat(betac[items, r]), flat(alpha[items, r]))
                prep = [x.reshape((m, r.stop - r0) + x.shape[1:])
                        for x in (decay, ut_beta, ut_beta_gamma, gamma, to_end)]
            for g0 in range(r0, r.stop, group):
                sl = slice(g0, min(r.stop, g0 + group))
                q_g, k_g, v_g, beta_g = (x[items, sl] for x in (qc, kc, vc, betac))
                if channelwise:
                    qk, ut, gamma, to_end = _kda_prep(flat(q_g), flat(k_g), flat(beta_g), flat(alpha[items, sl]))
                else:
                    decay, ut_beta, ut_beta_gamma, gamma, to_end = (flat(x[:, g0 - r0:sl.stop - r0]) for x in prep)
                    ut = (ut_beta, ut_beta_gamma)
                    qk = _matmul(flat(q_g), flat(k_g).swapaxes(-1, -2))
                    qk *= decay
                out[items, sl] = _state_pass(q_g, k_g, v_g, beta_g, qk, ut, gamma, to_end, S_items, channelwise)
        S[items] = S_items
    outputs = out[:, :, :C].reshape(B, n * C, d_v)[:, :T]
    if scale != 1.0:
        outputs = outputs * dtype.type(scale)
    return outputs, S


def delta_rule_chunkwise(q, k, v, *, beta, scale=1.0, initial_state=None, chunk_size=64):
    """DeltaNet in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`delta_rule_recurrent` (shapes with
    leading axes ``...``), plus ``chunk_size`` (an integer >= 1; the length need
    not be a multiple of it; one that is not a power of two is padded up to
    one inside each chunk). The leading axes are processed inside the same
    matrix products, not one item at a time. The matrix products run with one
    BLAS thread; :func:`fixedstate.costs.delta_rule_chunkwise_flops` counts them.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _run(_chunkwise, q, k, v, beta, None, scale, initial_state, None, chunk_size)


def gated_delta_rule_chunkwise(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None, chunk_size=64):
    """Gated DeltaNet in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`gated_delta_rule_recurrent`, plus
    ``chunk_size``. The decay between tokens i <= r of a chunk,
    ``exp(b_r - b_i)`` with ``b`` the cumulative log-decay from the chunk start,
    is built as a product of the per-token decays ``exp(log_gate) <= 1`` (level by
    level over halves of the chunk), so no exponent is ever positive.
    :func:`gated_delta_rule_chunk` is one chunk of it, written plainly.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _run(_chunkwise, q, k, v, beta, log_gate, scale, initial_state, "scalar", chunk_size)


def kda_chunkwise(q, k, v, *, beta, log_gate, scale=1.0, initial_state=None, chunk_size=64):
    """Kimi Delta Attention in chunkwise-parallel form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    Same arguments and results as :func:`kda_recurrent`, plus ``chunk_size``.
    Per-channel decays between two positions of a chunk are ``exp(b_r - b_i)``
    with ``b`` the (C, d_k) cumulative log-decays from the chunk start. Each chunk
    is cut in halves, the halves in halves, down to single tokens; a pair i < r
    in the two halves of a block factors through the boundary p between them,
    ``exp(b_r - b_p) exp(b_p - b_i)``, both products of per-token decays <= 1, so
    the pairs of one level are one batched matrix product and no exponent is
    ever positive.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _run(_chunkwise, q, k, v, beta, log_gate, scale, initial_state, "channel", chunk_size)


# --------------------------------------------------------------------------- backward passes (chapter 9)
#
# The gradient of a loss L through the recurrence S_t = G_t S_{t-1} + beta_t k_t (v_t - (G_t S_{t-1})^T k_t)^T,
# o_t = scale * S_t^T q_t. The states are recomputed token by token with _step (the forward's own code);
# then the gradient of the state runs backwards in time through the erase factors:
#
#     dS_t = scale * q_t do_t^T + G_{t+1} (I - beta_{t+1} k_{t+1} k_{t+1}^T) dS_{t+1}
#
# and each token reads its gradients off dS_t (the derivation is in chapter 9).

from ._grad import sum_to, time_major  # noqa: E402  (kept here so that the section stands alone)

__all__ += ["gated_delta_rule_backward", "delta_rule_backward", "kda_backward"]


def _backward(q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, gate):
    """The reverse-time scan shared by the delta-rule backward passes; returns the six gradients."""
    shapes = {name: np.shape(x) for name, x in
              (("q", q), ("k", k), ("v", v), ("beta", beta), ("log_gate", log_gate), ("initial_state", initial_state))}
    lead, Q, K, V, Beta, G, S0, c = _prepare(q, k, v, beta, log_gate, scale, initial_state, gate=gate,
                                             min_length=1)
    T, d_k, d_v = Q.shape[-2], Q.shape[-1], V.shape[-1]
    dtype = float_dtype(Q, d_out, d_final_state)                   # as the forward: float16 counts as float32
    d_out = as_float_batch(d_out, "d_out", (T, d_v), ("T", "d_v"))
    items = [("q", Q, 2), ("d_out", d_out, 2)]
    if d_final_state is not None:
        d_final_state = as_float_batch(d_final_state, "d_final_state", (d_k, d_v), ("d_k", "d_v"))
        items.append(("d_final_state", d_final_state, 2))
    lead = broadcast_leading(*items)
    channelwise = gate == "channel"

    def fit(a, n):
        return None if a is None else np.broadcast_to(a.astype(dtype, copy=False), lead + a.shape[a.ndim - n:])

    # time-major copies (token t is Q[t], contiguous), broadcast to the leading axes
    Q, K, V, dO = (time_major(fit(a, 2), -2) for a in (Q, K, V, d_out))
    Beta = time_major(fit(Beta, 1), -1)
    decays = None if G is None else time_major(np.exp(fit(G, 1 + channelwise)), -1 - channelwise)
    S0 = fit(S0, 2)
    c = dtype.type(c)

    # the forward again with _step, storing the state before (S_{t-1}) and after (S_t) each token
    before = np.empty((T,) + lead + (d_k, d_v), dtype=dtype)
    after = np.empty_like(before)
    S = np.zeros(lead + (d_k, d_v), dtype=dtype) if S0 is None else S0
    G = None if G is None else time_major(fit(G, 1 + channelwise), -1 - channelwise)
    for t in range(T):
        before[t] = S
        _, S = _step(Q[t], K[t], V[t], Beta[t], None if G is None else G[t], S, 1.0, channelwise)
        after[t] = S

    # the gradient of the state, backwards in time (dS_t stored for every t) ...
    writes = c * (Q[..., :, None] * dO[..., None, :])                           # scale q_t do_t^T, all t
    beta_keys = Beta[..., None] * K                                             # beta_t k_t
    dS = np.zeros(lead + (d_k, d_v), dtype=dtype) if d_final_state is None else fit(d_final_state, 2).copy()
    d_states = np.empty_like(before)
    for t in range(T - 1, -1, -1):
        dS += writes[t]
        d_states[t] = dS                                                        # dS_t
        dS -= beta_keys[t][..., :, None] * (K[t][..., None, :] @ dS)            # (I - beta k k^T) dS_t
        if decays is not None:
            dS *= decays[t][..., :, None] if channelwise else decays[t][..., None, None]   # through G_t

    # ... then every token's gradients at once
    if decays is None:
        decayed = before                                                        # P_t = S_{t-1}
    else:
        decayed = (decays[..., :, None] if channelwise else decays[..., None, None]) * before   # P_t = G_t S_{t-1}
    error = V - (K[..., None, :] @ decayed)[..., 0, :]                          # e_t = v_t - P_t^T k_t
    dS_k = (K[..., None, :] @ d_states)[..., 0, :]                              # dS_t^T k_t
    dS_e = (d_states @ error[..., :, None])[..., 0]                             # dS_t e_t
    dbeta = np.sum(K * dS_e, axis=-1)                                           # k_t^T dS_t e_t
    dv = Beta[..., None] * dS_k
    dk = Beta[..., None] * (dS_e - (decayed @ dS_k[..., :, None])[..., 0])
    dgate = None
    if decays is not None:
        d_decayed = d_states - beta_keys[..., :, None] * dS_k[..., None, :]     # (I - beta k k^T) dS_t
        dgate = np.sum(d_decayed * decayed, axis=-1 if channelwise else (-2, -1))   # row by row for KDA
    dq = c * (after @ dO[..., None])[..., 0]                                    # scale S_t do_t
    dq, dk, dv = (np.moveaxis(a, 0, -2) for a in (dq, dk, dv))
    dbeta = np.moveaxis(dbeta, 0, -1)
    dgate = None if G is None else np.moveaxis(dgate, 0, -1 - channelwise)
    return (sum_to(dq, shapes["q"]), sum_to(dk, shapes["k"]), sum_to(dv, shapes["v"]),
            sum_to(dbeta, shapes["beta"]), None if G is None else sum_to(dgate, shapes["log_gate"]),
            dS if initial_state is None else sum_to(dS, shapes["initial_state"]))


def gated_delta_rule_backward(q, k, v, d_out, *, beta, log_gate, scale=1.0, initial_state=None,
                              d_final_state=None):
    """The gradients of Gated DeltaNet (``eq-dr-gated``): the reverse-time scan ``eq-bw-dr-state``, ``eq-bw-dr-grads``.

    With ``P_t = g_t S_{t-1}`` (``g_t = exp(log_gate_t)``), the error
    ``e_t = v_t - P_t^T k_t`` and ``S_t = P_t + beta_t k_t e_t^T``, the states are
    recomputed with the forward's one-token code; then, backwards in time, the
    gradient of the state collects the readout and passes through the erase factor
    and the gate:

        dS_t = scale * q_t do_t^T + g_{t+1} (I - beta_{t+1} k_{t+1} k_{t+1}^T) dS_{t+1}

    (``dS_T = scale * q_T do_T^T + d_final_state``), and each token reads off
    ``dq_t = scale * S_t do_t``, ``dv_t = beta_t dS_t^T k_t``,
    ``dk_t = beta_t (dS_t e_t - P_t dS_t^T k_t)``, ``dbeta_t = k_t^T dS_t e_t``,
    ``dlog_gate_t = <(I - beta_t k_t k_t^T) dS_t, P_t>``; the gradient with respect
    to the initial state is ``g_1 (I - beta_1 k_1 k_1^T) dS_1``.

    Parameters
    ----------
    q, k : (..., T, d_k). v : (..., T, d_v). d_out : (..., T, d_v), the gradient of the loss
        with respect to the outputs.
    beta : (..., T) in [0, 1]. log_gate : (..., T) log-decays <= 0. scale : readout scale.
    initial_state : (..., d_k, d_v) or None (zeros).
    d_final_state : (..., d_k, d_v), the gradient with respect to the final state, or None (zero).

    Returns
    -------
    dq, dk, dv, dbeta, dlog_gate : arrays of the shapes of the inputs (summed over the
        leading axes along which an input was broadcast), in the common precision.
    d_initial_state : the shape of ``initial_state``; when it is None, the gradient with
        respect to a zero initial state, ``(..., d_k, d_v)``.
    """
    return _backward(q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, "scalar")


def delta_rule_backward(q, k, v, d_out, *, beta, scale=1.0, initial_state=None, d_final_state=None):
    """The gradients of DeltaNet (``eq-dr-delta``): ``eq-bw-dr-grads`` with the gate 1.

    Calls :func:`gated_delta_rule_backward` with ``log_gate = 0`` and drops the
    gate's gradient. Returns ``(dq, dk, dv, dbeta, d_initial_state)``; arguments as
    there, without ``log_gate``.
    """
    zeros = np.zeros(np.shape(beta), dtype=float_dtype(beta))
    dq, dk, dv, dbeta, _, ds0 = gated_delta_rule_backward(q, k, v, d_out, beta=beta, log_gate=zeros, scale=scale,
                                                          initial_state=initial_state, d_final_state=d_final_state)
    return dq, dk, dv, dbeta, ds0


def kda_backward(q, k, v, d_out, *, beta, log_gate, scale=1.0, initial_state=None, d_final_state=None):
    """The gradients of Kimi Delta Attention (``eq-dr-kda``): ``eq-bw-dr-state`` with a gate per key channel.

    The gate is ``Diag(alpha_t)`` with ``alpha_t = exp(log_gate_t)`` per key channel:
    ``dS_{t-1}`` gets ``Diag(alpha_t) (I - beta_t k_t k_t^T) dS_t``, and
    ``dlog_gate_t[i]`` is row ``i`` of ``(I - beta_t k_t k_t^T) dS_t`` times row ``i``
    of ``P_t = Diag(alpha_t) S_{t-1}``, summed. ``log_gate`` is ``(..., T, d_k)``;
    the rest as :func:`gated_delta_rule_backward`, whose six gradients it returns.
    """
    return _backward(q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, "channel")
