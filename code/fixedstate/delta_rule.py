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
from ._threads import one_blas_thread
from .kernels import (chunk_gate_gradient, chunk_grid, chunk_tokens, delta_chunks, delta_scan, delta_step, flat,
                      matmul, scalar_chunk_decays, unchunk, unit_lower_inverse)

__all__ = [
    "delta_rule_step", "gated_delta_rule_step", "kda_step",
    "delta_rule_recurrent", "gated_delta_rule_recurrent", "kda_recurrent",
    "delta_rule_chunkwise", "gated_delta_rule_chunkwise", "kda_chunkwise",
    "gated_delta_rule_loop", "gated_delta_rule_chunk", "kda_loop",
    "kda_log_gate", "additive_step", "erase_factor",
    "gated_delta_rule_backward", "delta_rule_backward", "kda_backward",
    "gated_delta_rule_chunkwise_backward", "delta_rule_chunkwise_backward", "gated_delta_rule_chunk_backward",
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

def _backward_args(q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, gate):
    """Validate the arguments of a backward pass; return the input shapes, the leading shape, the dtype,
    ``fit`` (cast and broadcast to the leading axes) and the prepared arrays."""
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

    def fit(a, n):
        return None if a is None else np.broadcast_to(a.astype(dtype, copy=False), lead + a.shape[a.ndim - n:])
    return shapes, lead, dtype, fit, (Q, K, V, d_out, Beta, G, S0, d_final_state, c)


def _backward(q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, gate):
    """The reverse-time scan shared by the delta-rule backward passes; returns the six gradients."""
    shapes, lead, dtype, fit, (Q, K, V, d_out, Beta, G, S0, d_final_state, c) = _backward_args(
        q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, gate)
    T, d_k, d_v = Q.shape[-2], Q.shape[-1], V.shape[-1]
    channelwise = gate == "channel"

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


# --------------------------------------------------------------------------- the chunkwise backward (chapter 9)
#
# The backward of the chunkwise form, chunk by chunk (eq-bw-chunk-forward, eq-bw-chunk-ut, eq-bw-chunk-state,
# eq-bw-chunk-grads, eq-bw-chunk-gates): gated_delta_rule_chunk_backward is one chunk written plainly, with
# two triangular solves and no inverse; _chunks_backward is the same for all chunks of a batch. It stores
# nothing from the forward: it runs the forward over the chunks again (each chunk's S_0, U, W), then carries
# the state's gradient backwards over the chunks; these two loops are the only sequential parts. It forms
# (I + A)^{-1} once per chunk and reuses it for U~, W and dR. No state inside a chunk is formed, forwards or
# backwards: the states kept are one (d_k, d_v) matrix per chunk (S_0 and dS_C); U, dU and the (C, C) blocks
# are per token.

def gated_delta_rule_chunk_backward(q, k, v, d_out, *, beta, log_gate, scale=1.0, initial_state=None,
                                    d_final_state=None):
    """The backward of one chunk of the chunkwise form: ``eq-bw-chunk-ut`` to ``eq-bw-chunk-gates``.

    The gradients of :func:`gated_delta_rule_chunk` for one chunk of ``C`` tokens (``q, k``
    (C, d_k), ``v``, ``d_out`` (C, d_v), ``beta``, ``log_gate`` (C,), no leading axes), given
    the incoming state ``S_0`` (``initial_state``, (d_k, d_v) or None for zeros) and the
    gradient of the outgoing state ``dS_C`` (``d_final_state``, or None for zero). Returns
    ``dq, dk, dv, dbeta, dlog_gate`` and ``dS_0``, the gradient of the incoming state, which is
    the ``d_final_state`` of the chunk before. Applied from the last chunk to the first (each
    with the ``S_0`` the forward gave it) it is the whole sequence's backward;
    :func:`gated_delta_rule_chunkwise_backward` is the same computation for all chunks at once.
    """
    _, Q, K, V, beta, log_gate, S0, c = _prepare(q, k, v, beta, log_gate, scale, initial_state,
                                                 gate="scalar", one_sequence=True, min_length=1)
    S0 = np.zeros((K.shape[1], V.shape[1]), dtype=V.dtype) if S0 is None else S0
    dO = as_float_array(d_out, "d_out", shape=V.shape).astype(V.dtype, copy=False)
    dSC = np.zeros_like(S0) if d_final_state is None else as_float_array(
        d_final_state, "d_final_state", shape=S0.shape).astype(V.dtype, copy=False)
    C = len(Q)
    # the forward of the chunk again (eq-bw-chunk-forward)
    b = np.cumsum(log_gate)                                   # b_r, the log-decay since the chunk start
    Gamma, to_end = np.exp(b), np.exp(b[-1] - b)              # Gamma_r = e^{b_r}, e^{b_C - b_r}
    D = np.exp(np.where(np.tri(C, dtype=bool), b[:, None] - b[None, :], -np.inf))   # D_ri = e^{b_r - b_i}, i <= r
    KK = K @ K.T
    A = np.tril(beta[:, None] * D * KK, -1)                   # A_ri = beta_r D_ri k_r^T k_i, i < r
    I_plus_A = np.eye(C) + A
    R = beta[:, None] * V - (beta * Gamma)[:, None] * (K @ S0)             # R = diag(beta) V - diag(beta Gamma) K S_0
    U = solve_triangular(I_plus_A, R, lower=True, unit_diagonal=True)      # (I + A) U = R
    M = (Q @ K.T) * D                                         # M = Q K^T o D
    K_bar = to_end[:, None] * K                               # the keys decayed to the chunk's end
    # backwards through the outputs and the outgoing state
    G = c * dO
    dU = M.T @ G + K_bar @ dSC                                # eq-bw-chunk-ut, first line
    dR = solve_triangular(I_plus_A, dU, trans="T", lower=True, unit_diagonal=True)   # (I + A)^T dR = dU
    dA = -np.tril(dR @ U.T, -1)                               # eq-bw-chunk-ut, last line
    dS0 = Q.T @ (Gamma[:, None] * G) + Gamma[-1] * dSC - K.T @ ((beta * Gamma)[:, None] * dR)   # eq-bw-chunk-state
    # the inputs' gradients, entry by entry from M, A, R, K_bar and Gamma
    dM = G @ U.T
    KS0 = K @ S0
    dq = (dM * D) @ K + Gamma[:, None] * (G @ S0.T)
    dk = ((dM * D).T @ Q + to_end[:, None] * (U @ dSC.T) - (beta * Gamma)[:, None] * (dR @ S0.T)
          + (dA * beta[:, None] * D) @ K + (dA * beta[:, None] * D).T @ K)
    dv = beta[:, None] * dR
    dbeta = np.sum(dR * V, axis=1) - Gamma * np.sum(dR * KS0, axis=1) + np.sum(dA * D * KK, axis=1)
    # the log-decays: each enters through b, so sum the gradients of D, Gamma and to_end over r >= t
    dD = dM * (Q @ K.T) + dA * beta[:, None] * KK
    dGamma = np.sum((Q @ S0) * G, axis=1) - beta * np.sum(dR * KS0, axis=1)
    dGamma[-1] += np.sum(S0 * dSC)                            # Gamma_C S_0 in S_C
    d_to_end = np.sum((U @ dSC.T) * K, axis=1)
    db = np.sum(dD * D, axis=1) - np.sum(dD * D, axis=0) + Gamma * dGamma - to_end * d_to_end
    db[-1] += np.sum(to_end * d_to_end)                       # e^{b_C - b_r} depends on b_C too
    dlog_gate = np.cumsum(db[::-1])[::-1]                     # gamma_t enters every b_r with r >= t
    return dq, dk, dv, dbeta, dlog_gate, dS0


@one_blas_thread
def _chunks_backward(q, k, v, d_out, beta, log_gate, S, d_final, scale, chunk_size):
    """:func:`gated_delta_rule_chunk_backward` for every chunk of B sequences: (B, T, d) arrays, (B, T) beta and
    log_gate (None: DeltaNet), (B, d_k, d_v) or None states; returns dq, dk, dv, dbeta, dlog_gate (or None), dS_0."""
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = v.dtype
    C2, n = chunk_grid(T, chunk_size)
    N = B * n
    Q, K, V, G = (chunk_tokens(x, chunk_size) for x in (q, k, v, d_out))
    if scale != 1.0:
        G = G * dtype.type(scale)
    beta_c = chunk_tokens(beta, chunk_size)[..., None]                      # (N, C2, 1); 0 on padding
    if log_gate is None:
        decay, gamma, to_end = np.broadcast_to(np.tri(C2, dtype=dtype), (N, C2, C2)), None, None
        beta_gamma, K_bar = beta_c, K
    else:
        decay, gamma, to_end = scalar_chunk_decays(log_gate, chunk_size, dtype)
        beta_gamma, K_bar = beta_c * gamma[..., None], K * to_end[..., None]
    # the chunk's UT transform: T = (I + A)^{-1}, U~ = T diag(beta) V, W = T diag(beta Gamma) K (eq-dr-ut)
    KK = matmul(K, K.swapaxes(-1, -2))
    a = KK * decay
    a *= beta_c
    T_ut = unit_lower_inverse(a)
    u_free = matmul(T_ut, V * beta_c)
    W = matmul(T_ut, K * beta_gamma)
    # forwards over the chunks: S_0 of every chunk and U = U~ - W S_0
    shape4 = lambda x: x.reshape((B, n) + x.shape[1:])                     # noqa: E731
    u_free, W, K_bar4 = shape4(u_free), shape4(W), shape4(K_bar)
    last = None if gamma is None else gamma[:, -1].reshape(B, n)
    starts = np.empty((B, n, d_k, d_v), dtype=dtype)
    U = np.empty((B, n, C2, d_v), dtype=dtype)
    state = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.astype(dtype, copy=True)
    for j in range(n):
        starts[:, j] = state
        np.subtract(u_free[:, j], matmul(W[:, j], state), out=U[:, j])
        if last is not None:
            state *= last[:, j, None, None]
        state += matmul(K_bar4[:, j].swapaxes(-1, -2), U[:, j])
    # backwards over the chunks: dS_C of every chunk, dU and dS_0 (eq-bw-chunk-ut, eq-bw-chunk-state)
    M = matmul(Q, K.swapaxes(-1, -2))
    M *= decay
    MtG = shape4(matmul(M.swapaxes(-1, -2), G))
    QG = Q if gamma is None else Q * gamma[..., None]
    read = shape4(matmul(QG.swapaxes(-1, -2), G))
    d_ends = np.empty((B, n, d_k, d_v), dtype=dtype)
    dU = np.empty((B, n, C2, d_v), dtype=dtype)
    dS = np.zeros((B, d_k, d_v), dtype=dtype) if d_final is None else d_final.astype(dtype, copy=True)
    for j in range(n - 1, -1, -1):
        d_ends[:, j] = dS
        np.add(MtG[:, j], matmul(K_bar4[:, j], dS), out=dU[:, j])
        if last is not None:
            dS *= last[:, j, None, None]
        dS += read[:, j]
        dS -= matmul(W[:, j].swapaxes(-1, -2), dU[:, j])
    starts, d_ends = starts.reshape(N, d_k, d_v), d_ends.reshape(N, d_k, d_v)
    U, dU = U.reshape(N, C2, d_v), dU.reshape(N, C2, d_v)
    # every chunk's gradients at once
    dR = matmul(T_ut.swapaxes(-1, -2), dU)                                 # (I + A)^T dR = dU
    dA = matmul(dR, U.swapaxes(-1, -2))
    dA *= -1.0                                                             # -dR U^T (only i < r is read)
    dM = matmul(G, U.swapaxes(-1, -2))
    dP = dM * decay
    F = dA * decay
    F *= beta_c
    F = np.tril(F, -1)
    KS0 = matmul(K, starts)
    dq = matmul(dP, K)
    dq += matmul(G, starts.swapaxes(-1, -2)) * (1.0 if gamma is None else gamma[..., None])
    U_dS = matmul(U, d_ends.swapaxes(-1, -2))                              # the gradient of K_bar
    dk = matmul(dP.swapaxes(-1, -2), Q)
    dk += U_dS if to_end is None else U_dS * to_end[..., None]
    dk -= matmul(dR * beta_gamma, starts.swapaxes(-1, -2))
    dk += matmul(F + F.swapaxes(-1, -2), K)
    dv = dR * beta_c
    dR_KS0 = np.einsum("ncp,ncp->nc", dR, KS0)
    dA_strict = np.tril(dA, -1)
    dbeta = np.einsum("ncp,ncp->nc", dR, V) + np.einsum("nri,nri->nr", dA_strict * decay, KK)
    dbeta -= dR_KS0 if gamma is None else gamma * dR_KS0
    dlog = None
    if gamma is not None:
        z = dM * M + dA_strict * a                                         # dD o D
        d_gamma = np.einsum("ncp,ncp->nc", matmul(Q, starts), G) - beta_c[..., 0] * dR_KS0
        d_gamma[:, -1] += np.einsum("nkp,nkp->n", starts, d_ends)          # Gamma_C S_0 in S_C
        d_to_end = np.einsum("nck,nck->nc", U_dS, K)
        dlog = chunk_gate_gradient(z, d_gamma, d_to_end, gamma, to_end)
        dlog = unchunk(dlog[..., None], B, T, chunk_size)[..., 0]
    dbeta = unchunk(dbeta[..., None], B, T, chunk_size)[..., 0]
    return (unchunk(dq, B, T, chunk_size), unchunk(dk, B, T, chunk_size), unchunk(dv, B, T, chunk_size),
            dbeta, dlog, dS)


def _chunkwise_backward(q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, gate, chunk_size):
    """Validate, broadcast and flatten; run :func:`_chunks_backward`; sum each gradient to its input's shape."""
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    shapes, lead, dtype, fit, (Q, K, V, d_out, Beta, G, S0, d_final_state, c) = _backward_args(
        q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, gate)
    T, d_k, d_v = Q.shape[-2], Q.shape[-1], V.shape[-1]
    flat_all = lambda a, n: None if a is None else flat(np.ascontiguousarray(fit(a, n)), lead, n)   # noqa: E731
    dq, dk, dv, dbeta, dlog, dS = _chunks_backward(
        flat_all(Q, 2), flat_all(K, 2), flat_all(V, 2), flat_all(d_out, 2), flat_all(Beta, 1), flat_all(G, 1),
        flat_all(S0, 2), flat_all(d_final_state, 2), c, chunk_size)
    back = lambda a, core: a.reshape(lead + core)                          # noqa: E731
    dS = back(dS, (d_k, d_v))
    return (sum_to(back(dq, (T, d_k)), shapes["q"]), sum_to(back(dk, (T, d_k)), shapes["k"]),
            sum_to(back(dv, (T, d_v)), shapes["v"]), sum_to(back(dbeta, (T,)), shapes["beta"]),
            None if dlog is None else sum_to(back(dlog, (T,)), shapes["log_gate"]),
            dS if initial_state is None else sum_to(dS, shapes["initial_state"]))


def gated_delta_rule_chunkwise_backward(q, k, v, d_out, *, beta, log_gate, scale=1.0, initial_state=None,
                                        d_final_state=None, chunk_size=64):
    """The gradients of Gated DeltaNet in chunkwise form: ``eq-bw-chunk-ut`` to ``eq-bw-chunk-gates``.

    The same six gradients as :func:`gated_delta_rule_backward` (same arguments, shapes and
    results), computed chunk by chunk as :func:`gated_delta_rule_chunk_backward` does for one
    chunk: the chunk states are recomputed forwards over the chunks (one ``(d_k, d_v)`` state
    per chunk; none inside a chunk), the state's gradient is carried backwards over the chunks
    through the WY form of each chunk's erase factors, and everything else is a product of
    ``(C, C)`` and ``(C, d)`` blocks for all chunks at once; ``(I + A)^{-1}`` is formed once per
    chunk and reused for the forward's ``U~``, ``W`` and the backward's ``dR``.
    ``chunk_size`` (an integer >= 1; the length need not be a multiple of it) changes the
    order of the sums, not the result. One BLAS thread.
    """
    return _chunkwise_backward(q, k, v, d_out, beta, log_gate, scale, initial_state, d_final_state, "scalar",
                               chunk_size)


def delta_rule_chunkwise_backward(q, k, v, d_out, *, beta, scale=1.0, initial_state=None, d_final_state=None,
                                  chunk_size=64):
    """The gradients of DeltaNet in chunkwise form: ``eq-bw-chunk-ut``, ``eq-bw-chunk-state`` with the gate 1.

    :func:`gated_delta_rule_chunkwise_backward` without the gate (no decays are formed).
    Returns ``(dq, dk, dv, dbeta, d_initial_state)``, as :func:`delta_rule_backward`.
    """
    dq, dk, dv, dbeta, _, ds0 = _chunkwise_backward(q, k, v, d_out, beta, None, scale, initial_state,
                                                    d_final_state, None, chunk_size)
    return dq, dk, dv, dbeta, ds0
