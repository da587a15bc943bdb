"""Causal linear attention in four forms, Performer features and Linformer (chapter "Linear attention").

Shapes and conventions (chapter ``chap-linear-attention``):

- ``q, k``: ``(..., T, d_k)``; ``v``: ``(..., T, d_v)``; one token per row, with any
  leading axes (batch, heads, ...) that broadcast together by numpy's rules.
- A feature map ``phi`` sends an array ``(..., d_k)`` to ``(..., r)`` along the last
  axis (``r = d_k`` for :func:`elu_plus_one` and :func:`identity_feature_map`).
- The state is ``S`` of shape ``(..., r, d_v)``, written ``S + phi(k) v^T`` and read
  ``S^T phi(q)``. The readout of token ``t`` uses the state *including* token ``t``
  (equations ``eq-la-recurrent`` and ``eq-la-readout``).
- ``normalize=True`` divides by ``max(phi(q) . z, eps)`` (equation ``eq-la-kernel``),
  where the normaliser ``z = sum_j phi(k_j)`` lives in the state: the state is then
  ``(..., r, d_v + 1)`` and its last column is ``z``, because the normaliser is the
  state of a constant value 1 appended to every value. ``normalize=False`` returns
  the numerator only, and the state is ``(..., r, d_v)``.
- The output is multiplied by ``scale`` (default 1: no ``1/sqrt(d_k)`` scale).

Every form takes ``q, k, v`` positionally and ``feature_map, normalize, eps,
scale, initial_state`` (and ``chunk_size``) by keyword, and returns
``(outputs, final_state)``. The parallel, recurrent, chunkwise and one-token
forms compute the same numbers; ``tests/test_linear_attention.py`` proves it to
a relative error of 1e-10 in float64, and against the reference token loop
:func:`linear_attention_loop`. float32 in gives float32 out.

:func:`linear_attention_backward` is the backward pass of the un-normalised,
identity-feature-map recurrence, optionally with a scalar gate per token
(chapter 9).
"""

from __future__ import annotations

import math

import numpy as np

from ._grad import sum_to, time_major
from ._validate import (as_float_array, as_float_batch, broadcast_leading, check_dim, check_log_gate,
                        check_positive_int, check_real_number, check_same_length, float_dtype)
from .kernels import additive_chunks_backward, additive_scan, flat, row_softmax, softmax_scale

__all__ = [
    "elu_plus_one",
    "identity_feature_map",
    "linear_attention_parallel",
    "linear_attention_recurrent",
    "linear_attention_chunkwise",
    "linear_attention_step",
    "linear_attention_loop",
    "softmax_kernel",
    "draw_favor_projection",
    "favor_plus_features",
    "draw_linformer_projection",
    "linformer_attention",
    "linear_attention_backward",
    "linear_attention_chunkwise_backward",
]


# ---------------------------------------------------------------- feature maps

def elu_plus_one(x):
    """The feature map ``phi(x) = elu(x) + 1`` of equation ``eq-la-elu``, applied entrywise.

    ``x + 1`` for ``x > 0`` and ``exp(x)`` otherwise: strictly positive, smooth, and
    close to the identity shifted by one for positive inputs. Any shape in, same
    shape and precision out.
    """
    arr = as_float_array(x, "x")
    return np.where(arr > 0, arr + 1.0, np.exp(np.minimum(arr, 0.0)))


def identity_feature_map(x):
    """``phi(x) = x``: plain (un-normalized) linear attention, equation ``eq-la-associativity``.

    Can be negative, so it is only valid with ``normalize=False``.
    """
    return as_float_array(x, "x")


# ---------------------------------------------------------------- validation

def _apply_feature_map(feature_map, x: np.ndarray, name: str, normalize: bool) -> np.ndarray:
    if not callable(feature_map):
        raise ValueError(f"feature_map: expected a callable mapping (..., d_k) to (..., r), "
                         f"got {feature_map!r}")
    out = np.asarray(feature_map(x))
    if out.ndim != x.ndim or out.shape[:-1] != x.shape[:-1] or out.dtype.kind not in "iuf":
        want = "(" + ", ".join(str(n) for n in x.shape[:-1]) + (", " if x.ndim > 1 else "") + "r)"
        raise ValueError(f"feature_map: expected a real array of shape {want} when "
                         f"applied to {name} of shape {x.shape}, got "
                         f"{'shape ' + str(out.shape) if out.ndim else repr(out)} dtype {out.dtype}")
    if not np.all(np.isfinite(out)):
        raise ValueError(f"feature_map: returned NaN or infinity on {name}")
    if normalize and np.any(out < 0):
        raise ValueError(f"feature_map: returned a negative value ({float(out.min()):.3g}) on {name}; "
                         "with normalize=True the weights phi(q).phi(k) must be non-negative "
                         "(use a positive map such as elu_plus_one, or normalize=False)")
    return out


def _check_flags(normalize, eps) -> float:
    if not isinstance(normalize, (bool, np.bool_)):
        raise ValueError(f"normalize: expected True or False, got {normalize!r}")
    eps_arr = as_float_array(eps, "eps", ndim=0)
    if not float(eps_arr) > 0:
        raise ValueError(f"eps: expected a positive number, got {float(eps_arr)!r}")
    return float(eps_arr)


def _prepare(q, k, v, feature_map, normalize, eps, scale, initial_state, *, tokens=True, one_sequence=False):
    """Validate; return ``lead, phi(q), phi(k), v, initial_state, eps, scale`` cast to one dtype.

    ``initial_state`` is None or broadcast to the leading axes. With ``normalize``
    the values get the constant 1 appended as a last column, so that the state's
    last column is the normaliser.
    """
    eps = _check_flags(normalize, eps)
    scale = check_real_number(scale, "scale")
    dtype = float_dtype(q, k, v, initial_state)
    tok = ("T",) if tokens else ()
    n = len(tok) + 1
    q = as_float_batch(q, "q", (None,) * n, tok + ("d_k",))
    if tokens and q.shape[-2] < 1:
        raise ValueError(f"q: expected at least one token (shape (..., T, d_k) with T >= 1), got shape {q.shape}")
    tsize = q.shape[-2:-1] if tokens else ()
    k = as_float_batch(k, "k", tsize + (q.shape[-1],), tok + ("d_k",))
    v = as_float_batch(v, "v", tsize + (None,), tok + ("d_v",))
    q, k = q.astype(dtype, copy=False), k.astype(dtype, copy=False)       # float16 computes in float32
    phi_q = _apply_feature_map(feature_map, q, "q", normalize)
    phi_k = _apply_feature_map(feature_map, k, "k", normalize)
    r = phi_k.shape[-1]
    check_dim(phi_q, "feature_map", -1, r, "r, the feature width it gave k")
    items = [("q", q, n), ("k", k, n), ("v", v, n)]
    width = v.shape[-1] + 1 if normalize else v.shape[-1]
    if initial_state is not None:
        initial_state = as_float_batch(initial_state, "initial_state", (r, width),
                                       ("r", "d_v + 1 (the last column is z)" if normalize else "d_v"))
        if normalize and np.any(initial_state[..., -1] < 0):
            raise ValueError("initial_state: expected a non-negative last column with normalize=True "
                             "(it is the normaliser z, a sum of features phi(k)), got "
                             f"{float(initial_state[..., -1].min())!r}")
        items.append(("initial_state", initial_state, 2))
    lead = broadcast_leading(*items)
    if one_sequence and lead:
        raise ValueError(f"q: the reference loop takes one sequence (T, d_k) with no leading axes, got "
                         f"leading axes {lead} (use the other forms for batches)")
    dtype = np.result_type(dtype, phi_q, phi_k)
    cast = lambda a: None if a is None else a.astype(dtype, copy=False)  # noqa: E731
    phi_q, phi_k, v, initial_state = cast(phi_q), cast(phi_k), cast(v), cast(initial_state)
    if initial_state is not None and initial_state.shape[:-2] != lead:
        initial_state = np.broadcast_to(initial_state, lead + initial_state.shape[-2:])
    return lead, phi_q, phi_k, v, initial_state, eps, scale


def _with_ones(v, normalize):
    """The values with a constant 1 appended when normalizing: its state is the normaliser z."""
    if not normalize:
        return v
    return np.concatenate([v, np.ones(v.shape[:-1] + (1,), dtype=v.dtype)], axis=-1)


def _readout(numerator, normalize: bool, eps: float, scale: float):
    """Outputs from ``S^T phi(q)``: divide by the last column ``phi(q) . z`` when normalizing, then scale."""
    if normalize:
        numerator = numerator[..., :-1] / np.maximum(numerator[..., -1:], eps)
    return numerator * numerator.dtype.type(scale) if scale != 1.0 else numerator


def _full_state(state, lead):
    """The state, with the leading axes of all inputs (a state that does not depend on q is repeated)."""
    shape = lead + state.shape[-2:]
    return state if state.shape == shape else np.broadcast_to(state, shape).copy()


# ---------------------------------------------------------------- the four forms

def linear_attention_parallel(q, k, v, *, feature_map=elu_plus_one, normalize=True, eps=1e-12,
                              scale=1.0, initial_state=None):
    """The parallel (masked matrix) form of causal linear attention, equation ``eq-la-parallel``.

    ``O = (M * (phi(Q) phi(K)^T)) V + phi(Q) S_0``, divided row by row by
    ``(M * (phi(Q) phi(K)^T)) 1 + phi(Q) z_0`` when ``normalize``; ``M`` is the
    lower-triangular mask (diagonal included).

    Parameters
    ----------
    q, k : arrays ``(..., T, d_k)``; v : array ``(..., T, d_v)``
    feature_map : callable ``(..., d_k) -> (..., r)``; default :func:`elu_plus_one`
    normalize : bool
    eps : positive float, the floor of the denominator
    scale : number multiplying the outputs (default 1)
    initial_state : array ``(..., r, d_v + 1)`` (``normalize=True``, last column the
        normaliser ``z``) or ``(..., r, d_v)`` (``normalize=False``), or None (zeros)

    Returns
    -------
    outputs : array ``(..., T, d_v)``
    state : array ``(..., r, d_v + 1)`` or ``(..., r, d_v)``, after the last token
    """
    lead, phi_q, phi_k, v, s0, eps, scale = _prepare(q, k, v, feature_map, normalize, eps, scale,
                                                     initial_state)
    v = _with_ones(v, normalize)                          # the last column of ones carries z
    weights = np.tril(phi_q @ phi_k.swapaxes(-1, -2))     # (..., T, T), entry (t, j) = phi(q_t).phi(k_j)
    numerator = weights @ v
    state = phi_k.swapaxes(-1, -2) @ v                    # sum_j phi(k_j) v_j^T
    if s0 is not None:
        numerator = numerator + phi_q @ s0
        state = state + s0
    return _readout(numerator, normalize, eps, scale), _full_state(state, lead)


def linear_attention_recurrent(q, k, v, *, feature_map=elu_plus_one, normalize=True, eps=1e-12,
                               scale=1.0, initial_state=None):
    """The recurrent form, equations ``eq-la-recurrent`` and ``eq-la-readout``.

    ``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``,
    ``o_t = S_t^T phi(q_t) / (phi(q_t) . z_t)`` (no division when ``normalize=False``),
    one token at a time, vectorised over the leading axes.

    Arguments and results as :func:`linear_attention_parallel`.
    """
    lead, phi_q, phi_k, v, s0, eps, scale = _prepare(q, k, v, feature_map, normalize, eps, scale,
                                                     initial_state)
    v = _with_ones(v, normalize)
    # S_t = S_{t-1} + phi(k_t) v_t^T and the read S_t^T phi(q_t), token by token (fixedstate.kernels)
    numerator, state = additive_scan(phi_q, phi_k, v, s0)
    return _readout(numerator, normalize, eps, scale), state


def linear_attention_chunkwise(q, k, v, *, feature_map=elu_plus_one, normalize=True, eps=1e-12,
                               scale=1.0, initial_state=None, chunk_size=64):
    """The chunkwise form, equation ``eq-la-chunkwise``.

    Inside a chunk of ``C`` tokens, the masked product of the parallel form; between
    chunks, the state carried as in the recurrent form:
    ``O_[c] = (M * (phi(Q_[c]) phi(K_[c])^T)) V_[c] + phi(Q_[c]) S_[c-1]`` and
    ``S_[c] = S_[c-1] + phi(K_[c])^T V_[c]`` (the normaliser likewise, as the
    column of ones appended to ``V``). The last chunk may be shorter.

    Arguments and results as :func:`linear_attention_parallel`, plus ``chunk_size >= 1``.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    lead, phi_q, phi_k, v, s0, eps, scale = _prepare(q, k, v, feature_map, normalize, eps, scale,
                                                     initial_state)
    v = _with_ones(v, normalize)
    r, width, T = phi_k.shape[-1], v.shape[-1], v.shape[-2]
    state = np.zeros(lead + (r, width), dtype=v.dtype) if s0 is None else s0.copy()
    numerator = np.empty(lead + (T, width), dtype=v.dtype)
    for start in range(0, T, chunk_size):
        sl = slice(start, start + chunk_size)
        qc, kc, vc = phi_q[..., sl, :], phi_k[..., sl, :], v[..., sl, :]
        weights = np.tril(qc @ kc.swapaxes(-1, -2))                   # within the chunk
        numerator[..., sl, :] = weights @ vc + qc @ state             # + what earlier chunks left
        state += kc.swapaxes(-1, -2) @ vc                             # carry the chunk into the state
    return _readout(numerator, normalize, eps, scale), state


def linear_attention_step(q, k, v, *, feature_map=elu_plus_one, normalize=True, eps=1e-12, scale=1.0,
                          initial_state=None):
    """One generated token with a fixed-size state, equations ``eq-la-recurrent`` and ``eq-la-readout``.

    Parameters
    ----------
    q, k : arrays ``(..., d_k)``; v : array ``(..., d_v)``
    feature_map, normalize, eps, scale : as :func:`linear_attention_parallel`
    initial_state : the state after the earlier tokens, ``(..., r, d_v + 1)``
        (``normalize=True``, last column ``z``) or ``(..., r, d_v)``; None means zeros

    Returns
    -------
    o : array ``(..., d_v)``, read from the state *after* this token's write
    state : the new state (the one passed in is not modified)
    """
    lead, phi_q, phi_k, v, s0, eps, scale = _prepare(q, k, v, feature_map, normalize, eps, scale,
                                                     initial_state, tokens=False)
    v = _with_ones(v, normalize)
    state = phi_k[..., :, None] * v[..., None, :]                     # phi(k) v^T
    if s0 is not None:
        state = s0 + state
    state = _full_state(state, lead)
    numerator = (phi_q[..., None, :] @ state)[..., 0, :]
    return _readout(numerator, normalize, eps, scale), state


def linear_attention_loop(q, k, v, *, feature_map=elu_plus_one, normalize=True, eps=1e-12, scale=1.0,
                          initial_state=None):
    """The reference token loop for one sequence, equations ``eq-la-recurrent`` and ``eq-la-readout``.

    ``q, k`` (T, d_k), ``v`` (T, d_v), no leading axes; the other arguments and
    the results as :func:`linear_attention_recurrent`. Written to be read beside
    the equations; the tests check every other form against it.
    """
    _, phi_q, phi_k, v, state_0, eps, scale = _prepare(q, k, v, feature_map, normalize, eps, scale,
                                                       initial_state, one_sequence=True)
    (T, d_v), r = v.shape, phi_k.shape[1]         # phi_q, phi_k: (T, r), every query and key through phi
    S = np.zeros((r, d_v), dtype=v.dtype) if state_0 is None else state_0[:, :d_v]            # S_0
    z = np.zeros(r, dtype=v.dtype) if state_0 is None or not normalize else state_0[:, d_v]   # z_0
    o = np.empty_like(v)
    for t in range(T):
        S = S + np.outer(phi_k[t], v[t])          # eq-la-recurrent: S_t = S_{t-1} + phi(k_t) v_t^T
        z = z + phi_k[t]                          #                  z_t = z_{t-1} + phi(k_t)
        o[t] = S.T @ phi_q[t]                     # eq-la-readout: S_t^T phi(q_t) ...
        if normalize:
            o[t] /= max(phi_q[t] @ z, eps)        # ... divided by phi(q_t)^T z_t (at least eps)
    state = np.column_stack([S, z]) if normalize else S   # the package keeps z as the last column
    return scale * o, state


# ---------------------------------------------------------------- Performer (FAVOR+)

def softmax_kernel(q, k):
    """The softmax kernel ``exp(q . k)`` for every pair, equation ``eq-la-softmax-kernel``.

    ``q (..., n, d)``, ``k (..., m, d)`` -> ``(..., n, m)``. (Apply ``d**-0.25`` to both
    to get the ``exp(q . k / sqrt(d))`` of scaled attention.)
    """
    q = as_float_batch(q, "q", (None, None), ("n", "d"))
    k = as_float_batch(k, "k", (None, q.shape[-1]), ("m", "d"))
    broadcast_leading(("q", q, 2), ("k", k, 2))
    return np.exp(q @ k.swapaxes(-1, -2))


def draw_favor_projection(d, n_features, rng, orthogonal=True):
    """Random projection ``W`` of shape ``(n_features, d)`` for FAVOR+ (equation ``eq-la-favor``).

    Every row is marginally a standard Gaussian vector in ``R^d``, which is all
    the unbiasedness of :func:`favor_plus_features` needs. With ``orthogonal``,
    rows are drawn in blocks of ``d`` mutually orthogonal directions (Gram-Schmidt
    via QR of a Gaussian matrix) with lengths drawn as the norms of Gaussian
    vectors, which keeps each row Gaussian and lowers the estimator's variance.
    ``rng`` is a ``numpy.random.Generator``.
    """
    d = check_positive_int(d, "d")
    n_features = check_positive_int(n_features, "n_features")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng: expected a numpy.random.Generator (np.random.default_rng(seed)), "
                         f"got {type(rng).__name__}")
    if not isinstance(orthogonal, (bool, np.bool_)):
        raise ValueError(f"orthogonal: expected True or False, got {orthogonal!r}")
    if not orthogonal:
        return rng.standard_normal((n_features, d))
    blocks = []
    for _ in range(-(-n_features // d)):
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        q = q * np.sign(np.diag(r))                       # Haar-distributed orthogonal matrix
        lengths = np.linalg.norm(rng.standard_normal((d, d)), axis=1)
        blocks.append(q.T * lengths[:, None])             # rows: orthogonal directions, chi lengths
    return np.concatenate(blocks)[:n_features]


def favor_plus_features(x, projection):
    """Positive random features of FAVOR+, equation ``eq-la-favor``.

    ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)`` for ``W`` of shape ``(m, d)``, so that
    ``E[phi(q) . phi(k)] = exp(q . k)`` when the rows of ``W`` are standard
    Gaussian. Every feature is positive. ``x``: ``(..., d)`` -> ``(..., m)``.
    Use as ``feature_map=lambda a: favor_plus_features(a, W)``.
    """
    arr = as_float_batch(x, "x", (None,), ("d",))
    w = as_float_array(projection, "projection", ndim=2)
    check_dim(w, "projection", 1, arr.shape[-1], "d, the width of x")
    sq = 0.5 * np.sum(arr * arr, axis=-1, keepdims=True)
    return np.exp(arr @ w.T - sq) / math.sqrt(w.shape[0])   # a Python float keeps float32 float32


# ---------------------------------------------------------------- Linformer

def draw_linformer_projection(seq_len, proj_len, rng):
    """A random ``(proj_len, seq_len)`` projection along the sequence, entries ``N(0, 1/proj_len)``.

    For :func:`linformer_attention` (equation ``eq-la-linformer``); in the paper the
    projections are learned, a random one is the usual starting point.
    """
    seq_len = check_positive_int(seq_len, "seq_len")
    proj_len = check_positive_int(proj_len, "proj_len")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng: expected a numpy.random.Generator, got {type(rng).__name__}")
    return rng.standard_normal((proj_len, seq_len)) / np.sqrt(proj_len)


def linformer_attention(q, k, v, proj_k, proj_v, *, scale=None):
    """Linformer attention (bidirectional), equation ``eq-la-linformer``.

    ``softmax(scale * Q (E K)^T) (F V)`` with ``E = proj_k`` and ``F = proj_v`` of shape
    ``(k, T)``: the ``T`` keys and values are mixed down to ``k`` along the sequence,
    so the score matrix is ``(T, k)`` instead of ``(T, T)``. Every output row sees
    every token, so the layer is not causal, and it has no state to return.

    ``q, k``: ``(T, d_k)``; ``v``: ``(T, d_v)``; result ``(T, d_v)``.
    ``scale=None`` means ``1/sqrt(d_k)``.
    """
    q = as_float_array(q, "q", ndim=2)
    k = as_float_array(k, "k", ndim=2)
    v = as_float_array(v, "v", ndim=2)
    check_same_length("q", q, "k", k, axis=0)
    check_same_length("q", q, "v", v, axis=0)
    check_dim(k, "k", 1, q.shape[1], "d_k, the width of q")
    e = as_float_array(proj_k, "proj_k", ndim=2, shape=(None, q.shape[0]))
    f = as_float_array(proj_v, "proj_v", ndim=2, shape=(e.shape[0], q.shape[0]))
    if e.shape[0] < 1:
        raise ValueError(f"proj_k: expected at least one row, got shape {e.shape}")
    short_keys, short_values = e @ k, f @ v               # (k, d_k), (k, d_v): k summary tokens
    weights = row_softmax(softmax_scale(scale, q.shape[1]) * (q @ short_keys.T))   # (T, k)
    return weights @ short_values


# ---------------------------------------------------------------- the backward pass

def _backward_args(q, k, v, d_out, log_gate, scale, initial_state, d_final_state):
    """Validate the arguments of a backward pass: the dtype, the leading shape, ``fit`` (cast and broadcast
    to the leading axes) and the checked arrays (None where an optional one is left out)."""
    dtype = float_dtype(q, k, v, d_out, log_gate, initial_state, d_final_state)   # float16 counts as float32
    _, q, k, v, s0, _, c = _prepare(q, k, v, identity_feature_map, False, 1e-12, scale, initial_state)
    T, d_k, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    d_out = as_float_batch(d_out, "d_out", (T, d_v), ("T", "d_v"))
    items = [("q", q, 2), ("k", k, 2), ("v", v, 2), ("d_out", d_out, 2)]
    if log_gate is not None:
        log_gate = check_log_gate(as_float_batch(log_gate, "log_gate", (T,), ("T",), allow_nonfinite=True))
        items.append(("log_gate", log_gate, 1))
    if s0 is not None:
        s0 = as_float_batch(initial_state, "initial_state", (d_k, d_v), ("d_k", "d_v"))
        items.append(("initial_state", s0, 2))
    if d_final_state is not None:
        d_final_state = as_float_batch(d_final_state, "d_final_state", (d_k, d_v), ("d_k", "d_v"))
        items.append(("d_final_state", d_final_state, 2))
    lead = broadcast_leading(*items)
    fit = lambda a, n: np.broadcast_to(a.astype(dtype, copy=False), lead + a.shape[a.ndim - n:])  # noqa: E731
    return dtype, lead, fit, (q, k, v, d_out, log_gate, s0, d_final_state, c)

def linear_attention_backward(q, k, v, d_out, *, log_gate=None, scale=1.0, initial_state=None,
                              d_final_state=None):
    """The gradients of un-normalised linear attention (``eq-la-recurrent``), optionally gated: ``eq-bw-la-grads``.

    The forward pass is the recurrent form with ``feature_map=identity_feature_map,
    normalize=False`` (:func:`linear_attention_recurrent`), and, when ``log_gate`` is
    given, a decay ``g_t = exp(log_gate_t)`` of the state before each write:

        S_t = g_t S_{t-1} + k_t v_t^T,      o_t = scale * S_t^T q_t

    (``g_t = 1`` without a gate; with a gate this is also Mamba-2's recurrence,
    which :func:`fixedstate.ssm.ssd_backward` builds on). The normalised form and
    other feature maps are not covered: apply the feature map's own backward to
    ``dq`` and ``dk``. The states are recomputed token by token with
    :func:`linear_attention_step` (the forward's own code, fed the decayed state
    ``g_t S_{t-1}`` as its initial state); then the gradient of the state runs
    backwards in time (``eq-bw-la-state``)

        dS_t = scale * q_t do_t^T + g_{t+1} dS_{t+1},    dS_T = scale * q_T do_T^T + d_final_state,

    and each token reads its gradients off it:
    ``dq_t = scale * S_t do_t``, ``dk_t = dS_t v_t``, ``dv_t = dS_t^T k_t``,
    ``dlog_gate_t = g_t <dS_t, S_{t-1}>``, and ``d_initial_state = g_1 dS_1``.

    Parameters
    ----------
    q, k : arrays ``(..., T, d_k)``; v : array ``(..., T, d_v)``
    d_out : array ``(..., T, d_v)``, the gradient of the loss with respect to the outputs
    log_gate : array ``(..., T)`` of log-decays ``<= 0``, or None (no gate)
    scale : number multiplying the outputs (default 1)
    initial_state : array ``(..., d_k, d_v)`` or None (zeros)
    d_final_state : array ``(..., d_k, d_v)``, the gradient with respect to the final
        state (when the loss depends on it, as across chunks), or None (zero)

    Returns
    -------
    dq, dk, dv : arrays of the shapes of ``q``, ``k``, ``v``
    dlog_gate : array of the shape of ``log_gate``, or None when ``log_gate`` is None
    d_initial_state : array of the shape of ``initial_state``; when it is None, the
        gradient with respect to a zero initial state, ``(..., d_k, d_v)`` with the
        leading axes of all inputs

    Every gradient is summed over the leading axes along which its input was
    broadcast, and has the common floating precision of the arguments.
    """
    dtype, lead, fit, (q, k, v, d_out, log_gate, s0, d_final_state, c) = _backward_args(
        q, k, v, d_out, log_gate, scale, initial_state, d_final_state)
    T, d_k, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    # time-major copies (token t is Q[t], contiguous), broadcast to the leading axes
    Q, K, V, dO = (time_major(fit(a, 2), -2) for a in (q, k, v, d_out))
    gates = None if log_gate is None else time_major(np.exp(fit(log_gate, 1)), -1)   # g_t = exp(log_gate_t)
    c = dtype.type(c)

    # the forward again, storing the state before (S_{t-1}) and after (S_t) each token
    before = np.empty((T,) + lead + (d_k, d_v), dtype=dtype)
    after = np.empty_like(before)
    S = np.zeros(lead + (d_k, d_v), dtype=dtype) if s0 is None else fit(s0, 2)
    for t in range(T):
        before[t] = S
        decayed = S if gates is None else gates[t][..., None, None] * S
        _, S = linear_attention_step(Q[t], K[t], V[t], feature_map=identity_feature_map, normalize=False,
                                     initial_state=decayed)
        after[t] = S

    # the gradient of the state, backwards in time; then every token's reads at once
    writes = c * (Q[..., :, None] * dO[..., None, :])                           # scale q_t do_t^T, all t
    dS = np.zeros(lead + (d_k, d_v), dtype=dtype) if d_final_state is None else fit(d_final_state, 2).copy()
    d_states = np.empty_like(before)                                            # dS_t for every t
    for t in range(T - 1, -1, -1):
        dS += writes[t]
        d_states[t] = dS
        if gates is not None:
            dS *= gates[t][..., None, None]                                     # through the decay
    dq = c * (after @ dO[..., None])[..., 0]                                    # scale S_t do_t
    dk = (d_states @ V[..., None])[..., 0]                                      # dS_t v_t
    dv = (K[..., None, :] @ d_states)[..., 0, :]                                # dS_t^T k_t
    dgate = None if gates is None else gates * np.sum(d_states * before, axis=(-2, -1))
    dq, dk, dv = (np.moveaxis(a, 0, -2) for a in (dq, dk, dv))
    return (sum_to(dq, q.shape), sum_to(dk, k.shape), sum_to(dv, v.shape),
            None if dgate is None else sum_to(np.moveaxis(dgate, 0, -1), log_gate.shape),
            dS if s0 is None else sum_to(dS, s0.shape))


def linear_attention_chunkwise_backward(q, k, v, d_out, *, log_gate=None, scale=1.0, initial_state=None,
                                        d_final_state=None, chunk_size=64):
    """The gradients of un-normalised linear attention, optionally gated, chunk by chunk: ``eq-bw-la-state`` per chunk.

    The same five gradients as :func:`linear_attention_backward` (same arguments, shapes and
    results), in the chunkwise order of :func:`linear_attention_chunkwise`: the chunk states
    are recomputed forwards over the chunks, the state's gradient ``dS`` is carried backwards
    over them (``dS <- Gamma_C dS + scale * Q^T diag(Gamma) dO`` per chunk), and inside every
    chunk the gradients are products of ``(C, C)`` and ``(C, d)`` blocks, for all chunks at
    once (:func:`fixedstate.kernels.additive_chunks_backward`). ``chunk_size`` (an integer
    >= 1; the length need not be a multiple of it) changes the order of the sums, not the result.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    shapes = {"q": np.shape(q), "k": np.shape(k), "v": np.shape(v), "log_gate": np.shape(log_gate),
              "initial_state": np.shape(initial_state)}
    dtype, lead, fit, (q, k, v, d_out, log_gate, s0, d_final_state, c) = _backward_args(
        q, k, v, d_out, log_gate, scale, initial_state, d_final_state)
    T, d_k, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    flat_all = lambda a, n: None if a is None else flat(np.ascontiguousarray(fit(a, n)), lead, n)   # noqa: E731
    dq, dk, dv, dlog, dS = additive_chunks_backward(
        flat_all(q, 2), flat_all(k, 2), flat_all(v, 2), flat_all(log_gate, 1), flat_all(s0, 2),
        flat_all(d_out, 2), flat_all(d_final_state, 2), c, chunk_size)
    dS = dS.reshape(lead + (d_k, d_v))
    return (sum_to(dq.reshape(lead + (T, d_k)), shapes["q"]), sum_to(dk.reshape(lead + (T, d_k)), shapes["k"]),
            sum_to(dv.reshape(lead + (T, d_v)), shapes["v"]),
            None if dlog is None else sum_to(dlog.reshape(lead + (T,)), shapes["log_gate"]),
            dS if s0 is None else sum_to(dS, shapes["initial_state"]))
