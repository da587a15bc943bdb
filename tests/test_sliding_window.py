"""Sliding-window attention (fixedstate.softmax_attention): the banded form, its step, loop and backward.

- it equals full causal attention with the band mask applied by hand (an independent reference);
- with window >= T it is softmax attention;
- token by token against the window cache equals the sequence, and the cache never holds more than
  window - 1 tokens;
- a prefix in the cache then more tokens equals one call;
- its backward matches central finite differences (float64), over shapes, windows and lengths;
- float32 in gives float32 out; bad input raises ValueError naming the argument.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples
from _finite_differences import BOUND, check

from fixedstate import softmax_attention as sa


def _banded_by_hand(q, k, v, window, scale):
    """Masked full attention, the mask built entry by entry: key j visible from query t when t - window < j <= t."""
    T = q.shape[-2]
    scores = scale * (q @ k.swapaxes(-1, -2))
    mask = np.array([[t - window < j <= t for j in range(T)] for t in range(T)])
    scores = np.where(mask, scores, -np.inf)
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def _qkv(lead, T, d_k, d_v, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(lead + (T, d_k)), rng.standard_normal(lead + (T, d_k)),
            rng.standard_normal(lead + (T, d_v)))


@examples(40)
@given(lead=st.lists(st.integers(1, 3), max_size=2).map(tuple), T=st.integers(1, 12), d_k=st.integers(1, 4),
       d_v=st.integers(1, 4), window=st.integers(1, 14), seed=st.integers(0, 10**6))
def test_equals_masked_full_attention_and_the_loop(lead, T, d_k, d_v, window, seed):
    q, k, v = _qkv(lead, T, d_k, d_v, seed)
    out, cache = sa.sliding_window_attention(q, k, v, window=window, scale=0.7)
    np.testing.assert_allclose(out, _banded_by_hand(q, k, v, window, 0.7), rtol=1e-12, atol=1e-12)
    assert cache.length == min(window - 1, T)
    np.testing.assert_array_equal(cache.keys, k[..., T - cache.length:, :])
    if not lead:
        loop, loop_cache = sa.sliding_window_attention_loop(q, k, v, window=window, scale=0.7)
        np.testing.assert_allclose(loop, out, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(loop_cache.values, cache.values)


@examples(20)
@given(T=st.integers(1, 10), extra=st.integers(0, 5), seed=st.integers(0, 10**6))
def test_a_window_of_at_least_T_is_softmax_attention(T, extra, seed):
    q, k, v = _qkv((2,), T, 3, 2, seed)
    np.testing.assert_allclose(sa.sliding_window_attention(q, k, v, window=T + extra)[0],
                               sa.softmax_attention(q, k, v, causal=True)[0], rtol=1e-13, atol=1e-13)


@examples(30)
@given(T=st.integers(1, 12), window=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_one_token_at_a_time_against_the_window_cache(T, window, seed):
    q, k, v = _qkv((2,), T, 3, 2, seed)
    whole, final = sa.sliding_window_attention(q, k, v, window=window)
    cache, outs = None, []
    for t in range(T):
        o, cache = sa.sliding_window_attention_step(q[:, t], k[:, t], v[:, t], window=window, initial_state=cache)
        assert cache.length == min(window - 1, t + 1)          # the state stops growing
        outs.append(o)
    np.testing.assert_allclose(np.stack(outs, axis=-2), whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(cache.keys, final.keys)


@examples(30)
@given(n=st.integers(0, 8), T=st.integers(1, 8), window=st.integers(1, 10), seed=st.integers(0, 10**6))
def test_prefix_then_more_tokens_is_one_call(n, T, window, seed):
    q, k, v = _qkv((), n + T, 3, 2, seed)
    whole, _ = sa.sliding_window_attention(q, k, v, window=window)
    _, cache = sa.sliding_window_attention(q[:n], k[:n], v[:n], window=window) if n else (None, None)
    rest, _ = sa.sliding_window_attention(q[n:], k[n:], v[n:], window=window, initial_state=cache)
    np.testing.assert_allclose(rest, whole[n:], rtol=1e-12, atol=1e-12)
    full_prefix = (k[:n], v[:n]) if n else None             # a longer cache: only its last window - 1 are read
    again, _ = sa.sliding_window_attention(q[n:], k[n:], v[n:], window=window, initial_state=full_prefix)
    np.testing.assert_allclose(again, whole[n:], rtol=1e-12, atol=1e-12)


@examples(25)
@given(lead=st.lists(st.integers(1, 2), max_size=2).map(tuple), T=st.integers(1, 7), d_k=st.integers(1, 3),
       d_v=st.integers(1, 3), window=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_backward_matches_finite_differences(lead, T, d_k, d_v, window, seed):
    q, k, v = _qkv(lead, T, d_k, d_v, seed)

    def f(q, k, v):
        return sa.sliding_window_attention(q, k, v, window=window, scale=0.8)[0]

    def grads(d_out):
        dq, dk, dv = sa.sliding_window_attention_backward(q, k, v, d_out, window=window, scale=0.8)
        return {"q": dq, "k": dk, "v": dv}

    assert check(f, {"q": q, "k": k, "v": v}, grads) <= BOUND


def test_backward_equals_softmax_backward_when_the_window_covers_everything():
    q, k, v = _qkv((2,), 6, 3, 2, 1)
    d = np.random.default_rng(2).standard_normal((2, 6, 2))
    for a, b in zip(sa.sliding_window_attention_backward(q, k, v, d, window=6),
                    sa.softmax_attention_backward(q, k, v, d, causal=True)):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


def test_float32_in_float32_out():
    q, k, v = (a.astype(np.float32) for a in _qkv((), 5, 3, 2, 0))
    assert sa.sliding_window_attention(q, k, v, window=2)[0].dtype == np.float32
    assert sa.sliding_window_attention_step(q[0], k[0], v[0], window=2)[0].dtype == np.float32
    assert all(g.dtype == np.float32 for g in sa.sliding_window_attention_backward(q, k, v, v, window=2))


@pytest.mark.parametrize("window", [0, -1, 2.5, True, None])
def test_a_bad_window_names_the_argument(window):
    q, k, v = _qkv((), 4, 2, 2, 0)
    for call in (lambda: sa.sliding_window_attention(q, k, v, window=window),
                 lambda: sa.sliding_window_attention_step(q[0], k[0], v[0], window=window),
                 lambda: sa.sliding_window_attention_backward(q, k, v, v, window=window)):
        with pytest.raises(ValueError, match="window"):
            call()
    with pytest.raises(ValueError, match="k"):
        sa.sliding_window_attention(q, k[:3], v, window=2)
