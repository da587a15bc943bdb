"""Checks for the exercises of "The cost of softmax attention" and "Linear attention".

Coding exercises (each takes the student's function and returns a CheckResult):

- :func:`check_kv_cache_size` (``ex-sm-kv-cache-size``): bytes of a KV cache.
- :func:`check_softmax_decode_step` (``ex-sm-decode-step``): one token against a KV cache.
- :func:`check_linear_decode_step` (``ex-la-decode-step``): one token with a fixed state.
- :func:`check_causal_linear_attention` (``ex-la-parallel-form``): the masked parallel
  form with its normalizer.

Challenge problems (the package computes the same thing; the check compares with
it and refuses an answer that calls it):

- :func:`check_gqa_decode_step` (``ex-sm-gqa-decode``): one decode step of
  grouped-query attention over several heads, continuing a prefilled KV cache.
- :func:`check_chunkwise_decayed_attention` (``ex-la-chunkwise-decay``): linear
  attention with a scalar decay in chunkwise form.

Numeric answers: :func:`check_answer` with a label from :data:`ANSWERS`; every
expected value is computed here by :mod:`fixedstate.costs`, never typed in.

A check compares with the package's reference on small seeded cases, and when
the answer is wrong it tries the plausible mistakes (a missing normalizer, a
transposed state, reading before writing, ...) to say which one it is.
"""

from __future__ import annotations

import numpy as np

from .. import costs
from .. import linear_attention as la
from .. import softmax_attention as sa
from .. import ssm
from ._core import (check_numeric, CheckResult, Failure, call_student, call_without, compare_arrays, compare_number,
                    has_nonfinite, run_check)

__all__ = [
    "check_kv_cache_size",
    "check_softmax_decode_step",
    "check_linear_decode_step",
    "check_causal_linear_attention",
    "check_gqa_decode_step",
    "check_chunkwise_decayed_attention",
    "decayed_attention_loop",
    "check_answer",
    "ANSWERS",
]


def _matches(got, candidate) -> bool:
    try:
        got = np.asarray(got, dtype=float)
    except (TypeError, ValueError):
        return False
    candidate = np.asarray(candidate, dtype=float)
    return got.shape == candidate.shape and np.allclose(got, candidate, rtol=1e-8, atol=1e-10,
                                                       equal_nan=True)


def _diagnose(got, expected, mistakes, *, what: str, case: str) -> None:
    """Raise a Failure naming the first mistake whose result ``got`` reproduces, else compare."""
    if _matches(got, expected):
        return
    for candidate, explanation in mistakes:
        if _matches(got, candidate):
            raise Failure(f"{what} on {case}: {explanation}")
    compare_arrays(got, expected, what=what, case=case)


def _unpack(out, n: int, names: str, case: str):
    if not isinstance(out, (tuple, list)) or len(out) != n:
        raise Failure(f"on {case}: expected the function to return a tuple ({names}), "
                      f"got {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    return out


# ------------------------------------------------------------------ ex-sm-kv-cache-size

def check_kv_cache_size(kv_cache_size) -> CheckResult:
    """Check ``kv_cache_size(context_len, n_layers, n_kv_heads, head_dim, bytes_per_element)``.

    Expected: the bytes of the cache, equation ``eq-sm-kv-cache``
    (:func:`fixedstate.costs.kv_cache_bytes`). Diagnoses a missing factor 2 (keys
    *and* values), a missing factor for layers, heads or bytes, and bits for bytes.
    """
    exercise = "ex-sm-kv-cache-size"
    # distinct primes for every factor, so each mistake gives a distinct wrong number
    cases = [
        dict(context_len=11, n_layers=3, n_kv_heads=5, head_dim=7, bytes_per_element=4),
        dict(context_len=1, n_layers=1, n_kv_heads=1, head_dim=1, bytes_per_element=1),
        dict(context_len=128_000, n_layers=32, n_kv_heads=8, head_dim=128, bytes_per_element=2),
    ]

    def body():
        for args in cases:
            case = ", ".join(f"{k}={v:,}" for k, v in args.items())
            expected = costs.kv_cache_bytes(args["context_len"], n_layers=args["n_layers"],
                                            n_kv_heads=args["n_kv_heads"], head_dim=args["head_dim"],
                                            bytes_per_element=args["bytes_per_element"])
            got = call_student(kv_cache_size, *args.values(), case=case)
            try:
                value = float(got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected a number of bytes, got {type(got).__name__}") from None
            if value == expected:
                continue
            slips = [
                (expected / 2, "exactly half the expected size: a KV cache stores a key AND a value "
                               "for every token, so there is a factor 2"),
                (expected / args["bytes_per_element"], "you counted numbers, not bytes: multiply by "
                                                       "bytes_per_element"),
                (expected / args["n_layers"], "you left out the layers: every layer keeps its own cache"),
                (expected / args["n_kv_heads"], "you left out the KV heads: every KV head keeps its "
                                                "own keys and values"),
                (expected * 8, "eight times too large: that is bits, not bytes"),
                (expected / 2 / args["bytes_per_element"], "you counted the numbers of the keys only: "
                                                           "add the values (factor 2) and multiply by "
                                                           "bytes_per_element"),
            ]
            for wrong, explanation in slips:
                if wrong != expected and value == wrong:
                    raise Failure(f"on {case}: expected {expected:,} bytes, got {value:,.0f}: {explanation}")
            raise Failure(f"on {case}: expected {expected:,} bytes (2 x context_len x n_layers x "
                          f"n_kv_heads x head_dim x bytes_per_element), got {value:,.6g}")
        return f"the sizes are right on {len(cases)} cases, including a 128,000-token cache of 32 layers."

    return run_check(exercise, body)


# ------------------------------------------------------------------ ex-sm-decode-step

def _seq(seed: int, t: int, d_k: int, d_v: int):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((t, d_k)), rng.standard_normal((t, d_k)), rng.standard_normal((t, d_v))


def _softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def check_softmax_decode_step(decode_step) -> CheckResult:
    """Check ``decode_step(query, key, value, cache) -> (output, cache)`` (equation ``eq-sm-decode``).

    ``cache`` is ``None`` or ``(keys (n, d_k), values (n, d_v))``; the step appends
    the new key and value and attends over all ``n + 1`` of them with scale
    ``1/sqrt(d_k)``. Generating a 6-token sequence step by step must reproduce
    :func:`fixedstate.softmax_attention.softmax_attention`.
    """
    exercise = "ex-sm-decode-step"
    d_k, d_v, t = 4, 3, 6
    q, k, v = _seq(11, t, d_k, d_v)
    reference, _ = sa.softmax_attention(q, k, v)

    def body():
        cache = None
        for i in range(t):
            case = f"token {i + 1} of a {t}-token sequence (d_k={d_k}, d_v={d_v})"
            out = call_student(decode_step, q[i].copy(), k[i].copy(), v[i].copy(),
                               None if cache is None else (cache[0].copy(), cache[1].copy()), case=case)
            output, new_cache = _unpack(out, 2, "output, cache", case)
            if not isinstance(new_cache, (tuple, list)) or len(new_cache) != 2:
                raise Failure(f"on {case}: expected the cache to be a tuple (keys, values), "
                              f"got {type(new_cache).__name__}")
            scores = (k[: i + 1] @ q[i]) / np.sqrt(d_k)          # the right scores
            mistakes = [
                (_softmax(scores * np.sqrt(d_k)) @ v[: i + 1],
                 "the scores are not scaled: multiply q . k by 1/sqrt(d_k) before the softmax"),
                (np.exp(scores) @ v[: i + 1],
                 "the weights are not normalized: divide exp(scores) by their sum"),
                (np.mean(v[: i + 1], axis=0),
                 "the output is the plain average of the values: the weights must be the softmax "
                 "of the scores"),
            ]
            if i > 0:
                mistakes.insert(0, (_softmax(scores[:-1]) @ v[:i],
                                    "the output ignores the new token: append its key and value to "
                                    "the cache BEFORE attending (the token attends to itself)"))
            _diagnose(output, reference[i], mistakes, what="the output", case=case)
            keys, values = new_cache
            compare_arrays(keys, k[: i + 1], what="the cached keys (rows in token order, new one last)",
                           case=case)
            compare_arrays(values, v[: i + 1], what="the cached values (rows in token order, new one last)",
                           case=case)
            cache = (np.asarray(keys, dtype=float), np.asarray(values, dtype=float))
        return (f"generating {t} tokens one at a time reproduces causal softmax attention, "
                f"and the cache grows by one key and one value per step.")

    return run_check(exercise, body)


# ------------------------------------------------------------------ ex-la-decode-step

def check_linear_decode_step(decode_step) -> CheckResult:
    """Check ``decode_step(state, normalizer, query, key, value) -> (output, state, normalizer)``.

    Linear attention with the elu+1 feature map and the normalizer (equations
    ``eq-la-recurrent`` and ``eq-la-readout``); the state is ``(d_k, d_v)``. Running it
    over a sequence must reproduce :func:`fixedstate.linear_attention.linear_attention_recurrent`
    (whose state holds ``S`` and, as its last column, the normalizer ``z``).
    Diagnoses a transposed state, a missing normalizer, reading before writing, a
    missing feature map, a normalizer that is not updated, and an in-place update.
    """
    exercise = "ex-la-decode-step"
    d_k, d_v, t = 3, 2, 7
    q, k, v = _seq(21, t, d_k, d_v)
    ref_out, ref_full_state = la.linear_attention_recurrent(q, k, v)
    ref_state = ref_full_state[:, :d_v]                   # S; the last column is the normalizer z
    phi = la.elu_plus_one

    @np.errstate(divide="ignore", invalid="ignore")
    def body():
        state, normalizer = np.zeros((d_k, d_v)), np.zeros(d_k)
        for i in range(t):
            case = f"token {i + 1} of a {t}-token sequence (d_k={d_k}, d_v={d_v})"
            given_state, given_norm = state.copy(), normalizer.copy()
            out = call_student(decode_step, given_state, given_norm, q[i].copy(), k[i].copy(),
                               v[i].copy(), case=case)
            output, new_state, new_norm = _unpack(out, 3, "output, state, normalizer", case)
            pq, pk = phi(q[i]), phi(k[i])
            s_new = state + np.outer(pk, v[i])
            z_new = normalizer + pk
            s_raw = state + np.outer(k[i], v[i])
            z_raw = normalizer + k[i]
            mistakes = [
                (s_new.T @ pq, "the output is not divided by the normalizer phi(q) . z: with "
                               "normalize on, divide S^T phi(q) by phi(q) . z"),
                (s_raw.T @ q[i] / (q[i] @ z_raw), "the feature map is missing: apply elu_plus_one "
                                                  "to the query and the key first"),
                (s_new.T @ pq / (pq @ normalizer) if i else None,
                 "the normalizer used in the readout is the old one: add phi(k) to z first"),
            ]
            if i > 0:
                mistakes.insert(0, (state.T @ pq / (pq @ normalizer),
                                    "the output was read from the state BEFORE this token's write: "
                                    "write S + phi(k) v^T and z + phi(k) first, then read"))
            mistakes = [(c, m) for c, m in mistakes if c is not None]
            _diagnose(output, ref_out[i], mistakes, what="the output", case=case)
            if _matches(new_state, s_new.T) and d_k != d_v:
                raise Failure(f"the state on {case}: it is the transpose of the expected one: the book "
                              f"stores S as (d_k, d_v) = ({d_k}, {d_v}) and writes S + phi(k) v^T")
            _diagnose(new_state, s_new, [(s_raw, "the feature map is missing: write phi(k) v^T with "
                                                 "phi = elu_plus_one, not k v^T"),
                                         (np.outer(pk, v[i]), "the state holds only the newest token: "
                                                              "ADD phi(k) v^T to the old state")],
                      what="the returned state", case=case)
            _diagnose(new_norm, z_new, [(normalizer, "the normalizer was not updated: z + phi(k)"),
                                        (z_raw, "the normalizer adds the raw key: add phi(k)")],
                      what="the returned normalizer", case=case)
            if not (np.array_equal(given_state, state) and np.array_equal(given_norm, normalizer)):
                raise Failure(f"on {case}: the function changed the state or normalizer passed in "
                              "(an in-place +=): build new arrays, e.g. S = S + np.outer(...)")
            state, normalizer = np.asarray(new_state, dtype=float), np.asarray(new_norm, dtype=float)
        compare_arrays(state, ref_state, what="the final state", case=f"the {t}-token sequence")
        return (f"{t} decode steps reproduce linear_attention_recurrent: outputs, the ({d_k}, {d_v}) "
                "state and the normalizer all agree to 1e-10.")

    return run_check(exercise, body)


# ------------------------------------------------------------------ ex-la-parallel-form

def check_causal_linear_attention(causal_linear_attention) -> CheckResult:
    """Check ``causal_linear_attention(queries, keys, values) -> outputs`` (equation ``eq-la-parallel``).

    The masked matrix form with the elu+1 feature map and the normalizer. Diagnoses
    a missing mask, a mask that drops the diagonal, a missing normalizer, a
    normalizer summed over all keys, and a missing feature map.
    """
    exercise = "ex-la-parallel-form"
    cases = [(31, 1, 2, 3), (32, 6, 3, 2), (33, 9, 4, 4)]

    def body():
        for seed, t, d_k, d_v in cases:
            q, k, v = _seq(seed, t, d_k, d_v)
            case = f"a {t}-token sequence (d_k={d_k}, d_v={d_v})"
            got = call_student(causal_linear_attention, q.copy(), k.copy(), v.copy(), case=case)
            expected, _ = la.linear_attention_parallel(q, k, v)
            pq, pk = la.elu_plus_one(q), la.elu_plus_one(k)
            w = pq @ pk.T
            low, strict = np.tril(w), np.tril(w, -1)
            with np.errstate(divide="ignore", invalid="ignore"):
                mistakes = [
                    ((w @ v) / w.sum(1, keepdims=True), "no causal mask: token t must only see tokens "
                                                        "1..t (zero the weights above the diagonal)"),
                    (low @ v, "the outputs are not divided by the normalizer: divide each row by the "
                              "sum of its weights"),
                    ((low @ v) / w.sum(1, keepdims=True), "the normalizer sums over ALL keys: mask it "
                                                          "as well, only keys j <= t count"),
                    (np.tril(q @ k.T) @ v / np.tril(q @ k.T).sum(1, keepdims=True),
                     "the feature map is missing: apply elu_plus_one to queries and keys"),
                ]
                diagonal = ("the mask drops the diagonal: token t must also see itself "
                            "(use np.tril(..., 0))")
                strict_sum = strict.sum(1, keepdims=True)
                mistakes.append(((strict @ v) / np.where(strict_sum > 0, strict_sum, np.nan), diagonal))
                mistakes.append(((strict @ v) / np.maximum(strict_sum, 1e-300), diagonal))
            _diagnose(got, expected, mistakes, what="the outputs", case=case)
        return f"the parallel form agrees with the package on {len(cases)} sequences (lengths 1, 6 and 9)."

    return run_check(exercise, body)


# ------------------------------------------------------------------ ex-sm-gqa-decode (challenge)

_SA_FORMS = (sa.softmax_attention, sa.softmax_attention_step, sa.softmax_attention_loop, sa.attention_weights)


def _gqa_reference(q, keys, values):
    """Outputs (H, d_v) of one query per head against cached keys/values (H_kv, n, d); head h reads h // G."""
    H, d_k = q.shape
    H_kv = keys.shape[0]
    out, _ = sa.softmax_attention(q.reshape(H_kv, H // H_kv, 1, d_k), keys[:, None], values[:, None],
                                  causal=False)
    return out.reshape(H, -1)


def _gqa_variant(q, keys, values, *, head_of, scale=True, normalize=True, stable=True):
    """Plausible wrong decode steps, written plainly (no package call)."""
    H, d_k = q.shape
    out = []
    for h in range(H):
        j = head_of(h)
        s = keys[j] @ q[h] * (1 / np.sqrt(d_k) if scale else 1.0)
        w = np.exp(s - (s.max() if stable else 0.0))
        out.append((w / w.sum() if normalize else w) @ values[j])
    return np.array(out)


def _gqa_cases():
    """(description, H, H_kv, d_k, d_v, prompt length, new tokens, magnitude)."""
    return [("4 query heads sharing 2 KV heads (d_k = 3, d_v = 2), a 3-token prompt, 4 new tokens",
             4, 2, 3, 2, 3, 4, 1.0),
            ("6 query heads sharing 2 KV heads (d_k = 4, d_v = 5), no prompt, 5 new tokens", 6, 2, 4, 5, 0, 5, 1.0),
            ("2 query heads with 2 KV heads (plain multi-head attention), a 2-token prompt, 3 new tokens",
             2, 2, 3, 3, 2, 3, 1.0),
            ("4 query heads sharing 1 KV head, queries and keys of size 40 (scores near 800), 4 new tokens",
             4, 1, 4, 2, 2, 4, 40.0)]


def check_gqa_decode_step(gqa_decode_step) -> CheckResult:
    """Check ``gqa_decode_step(q, k, v, cache) -> (o, new_cache)`` (equation ``eq-sm-decode``, several heads).

    ``q`` ``(H, d_k)``: one query per query head; ``k`` ``(H_kv, d_k)`` and ``v``
    ``(H_kv, d_v)``: one key and value per KV head; ``cache`` ``None`` or
    ``(keys (H_kv, n, d_k), values (H_kv, n, d_v))``. Query head ``h`` reads KV
    head ``h // (H // H_kv)``. Returns ``o`` ``(H, d_v)`` and the cache with the
    token appended. The check continues a prefilled cache token by token and
    compares with :func:`fixedstate.softmax_attention.softmax_attention`; it names
    an interleaved head mapping, a cache kept per query head, a missing scale,
    unnormalised weights, an overflowing softmax and a token that does not see
    itself, and refuses an answer that calls the package's attention.
    """
    exercise = "ex-sm-gqa-decode"

    def body():
        for seed, (desc, H, H_kv, d_k, d_v, prompt, new, size) in enumerate(_gqa_cases()):
            rng = np.random.default_rng(40 + seed)
            G = H // H_kv
            Q = rng.standard_normal((H, prompt + new, d_k))
            K = rng.standard_normal((H_kv, prompt + new, d_k))
            V = rng.standard_normal((H_kv, prompt + new, d_v))
            if size != 1.0:
                Q *= size / np.linalg.norm(Q, axis=-1, keepdims=True)
                K *= size / np.linalg.norm(K, axis=-1, keepdims=True)
            cache = None if prompt == 0 else (K[:, :prompt].copy(), V[:, :prompt].copy())
            for t in range(prompt, prompt + new):
                case = f"{desc}: token {t + 1}"
                given = None if cache is None else (cache[0].copy(), cache[1].copy())
                out = call_without(gqa_decode_step, _SA_FORMS, Q[:, t].copy(), K[:, t].copy(), V[:, t].copy(),
                                   given, case=case)
                o, new_cache = _unpack(out, 2, "o, new_cache", case)
                if not isinstance(new_cache, (tuple, list)) or len(new_cache) != 2:
                    raise Failure(f"on {case}: expected the cache to be a pair (keys, values), "
                                  f"got {type(new_cache).__name__}")
                keys, values = K[:, :t + 1], V[:, :t + 1]
                got_keys = np.asarray(new_cache[0], dtype=float)
                if G > 1 and got_keys.shape == (H, t + 1, d_k):
                    raise Failure(f"on {case}: the cached keys have shape {got_keys.shape}, one row per "
                                  f"QUERY head; grouped-query attention keeps one cache per KV head, "
                                  f"({H_kv}, n, d_k), {G} times smaller: that is its point")
                expected = _gqa_reference(Q[:, t], keys, values)
                if has_nonfinite(o) and size != 1.0:
                    raise Failure(f"the output on {case} holds inf or nan: exp of a score near 800 "
                                  "overflows. Subtract each head's largest score before exponentiating "
                                  "(the weights do not change)")
                mistakes = [
                    (_gqa_variant(Q[:, t], keys, values, head_of=lambda h: h % H_kv),
                     f"query head h reads KV head h % {H_kv} (interleaved); heads are grouped in "
                     f"consecutive blocks of {G}: head h reads KV head h // {G}"),
                    (_gqa_variant(Q[:, t], keys, values, head_of=lambda h: h // G, scale=False),
                     "the scores are not scaled: multiply q . k by 1/sqrt(d_k)"),
                    (_gqa_variant(Q[:, t], keys, values, head_of=lambda h: h // G, normalize=False),
                     "the weights are not normalized: divide exp(scores) by their sum"),
                ]
                if t > 0:
                    mistakes.append((_gqa_variant(Q[:, t], K[:, :t], V[:, :t], head_of=lambda h: h // G),
                                     "the output ignores the new token: append its key and value to the "
                                     "cache before attending (the token attends to itself)"))
                if H_kv > 1 and G > 1:
                    mistakes.append((_gqa_variant(Q[:, t], keys, values, head_of=lambda h: 0),
                                     "every query head reads KV head 0: head h reads KV head h // G"))
                _diagnose(o, expected, mistakes, what="the output", case=case)
                compare_arrays(new_cache[0], keys, what="the cached keys (H_kv, n, d_k), new token last",
                               case=case)
                compare_arrays(new_cache[1], values, what="the cached values (H_kv, n, d_v), new token last",
                               case=case)
                if given is not None and not (np.array_equal(given[0], cache[0])
                                              and np.array_equal(given[1], cache[1])):
                    raise Failure(f"on {case}: the function changed the cache it was given; return a new "
                                  "one (np.concatenate builds a new array)")
                cache = (np.asarray(new_cache[0], dtype=float), np.asarray(new_cache[1], dtype=float))
        return ("decoding continues the prefilled cache exactly as full causal attention would, for "
                "grouped and plain heads, with scores near 800 included")

    return run_check(exercise, body)


# ------------------------------------------------------------------ ex-la-chunkwise-decay (challenge)

def decayed_attention_loop(q, k, v, log_gate, initial_state=None):
    """The token loop of linear attention with a scalar decay: the reference of ``ex-la-chunkwise-decay``.

    ``S_t = g_t S_{t-1} + k_t v_t^T`` with ``g_t = exp(log_gate_t)``, ``o_t = S_t^T q_t``
    (no feature map, no normaliser): Mamba-2's recurrence ``eq-ssm-ssd-recurrent``
    with query ``C``, key ``B`` and value ``delta x``. ``q, k`` ``(T, d_k)``, ``v``
    ``(T, d_v)``, ``log_gate`` ``(T,)``; returns ``(o (T, d_v), S (d_k, d_v))``.
    """
    S = np.zeros((k.shape[1], v.shape[1])) if initial_state is None else np.array(initial_state, dtype=float)
    o = np.empty((len(q), v.shape[1]))
    for t in range(len(q)):
        S = np.exp(log_gate[t]) * S + np.outer(k[t], v[t])
        o[t] = S.T @ q[t]
    return o, S


def decayed_chunks(q, k, v, log_gate, chunk_size, *, diagonal=True, decay_in=True, decay_state=True,
                    decay_keys=True, write_then_decay=False):
    """The chunkwise form, with switches that reproduce the plausible mistakes."""
    T = len(q)
    S = np.zeros((k.shape[1], v.shape[1]))
    out = np.empty((T, v.shape[1]))
    for s in range(0, T, chunk_size):
        Q, K, V, g = q[s:s + chunk_size], k[s:s + chunk_size], v[s:s + chunk_size], log_gate[s:s + chunk_size]
        b = np.cumsum(g)
        if write_then_decay:                        # S_t = g_t (S_{t-1} + k_t v_t^T): token i decays by b_r - b_{i-1}
            b_key = np.concatenate([[0.0], b[:-1]])
        else:
            b_key = b
        C = len(Q)
        keep = np.tril(np.ones((C, C), dtype=bool), 0 if diagonal else -1)
        D = np.exp(np.where(keep, b[:, None] - b_key[None, :], -np.inf))
        Gamma = np.exp(b) if decay_in else np.ones(C)
        out[s:s + C] = (Gamma[:, None] * Q) @ S + ((Q @ K.T) * D) @ V
        key_decay = np.exp(b[-1] - b_key) if decay_keys else np.ones(C)
        S = (np.exp(b[-1]) if decay_state else 1.0) * S + (key_decay[:, None] * K).T @ V
    return out, S


def _decay_cases():
    """(description, T, chunk_size, d_k, d_v, log-gate kind)."""
    return [("T = 10 tokens in chunks of 4 (the last chunk has 2), d_k = 3, d_v = 2", 10, 4, 3, 2, "random"),
            ("T = 8 tokens in one chunk of 8, d_k = 2, d_v = 3", 8, 8, 2, 3, "random"),
            ("T = 7 tokens in chunks of 3 with no decay (every log_gate 0), d_k = 3, d_v = 3", 7, 3, 3, 3, "zero"),
            ("T = 12 tokens in chunks of 6 with every log_gate = -200 (each gate about 1e-87)", 12, 6, 3, 2,
             "strong"),
            ("T = 5 tokens in chunks of 1, d_k = 4, d_v = 2", 5, 1, 4, 2, "random")]


_DECAY_FORMS = (decayed_attention_loop, decayed_chunks, ssm.ssd_recurrent, ssm.ssd_quadratic, ssm.ssd_chunk, ssm.ssd_mask, ssm.selective_scan_sequential,
                ssm.selective_scan_parallel)


def check_chunkwise_decayed_attention(chunkwise_decayed_attention) -> CheckResult:
    """Check ``chunkwise_decayed_attention(q, k, v, log_gate, chunk_size) -> (o, S)``.

    Linear attention with a scalar decay (no feature map, no normaliser),
    ``S_t = g_t S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t``, computed chunk by chunk
    (eq-la-chunkwise with the decays of eq-dr-chunk-out). Compared with
    :func:`decayed_attention_loop` (Mamba-2's recurrence, which the package computes
    as :func:`fixedstate.ssm.ssd_recurrent`); names a positive exponent that
    overflows, a mask without its diagonal, an undecayed incoming state, an
    undecayed carried state, keys not decayed to the chunk's end, and "write,
    then decay". Refuses an answer that calls the package's SSD forms or this
    module's reference loop.
    """
    exercise = "ex-la-chunkwise-decay"

    def body():
        for seed, (desc, T, C, d_k, d_v, kind) in enumerate(_decay_cases()):
            rng = np.random.default_rng(60 + seed)
            q, k, v = rng.standard_normal((T, d_k)), rng.standard_normal((T, d_k)), rng.standard_normal((T, d_v))
            log_gate = {"random": -rng.uniform(0.0, 1.5, T), "zero": np.zeros(T),
                        "strong": np.full(T, -200.0)}[kind]
            try:
                with np.errstate(all="ignore"):
                    out = call_without(chunkwise_decayed_attention, _DECAY_FORMS, q.copy(), k.copy(), v.copy(),
                                       log_gate.copy(), C, case=desc)
            except Failure as failure:
                if kind == "strong" and ("inf" in str(failure).lower() or "nan" in str(failure).lower()):
                    raise Failure(f"{failure}. An inf or nan appeared inside your function: a decay written "
                                  "as a quotient Gamma_r / Gamma_i forms exp(-b_i), a positive exponent; form "
                                  "exp(b_r - b_i) for i <= r only") from None
                raise
            o, S = _unpack(out, 2, "o, S", desc)
            want_o, want_S = decayed_attention_loop(q, k, v, log_gate)
            if has_nonfinite(o) or has_nonfinite(S):
                raise Failure(f"on {desc}: the result holds inf or nan. A decay written as a quotient "
                              "Gamma_r / Gamma_i forms exp(-b_i), a positive exponent, which overflows "
                              "(exp(1200) is inf in float64); form exp(b_r - b_i) for i <= r only, and "
                              "mask the other entries before exponentiating")
            mistakes = []
            for flags, message in [
                (dict(diagonal=False), "token r does not see its own write: the mask keeps i <= r, "
                                       "the diagonal included (np.tril(..., 0))"),
                (dict(decay_in=False), "the incoming state is read undecayed: token r of a chunk reads "
                                       "Gamma_r S_0, with Gamma_r = exp(b_r) the decay since the chunk's start"),
                (dict(decay_state=False), "the state handed to the next chunk is not decayed: "
                                          "S_C = Gamma_C S_0 + ..., Gamma_C = exp(b_C)"),
                (dict(decay_keys=False), "the keys written into the outgoing state are not decayed to the "
                                         "chunk's end: each k_i carries exp(b_C - b_i)"),
                (dict(write_then_decay=True), "you decayed after the write, S_t = g_t (S_{t-1} + k_t v_t^T); "
                                              "the layer decays first and then writes, so a token's own "
                                              "write is not decayed"),
            ]:
                with np.errstate(over="ignore", invalid="ignore"):
                    mo, ms = decayed_chunks(q, k, v, log_gate, C, **flags)
                mistakes.append(((mo, ms), message))
            o_arr = np.asarray(o, dtype=float)
            if o_arr.shape == want_o.shape and not np.allclose(o_arr, want_o, rtol=1e-8, atol=1e-10):
                for (mo, ms), message in mistakes:
                    if _matches(o, mo) and (_matches(S, ms) or not _matches(S, want_S)):
                        raise Failure(f"the outputs on {desc}: {message}")
            compare_arrays(o, want_o, what="the outputs o (T, d_v)", case=desc, rtol=1e-9, atol=1e-10)
            S_arr = np.asarray(S, dtype=float)
            if S_arr.shape == want_S.T.shape and d_k != d_v:
                raise Failure(f"the final state on {desc} has shape {S_arr.shape}: the transpose; the book "
                              f"stores S as (d_k, d_v) = {want_S.shape}")
            for (mo, ms), message in mistakes:
                if _matches(S, ms) and not _matches(S, want_S):
                    raise Failure(f"the final state on {desc}: {message}")
            compare_arrays(S, want_S, what="the final state S (d_k, d_v)", case=desc, rtol=1e-9, atol=1e-10)
        return ("the chunkwise form equals the token loop for every chunk size, a ragged last chunk, "
                "no decay and a decay of exp(-200) per token, with no inf or nan")

    return run_check(exercise, body)


# ------------------------------------------------------------------ numeric answers

# The exercises' model shapes. Each differs from every shape the chapters print a result for,
# so that no answer can be copied from a chapter's output.
SM_128K = dict(n_layers=48, n_kv_heads=8, head_dim=128, bytes_per_element=2)   # ex-sm-128k
SM_128K_QUERY_HEADS = 64
CHAPTER_KV_SHAPE = dict(n_layers=32, n_kv_heads=32, head_dim=128, bytes_per_element=2)   # chapter 1's example
LA_STATE_VS_CACHE = dict(n_layers=24, n_heads=16, d=64, bytes_per_element=4, context_len=32_768)
LA_CROSSOVER = dict(r=256, d_k=64, d_v=128)                                      # ex-la-crossover
SM_DECODE = dict(context_len=128_000, d_k=128, d_v=128)                            # ex-sm-decode-flops


def _answers() -> dict:
    kv_128k = costs.kv_cache_bytes(128_000, **SM_128K)
    kv_chapter = costs.kv_cache_bytes(128_000, **CHAPTER_KV_SHAPE)
    dec = costs.softmax_decode_flops(**SM_DECODE)

    m = LA_STATE_VS_CACHE
    model = dict(n_layers=m["n_layers"], bytes_per_element=m["bytes_per_element"])
    state = costs.linear_state_bytes(n_heads=m["n_heads"], d_k=m["d"], d_v=m["d"], **model)
    state_z = costs.linear_state_bytes(n_heads=m["n_heads"], d_k=m["d"], d_v=m["d"],
                                       include_normalizer=True, **model)
    cache_args = dict(n_kv_heads=m["n_heads"], head_dim=m["d"], **model)
    cache = costs.kv_cache_bytes(m["context_len"], **cache_args)
    per_token = costs.kv_cache_bytes(1, **cache_args)
    equal = -(-state // per_token)                     # the shortest context whose cache >= the states
    equal_z = -(-state_z // per_token)
    equal_keys_only = -(-state // (per_token // 2))

    r, d_k, d_v = LA_CROSSOVER["r"], LA_CROSSOVER["d_k"], LA_CROSSOVER["d_v"]
    cross = costs.crossover_length(r, d_k, d_v)
    cross_causal = costs.crossover_length(r, d_k, d_v, causal=True)
    return {
        "ex-sm-128k": dict(
            value=kv_128k / 1e9, tolerance=0.005, relative=True, unit="GB (10^9 bytes)",
            hints=[(kv_128k / 2e9, "half: count a key and a value per token"),
                   (kv_128k / 2**30, "that is GiB (2^30 bytes); the question asks for GB = 10^9 bytes"),
                   (kv_128k / 1e9 * 131_072 / 128_000, "you used 131,072 tokens; the question says 128,000"),
                   (kv_128k / 1e9 * SM_128K_QUERY_HEADS / SM_128K["n_kv_heads"],
                    "you counted the 64 query heads: with grouped-query attention only the 8 key-value "
                    "heads keep keys and values"),
                   (kv_chapter / 1e9, "that is the chapter's example model (32 layers, 32 key-value heads); "
                                      "this one has 48 layers and 8 key-value heads")]),
        "ex-sm-decode-flops": dict(
            value=dec / 1e6, tolerance=0.005, relative=True, unit="MFLOP",
            hints=[(dec / 2e6, "half: a multiply-add counts as 2 FLOPs, and both the scores (d_k) "
                               "and the weighted sum (d_v) count")]),
        "ex-la-state-vs-cache/state": dict(
            value=state, tolerance=0, relative=False, unit="bytes",
            hints=[(state_z, "that includes the normaliser z; the question leaves it out"),
                   (state // m["bytes_per_element"], "that is the number of numbers: multiply by the "
                                                    "4 bytes of a float32"),
                   (state // 2, "half: this model stores float32 numbers, 4 bytes each"),
                   (2 * state, "the state of a head is ONE d_k x d_v matrix, not a key part and a "
                               "value part"),
                   (state // (m["n_layers"] * m["n_heads"]), "that is one head of one layer: every head "
                                                              "of every layer keeps its own state")]),
        "ex-la-state-vs-cache/cache": dict(
            value=cache, tolerance=0, relative=False, unit="bytes",
            hints=[(cache // 2, "half: the cache keeps a key AND a value per token, each in 4 bytes "
                                "(float32)"),
                   (cache // m["bytes_per_element"], "that is the number of numbers: multiply by the "
                                                    "4 bytes of a float32"),
                   (costs.kv_cache_bytes(32_000, **cache_args), "you used 32,000 tokens; the context "
                                                                "is 32,768 = 2^15")]),
        "ex-la-state-vs-cache/equal": dict(
            value=equal, tolerance=0, relative=False, unit="tokens",
            hints=[(equal_z, "that counts the normaliser z in the state; the question leaves it out "
                             "(and at that length the cache is already larger)"),
                   (equal_keys_only, "the cache keeps a key AND a value per token: it catches up "
                                     "twice as fast")]),
        "ex-la-crossover/full": dict(
            value=cross, tolerance=0, relative=False, unit="tokens",
            hints=[(r + 1, "T > r holds only when d_k = d_v; here the condition is "
                           "T > 2 r d_v / (d_k + d_v)"),
                   (cross - 1, "at that length linear attention still costs more: T must be strictly "
                               "larger than 2 r d_v / (d_k + d_v)"),
                   (costs.crossover_length(r, d_v, d_k), "you swapped d_k and d_v: linear attention "
                                                         "costs 4 T r d_v")]),
        "ex-la-crossover/causal": dict(
            value=cross_causal, tolerance=0, relative=False, unit="tokens",
            hints=[(cross, "that is the crossover for the full square; counting only the causal half "
                           "halves softmax's cost"),
                   (2 * r, "T = 2r holds only when d_k = d_v"),
                   (cross_causal + 1, "the visible pairs number T(T+1)/2, not T^2/2: linear attention "
                                      "is already cheaper one token earlier")]),
    }


#: label -> dict(value, tolerance, relative, unit, hints); computed by fixedstate.costs.
ANSWERS = _answers()


def check_answer(label: str, value) -> CheckResult:
    """Check a numeric answer against :data:`ANSWERS` (computed by the package) within its tolerance."""
    return check_numeric(label, value, ANSWERS)
