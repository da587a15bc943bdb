"""Softmax attention and its KV cache (chapter "The cost of softmax attention", chap-softmax-cost).

Shapes: a sequence is ``(..., T, d)`` with one token per row and any leading axes
(batch, heads, ...) that broadcast together; one token is ``(..., d)``. Queries
and keys have width ``d_k``, values width ``d_v``. The default score scale is
``1/sqrt(d_k)`` (equation ``eq-sm-scores``). float32 in gives float32 out.

The state of softmax attention is its KV cache (:class:`KVCache`): the keys and
values of every token so far, growing by one row per token. Like the
fixed-state layers, every form takes ``q, k, v`` positionally and returns
``(outputs, state)``:

- :func:`softmax_attention`: the masked (causal) or full (bidirectional) matrix
  form, equation ``eq-sm-causal``, optionally after a cache of earlier tokens;
- :func:`softmax_attention_step`: one generated token against the KV cache,
  equation ``eq-sm-decode``;
- :func:`softmax_attention_loop`: the reference loop, one query at a time;
- :func:`attention_weights`: the attention matrix itself (a helper, not a core);
- :func:`softmax_attention_backward`: the gradients of the masked matrix form
  with respect to ``q, k, v`` (chapter 9).

Sliding-window attention is softmax attention whose mask is a band: query ``t``
sees only the ``window`` most recent tokens, itself included (keys ``j`` with
``t - window < j <= t``). Its state is a window cache, the keys and values of
the last ``window - 1`` tokens, whatever the length of the sequence (the
baseline of the recall-against-state experiment of chapter 9):

- :func:`sliding_window_attention`: the banded matrix form, optionally after a
  cache of earlier tokens;
- :func:`sliding_window_attention_step`: one token against the window cache;
- :func:`sliding_window_attention_loop`: its reference loop;
- :func:`sliding_window_attention_backward`: its gradients.
"""

from __future__ import annotations

import numpy as np

from ._grad import sum_to
from ._validate import as_float_array, as_float_batch, broadcast_leading, check_positive_int, float_dtype
from .kernels import row_softmax, softmax_scale

__all__ = [
    "KVCache",
    "softmax_attention",
    "softmax_attention_step",
    "softmax_attention_loop",
    "attention_weights",
    "softmax_attention_backward",
    "sliding_window_attention",
    "sliding_window_attention_step",
    "sliding_window_attention_loop",
    "sliding_window_attention_backward",
]


# ---------------------------------------------------------------- the KV cache

class _Buffers:
    """Key and value buffers with spare rows, shared by the caches built on them."""
    __slots__ = ("keys", "values", "filled")

    def __init__(self, keys, values, filled):
        self.keys, self.values, self.filled = keys, values, filled


class KVCache:
    """The KV cache of softmax attention (equation ``eq-sm-decode``): the state of the layer.

    ``KVCache(keys, values)`` holds the keys ``(..., n, d_k)`` and values
    ``(..., n, d_v)`` of ``n`` earlier tokens (copied in). Read them as
    ``cache.keys`` and ``cache.values`` (read-only views), or unpack
    ``keys, values = cache``; ``cache.length`` is ``n``.

    The rows live in buffers with spare capacity. Appending tokens (which
    :func:`softmax_attention_step` and :func:`softmax_attention` do, returning a
    new cache) writes them into the spare rows, and when the buffers are full
    they are reallocated with twice the rows: an append costs amortised O(1) per
    token instead of copying the whole cache every step, as a real decoder's
    preallocated cache does. A cache never changes once returned: if it is
    appended to twice (two continuations of one prefix), the second append
    copies instead of overwriting the first one's rows.

    The cache has the leading axes of the keys and values (and of the cache it
    continues), not those of the queries: a cache read by several query heads,
    as in grouped-query attention, is kept once, not repeated per head.
    """
    __slots__ = ("_buffers", "_length")

    def __init__(self, keys, values):
        dtype = float_dtype(keys, values)
        keys = as_float_batch(keys, "keys", (None, None), ("n", "d_k"))
        values = as_float_batch(values, "values", (keys.shape[-2], None), ("n", "d_v"))
        lead = broadcast_leading(("keys", keys, 2), ("values", values, 2))
        empty = _Buffers(np.zeros(lead + (0, keys.shape[-1]), dtype=dtype),
                         np.zeros(lead + (0, values.shape[-1]), dtype=dtype), 0)
        appended = KVCache._wrap(empty, 0)._append(keys.astype(dtype, copy=False),
                                                   values.astype(dtype, copy=False), spare=False)
        self._buffers, self._length = appended._buffers, appended._length

    @classmethod
    def _wrap(cls, buffers, length):
        cache = object.__new__(cls)
        cache._buffers, cache._length = buffers, length
        return cache

    @property
    def keys(self) -> np.ndarray:
        """The cached keys, ``(..., n, d_k)``, a read-only view."""
        view = self._buffers.keys[..., :self._length, :]
        view.flags.writeable = False
        return view

    @property
    def values(self) -> np.ndarray:
        """The cached values, ``(..., n, d_v)``, a read-only view."""
        view = self._buffers.values[..., :self._length, :]
        view.flags.writeable = False
        return view

    @property
    def length(self) -> int:
        """The number of cached tokens ``n``."""
        return self._length

    @property
    def capacity(self) -> int:
        """The number of rows the buffers have room for before they are reallocated."""
        return self._buffers.keys.shape[-2]

    @property
    def dtype(self) -> np.dtype:
        return self._buffers.keys.dtype

    def __iter__(self):
        yield self.keys
        yield self.values

    def __repr__(self) -> str:
        return (f"KVCache(length={self._length}, keys {self.keys.shape}, values {self.values.shape}, "
                f"capacity={self.capacity}, dtype={self.dtype})")

    def _append(self, keys, values, *, spare=True):
        """A new cache with ``keys (..., t, d_k)`` and ``values (..., t, d_v)`` after this one's rows.

        The arrays are validated by the caller and already in the cache's dtype or wider.
        """
        buf, n, t = self._buffers, self._length, keys.shape[-2]
        lead = np.broadcast_shapes(buf.keys.shape[:-2], keys.shape[:-2], values.shape[:-2])
        dtype = np.result_type(buf.keys, keys, values)
        need = n + t
        reuse = (buf.filled == n and buf.keys.shape[-2] >= need and buf.keys.shape[:-2] == lead
                 and buf.keys.dtype == dtype)
        if not reuse:
            rows = max(need, 2 * buf.keys.shape[-2], 16) if spare else need
            new = _Buffers(np.empty(lead + (rows, buf.keys.shape[-1]), dtype=dtype),
                           np.empty(lead + (rows, buf.values.shape[-1]), dtype=dtype), n)
            new.keys[..., :n, :] = buf.keys[..., :n, :]
            new.values[..., :n, :] = buf.values[..., :n, :]
            buf = new
        buf.keys[..., n:need, :] = keys
        buf.values[..., n:need, :] = values
        buf.filled = need
        return KVCache._wrap(buf, need)


def _as_cache(initial_state, d_k: int, d_v: int) -> KVCache:
    """``initial_state`` as a KVCache: None (empty), a KVCache, or a pair ``(keys, values)``."""
    if initial_state is None:
        return KVCache(np.zeros((0, d_k), dtype=np.float32), np.zeros((0, d_v), dtype=np.float32))
    if isinstance(initial_state, KVCache):
        cache = initial_state
    elif isinstance(initial_state, (tuple, list)) and len(initial_state) == 2:
        try:
            cache = KVCache(*initial_state)
        except ValueError as exc:
            raise ValueError(f"initial_state: {exc}") from None
    else:
        raise ValueError("initial_state: expected None, a KVCache or a pair (keys (..., n, d_k), "
                         f"values (..., n, d_v)), got {type(initial_state).__name__}")
    if cache.keys.shape[-1] != d_k or cache.values.shape[-1] != d_v:
        raise ValueError(f"initial_state: expected cached keys of width d_k={d_k} and values of width "
                         f"d_v={d_v}, got keys {cache.keys.shape} and values {cache.values.shape}")
    return cache


# ---------------------------------------------------------------- helpers

def _check_causal(causal) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal: expected True or False, got {causal!r}")
    return bool(causal)


def _prepare(q, k, v, initial_state, *, causal=True, tokens=True, one_sequence=False):
    """Validate; return ``q, k, v`` in the common dtype and the incoming cache."""
    dtype = float_dtype(q, k, v)           # of the inputs as given: float16 computes in float32
    tok = ("T",) if tokens else ()
    n = len(tok) + 1
    q = as_float_batch(q, "q", (None,) * n, tok + ("d_k",))
    if tokens and q.shape[-2] < 1:
        raise ValueError(f"q: expected at least one token (shape (..., T, d_k) with T >= 1), got shape {q.shape}")
    if tokens and causal:
        length, names = (q.shape[-2],), ("T",)
    else:
        length, names = ((None,), ("m",)) if tokens else ((), ())
    k = as_float_batch(k, "k", length + (q.shape[-1],), names + ("d_k",))
    v = as_float_batch(v, "v", (k.shape[-2],) + (None,) if tokens else (None,), names + ("d_v",))
    cache = _as_cache(initial_state, q.shape[-1], v.shape[-1])
    items = [("q", q, n), ("k", k, n), ("v", v, n), ("initial_state", cache.keys, 2)]
    lead = broadcast_leading(*items)
    if one_sequence and lead:
        raise ValueError(f"q: the reference loop takes one sequence (T, d_k) with no leading axes, got "
                         f"leading axes {lead} (use softmax_attention for batches)")
    if cache.length:
        dtype = np.result_type(dtype, cache.keys)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), cache


# ---------------------------------------------------------------- the forms

def attention_weights(q, k, *, causal: bool = True, scale=None) -> np.ndarray:
    """The attention matrix ``A = softmax(mask(scale * Q K^T))`` (equation ``eq-sm-causal``).

    ``q`` ``(..., T, d_k)`` and ``k`` ``(..., T, d_k)``; the result is ``(..., T, T)``,
    each row a probability distribution over the keys the query may see (row ``t``
    puts zero weight on keys after ``t`` when ``causal``). With ``causal=False`` the
    keys may be a different number ``m`` of rows, giving ``(..., T, m)``.
    """
    causal = _check_causal(causal)
    dtype = float_dtype(q, k)
    q = as_float_batch(q, "q", (None, None), ("T", "d_k"))
    if q.shape[-2] < 1:
        raise ValueError(f"q: expected at least one token, got shape {q.shape}")
    k = as_float_batch(k, "k", ((q.shape[-2],) if causal else (None,)) + (q.shape[-1],),
                       ("T" if causal else "m", "d_k"))
    broadcast_leading(("q", q, 2), ("k", k, 2))
    q, k = q.astype(dtype, copy=False), k.astype(dtype, copy=False)
    scores = softmax_scale(scale, q.shape[-1]) * (q @ k.swapaxes(-1, -2))
    if causal:
        t = q.shape[-2]
        scores = np.where(np.tri(t, dtype=bool), scores, -np.inf)
    return row_softmax(scores)


def softmax_attention(q, k, v, *, causal: bool = True, scale=None, initial_state=None):
    """Softmax attention ``softmax(mask(scale * Q K^T)) V`` (equation ``eq-sm-causal``).

    Parameters
    ----------
    q : array ``(..., T, d_k)``
    k : array ``(..., T, d_k)`` (``(..., m, d_k)`` allowed when not causal)
    v : array ``(..., T, d_v)`` (or ``(..., m, d_v)``)
    causal : bool
        ``True``: token ``t`` sees the cached tokens and new tokens ``1..t`` (the
        decoder). ``False``: every query sees every key (the encoder; used by
        Linformer and the recall read-out).
    scale : positive float or None
        Multiplies the scores; ``None`` means ``1/sqrt(d_k)`` (``eq-sm-scores``).
    initial_state : :class:`KVCache`, a pair ``(keys (..., n, d_k), values (..., n, d_v))``, or None
        The keys and values of ``n`` earlier tokens (a prefix); the new queries
        attend to them as well.

    Returns
    -------
    outputs : array ``(..., T, d_v)``
    cache : :class:`KVCache` with the ``n + T`` (or ``n + m``) keys and values (with the
        leading axes of ``k``, ``v`` and ``initial_state``)
    """
    causal = _check_causal(causal)
    q, k, v, cache = _prepare(q, k, v, initial_state, causal=causal)
    n = cache.length
    cache = cache._append(k, v)
    scores = softmax_scale(scale, q.shape[-1]) * (q @ cache.keys.swapaxes(-1, -2))   # (..., T, n + m)
    if causal:
        visible = np.tri(q.shape[-2], n + q.shape[-2], k=n, dtype=bool)   # key j visible from query t: j <= n + t
        scores = np.where(visible, scores, -np.inf)
    return row_softmax(scores) @ cache.values, cache


def softmax_attention_step(q, k, v, *, scale=None, initial_state=None):
    """One decode step with a KV cache, equation ``eq-sm-decode``.

    Appends the new token's key and value to the cache, then attends from the
    new query to every cached key (the new one included).

    Parameters
    ----------
    q, k : arrays ``(..., d_k)``; v : array ``(..., d_v)``
    scale : positive float or None (``1/sqrt(d_k)``)
    initial_state : :class:`KVCache`, a pair ``(keys (..., n, d_k), values (..., n, d_v))``, or None
        (the empty cache)

    Returns
    -------
    o : array ``(..., d_v)``
    cache : :class:`KVCache` of ``n + 1`` tokens (the cache passed in is not modified)
    """
    q, k, v, cache = _prepare(q, k, v, initial_state, tokens=False)
    cache = cache._append(k[..., None, :], v[..., None, :])
    scores = softmax_scale(scale, q.shape[-1]) * (cache.keys @ q[..., :, None])[..., 0]   # (..., n + 1)
    weights = row_softmax(scores)
    return (weights[..., None, :] @ cache.values)[..., 0, :], cache


def softmax_attention_loop(q, k, v, *, scale=None, initial_state=None):
    """The reference loop for ``eq-sm-causal``: one query at a time over its prefix.

    One sequence: ``q, k`` ``(T, d_k)``, ``v`` ``(T, d_v)``, no leading axes;
    ``initial_state`` a cache of earlier tokens or None. Same results as
    :func:`softmax_attention` with ``causal=True``; slower, and written to be
    read next to the equations.
    """
    q, k, v, cache = _prepare(q, k, v, initial_state, one_sequence=True)
    c = softmax_scale(scale, q.shape[1])
    K = np.concatenate([cache.keys, k])           # every key: the cached ones, then the new ones
    V = np.concatenate([cache.values, v])
    n = cache.length
    o = np.empty_like(v)
    for t in range(len(q)):
        s = c * (K[: n + t + 1] @ q[t])           # eq-sm-scores: s_tj = c q_t^T k_j for the visible j
        w = np.exp(s - s.max())                   # exp(s_tj), shifted by the largest so nothing overflows
        o[t] = (w / w.sum()) @ V[: n + t + 1]     # eq-sm-causal: the weighted average of the visible values
    return o, KVCache(K, V)


# ---------------------------------------------------------------- the backward pass

def softmax_attention_backward(q, k, v, d_out, *, causal: bool = True, scale=None):
    """The gradients of :func:`softmax_attention` (``eq-sm-causal``, no cache): ``eq-bw-sm-dv``, ``eq-bw-sm-dqk``.

    For a loss ``L`` whose gradient with respect to the outputs ``O = A V`` is
    ``d_out``, with ``A = softmax(mask(c Q K^T))`` (recomputed by
    :func:`attention_weights`, the forward's own code):

    - ``dV = A^T dO``;
    - ``dA = dO V^T`` and, through the softmax of each row,
      ``dS = A * (dA - rowsum(A * dA))`` (masked entries have ``A = 0``, so no
      gradient);
    - ``dQ = c dS K`` and ``dK = c dS^T Q``.

    Parameters
    ----------
    q : array ``(..., T, d_k)``
    k : array ``(..., T, d_k)`` (``(..., m, d_k)`` allowed when not causal)
    v : array ``(..., T, d_v)`` (or ``(..., m, d_v)``)
    d_out : array ``(..., T, d_v)``, the gradient of the loss with respect to the outputs
    causal, scale : as :func:`softmax_attention`

    Returns
    -------
    dq, dk, dv : arrays of the shapes of ``q``, ``k``, ``v`` (summed over the leading
        axes along which an input was broadcast), in the common floating precision.
    """
    causal = _check_causal(causal)
    dtype = float_dtype(q, k, v, d_out)                           # float16 counts as float32
    q, k, v, _ = _prepare(q, k, v, None, causal=causal)
    d_out = as_float_batch(d_out, "d_out", (q.shape[-2], v.shape[-1]), ("T", "d_v"))
    broadcast_leading(("q", q, 2), ("k", k, 2), ("v", v, 2), ("d_out", d_out, 2))
    q, k, v, d_out = (a.astype(dtype, copy=False) for a in (q, k, v, d_out))
    c = dtype.type(softmax_scale(scale, q.shape[-1]))
    weights = attention_weights(q, k, causal=causal, scale=scale)           # A, (..., T, m)
    d_weights = d_out @ v.swapaxes(-1, -2)                                   # dA = dO V^T
    d_scores = weights * (d_weights - np.sum(weights * d_weights, axis=-1, keepdims=True))
    dq = c * (d_scores @ k)
    dk = c * (d_scores.swapaxes(-1, -2) @ q)
    dv = weights.swapaxes(-1, -2) @ d_out
    return sum_to(dq, q.shape), sum_to(dk, k.shape), sum_to(dv, v.shape)


# ---------------------------------------------------------------- sliding-window attention

def _window_cache(cache: KVCache, window: int) -> KVCache:
    """The last ``window - 1`` tokens of ``cache`` (all of them if it holds fewer): the window cache."""
    keep = min(window - 1, cache.length)
    if keep == cache.length:
        return cache
    return KVCache(cache.keys[..., cache.length - keep:, :], cache.values[..., cache.length - keep:, :])


def _band(T: int, n: int, window: int) -> np.ndarray:
    """Which of ``n + T`` keys each of ``T`` new queries sees: key ``j`` from query ``t`` when
    ``n + t - window < j <= n + t`` (``(T, n + T)`` booleans)."""
    t = np.arange(T)[:, None] + n
    j = np.arange(n + T)[None, :]
    return (j <= t) & (j > t - window)


def _window_weights(q, k, window, scale):
    """The banded attention matrix of validated ``q``, ``k`` ``(..., T, d_k)`` (no cache)."""
    scores = softmax_scale(scale, q.shape[-1]) * (q @ k.swapaxes(-1, -2))
    return row_softmax(np.where(_band(q.shape[-2], 0, window), scores, -np.inf))


def sliding_window_attention(q, k, v, *, window, scale=None, initial_state=None):
    """Sliding-window attention: ``eq-sm-causal`` with the mask cut to a band of ``window`` keys.

    Query ``t`` attends to the keys ``j`` with ``t - window < j <= t`` (itself and
    the ``window - 1`` tokens before it), counting the cached tokens of
    ``initial_state`` as the positions before the first new one. With
    ``window >= n + T`` it is :func:`softmax_attention` with ``causal=True``.
    The matrix is formed in full and masked (``O(T^2)`` work, fine at the book's
    lengths; a kernel would compute only the band).

    Parameters
    ----------
    q, k : arrays ``(..., T, d_k)``; v : array ``(..., T, d_v)``
    window : int >= 1, the number of tokens each query sees (itself included)
    scale : positive float or None (``1/sqrt(d_k)``, ``eq-sm-scores``)
    initial_state : a window cache (:class:`KVCache`, a pair ``(keys, values)``) or None
        (only its last ``window - 1`` tokens are read)

    Returns
    -------
    outputs : array ``(..., T, d_v)``
    cache : :class:`KVCache` of the last ``min(window - 1, n + T)`` keys and values, the layer's state
    """
    window = check_positive_int(window, "window")
    q, k, v, cache = _prepare(q, k, v, initial_state)
    cache = _window_cache(cache, window)
    n = cache.length
    cache = cache._append(k, v)
    scores = softmax_scale(scale, q.shape[-1]) * (q @ cache.keys.swapaxes(-1, -2))      # (..., T, n + T)
    scores = np.where(_band(q.shape[-2], n, window), scores, -np.inf)
    return row_softmax(scores) @ cache.values, _window_cache(cache, window)


def sliding_window_attention_step(q, k, v, *, window, scale=None, initial_state=None):
    """One token of sliding-window attention against its window cache (``eq-sm-decode`` over the window).

    ``q, k`` ``(..., d_k)``, ``v`` ``(..., d_v)``; ``initial_state`` the window
    cache (None: empty). The new token's key and value join the cache, the query
    attends to the last ``window`` of them, and the cache returned keeps the last
    ``window - 1``: its size stops growing once ``window - 1`` tokens have passed.
    Returns ``(o (..., d_v), cache)``.
    """
    window = check_positive_int(window, "window")
    q, k, v, cache = _prepare(q, k, v, initial_state, tokens=False)
    cache = _window_cache(cache, window)._append(k[..., None, :], v[..., None, :])
    scores = softmax_scale(scale, q.shape[-1]) * (cache.keys @ q[..., :, None])[..., 0]
    weights = row_softmax(scores)
    return (weights[..., None, :] @ cache.values)[..., 0, :], _window_cache(cache, window)


def sliding_window_attention_loop(q, k, v, *, window, scale=None, initial_state=None):
    """The reference loop for sliding-window attention (``eq-sm-causal`` over a band): one query at a time.

    One sequence: ``q, k`` ``(T, d_k)``, ``v`` ``(T, d_v)``; ``initial_state`` a
    cache of earlier tokens or None. Same results as :func:`sliding_window_attention`.
    """
    window = check_positive_int(window, "window")
    q, k, v, cache = _prepare(q, k, v, initial_state, one_sequence=True)
    c = softmax_scale(scale, q.shape[1])
    K = np.concatenate([cache.keys, k])
    V = np.concatenate([cache.values, v])
    n = cache.length
    o = np.empty_like(v)
    for t in range(len(q)):
        first = max(0, n + t + 1 - window)        # the window: keys first .. n + t
        s = c * (K[first: n + t + 1] @ q[t])
        w = np.exp(s - s.max())
        o[t] = (w / w.sum()) @ V[first: n + t + 1]
    return o, _window_cache(KVCache(K, V), window)


def sliding_window_attention_backward(q, k, v, d_out, *, window, scale=None):
    """The gradients of :func:`sliding_window_attention` (no cache): ``eq-bw-sm-dv``, ``eq-bw-sm-dqk``.

    The same three products as :func:`softmax_attention_backward`, with ``A`` the
    banded attention matrix: entries outside the band have ``A = 0`` and get no
    gradient. ``q, k`` ``(..., T, d_k)``, ``v`` and ``d_out`` ``(..., T, d_v)``;
    returns ``dq, dk, dv`` of the shapes of ``q, k, v`` (summed over broadcast
    leading axes).
    """
    window = check_positive_int(window, "window")
    dtype = float_dtype(q, k, v, d_out)
    q, k, v, _ = _prepare(q, k, v, None)
    d_out = as_float_batch(d_out, "d_out", (q.shape[-2], v.shape[-1]), ("T", "d_v"))
    broadcast_leading(("q", q, 2), ("k", k, 2), ("v", v, 2), ("d_out", d_out, 2))
    q, k, v, d_out = (a.astype(dtype, copy=False) for a in (q, k, v, d_out))
    c = dtype.type(softmax_scale(scale, q.shape[-1]))
    weights = _window_weights(q, k, window, scale)
    d_weights = d_out @ v.swapaxes(-1, -2)
    d_scores = weights * (d_weights - np.sum(weights * d_weights, axis=-1, keepdims=True))
    dq = c * (d_scores @ k)
    dk = c * (d_scores.swapaxes(-1, -2) @ q)
    dv = weights.swapaxes(-1, -2) @ d_out
    return sum_to(dq, q.shape), sum_to(dk, k.shape), sum_to(dv, v.shape)
