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
  ``fixedstate._threads``); their chunk machinery is :func:`fixedstate.kernels.delta_chunks`;
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

from ._grad import sum_to, time_major
from ._validate import (Arg, as_float_array, as_float_batch, broadcast_leading, check_interval, check_log_gate,
                        check_positive_int, float_dtype, prepare_layer_args)
from .kernels import delta_chunks, delta_scan, delta_step, flat

__all__ = [
    "delta_rule_step", "gated_delta_rule_step", "kda_step",
    "delta_rule_recurrent", "gated_delta_rule_recurrent", "kda_recurrent",
    "delta_rule_chunkwise", "gated_delta_rule_chunkwise", "kda_chunkwise",
    "gated_delta_rule_loop", "gated_delta_rule_chunk", "kda_loop",
    "kda_log_gate", "additive_step", "erase_factor",
    "gated_delta_rule_backward", "delta_rule_backward", "kda_backward",
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


# --------------------------------------------------------------------------- one token

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
    return delta_step(q, k, v, beta, None, S, scale, False)


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
    return delta_step(q, k, v, beta, g, S, scale, False)


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
    return delta_step(q, k, v, beta, g, S, scale, True)


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

def _run(form, q, k, v, beta, log_gate, scale, initial_state, gate, *extra):
    lead, q, k, v, beta, g, S, scale = _prepare(q, k, v, beta, log_gate, scale, initial_state, gate=gate)
    T = q.shape[-2]
    channelwise = gate == "channel"
    out, S = form(flat(q, lead, 2), flat(k, lead, 2), flat(v, lead, 2), flat(beta, lead, 1),
                  flat(g, lead, 1 + channelwise), flat(S, lead, 2), scale, *extra, channelwise)
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
    return _run(delta_scan, q, k, v, beta, None, scale, initial_state, None)


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
    return _run(delta_scan, q, k, v, beta, log_gate, scale, initial_state, "scalar")


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
    return _run(delta_scan, q, k, v, beta, log_gate, scale, initial_state, "channel")


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
# The chunkwise forms validate and flatten their arguments and call the chunk machinery of
# fixedstate.kernels (delta_chunks: the decays level by level over halves of a chunk, the UT
# transform, the state carried from chunk to chunk), which DeltaProduct's chunkwise form
# (fixedstate.delta_family) shares.

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
    return _run(delta_chunks, q, k, v, beta, None, scale, initial_state, None, chunk_size)


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
    return _run(delta_chunks, q, k, v, beta, log_gate, scale, initial_state, "scalar", chunk_size)


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
    return _run(delta_chunks, q, k, v, beta, log_gate, scale, initial_state, "channel", chunk_size)


# --------------------------------------------------------------------------- backward passes (chapter 9)
#
# The gradient of a loss L through the recurrence S_t = G_t S_{t-1} + beta_t k_t (v_t - (G_t S_{t-1})^T k_t)^T,
# o_t = scale * S_t^T q_t. The states are recomputed token by token with delta_step (the forward's own code);
# then the gradient of the state runs backwards in time through the erase factors:
#
#     dS_t = scale * q_t do_t^T + G_{t+1} (I - beta_{t+1} k_{t+1} k_{t+1}^T) dS_{t+1}
#
# and each token reads its gradients off dS_t (the derivation is in chapter 9).

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

    # the forward again with delta_step, storing the state before (S_{t-1}) and after (S_t) each token
    before = np.empty((T,) + lead + (d_k, d_v), dtype=dtype)
    after = np.empty_like(before)
    S = np.zeros(lead + (d_k, d_v), dtype=dtype) if S0 is None else S0
    G = None if G is None else time_major(fit(G, 1 + channelwise), -1 - channelwise)
    for t in range(T):
        before[t] = S
        _, S = delta_step(Q[t], K[t], V[t], Beta[t], None if G is None else G[t], S, 1.0, channelwise)
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
