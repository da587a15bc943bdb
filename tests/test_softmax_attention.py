"""Softmax attention: the matrix form, the reference loop and the KV-cache decoder agree.

Properties from chapter chap-softmax-cost:
- the masked matrix form equals an independent scalar double loop of eq-sm-causal;
- generating token by token with a growing KV cache (eq-sm-decode) reproduces the
  full causal attention, and the cache grows by exactly one key and one value a step;
- causality: changing a later token never changes an earlier output;
- bad input raises ValueError naming the argument.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fixedstate import softmax_attention as sa

SETTINGS = settings(max_examples=40, deadline=None)


def _scalar_loop(q, k, v, scale):
    """eq-sm-causal written with Python floats only: an independent reference."""
    out = np.zeros((q.shape[0], v.shape[1]))
    for t in range(q.shape[0]):
        scores = [scale * sum(q[t, i] * k[j, i] for i in range(q.shape[1])) for j in range(t + 1)]
        top = max(scores)
        w = [math.exp(s - top) for s in scores]
        total = sum(w)
        for j in range(t + 1):
            out[t] += (w[j] / total) * v[j]
    return out


def _data(seed, t, d_k, d_v):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((t, d_k)), rng.standard_normal((t, d_k)), rng.standard_normal((t, d_v))


def test_matrix_form_matches_scalar_loop_with_default_scale():
    q, k, v = _data(0, 9, 4, 3)
    expected = _scalar_loop(q, k, v, 1 / math.sqrt(4))
    np.testing.assert_allclose(sa.causal_softmax_attention(q, k, v), expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sa.causal_softmax_attention_loop(q, k, v), expected, rtol=1e-12, atol=1e-14)


def test_explicit_scale_is_used():
    q, k, v = _data(1, 6, 3, 2)
    expected = _scalar_loop(q, k, v, 0.7)
    np.testing.assert_allclose(sa.causal_softmax_attention(q, k, v, scale=0.7), expected, rtol=1e-12)


def test_first_output_is_first_value_and_rows_are_distributions():
    q, k, v = _data(2, 8, 5, 4)
    np.testing.assert_allclose(sa.causal_softmax_attention(q, k, v)[0], v[0], rtol=1e-14)
    a = sa.attention_weights(q, k)
    np.testing.assert_allclose(a.sum(axis=1), 1.0, rtol=1e-14)
    assert np.all(a[np.triu_indices(8, 1)] == 0.0)


@SETTINGS
@given(t=st.integers(1, 12), d_k=st.integers(1, 5), d_v=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_decode_over_growing_cache_equals_full_attention(t, d_k, d_v, seed):
    q, k, v = _data(seed, t, d_k, d_v)
    full = sa.causal_softmax_attention(q, k, v)
    cache = None
    for i in range(t):
        out, cache = sa.softmax_decode_step(q[i], k[i], v[i], cache)
        assert cache[0].shape == (i + 1, d_k) and cache[1].shape == (i + 1, d_v)
        np.testing.assert_allclose(out, full[i], rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(cache[0], k)
    np.testing.assert_array_equal(cache[1], v)


def test_decode_does_not_modify_the_cache_passed_in():
    q, k, v = _data(3, 3, 2, 2)
    _, cache = sa.softmax_decode_step(q[0], k[0], v[0])
    before = (cache[0].copy(), cache[1].copy())
    sa.softmax_decode_step(q[1], k[1], v[1], cache)
    np.testing.assert_array_equal(cache[0], before[0])
    np.testing.assert_array_equal(cache[1], before[1])


@SETTINGS
@given(t=st.integers(2, 10), seed=st.integers(0, 10**6))
def test_causal_outputs_ignore_the_future_but_bidirectional_do_not(t, seed):
    q, k, v = _data(seed, t, 3, 2)
    k2, v2 = k.copy(), v.copy()
    k2[-1] += 1.0
    v2[-1] += 1.0
    a = sa.causal_softmax_attention(q, k, v)
    b = sa.causal_softmax_attention(q, k2, v2)
    np.testing.assert_array_equal(a[:-1], b[:-1])
    full_a = sa.softmax_attention(q, k, v, causal=False)
    full_b = sa.softmax_attention(q, k2, v2, causal=False)
    assert not np.allclose(full_a[0], full_b[0])


def test_large_scores_do_not_overflow():
    q, k, v = _data(4, 5, 3, 2)
    out = sa.causal_softmax_attention(300 * q, 300 * k, v)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, sa.causal_softmax_attention_loop(300 * q, 300 * k, v), rtol=1e-10)


def test_float32_stays_float32():
    q, k, v = (a.astype(np.float32) for a in _data(5, 4, 3, 2))
    assert sa.causal_softmax_attention(q, k, v).dtype == np.float32


@pytest.mark.parametrize("call, name", [
    (lambda q, k, v: sa.causal_softmax_attention(q, k[:-1], v), "keys"),
    (lambda q, k, v: sa.causal_softmax_attention(q, k, v[:-1]), "values"),
    (lambda q, k, v: sa.causal_softmax_attention(q, k[:, :-1], v), "keys"),
    (lambda q, k, v: sa.causal_softmax_attention(q[0], k, v), "queries"),
    (lambda q, k, v: sa.causal_softmax_attention(q.astype(complex), k, v), "queries"),
    (lambda q, k, v: sa.causal_softmax_attention(q, k, v, scale=-1.0), "scale"),
    (lambda q, k, v: sa.softmax_decode_step(q[0], k[0][:-1], v[0]), "key"),
    (lambda q, k, v: sa.softmax_decode_step(q[0], k[0], v[0], cache=(k, v[:, :1])), "cache[1]"),
    (lambda q, k, v: sa.softmax_decode_step(q[0], k[0], v[0], cache=(k, v[:-1])), "cache[1]"),
    (lambda q, k, v: sa.softmax_decode_step(q[0], k[0], v[0], cache=k), "cache"),
])
def test_bad_input_names_the_argument(call, name):
    q, k, v = _data(6, 4, 3, 2)
    with pytest.raises(ValueError, match=r"^" + name.replace("[", r"\[").replace("]", r"\]")):
        call(q, k, v)
