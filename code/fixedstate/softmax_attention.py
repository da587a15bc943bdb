"""Softmax attention and its KV cache (chapter "The cost of softmax attention", chap-softmax-cost).

Shapes: a sequence is ``(T, d)`` with one token per row; one token is ``(d,)``.
Queries and keys have width ``d_k``, values width ``d_v``. The default score
scale is ``1/sqrt(d_k)`` (equation ``eq-sm-scores``).

- :func:`softmax_attention`: the masked (causal) or full (bidirectional) matrix form.
- :func:`causal_softmax_attention`: the causal form, equation ``eq-sm-causal``.
- :func:`causal_softmax_attention_loop`: the same, one query at a time (the reference loop).
- :func:`softmax_decode_step`: one generated token against a KV cache that it
  grows by one row, equation ``eq-sm-decode``.
"""

from __future__ import annotations

import numpy as np

from ._validate import as_float_array, as_token_sequences, check_dim, check_same_length

__all__ = [
    "softmax_attention",
    "causal_softmax_attention",
    "causal_softmax_attention_loop",
    "softmax_decode_step",
    "attention_weights",
]


def _scale(scale, d_k: int) -> float:
    if scale is None:
        return 1.0 / float(np.sqrt(d_k))
    arr = as_float_array(scale, "scale", ndim=0)
    value = float(arr)
    if not value > 0:
        raise ValueError(f"scale: expected a positive number (or None for 1/sqrt(d_k)), got {value!r}")
    return value


def _sequences(queries, keys, values):
    q, k, v = as_token_sequences(queries, keys, values)
    dtype = np.result_type(q, k, v)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False)


def _row_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax along the last axis, with -inf entries (masked) getting weight 0."""
    shifted = scores - np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(shifted)
    return weights / np.sum(weights, axis=-1, keepdims=True)


def attention_weights(queries, keys, *, causal: bool = True, scale=None) -> np.ndarray:
    """The attention matrix ``A = softmax(mask(scale * Q K^T))`` (equation ``eq-sm-causal``).

    ``queries`` ``(T, d_k)`` and ``keys`` ``(T, d_k)``; the result is ``(T, T)``, each
    row a probability distribution over the keys the query may see (row ``t`` puts
    zero weight on keys after ``t`` when ``causal``). With ``causal=False`` the
    keys may be a different number ``m`` of rows, giving ``(T, m)``.
    """
    q = as_float_array(queries, "queries", ndim=2)
    k = as_float_array(keys, "keys", ndim=2)
    if q.shape[0] < 1:
        raise ValueError(f"queries: expected at least one token, got shape {q.shape}")
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal: expected True or False, got {causal!r}")
    if causal:
        check_same_length("queries", q, "keys", k)
    check_dim(k, "keys", 1, q.shape[1], "d_k, the width of queries")
    scores = _scale(scale, q.shape[1]) * (q @ k.T)
    if causal:
        t = q.shape[0]
        scores = np.where(np.tri(t, dtype=bool), scores, -np.inf)
    return _row_softmax(scores)


def softmax_attention(queries, keys, values, *, causal: bool = True, scale=None) -> np.ndarray:
    """Softmax attention ``softmax(mask(scale * Q K^T)) V`` (equation ``eq-sm-causal``).

    Parameters
    ----------
    queries, keys : arrays of shape ``(T, d_k)``
    values : array of shape ``(T, d_v)``
    causal : bool
        ``True``: token ``t`` sees tokens ``1..t`` (the decoder). ``False``: every
        token sees every token (the encoder; used by Linformer).
    scale : positive float or None
        Multiplies the scores; ``None`` means ``1/sqrt(d_k)``.

    Returns
    -------
    array of shape ``(T, d_v)``
    """
    q, k, v = _sequences(queries, keys, values)
    return attention_weights(q, k, causal=causal, scale=scale) @ v


def causal_softmax_attention(queries, keys, values, *, scale=None) -> np.ndarray:
    """Causal softmax attention, equation ``eq-sm-causal``.

    ``o_t = sum_{j<=t} softmax_j(scale * q_t . k_j) v_j`` for every ``t``.
    ``queries, keys``: ``(T, d_k)``; ``values``: ``(T, d_v)``; result ``(T, d_v)``.
    ``scale=None`` means ``1/sqrt(d_k)``.
    """
    return softmax_attention(queries, keys, values, causal=True, scale=scale)


def causal_softmax_attention_loop(queries, keys, values, *, scale=None) -> np.ndarray:
    """The reference loop for ``eq-sm-causal``: one query at a time over its prefix.

    Same arguments and result as :func:`causal_softmax_attention`; slower, and
    written to be read next to the equation.
    """
    q, k, v = _sequences(queries, keys, values)
    c = _scale(scale, q.shape[1])
    out = np.empty((q.shape[0], v.shape[1]), dtype=v.dtype)
    for t in range(q.shape[0]):
        scores = c * (k[: t + 1] @ q[t])          # (t+1,): one score per visible key
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        out[t] = weights @ v[: t + 1]             # weighted average of the visible values
    return out


def softmax_decode_step(query, key, value, cache=None, *, scale=None):
    """One decode step with a KV cache, equation ``eq-sm-decode``.

    Appends the new token's key and value to the cache, then attends from the
    new query to every cached key (the new one included).

    Parameters
    ----------
    query, key : arrays of shape ``(d_k,)``
    value : array of shape ``(d_v,)``
    cache : tuple ``(keys (n, d_k), values (n, d_v))`` or None
        The keys and values of the ``n`` earlier tokens; ``None`` is the empty cache.
    scale : positive float or None
        ``None`` means ``1/sqrt(d_k)``.

    Returns
    -------
    output : array of shape ``(d_v,)``
    cache : tuple ``(keys (n+1, d_k), values (n+1, d_v))``
        New arrays; the cache passed in is not modified.
    """
    q = as_float_array(query, "query", ndim=1)
    k = as_float_array(key, "key", ndim=1, shape=(q.shape[0],))
    v = as_float_array(value, "value", ndim=1)
    if cache is None:
        cached_k = np.zeros((0, q.shape[0]), dtype=k.dtype)
        cached_v = np.zeros((0, v.shape[0]), dtype=v.dtype)
    else:
        if not isinstance(cache, (tuple, list)) or len(cache) != 2:
            raise ValueError("cache: expected None or a tuple (keys (n, d_k), values (n, d_v)), "
                             f"got {type(cache).__name__}")
        cached_k = as_float_array(cache[0], "cache[0] (keys)", ndim=2, shape=(None, q.shape[0]))
        cached_v = as_float_array(cache[1], "cache[1] (values)", ndim=2, shape=(None, v.shape[0]))
        check_same_length("cache[0] (keys)", cached_k, "cache[1] (values)", cached_v)
    dtype = np.result_type(q, k, v, cached_k, cached_v)
    all_k = np.concatenate([cached_k, k[None, :]]).astype(dtype, copy=False)
    all_v = np.concatenate([cached_v, v[None, :]]).astype(dtype, copy=False)
    scores = _scale(scale, q.shape[0]) * (all_k @ q)   # (n+1,)
    weights = np.exp(scores - scores.max())
    weights /= weights.sum()
    return weights @ all_v, (all_k, all_v)
