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


# ------------------------------------------------------------------ challenge problems

def _gqa_step(q, k, v, cache, *, interleave=False, stable=True, per_query_head=False, use_package=False):
    from fixedstate import softmax_attention as sa
    H, d_k = q.shape
    H_kv = k.shape[0]
    G = H // H_kv
    if cache is None:
        keys, values = k[:, None, :], v[:, None, :]
    else:
        keys = np.concatenate([cache[0], k[:, None, :]], axis=1)
        values = np.concatenate([cache[1], v[:, None, :]], axis=1)
    if use_package:
        o, _ = sa.softmax_attention(q.reshape(H_kv, G, 1, d_k), keys[:, None], values[:, None], causal=False)
        return o.reshape(H, -1), (keys, values)
    heads = [(h % H_kv) if interleave else (h // G) for h in range(H)]
    out = []
    for h, j in enumerate(heads):
        s = keys[j] @ q[h] / np.sqrt(d_k)
        with np.errstate(over="ignore", invalid="ignore"):    # the unstable slip overflows on purpose
            w = np.exp(s - (s.max() if stable else 0.0))
            out.append(w / w.sum() @ values[j])
    if per_query_head:
        return np.array(out), (np.repeat(keys, G, axis=0), np.repeat(values, G, axis=0))
    return np.array(out), (keys, values)


def test_gqa_decode_check_passes_the_solution_and_names_the_slips():
    from fixedstate.checks.linear import check_gqa_decode_step
    assert check_gqa_decode_step(_gqa_step).passed
    for kwargs, words in [(dict(interleave=True), "h // 2"), (dict(stable=False), "overflows"),
                          (dict(per_query_head=True), "one cache per KV head"),
                          (dict(use_package=True), "the package's own implementation")]:
        result = check_gqa_decode_step(lambda q, k, v, c, kw=kwargs: _gqa_step(q, k, v, c, **kw))
        assert not result.passed and words in result.message, (kwargs, result.message)


def _own_copy(fn):
    """A fresh function compiled from ``fn``'s source (a new code object: not "the package's")."""
    import inspect
    namespace = dict(fn.__globals__)
    exec(compile(inspect.getsource(fn), "<student>", "exec"), namespace)
    return namespace[fn.__name__]


def _chunked(q, k, v, log_gate, chunk_size, *, quotient=False, **flags):
    from fixedstate.checks.linear import decayed_chunks
    decayed_chunks = _own_copy(decayed_chunks)
    if quotient:                                   # Gamma_r / Gamma_i from the chunk start: overflows
        T = len(q)
        S = np.zeros((k.shape[1], v.shape[1]))
        out = np.empty((T, v.shape[1]))
        for s in range(0, T, chunk_size):
            Q, K, V = q[s:s + chunk_size], k[s:s + chunk_size], v[s:s + chunk_size]
            G = np.exp(np.cumsum(log_gate[s:s + chunk_size]))
            with np.errstate(all="ignore"):
                D = np.tril(G[:, None] / G[None, :])
                out[s:s + len(Q)] = (G[:, None] * Q) @ S + ((Q @ K.T) * D) @ V
                S = G[-1] * S + ((G[-1] / G)[:, None] * K).T @ V
        return out, S
    return decayed_chunks(q, k, v, log_gate, chunk_size, **flags)


def test_chunkwise_decay_check_passes_the_solution_and_names_the_slips():
    from fixedstate.checks.linear import check_chunkwise_decayed_attention, decayed_attention_loop
    from fixedstate import ssm
    # the reference loop is Mamba-2's recurrence with q = C, k = B, value delta x, gate exp(delta a)
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((9, 3)), rng.standard_normal((9, 3)), rng.standard_normal((9, 2))
    log_gate = -rng.uniform(0.1, 1.0, 9)
    o, S = decayed_attention_loop(q, k, v, log_gate)
    y, S2 = ssm.ssd_recurrent(v / -log_gate[:, None], -log_gate, -1.0, k, q)
    np.testing.assert_allclose(o, y, rtol=1e-12)
    np.testing.assert_allclose(S, S2, rtol=1e-12)

    assert check_chunkwise_decayed_attention(_chunked).passed
    for kwargs, words in [(dict(quotient=True), "positive exponent"), (dict(diagonal=False), "own write"),
                          (dict(decay_in=False), "incoming state is read undecayed"),
                          (dict(decay_state=False), "not decayed"), (dict(write_then_decay=True), "decayed after")]:
        result = check_chunkwise_decayed_attention(lambda *a, kw=kwargs: _chunked(*a, **kw))
        assert not result.passed and words in result.message, (kwargs, result.message)
    loop = lambda q, k, v, g, C: (_ for _ in ()).throw(NotImplementedError)
    assert "not written yet" in check_chunkwise_decayed_attention(loop).message
    copied = lambda q, k, v, g, C: decayed_attention_loop(q, k, v, g)
    assert "the package's own implementation" in check_chunkwise_decayed_attention(copied).message
