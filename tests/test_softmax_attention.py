"""Softmax attention: the matrix form, the reference loop and the KV-cache decoder agree.

Properties from chapter chap-softmax-cost:
- the masked matrix form and the reference loop equal an independent scalar double
  loop of eq-sm-causal;
- generating token by token with a growing KV cache (eq-sm-decode) reproduces the
  full causal attention, and the cache grows by exactly one key and one value a step;
- a prefix in the cache (initial_state) then more tokens equals one call;
- the cache appends in amortised O(1): its buffers double, and a cache once
  returned never changes, even when two continuations branch from it;
- leading axes broadcast: a batched call equals the loop over its items;
- causality: changing a later token never changes an earlier output;
- float32 in gives float32 out;
- bad input raises ValueError naming the argument.
"""

import math

import numpy as np

from _shapes import thin
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import softmax_attention as sa

SETTINGS = examples(40)


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


def _data(seed, t, d_k, d_v, lead=()):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(lead + (t, d_k)), rng.standard_normal(lead + (t, d_k)),
            rng.standard_normal(lead + (t, d_v)))


def test_matrix_form_matches_scalar_loop_with_default_scale():
    q, k, v = _data(0, 9, 4, 3)
    expected = _scalar_loop(q, k, v, 1 / math.sqrt(4))
    out, cache = sa.softmax_attention(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sa.softmax_attention_loop(q, k, v)[0], expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(cache.keys, k)
    np.testing.assert_array_equal(cache.values, v)
    assert cache.length == 9


def test_explicit_scale_is_used():
    q, k, v = _data(1, 6, 3, 2)
    expected = _scalar_loop(q, k, v, 0.7)
    np.testing.assert_allclose(sa.softmax_attention(q, k, v, scale=0.7)[0], expected, rtol=1e-12)
    np.testing.assert_allclose(sa.softmax_attention_loop(q, k, v, scale=0.7)[0], expected, rtol=1e-12)


def test_first_output_is_first_value_and_rows_are_distributions():
    q, k, v = _data(2, 8, 5, 4)
    np.testing.assert_allclose(sa.softmax_attention(q, k, v)[0][0], v[0], rtol=1e-14)
    a = sa.attention_weights(q, k)
    np.testing.assert_allclose(a.sum(axis=1), 1.0, rtol=1e-14)
    assert np.all(a[np.triu_indices(8, 1)] == 0.0)


@SETTINGS
@given(t=st.integers(1, 12), d_k=st.integers(1, 5), d_v=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_decode_over_growing_cache_equals_full_attention(t, d_k, d_v, seed):
    q, k, v = _data(seed, t, d_k, d_v)
    full, _ = sa.softmax_attention(q, k, v)
    cache = None
    for i in range(t):
        out, cache = sa.softmax_attention_step(q[i], k[i], v[i], initial_state=cache)
        assert cache.keys.shape == (i + 1, d_k) and cache.values.shape == (i + 1, d_v)
        np.testing.assert_allclose(out, full[i], rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(cache.keys, k)
    np.testing.assert_array_equal(cache.values, v)


@SETTINGS
@given(n=st.integers(0, 8), t=st.integers(1, 8), seed=st.integers(0, 10**6), as_pair=st.booleans())
def test_prefix_in_the_cache_then_more_tokens_is_one_call(n, t, seed, as_pair):
    q, k, v = _data(seed, n + t, 3, 2)
    full, full_cache = sa.softmax_attention(q, k, v)
    if n:
        _, cache = sa.softmax_attention(q[:n], k[:n], v[:n])
        cache = (cache.keys, cache.values) if as_pair else cache
    else:
        cache = None
    rest, cache2 = sa.softmax_attention(q[n:], k[n:], v[n:], initial_state=cache)
    np.testing.assert_allclose(rest, full[n:], rtol=1e-12, atol=1e-14)
    loop, _ = sa.softmax_attention_loop(q[n:], k[n:], v[n:], initial_state=cache)
    np.testing.assert_allclose(loop, full[n:], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(cache2.keys, full_cache.keys)
    np.testing.assert_array_equal(cache2.values, full_cache.values)


def test_bidirectional_with_a_cache_sees_every_key():
    q, k, v = _data(7, 5, 3, 2)
    _, cache = sa.softmax_attention(q[:2], k[:2], v[:2])
    out, _ = sa.softmax_attention(q[2:], k[2:], v[2:], causal=False, initial_state=cache)
    np.testing.assert_allclose(out, sa.softmax_attention(q[2:], k, v, causal=False)[0], rtol=1e-13)


def test_bidirectional_keys_may_be_a_different_number_of_rows():
    q, k, v = _data(8, 3, 4, 2)
    keys, values = _data(9, 7, 4, 5)[1:]
    out, cache = sa.softmax_attention(q, keys, values[..., :2], causal=False)
    weights = sa.attention_weights(q, keys, causal=False)
    assert out.shape == (3, 2) and cache.length == 7
    np.testing.assert_allclose(out, weights @ values[..., :2], rtol=1e-13)


def test_decode_does_not_modify_the_cache_passed_in():
    q, k, v = _data(3, 3, 2, 2)
    _, cache = sa.softmax_attention_step(q[0], k[0], v[0])
    before = (cache.keys.copy(), cache.values.copy())
    sa.softmax_attention_step(q[1], k[1], v[1], initial_state=cache)
    np.testing.assert_array_equal(cache.keys, before[0])
    np.testing.assert_array_equal(cache.values, before[1])
    assert cache.length == 1
    with pytest.raises(ValueError):
        cache.keys[0, 0] = 5.0                      # read-only views


def test_two_continuations_of_one_prefix_do_not_overwrite_each_other():
    q, k, v = _data(4, 4, 3, 2)
    _, prefix = sa.softmax_attention(q[:2], k[:2], v[:2])
    out_a, cache_a = sa.softmax_attention_step(q[2], k[2], v[2], initial_state=prefix)
    out_b, cache_b = sa.softmax_attention_step(q[3], k[3], v[3], initial_state=prefix)
    np.testing.assert_array_equal(cache_a.keys, k[[0, 1, 2]])
    np.testing.assert_array_equal(cache_b.keys, k[[0, 1, 3]])
    np.testing.assert_array_equal(cache_a.values, v[[0, 1, 2]])


def test_cache_appends_in_place_and_doubles_its_capacity():
    rng = np.random.default_rng(5)
    cache, capacities, grown = None, [], 0
    for i in range(100):
        x = rng.standard_normal(4)
        _, new = sa.softmax_attention_step(x, x, x[:2], initial_state=cache)
        if cache is not None and new.capacity != cache.capacity:
            grown += 1
        elif cache is not None:
            assert np.shares_memory(new.keys, cache.keys)      # no copy while there is room
        cache = new
        capacities.append(cache.capacity)
    assert cache.length == 100 and cache.capacity >= 100
    assert grown <= math.ceil(math.log2(100 / 16)) + 1          # doubling: a handful of copies in 100 steps
    assert all(b >= a for a, b in zip(capacities, capacities[1:]))


def test_a_cache_shared_by_query_heads_stays_shared():
    # grouped-query attention: 4 query heads read one key/value head; the cache is not repeated
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 5, 3))                 # (batch, query heads, T, d_k)
    k, v = rng.standard_normal((2, 1, 5, 3)), rng.standard_normal((2, 1, 5, 2))
    out, cache = sa.softmax_attention(q, k, v)
    assert out.shape == (2, 4, 5, 2) and cache.keys.shape == (2, 1, 5, 3)
    o, cache = sa.softmax_attention_step(q[..., 0, :], k[..., 0, :], v[..., 0, :], initial_state=cache)
    assert o.shape == (2, 4, 2) and cache.keys.shape == (2, 1, 6, 3)


def test_kv_cache_constructor_and_unpacking():
    keys, values = np.ones((2, 3, 4)), np.zeros((3, 5))
    cache = sa.KVCache(keys, values)
    k_, v_ = cache
    assert k_.shape == (2, 3, 4) and v_.shape == (2, 3, 5) and cache.length == 3
    assert "length=3" in repr(cache)
    with pytest.raises(ValueError, match="^values"):
        sa.KVCache(keys, np.zeros((4, 5)))


@SETTINGS
@given(t=st.integers(2, 10), seed=st.integers(0, 10**6))
def test_causal_outputs_ignore_the_future_but_bidirectional_do_not(t, seed):
    q, k, v = _data(seed, t, 3, 2)
    k2, v2 = k.copy(), v.copy()
    k2[-1] += 1.0
    v2[-1] += 1.0
    a, _ = sa.softmax_attention(q, k, v)
    b, _ = sa.softmax_attention(q, k2, v2)
    np.testing.assert_array_equal(a[:-1], b[:-1])
    full_a, _ = sa.softmax_attention(q, k, v, causal=False)
    full_b, _ = sa.softmax_attention(q, k2, v2, causal=False)
    assert not np.allclose(full_a[0], full_b[0])


def test_large_scores_do_not_overflow():
    q, k, v = _data(4, 5, 3, 2)
    out, _ = sa.softmax_attention(300 * q, 300 * k, v)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, sa.softmax_attention_loop(300 * q, 300 * k, v)[0], rtol=1e-10)


# ---------------------------------------------------------------- leading axes

@examples(30)
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple), t=st.integers(1, 6),
       n=st.integers(0, 4), seed=st.integers(0, 10**6),
       masks=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=4, max_size=4),
       drop=st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_batched_equals_loop_over_items(lead, t, n, seed, masks, drop):
    rng = np.random.default_rng(seed)
    shapes = [thin(lead, m, d) for m, d in zip(masks, drop)]
    q = rng.standard_normal(shapes[0] + (t, 3))
    k = rng.standard_normal(shapes[1] + (t, 3))
    v = rng.standard_normal(shapes[2] + (t, 2))
    cache = (rng.standard_normal(shapes[3] + (n, 3)), rng.standard_normal(shapes[3] + (n, 2)))
    full = np.broadcast_shapes(*shapes)
    kv_lead = np.broadcast_shapes(*shapes[1:])   # the cache keeps the leading axes of k, v and the old cache
    out, new_cache = sa.softmax_attention(q, k, v, initial_state=cache)
    assert out.shape == full + (t, 2) and new_cache.keys.shape == kv_lead + (n + t, 3)
    for idx in np.ndindex(*full):
        item = lambda x: np.broadcast_to(x, full + x.shape[-2:])[idx]  # noqa: E731
        o, c = sa.softmax_attention_loop(item(q), item(k), item(v), initial_state=(item(cache[0]), item(cache[1])))
        np.testing.assert_allclose(out[idx], o, rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(item(new_cache.keys), c.keys)
    # one decode step with a head axis
    o_step, c_step = sa.softmax_attention_step(q[..., 0, :], k[..., 0, :], v[..., 0, :], initial_state=cache)
    o_ref, _ = sa.softmax_attention(q[..., :1, :], k[..., :1, :], v[..., :1, :], initial_state=cache)
    np.testing.assert_allclose(o_step, o_ref[..., 0, :], rtol=1e-12, atol=1e-14)
    assert c_step.length == n + 1


# ---------------------------------------------------------------- precision

@pytest.mark.parametrize("low", [np.float32, np.float16])
@pytest.mark.parametrize("form", ["matrix", "bidirectional", "step", "loop", "weights"])
def test_float32_in_float32_out(form, low):
    # float16 computes in float32, as in every core of the package (fixedstate._validate.float_dtype)
    q, k, v = (a.astype(low) for a in _data(5, 4, 3, 2))
    if form == "weights":
        assert sa.attention_weights(q, k).dtype == np.float32
        return
    call = {"matrix": lambda: sa.softmax_attention(q, k, v, scale=0.5),
            "bidirectional": lambda: sa.softmax_attention(q, k, v, causal=False),
            "step": lambda: sa.softmax_attention_step(q[0], k[0], v[0], initial_state=(k[1:], v[1:])),
            "loop": lambda: sa.softmax_attention_loop(q, k, v)}[form]
    out, cache = call()
    assert out.dtype == np.float32 and cache.dtype == np.float32
    assert cache.keys.dtype == np.float32 and cache.values.dtype == np.float32


def test_float64_cache_with_float32_tokens_gives_float64():
    q, k, v = _data(6, 3, 3, 2)
    _, cache = sa.softmax_attention(q, k, v)
    out, cache = sa.softmax_attention_step(*(a[0].astype(np.float32) for a in (q, k, v)), initial_state=cache)
    assert out.dtype == np.float64 and cache.dtype == np.float64


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("call, name", [
    (lambda q, k, v: sa.softmax_attention(q, k[:-1], v), "k"),
    (lambda q, k, v: sa.softmax_attention(q, k, v[:-1]), "v"),
    (lambda q, k, v: sa.softmax_attention(q, k[:, :-1], v), "k"),
    (lambda q, k, v: sa.softmax_attention(q[0], k, v), "q"),
    (lambda q, k, v: sa.softmax_attention(q[:0], k[:0], v[:0]), "q"),
    (lambda q, k, v: sa.softmax_attention(q.astype(complex), k, v), "q"),
    (lambda q, k, v: sa.softmax_attention(q, k, v, scale=-1.0), "scale"),
    (lambda q, k, v: sa.softmax_attention(q, k, v, causal=1), "causal"),
    (lambda q, k, v: sa.softmax_attention(np.stack([q, q]), np.stack([k, k, k]), v), "k"),
    (lambda q, k, v: sa.softmax_attention(q, k, v, initial_state=k), "initial_state"),
    (lambda q, k, v: sa.softmax_attention(q, k, v, initial_state=(k, v[:, :1])), "initial_state"),
    (lambda q, k, v: sa.softmax_attention(np.stack([q, q]), k, v, initial_state=(np.stack([k] * 3), np.stack([v] * 3))),
     "initial_state"),
    (lambda q, k, v: sa.softmax_attention_step(q[0], k[0][:-1], v[0]), "k"),
    (lambda q, k, v: sa.softmax_attention_step(q[0], k[0], v[0], initial_state=(k, v[:, :1])), "initial_state"),
    (lambda q, k, v: sa.softmax_attention_step(q[0], k[0], v[0], initial_state=(k, v[:-1])), "initial_state"),
    (lambda q, k, v: sa.softmax_attention_step(q[0], k[0], v[0], initial_state=k), "initial_state"),
    (lambda q, k, v: sa.softmax_attention_loop(np.stack([q, q]), k, v), "q"),
    (lambda q, k, v: sa.attention_weights(q, k[:-1]), "k"),
])
def test_bad_input_names_the_argument(call, name):
    q, k, v = _data(6, 4, 3, 2)
    with pytest.raises(ValueError, match=r"^" + name):
        call(q, k, v)
