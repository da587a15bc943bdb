"""The exercise checks of chapters chap-softmax-cost and chap-linear-attention.

Each check passes on the package's reference (wrapped to the exercise's
signature), fails on the unfinished starter (a `...` body), and fails with the
specific message on each plausible wrong answer. Numeric answers come from
fixedstate.costs and the stated slips get their hint.
"""

import numpy as np
import pytest

from fixedstate import costs
from fixedstate import linear_attention as la
from fixedstate import softmax_attention as sa
from fixedstate.checks import linear as ck


def starter(*args, **kwargs):
    ...


# ------------------------------------------------------------------ kv cache size

def kv_right(context_len, n_layers, n_kv_heads, head_dim, bytes_per_element):
    return 2 * context_len * n_layers * n_kv_heads * head_dim * bytes_per_element


@pytest.mark.parametrize("wrong, message", [
    (lambda s, l, h, d, b: s * l * h * d * b, "a key AND a value"),
    (lambda s, l, h, d, b: 2 * s * l * h * d, "numbers, not bytes"),
    (lambda s, l, h, d, b: 2 * s * h * d * b, "left out the layers"),
    (lambda s, l, h, d, b: 2 * s * l * d * b, "left out the KV heads"),
    (lambda s, l, h, d, b: 16 * s * l * h * d * b, "bits, not bytes"),
    (lambda s, l, h, d, b: s * l * h * d, "keys only"),
    (lambda s, l, h, d, b: 2 * s * l * h * d * b + 1, "expected"),
])
def test_kv_cache_size_diagnoses(wrong, message):
    result = ck.check_kv_cache_size(wrong)
    assert not result.passed and message in result.message, result.message


def test_kv_cache_size_pass_and_starter():
    assert ck.check_kv_cache_size(kv_right).passed
    result = ck.check_kv_cache_size(starter)
    assert not result.passed and "replace the `...`" in result.message
    assert repr(result).startswith("NOT YET [ex-sm-kv-cache-size]")


# ------------------------------------------------------------------ softmax decode step

def softmax_step(query, key, value, cache, **kw):
    """The package's step, wrapped to the exercise's signature: the cache is a pair (keys, values)."""
    out, new = sa.softmax_attention_step(query, key, value, initial_state=cache, **kw)
    return out, (new.keys, new.values)


def softmax_right(query, key, value, cache):
    return softmax_step(query, key, value, cache)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def softmax_unscaled(query, key, value, cache):
    return softmax_step(query, key, value, cache, scale=1.0)


def softmax_before_append(query, key, value, cache):
    keys = key[None] if cache is None else np.vstack([cache[0], key])
    values = value[None] if cache is None else np.vstack([cache[1], value])
    if cache is None:
        return value.copy(), (keys, values)
    return _softmax(cache[0] @ query / np.sqrt(len(query))) @ cache[1], (keys, values)


def softmax_unnormalized(query, key, value, cache):
    _, (keys, values) = softmax_step(query, key, value, cache)
    return np.exp(keys @ query / np.sqrt(len(query))) @ values, (keys, values)


def softmax_cache_not_grown(query, key, value, cache):
    out, (keys, values) = softmax_step(query, key, value, cache)
    return out, (keys[-1:], values[-1:])


def softmax_cache_order(query, key, value, cache):
    out, (keys, values) = softmax_step(query, key, value, cache)
    return out, (keys[::-1], values[::-1])


@pytest.mark.parametrize("wrong, message", [
    (softmax_unscaled, "not scaled"),
    (softmax_before_append, "ignores the new token"),
    (softmax_unnormalized, "not normalized"),
    (softmax_cache_not_grown, "the cached keys"),
    (softmax_cache_order, "the cached keys"),
    (lambda q, k, v, c: softmax_step(q, k, v, c)[0], "expected the function to return a tuple"),
])
def test_softmax_decode_diagnoses(wrong, message):
    result = ck.check_softmax_decode_step(wrong)
    assert not result.passed and message in result.message, result.message


def test_softmax_decode_pass_and_starter():
    assert ck.check_softmax_decode_step(softmax_right).passed
    assert "replace the `...`" in ck.check_softmax_decode_step(starter).message


# ------------------------------------------------------------------ linear decode step

def linear_step(state, normalizer, query, key, value, **kw):
    """The package's step, wrapped to the exercise's signature: S and z apart (the package keeps z
    as the last column of the state when normalizing)."""
    normalize = kw.get("normalize", True)
    full = np.column_stack([state, normalizer]) if normalize else state
    out, new = la.linear_attention_step(query, key, value, initial_state=full, **kw)
    if normalize:
        return out, new[:, :-1], new[:, -1]
    return out, new, normalizer + kw.get("feature_map", la.elu_plus_one)(key)


def linear_right(state, normalizer, query, key, value):
    return linear_step(state, normalizer, query, key, value)


def linear_no_normalizer(state, normalizer, query, key, value):
    pk, pq = la.elu_plus_one(key), la.elu_plus_one(query)
    state = state + np.outer(pk, value)
    return state.T @ pq, state, normalizer + pk


def linear_read_first(state, normalizer, query, key, value):
    pk, pq = la.elu_plus_one(key), la.elu_plus_one(query)
    if not normalizer.any():
        out = value.copy()
    else:
        out = state.T @ pq / (pq @ normalizer)
    return out, state + np.outer(pk, value), normalizer + pk


def linear_transposed(state, normalizer, query, key, value):
    pk, pq = la.elu_plus_one(key), la.elu_plus_one(query)
    s = (state.T if state.shape[0] == len(key) else state) + np.outer(value, pk)   # (d_v, d_k)
    z = normalizer + pk
    return s @ pq / (pq @ z), s, z


def linear_no_feature_map(state, normalizer, query, key, value):
    return linear_step(state, normalizer, query, key, value, feature_map=la.identity_feature_map, normalize=False)


def linear_raw_normalized(state, normalizer, query, key, value):
    s = state + np.outer(key, value)
    z = normalizer + key
    return s.T @ query / (query @ z), s, z


def linear_normalizer_stale(state, normalizer, query, key, value):
    out, s, z = linear_step(state, normalizer, query, key, value)
    return out, s, normalizer


def linear_in_place(state, normalizer, query, key, value):
    out, s, z = linear_step(state, normalizer, query, key, value)
    state += s - state
    normalizer += z - normalizer
    return out, state, normalizer


@pytest.mark.parametrize("wrong, message", [
    (linear_no_normalizer, "not divided by the normalizer"),
    (linear_read_first, "BEFORE this token's write"),
    (linear_transposed, "transpose"),
    (linear_raw_normalized, "feature map is missing"),
    (linear_no_feature_map, "the output"),
    (linear_normalizer_stale, "normalizer was not updated"),
    (linear_in_place, "changed the state or normalizer passed in"),
    (lambda *a: (1 / 0), "ZeroDivisionError"),
])
def test_linear_decode_diagnoses(wrong, message):
    result = ck.check_linear_decode_step(wrong)
    assert not result.passed and message in result.message, result.message


def test_linear_decode_pass_and_starter():
    result = ck.check_linear_decode_step(linear_right)
    assert result.passed and repr(result).startswith("PASSED [ex-la-decode-step]")
    assert "replace the `...`" in ck.check_linear_decode_step(starter).message


# ------------------------------------------------------------------ parallel form

def parallel_right(queries, keys, values):
    return la.linear_attention_parallel(queries, keys, values)[0]


def _weights(q, k):
    return la.elu_plus_one(q) @ la.elu_plus_one(k).T


@pytest.mark.parametrize("wrong, message", [
    (lambda q, k, v: (_weights(q, k) @ v) / _weights(q, k).sum(1, keepdims=True), "no causal mask"),
    (lambda q, k, v: np.tril(_weights(q, k)) @ v, "not divided by the normalizer"),
    (lambda q, k, v: (np.tril(_weights(q, k)) @ v) / _weights(q, k).sum(1, keepdims=True), "ALL keys"),
    (lambda q, k, v: np.tril(q @ k.T) @ v / np.tril(q @ k.T).sum(1, keepdims=True), "feature map is missing"),
    (lambda q, k, v: (np.tril(_weights(q, k), -1) @ v) / np.maximum(np.tril(_weights(q, k), -1).sum(1, keepdims=True), 1e-300),
     "drops the diagonal"),
    (lambda q, k, v: parallel_right(q, k, v).T, "expected shape"),
])
def test_parallel_form_diagnoses(wrong, message):
    result = ck.check_causal_linear_attention(wrong)
    assert not result.passed and message in result.message, result.message


def test_parallel_form_pass_and_starter():
    assert ck.check_causal_linear_attention(parallel_right).passed
    assert "replace the `...`" in ck.check_causal_linear_attention(starter).message


# ------------------------------------------------------------------ numeric answers

def test_answers_are_computed_by_the_package():
    a = ck.ANSWERS
    # ex-sm-128k: 48 layers, 8 KV heads of 128, 16-bit, 128,000 tokens
    assert a["ex-sm-128k"]["value"] == 2 * 128_000 * 48 * 8 * 128 * 2 / 1e9
    assert a["ex-sm-decode-flops"]["value"] == pytest.approx(costs.softmax_decode_flops(128_000, 128, 128) / 1e6)
    # ex-la-state-vs-cache: 24 layers of 16 heads, d_k = d_v = 64, float32, 32,768 tokens
    assert a["ex-la-state-vs-cache/state"]["value"] == 24 * 16 * 64 * 64 * 4
    assert a["ex-la-state-vs-cache/cache"]["value"] == 2 * 32_768 * 24 * 16 * 64 * 4
    assert a["ex-la-state-vs-cache/equal"]["value"] == 64 * 64 // (2 * 64)        # 2 T d >= d^2 <=> T >= d/2
    # ex-la-crossover: r = 256, d_k = 64, d_v = 128: T > 2 r d_v / (d_k + d_v) = 341.3
    assert a["ex-la-crossover/full"]["value"] == 342
    assert a["ex-la-crossover/causal"]["value"] == 682                            # T + 1 > 4 r d_v / (d_k + d_v)
    assert "ex-la-long-context" not in a                                          # merged into ex-la-state-vs-cache


def test_no_numeric_answer_is_printed_by_its_chapter():
    """The exercises' shapes differ from the chapters' examples, so their answers are not in the chapters."""
    a = ck.ANSWERS
    assert a["ex-sm-128k"]["value"] != costs.kv_cache_bytes(128_000, **ck.CHAPTER_KV_SHAPE) / 1e9
    for r, d in ((64, 64), (128, 128), (256, 64)):            # the pairs chapter 2 prints
        assert a["ex-la-crossover/full"]["value"] != costs.crossover_length(r, d, d)
        assert a["ex-la-crossover/causal"]["value"] != costs.crossover_length(r, d, d, causal=True)
    assert a["ex-la-state-vs-cache/state"]["value"] != costs.linear_state_bytes(n_layers=32, n_heads=32,
                                                                                 d_k=128, d_v=128)


@pytest.mark.parametrize("label", sorted(ck.ANSWERS))
def test_check_answer_accepts_the_value_and_rejects_slips(label):
    spec = ck.ANSWERS[label]
    assert ck.check_answer(label, spec["value"]).passed
    assert not ck.check_answer(label, spec["value"] * 1.5 + 1).passed
    assert "no answer yet" in ck.check_answer(label, ...).message
    for wrong, hint in spec["hints"]:
        result = ck.check_answer(label, wrong)
        assert not result.passed and hint in result.message, result.message


def test_check_answer_unknown_label():
    assert not ck.check_answer("ex-nope", 1).passed
