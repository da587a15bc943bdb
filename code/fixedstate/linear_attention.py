"""Causal linear attention in four forms, Performer features and Linformer (chapter "Linear attention").

Shapes and conventions (chapter ``chap-linear-attention``):

- ``queries, keys``: ``(T, d_k)``; ``values``: ``(T, d_v)``; one token per row.
- A feature map ``phi`` sends an array ``(n, d_k)`` to ``(n, r)`` row by row
  (``r = d_k`` for :func:`elu_plus_one` and :func:`identity_feature_map`).
- The state is ``S`` of shape ``(r, d_v)``, written ``S + phi(k) v^T`` and read
  ``S^T phi(q)``; the normalizer is ``z`` of shape ``(r,)``, written ``z + phi(k)``
  and read ``phi(q) . z``. The readout of token ``t`` uses the state *including*
  token ``t`` (equations ``eq-la-recurrent`` and ``eq-la-readout``).
- ``normalize=True`` divides by ``max(phi(q) . z, eps)`` (equation ``eq-la-kernel``);
  ``normalize=False`` returns the numerator only, but the normalizer is still
  tracked and returned.
- No ``1/sqrt(d_k)`` scale is applied.

The four forms (parallel, recurrent, chunkwise, one-token decode) compute the
same numbers; ``tests/test_linear_attention.py`` proves it to a relative error
of 1e-10 in float64.
"""

from __future__ import annotations

import numpy as np

from ._validate import as_float_array, as_token_sequences, check_dim, check_positive_int, check_same_length

__all__ = [
    "elu_plus_one",
    "identity_feature_map",
    "linear_attention_parallel",
    "linear_attention_recurrent",
    "linear_attention_chunkwise",
    "linear_attention_decode_step",
    "softmax_kernel",
    "draw_favor_projection",
    "favor_plus_features",
    "draw_linformer_projection",
    "linformer_attention",
]


# ---------------------------------------------------------------- feature maps

def elu_plus_one(x):
    """The feature map ``phi(x) = elu(x) + 1`` of equation ``eq-la-elu``, applied entrywise.

    ``x + 1`` for ``x > 0`` and ``exp(x)`` otherwise: strictly positive, smooth, and
    close to the identity shifted by one for positive inputs. Any shape in, same shape out.
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
        raise ValueError(f"feature_map: expected a callable mapping (n, d_k) to (n, r), "
                         f"got {feature_map!r}")
    out = np.asarray(feature_map(x))
    if out.ndim != 2 or out.shape[0] != x.shape[0] or out.dtype.kind not in "iuf":
        raise ValueError(f"feature_map: expected a real array of shape ({x.shape[0]}, r) when "
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


def _prepare(queries, keys, values, feature_map, normalize, initial_state, initial_normalizer, eps):
    eps = _check_flags(normalize, eps)
    q, k, v = as_token_sequences(queries, keys, values)
    phi_q = _apply_feature_map(feature_map, q, "queries", normalize)
    phi_k = _apply_feature_map(feature_map, k, "keys", normalize)
    r = phi_k.shape[1]
    check_dim(phi_q, "feature_map", 1, r, "r, the feature width it gave the keys")
    dtype = np.result_type(q, k, v, phi_q, phi_k)
    if initial_state is None:
        s0 = np.zeros((r, v.shape[1]), dtype=dtype)
    else:
        s0 = as_float_array(initial_state, "initial_state", ndim=2, shape=(r, v.shape[1]))
    if initial_normalizer is None:
        z0 = np.zeros(r, dtype=dtype)
    else:
        z0 = as_float_array(initial_normalizer, "initial_normalizer", ndim=1, shape=(r,))
        if normalize and np.any(z0 < 0):
            raise ValueError("initial_normalizer: expected non-negative entries with normalize=True "
                             f"(it is a sum of features phi(k)), got {float(z0.min())!r}")
    dtype = np.result_type(dtype, s0, z0)
    cast = lambda a: a.astype(dtype, copy=False)  # noqa: E731
    return cast(phi_q), cast(phi_k), cast(v), cast(s0).copy(), cast(z0).copy(), eps


def _readout(numerator, denominator, normalize: bool, eps: float):
    if not normalize:
        return numerator
    return numerator / np.maximum(denominator, eps)[..., None]


# ---------------------------------------------------------------- the four forms

def linear_attention_parallel(queries, keys, values, *, feature_map=elu_plus_one, normalize=True,
                              initial_state=None, initial_normalizer=None, eps=1e-12):
    """The parallel (masked matrix) form of causal linear attention, equation ``eq-la-parallel``.

    ``O = (M * (phi(Q) phi(K)^T)) V + phi(Q) S_0``, divided row by row by
    ``(M * (phi(Q) phi(K)^T)) 1 + phi(Q) z_0`` when ``normalize``; ``M`` is the
    lower-triangular mask (diagonal included).

    Parameters
    ----------
    queries, keys : arrays ``(T, d_k)``; values : array ``(T, d_v)``
    feature_map : callable ``(n, d_k) -> (n, r)``; default :func:`elu_plus_one`
    normalize : bool
    initial_state : array ``(r, d_v)`` or None (zeros)
    initial_normalizer : array ``(r,)`` or None (zeros)
    eps : positive float, the floor of the denominator

    Returns
    -------
    outputs : array ``(T, d_v)``
    """
    phi_q, phi_k, v, s0, z0, eps = _prepare(queries, keys, values, feature_map, normalize,
                                            initial_state, initial_normalizer, eps)
    weights = np.tril(phi_q @ phi_k.T)                    # (T, T), entry (t, j) = phi(q_t).phi(k_j)
    numerator = weights @ v + phi_q @ s0
    denominator = weights.sum(axis=1) + phi_q @ z0
    return _readout(numerator, denominator, normalize, eps)


def linear_attention_recurrent(queries, keys, values, *, feature_map=elu_plus_one, normalize=True,
                               initial_state=None, initial_normalizer=None, eps=1e-12):
    """The recurrent form, equations ``eq-la-recurrent`` and ``eq-la-readout``: the reference loop.

    ``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``,
    ``o_t = S_t^T phi(q_t) / (phi(q_t) . z_t)`` (no division when ``normalize=False``).

    Arguments as :func:`linear_attention_parallel`. Returns ``(outputs (T, d_v),
    state (r, d_v), normalizer (r,))``, the last two after the final token.
    """
    phi_q, phi_k, v, state, normalizer, eps = _prepare(queries, keys, values, feature_map, normalize,
                                                       initial_state, initial_normalizer, eps)
    outputs = np.empty((phi_q.shape[0], v.shape[1]), dtype=v.dtype)
    for t in range(phi_q.shape[0]):
        state += np.outer(phi_k[t], v[t])                 # write: S_t = S_{t-1} + phi(k_t) v_t^T
        normalizer += phi_k[t]                            #        z_t = z_{t-1} + phi(k_t)
        outputs[t] = _readout(state.T @ phi_q[t], phi_q[t] @ normalizer, normalize, eps)
    return outputs, state, normalizer


def linear_attention_chunkwise(queries, keys, values, *, feature_map=elu_plus_one, normalize=True,
                               initial_state=None, initial_normalizer=None, eps=1e-12,
                               chunk_size=64):
    """The chunkwise form, equation ``eq-la-chunkwise``.

    Inside a chunk of ``C`` tokens, the masked product of the parallel form; between
    chunks, the state carried as in the recurrent form:
    ``O_[c] = (M * (phi(Q_[c]) phi(K_[c])^T)) V_[c] + phi(Q_[c]) S_[c-1]`` and
    ``S_[c] = S_[c-1] + phi(K_[c])^T V_[c]`` (the normalizer likewise, with a
    column of ones in place of ``V``). The last chunk may be shorter.

    Arguments as :func:`linear_attention_parallel`, plus ``chunk_size >= 1``.
    Returns ``(outputs (T, d_v), state (r, d_v), normalizer (r,))``.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    phi_q, phi_k, v, state, normalizer, eps = _prepare(queries, keys, values, feature_map, normalize,
                                                       initial_state, initial_normalizer, eps)
    outputs = np.empty((phi_q.shape[0], v.shape[1]), dtype=v.dtype)
    for start in range(0, phi_q.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        qc, kc, vc = phi_q[sl], phi_k[sl], v[sl]
        weights = np.tril(qc @ kc.T)                      # within the chunk
        numerator = weights @ vc + qc @ state             # + what earlier chunks left in the state
        denominator = weights.sum(axis=1) + qc @ normalizer
        outputs[sl] = _readout(numerator, denominator, normalize, eps)
        state += kc.T @ vc                                # carry the chunk into the state
        normalizer += kc.sum(axis=0)
    return outputs, state, normalizer


def linear_attention_decode_step(state, normalizer, query, key, value, *, feature_map=elu_plus_one,
                                 normalize=True, eps=1e-12):
    """One generated token with a fixed-size state, equations ``eq-la-recurrent`` and ``eq-la-readout``.

    Parameters
    ----------
    state : array ``(r, d_v)``; normalizer : array ``(r,)``
        The state and normalizer after the earlier tokens (zeros before the first).
    query, key : arrays ``(d_k,)``; value : array ``(d_v,)``
    feature_map, normalize, eps : as :func:`linear_attention_parallel`

    Returns
    -------
    output : array ``(d_v,)``, read from the state *after* this token's write
    state : array ``(r, d_v)``; normalizer : array ``(r,)``
        New arrays (the ones passed in are not modified).
    """
    eps = _check_flags(normalize, eps)
    q = as_float_array(query, "query", ndim=1)
    k = as_float_array(key, "key", ndim=1, shape=(q.shape[0],))
    v = as_float_array(value, "value", ndim=1)
    phi_q = _apply_feature_map(feature_map, q[None, :], "query", normalize)[0]
    phi_k = _apply_feature_map(feature_map, k[None, :], "key", normalize)[0]
    r = phi_k.shape[0]
    check_dim(phi_q[None, :], "feature_map", 1, r, "r, the feature width it gave the key")
    s = as_float_array(state, "state", ndim=2, shape=(r, v.shape[0]))
    z = as_float_array(normalizer, "normalizer", ndim=1, shape=(r,))
    if normalize and np.any(z < 0):
        raise ValueError("normalizer: expected non-negative entries with normalize=True "
                         f"(it is a sum of features phi(k)), got {float(z.min())!r}")
    new_state = s + np.outer(phi_k, v)
    new_normalizer = z + phi_k
    output = _readout(new_state.T @ phi_q, phi_q @ new_normalizer, normalize, eps)
    return output, new_state, new_normalizer


# ---------------------------------------------------------------- Performer (FAVOR+)

def softmax_kernel(queries, keys):
    """The softmax kernel ``exp(q . k)`` for every pair, equation ``eq-la-softmax-kernel``.

    ``queries (n, d)``, ``keys (m, d)`` -> ``(n, m)``. (Apply ``d**-0.25`` to both
    to get the ``exp(q . k / sqrt(d))`` of scaled attention.)
    """
    q = as_float_array(queries, "queries", ndim=2)
    k = as_float_array(keys, "keys", ndim=2)
    check_dim(k, "keys", 1, q.shape[1], "d, the width of queries")
    return np.exp(q @ k.T)


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
    Gaussian. Every feature is positive. ``x``: ``(n, d)`` (or ``(d,)``) -> ``(n, m)``
    (or ``(m,)``). Use as ``feature_map=lambda a: favor_plus_features(a, W)``.
    """
    arr = as_float_array(x, "x", ndim=(1, 2))
    w = as_float_array(projection, "projection", ndim=2)
    check_dim(w, "projection", 1, arr.shape[-1], "d, the width of x")
    sq = 0.5 * np.sum(arr * arr, axis=-1, keepdims=True)
    return np.exp(arr @ w.T - sq) / np.sqrt(w.shape[0])


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


def linformer_attention(queries, keys, values, proj_k, proj_v, *, scale=None):
    """Linformer attention (bidirectional), equation ``eq-la-linformer``.

    ``softmax(scale * Q (E K)^T) (F V)`` with ``E = proj_k`` and ``F = proj_v`` of shape
    ``(k, T)``: the ``T`` keys and values are mixed down to ``k`` along the sequence,
    so the score matrix is ``(T, k)`` instead of ``(T, T)``. Every output row sees
    every token, so the layer is not causal.

    ``queries, keys``: ``(T, d_k)``; ``values``: ``(T, d_v)``; result ``(T, d_v)``.
    ``scale=None`` means ``1/sqrt(d_k)``.
    """
    from .softmax_attention import _row_softmax, _scale

    q = as_float_array(queries, "queries", ndim=2)
    k = as_float_array(keys, "keys", ndim=2)
    v = as_float_array(values, "values", ndim=2)
    check_same_length("queries", q, "keys", k)
    check_same_length("queries", q, "values", v)
    check_dim(k, "keys", 1, q.shape[1], "d_k, the width of queries")
    e = as_float_array(proj_k, "proj_k", ndim=2, shape=(None, q.shape[0]))
    f = as_float_array(proj_v, "proj_v", ndim=2, shape=(e.shape[0], q.shape[0]))
    if e.shape[0] < 1:
        raise ValueError(f"proj_k: expected at least one row, got shape {e.shape}")
    short_keys, short_values = e @ k, f @ v               # (k, d_k), (k, d_v): k summary tokens
    weights = _row_softmax(_scale(scale, q.shape[1]) * (q @ short_keys.T))   # (T, k)
    return weights @ short_values
