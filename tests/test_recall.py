"""Tests for fixedstate.recall: the claims of the chapter "What a fixed state forgets"."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from _examples import examples

from fixedstate import recall as rc
from fixedstate import recall_lab
from fixedstate.delta_rule import delta_rule_recurrent, gated_delta_rule_recurrent
from fixedstate.linear_attention import identity_feature_map, linear_attention_recurrent
from fixedstate.softmax_attention import softmax_attention
from fixedstate.ssm import ssd_quadratic

FAST = examples(40)


def rel(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


# ----------------------------------------------------------------------------- keys

@FAST
@given(n=st.integers(1, 12), extra=st.integers(0, 6), rho=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_orthogonal_keys_have_exactly_the_requested_overlap(n, extra, rho, seed):
    keys = rc.make_keys(n, n + extra, overlap=rho, orthogonal=True, rng=seed)
    gram = keys @ keys.T
    want = (1 - rho) * np.eye(n) + rho * np.ones((n, n))
    assert keys.shape == (n, n + extra)
    assert np.max(np.abs(gram - want)) < 1e-12


@FAST
@given(n=st.integers(1, 40), d=st.integers(2, 16), rho=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_random_keys_are_unit_with_the_shared_overlap_plus_chance(n, d, rho, seed):
    keys = rc.make_keys(n, d, overlap=rho, rng=seed)
    assert np.max(np.abs(np.linalg.norm(keys, axis=1) - 1)) < 1e-12
    # every pairwise overlap is rho + (1 - rho) u_i.u_j with |u_i.u_j| <= 1
    gram = keys @ keys.T
    assert np.all(gram >= 2 * rho - 1 - 1e-12)


def test_random_keys_with_overlap_average_to_it():
    keys = rc.make_keys(400, 64, overlap=0.4, rng=3)
    gram = keys @ keys.T
    off = gram[~np.eye(400, dtype=bool)]
    # chance overlaps of random directions average to zero, sd 1/sqrt(63): the mean of
    # about 80k of them sits within 0.01 of zero
    assert abs(off.mean() - 0.4) < 0.01


# ----------------------------------------------------------------------------- softmax

@FAST
@given(n=st.integers(1, 80), d=st.integers(2, 16), seed=st.integers(0, 10**6))
def test_sharp_softmax_recalls_every_pair_exactly_at_any_n(n, d, seed):
    rng = np.random.default_rng(seed)
    keys = rc.make_keys(n, d, rng=rng)
    values = rc.make_values(n, 5, rng=rng)
    gram = keys @ keys.T
    gap = 1.0 if n == 1 else np.min(1 - gram[~np.eye(n, dtype=bool)])
    assume(gap > 1e-3)
    # each wrong key gets weight <= exp(-gap / temperature) = exp(-60)
    result = rc.recall_pairs("softmax", keys, values, temperature=gap / 60)
    assert result.accuracy == 1.0
    assert np.max(result.errors) < 1e-10 * max(1, n)


def test_softmax_read_is_the_last_row_of_the_package_attention():
    rng = np.random.default_rng(1)
    keys, values = rc.make_keys(9, 6, rng=rng), rc.make_values(9, 4, rng=rng)
    cache = rc.write_memory("softmax", keys, values)
    assert np.array_equal(cache[0], keys) and np.array_equal(cache[1], values)
    for i in range(9):
        q = keys.copy()
        q[-1] = keys[i]  # the last token sees every cached pair
        want = softmax_attention(q, keys, values, causal=True, scale=1 / 0.05)[0][-1]
        got = rc.read_memory("softmax", cache, keys[i:i + 1], temperature=0.05)[0]
        assert rel(got, want) < 1e-12


def test_softmax_read_handles_more_queries_than_cached_pairs():
    rng = np.random.default_rng(2)
    keys, values = rc.make_keys(3, 4, rng=rng), rc.make_values(3, 2, rng=rng)
    queries = rc.make_keys(7, 4, rng=rng)
    got = rc.read_memory("softmax", rc.write_memory("softmax", keys, values), queries, temperature=0.3)
    scores = queries @ keys.T / 0.3
    w = np.exp(scores - scores.max(axis=1, keepdims=True))
    assert rel(got, (w / w.sum(axis=1, keepdims=True)) @ values) < 1e-12


# ----------------------------------------------------------------------------- orthonormal keys

@FAST
@given(d=st.integers(1, 16), data=st.data())
def test_delta_rule_recalls_up_to_d_k_orthonormal_keys_exactly(d, data):
    n = data.draw(st.integers(1, d))
    seed = data.draw(st.integers(0, 10**6))
    rng = np.random.default_rng(seed)
    keys = rc.make_keys(n, d, orthogonal=True, rng=rng)
    values = rc.make_values(n, 6, rng=rng)
    for mech in ("delta", "linear"):
        result = rc.recall_pairs(mech, keys, values)
        assert result.accuracy == 1.0
        assert np.max(np.abs(result.recalled - values)) < 1e-12


@FAST
@given(n=st.integers(2, 10), gate=st.floats(0.3, 1.0), seed=st.integers(0, 10**6))
def test_gate_scales_old_orthonormal_pairs_by_its_powers(n, gate, seed):
    rng = np.random.default_rng(seed)
    keys = rc.make_keys(n, 12, orthogonal=True, rng=rng)
    values = rc.make_values(n, 3, rng=rng)
    powers = gate ** np.arange(n - 1, -1, -1)  # pair i has seen n - 1 - i later decays
    for mech in ("gated_delta", "ssm"):
        recalled = rc.recall_pairs(mech, keys, values, gate=gate).recalled
        assert np.max(np.abs(recalled - powers[:, None] * values)) < 1e-12


# ----------------------------------------------------------------------------- crosstalk

@FAST
@given(n=st.integers(2, 8), rho=st.floats(0.05, 0.95), seed=st.integers(0, 10**6))
def test_additive_error_is_the_crosstalk_and_has_the_predicted_size(n, rho, seed):
    rng = np.random.default_rng(seed)
    keys = rc.make_keys(n, 10, overlap=rho, orthogonal=True, rng=rng)
    values = rc.make_values(n, n, orthogonal=True, rng=rng)
    result = rc.recall_pairs("linear", keys, values)
    # the text: recalled_i = v_i + sum_{j != i} (k_j . k_i) v_j
    for i in range(n):
        cross = sum((keys[j] @ keys[i]) * values[j] for j in range(n) if j != i)
        assert np.max(np.abs(result.recalled[i] - values[i] - cross)) < 1e-12
    # with overlap rho and orthonormal values every error has length rho sqrt(N - 1)
    assert np.max(np.abs(result.errors - rho * np.sqrt(n - 1))) < 1e-12
    assert np.max(np.abs(rc.crosstalk(keys, values) - (result.recalled - values))) < 1e-12


def test_two_keys_with_overlap_recall_each_other_in_that_proportion():
    keys = rc.make_keys(2, 4, overlap=0.6, orthogonal=True, rng=0)
    values = np.eye(2)
    recalled = rc.recall_pairs("linear", keys, values).recalled
    assert np.max(np.abs(recalled - np.array([[1.0, 0.6], [0.6, 1.0]]))) < 1e-12


def test_delta_rule_has_a_smaller_error_than_additive_on_overlapping_keys():
    errs = {m: [] for m in ("linear", "delta")}
    for seed in range(10):
        rng = np.random.default_rng(seed)
        keys = rc.make_keys(8, 16, overlap=0.3, orthogonal=True, rng=rng)
        values = rc.make_values(8, 16, rng=rng)
        for m in errs:
            errs[m].append(rc.recall_pairs(m, keys, values).mean_error)
    assert all(d < a for d, a in zip(errs["delta"], errs["linear"]))


def test_repeated_delta_writes_converge_to_exact_recall_below_d_k_only():
    rng = np.random.default_rng(5)
    keys, values = rc.make_keys(8, 16, rng=rng), rc.make_values(8, 16, rng=rng)
    one = rc.recall_pairs("delta", keys, values).mean_error
    many = rc.recall_pairs("delta", keys, values, passes=200).mean_error
    assert one > 0.1 and many < 1e-8
    # more pairs than dimensions: no state recalls them all, the error stays put
    keys, values = rc.make_keys(24, 16, rng=rng), rc.make_values(24, 16, rng=rng)
    s = rc.write_memory("delta", keys, values, passes=200)
    lstsq = np.linalg.lstsq(keys, values, rcond=None)[0]
    floor = np.mean(np.linalg.norm(keys @ lstsq - values, axis=1))
    got = np.mean(np.linalg.norm(keys @ s - values, axis=1))
    assert floor > 0.3 and got >= floor - 1e-12


# ----------------------------------------------------------------------------- the package's layers

@pytest.mark.parametrize("mech", ["linear", "delta", "gated_delta", "ssm"])
def test_batched_states_equal_the_package_layers(mech):
    rng = np.random.default_rng(7)
    keys = np.stack([rc.make_keys(11, 5, overlap=0.2, rng=rng) for _ in range(3)])
    values = rng.standard_normal((3, 11, 4))
    states = rc.batched_final_states(mech, keys, values, beta=0.7, gate=0.8, checkpoints=[1, 4, 11])
    for b in range(3):
        for p, n in enumerate([1, 4, 11]):
            want = rc.write_memory(mech, keys[b, :n], values[b, :n], beta=0.7, gate=0.8)
            assert rel(states[p][b], want) < 1e-10


def test_write_memory_uses_the_layers_as_documented():
    rng = np.random.default_rng(8)
    k, v = rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    _, s_lin = linear_attention_recurrent(k, k, v, feature_map=identity_feature_map, normalize=False)
    assert rel(rc.write_memory("linear", k, v), k.T @ v) < 1e-12
    assert rel(rc.write_memory("linear", k, v), s_lin) < 1e-12
    _, s_d = delta_rule_recurrent(k, k, v, beta=np.full(6, 0.5))
    assert rel(rc.write_memory("delta", k, v, beta=0.5), s_d) < 1e-12
    # the public gate is the decay g; the core takes log g
    _, s_g = gated_delta_rule_recurrent(k, k, v, beta=np.full(6, 0.5), log_gate=np.full(6, np.log(0.7)))
    assert rel(rc.write_memory("gated_delta", k, v, beta=0.5, gate=0.7), s_g) < 1e-12
    weights = 0.7 ** np.arange(5, -1, -1)
    assert rel(rc.write_memory("ssm", k, v, gate=0.7), (weights[:, None] * k).T @ v) < 1e-12


@pytest.mark.parametrize("mech", ["linear", "delta", "gated_delta", "ssm"])
def test_batched_states_are_one_call_of_the_layer_with_a_batch_axis(mech):
    # no checkpoints: the final state of each sequence, equal to the unbatched write
    rng = np.random.default_rng(9)
    keys = np.stack([rc.make_keys(7, 4, rng=rng) for _ in range(5)])
    values = rng.standard_normal((5, 7, 3))
    states = rc.batched_final_states(mech, keys, values, beta=0.6, gate=0.9)
    assert states.shape == (5, 4, 3)
    for b in range(5):
        assert rel(states[b], rc.write_memory(mech, keys[b], values[b], beta=0.6, gate=0.9)) < 1e-12
    # repeated checkpoints give the same state twice
    twice = rc.batched_final_states(mech, keys, values, beta=0.6, gate=0.9, checkpoints=[3, 3, 7])
    assert np.array_equal(twice[0], twice[1]) and rel(twice[2], states) < 1e-12


def _layer_states(mech, keys, values, beta, gate, marks):
    """The states after each mark from the layers' public forms, piece by piece from mark to mark."""
    states, state, done = [], None, 0
    for m in marks:
        if m > done:
            k, v = keys[:, done:m], values[:, done:m]
            n = m - done
            if mech == "linear":
                _, state = linear_attention_recurrent(k, k, v, feature_map=identity_feature_map, normalize=False,
                                                      initial_state=state)
            elif mech == "delta":
                _, state = delta_rule_recurrent(k, k, v, beta=np.full(n, beta), initial_state=state)
            elif mech == "gated_delta":
                _, state = gated_delta_rule_recurrent(k, k, v, beta=np.full(n, beta),
                                                      log_gate=np.full(n, np.log(gate)), initial_state=state)
            else:   # S <- gate S + k v^T: a Mamba-2 head with scalar decay log(gate), step 1, x = v, B = C = k
                _, state = ssd_quadratic(v, np.ones(n), np.log(gate), k, k, initial_state=state)
            done = m
        states.append(state)
    return states


@FAST
@given(mech=st.sampled_from(["linear", "delta", "gated_delta", "ssm"]), b=st.integers(1, 3),
       n=st.integers(1, 12), d_k=st.integers(1, 5), d_v=st.integers(1, 4), data=st.data())
def test_the_labs_states_are_the_layers_states_bit_for_bit(mech, b, n, d_k, d_v, data):
    # batched_final_states (and capacity_curve, which shares its code) runs the layers' own scans of
    # fixedstate.kernels without their reads: the states are the numbers the layers' public forms give
    marks = sorted(data.draw(st.lists(st.integers(1, n), min_size=1, max_size=4)))
    beta = data.draw(st.floats(0.05, 1.0))
    gate = data.draw(st.floats(0.05, 1.0))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    keys = np.stack([rc.make_keys(n, d_k, rng=rng) for _ in range(b)])
    values = rng.standard_normal((b, n, d_v))
    got = rc.batched_final_states(mech, keys, values, beta=beta, gate=gate, checkpoints=marks)
    want = _layer_states(mech, keys, values, beta, gate, marks)
    assert len(got) == len(marks)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


def test_the_capacity_curve_reads_the_states_of_batched_final_states():
    # capacity_curve's accuracy at N comes from the memory batched_final_states gives after N pairs
    ns = [2, 5, 9]
    for mech in ("linear", "delta", "gated_delta", "ssm"):
        curve = rc.capacity_curve(6, ns, mechanisms=(mech,), n_seeds=2, seed=3, beta=0.8, gate=0.7)
        rng = np.random.default_rng(3)
        keys = np.stack([rc.make_keys(9, 6, rng=rng) for _ in range(2)])
        values = rng.standard_normal((2, 9, 6))
        values /= np.linalg.norm(values, axis=2, keepdims=True)
        states = rc.batched_final_states(mech, keys, values, beta=0.8, gate=0.7, checkpoints=ns)
        for p, n in enumerate(ns):
            recalled = keys[:, :n] @ states[p]
            nearest = np.argmax(recalled @ values[:, :n].transpose(0, 2, 1), axis=2)
            assert np.array_equal(curve.per_seed_accuracy[mech][:, p], np.mean(nearest == np.arange(n), axis=1))


@pytest.mark.parametrize("passes, overlap", [(1, 0.2), (3, 0.2), (1, 0.0), (3, 0.0)])
def test_capacity_curve_agrees_with_the_experiment_pair_by_pair(passes, overlap):
    ns = [2, 5, 9, 12]
    curve = rc.capacity_curve(6, ns, d_v=5, overlap=overlap, n_seeds=3, seed=11, temperature=0.02,
                              beta=0.9, gate=0.85, passes=passes)
    rng = np.random.default_rng(11)
    keys = [rc.make_keys(12, 6, overlap=overlap, rng=rng) for _ in range(3)]
    values = rng.standard_normal((3, 12, 5))
    values /= np.linalg.norm(values, axis=2, keepdims=True)
    for mech in rc.MECHANISMS:
        errors = np.empty((3, len(ns)))
        for s in range(3):
            for p, n in enumerate(ns):
                r = rc.recall_pairs(mech, keys[s][:n], values[s, :n], temperature=0.02, beta=0.9,
                                    gate=0.85, passes=passes)
                assert curve.per_seed_accuracy[mech][s, p] == r.accuracy
                errors[s, p] = r.mean_error
        assert np.allclose(curve.error[mech], errors.mean(axis=0), rtol=1e-9, atol=1e-10)
        assert np.allclose(curve.accuracy[mech], curve.per_seed_accuracy[mech].mean(axis=0), rtol=0,
                           atol=1e-15)


# ----------------------------------------------------------------------------- capacity curves

def test_capacity_falls_as_pairs_outnumber_dimensions():
    curve = rc.capacity_curve(16, [4, 16, 32, 64], n_seeds=8, seed=0)
    assert np.all(curve.accuracy["softmax"] == 1.0)
    for mech in ("linear", "delta", "gated_delta", "ssm"):
        acc, err = curve.accuracy[mech], curve.error[mech]
        assert acc[-1] < acc[0] - 0.2, mech
        assert np.all(np.diff(err) > 0), mech
    assert np.allclose(curve.ratios, [0.25, 1.0, 2.0, 4.0])


def test_capacity_curves_are_reproducible_from_the_seed():
    a = rc.capacity_curve(8, [2, 8, 16], n_seeds=4, seed=3)
    b = rc.capacity_curve(8, [2, 8, 16], n_seeds=4, seed=3)
    c = rc.capacity_curve(8, [2, 8, 16], n_seeds=4, seed=4)
    for mech in rc.MECHANISMS:
        assert np.array_equal(a.per_seed_accuracy[mech], b.per_seed_accuracy[mech])
        assert np.array_equal(a.error[mech], b.error[mech])
    assert not np.array_equal(a.error["linear"], c.error["linear"])


# ----------------------------------------------------------------------------- MQAR

@FAST
@given(vocab=st.integers(5, 80), data=st.data())
def test_mqar_sequences_have_the_stated_structure(vocab, data):
    n_keys = (vocab - 1) // 2
    n = data.draw(st.integers(1, n_keys))
    m = data.draw(st.integers(1, n))
    t_len = data.draw(st.integers(2 * n + 2 * m, 2 * n + 2 * m + 20))
    batch = rc.make_mqar(3, vocab, n, t_len, n_queries=m, rng=data.draw(st.integers(0, 10**6)))
    assert batch.tokens.shape == batch.targets.shape == (3, t_len)
    for tok, tgt in zip(batch.tokens, batch.targets):
        ks, vs = tok[0:2 * n:2], tok[1:2 * n:2]
        assert len(set(ks.tolist())) == n
        assert np.all(np.isin(ks, batch.key_tokens)) and np.all(np.isin(vs, batch.value_tokens))
        queries = np.flatnonzero(tgt >= 0)
        assert queries.size == m
        for p in queries:
            assert p >= 2 * n
            i = np.flatnonzero(ks == tok[p])
            assert i.size == 1  # the query's key was written earlier ...
            assert vs[i[0]] == tgt[p]  # ... with this value
            assert tok[p + 1] == tgt[p]
        rest = np.ones(t_len, dtype=bool)
        rest[:2 * n] = False
        rest[queries] = False
        rest[queries + 1] = False
        assert np.all(tok[rest] == 0)


def test_mqar_scores():
    batch = rc.make_mqar(4, 41, 6, 40, rng=1)
    assert rc.score_mqar(batch.targets, batch.targets) == 1.0
    wrong = batch.targets.copy()
    rows, cols = np.nonzero(wrong >= 0)
    wrong[rows[:6], cols[:6]] += 1
    assert rc.score_mqar(wrong, batch.targets) == 1 - 6 / rows.size
    assert rc.score_mqar(rc.mqar_answers("softmax", batch, d_k=16), batch.targets) == 1.0
    # more pairs than dimensions: additive writes cannot keep them apart
    big = rc.make_mqar(4, 201, 40, 160, rng=2)
    assert rc.score_mqar(rc.mqar_answers("linear", big, d_k=8), big.targets) < 0.6
    assert rc.score_mqar(rc.mqar_answers("softmax", big, d_k=8), big.targets) == 1.0


def test_mqar_answers_read_the_package_layer_at_query_positions():
    batch = rc.make_mqar(1, 21, 4, 20, rng=3)
    preds = rc.mqar_answers("delta", batch, d_k=8, rng=5)
    # rebuild the hand-wired layer independently
    rng = np.random.default_rng(5)
    emb_k = np.zeros((21, 8))
    unit = lambda shape: (lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True))(rng.standard_normal(shape))
    emb_k[batch.key_tokens] = unit((batch.key_tokens.size, 8))                 # random unit vectors, as mqar_answers
    emb_v = np.zeros((21, 8))
    emb_v[batch.value_tokens] = unit((batch.value_tokens.size, 8))
    tok = batch.tokens[0]
    state = np.zeros((8, 8))
    for t in range(20):
        k = emb_k[tok[t - 1]] if t else np.zeros(8)
        state = state + np.outer(k, emb_v[tok[t]] - state.T @ k)
        if batch.targets[0, t] >= 0:
            out = state.T @ emb_k[tok[t]]
            assert preds[0, t] == batch.value_tokens[np.argmax(emb_v[batch.value_tokens] @ out)]


@pytest.mark.parametrize("mech", rc.MECHANISMS)
def test_mqar_answers_of_a_batch_are_those_of_each_sequence(mech):
    batch = rc.make_mqar(3, 41, 6, 30, rng=4)
    preds = rc.mqar_answers(mech, batch, d_k=8, gate=0.8, beta=0.7, rng=2)
    for s in range(3):
        one = rc.MQARBatch(batch.tokens[s:s + 1], batch.targets[s:s + 1], batch.vocab_size, batch.n_pairs,
                           batch.key_tokens, batch.value_tokens)
        assert np.array_equal(rc.mqar_answers(mech, one, d_k=8, gate=0.8, beta=0.7, rng=2), preds[s:s + 1])


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, name", [
    (lambda: rc.make_keys(0, 4), "n_pairs"),
    (lambda: rc.make_keys(3, 0), "d_k"),
    (lambda: rc.make_keys(3, 4, overlap=-0.1), "overlap"),
    (lambda: rc.make_keys(3, 4, overlap=1.5), "overlap"),
    (lambda: rc.make_keys(5, 4, orthogonal=True), "n_pairs"),
    (lambda: rc.make_values(2, 0), "d_v"),
    (lambda: rc.recall_pairs("attention", np.eye(2), np.eye(2)), "mechanism"),
    (lambda: rc.recall_pairs("delta", np.zeros((0, 2)), np.zeros((0, 2))), "keys"),
    (lambda: rc.recall_pairs("delta", np.eye(2), np.eye(3)), "values"),
    (lambda: rc.recall_pairs("gated_delta", np.eye(2), np.eye(2), gate=0.0), "gate"),
    (lambda: rc.recall_pairs("softmax", np.eye(2), np.eye(2), temperature=0.0), "temperature"),
    (lambda: rc.capacity_curve(0, [1, 2]), "d_k"),
    (lambda: rc.capacity_curve(4, [0, 2]), "n_values"),
    (lambda: rc.capacity_curve(4, [3, 2]), "n_values"),
    (lambda: rc.capacity_curve(4, [1, 2], overlap=2.0), "overlap"),
    (lambda: rc.make_mqar(2, 11, 6, 40), "n_pairs"),
    (lambda: rc.make_mqar(2, 11, 0, 40), "n_pairs"),
    (lambda: rc.make_mqar(2, 41, 6, 20), "seq_len"),
    (lambda: rc.make_mqar(2, 41, 6, 40, n_queries=7), "n_queries"),
    (lambda: rc.score_mqar(np.zeros((2, 3), int), np.zeros((2, 4), int)), "predictions"),
])
def test_bad_input_raises_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# ----------------------------------------------------------------------------- the lab

def test_lab_update_is_the_experiment_and_the_curve():
    result, curve = recall_lab.update("delta", 10, 8, 0.3, seed=4, n_seeds=3)
    rng = np.random.default_rng(4)
    keys = rc.make_keys(10, 8, overlap=0.3, rng=rng)
    values = rc.make_values(10, 8, rng=rng)
    assert np.array_equal(result.recalled, rc.recall_pairs("delta", keys, values).recalled)
    again = rc.capacity_curve(8, recall_lab.n_values(8), overlap=0.3, n_seeds=3, seed=4)
    for m in rc.MECHANISMS:
        assert np.array_equal(curve.accuracy[m], again.accuracy[m])
    assert curve.n_values[0] == 1 and curve.n_values[-1] == 32


def test_lab_update_takes_the_value_width():
    result, curve = recall_lab.update("linear", 10, 8, 0.0, d_v=24, seed=4, n_seeds=3)
    rng = np.random.default_rng(4)
    keys = rc.make_keys(10, 8, rng=rng)
    values = rc.make_values(10, 24, rng=rng)
    assert result.recalled.shape == (10, 24)
    assert np.array_equal(result.recalled, rc.recall_pairs("linear", keys, values).recalled)
    again = rc.capacity_curve(8, recall_lab.n_values(8), d_v=24, n_seeds=3, seed=4)
    assert curve.d_v == 24
    for m in rc.MECHANISMS:
        assert np.array_equal(curve.accuracy[m], again.accuracy[m])


# ----------------------------------------------------------------------------- vocabulary decoding

def test_vocabulary_recall_is_the_nearest_candidate_by_cosine():
    acc = rc.vocabulary_recall("linear", 6, 5, [3, 9], n_candidates=12, n_seeds=2, seed=3)
    expected = np.zeros(2)
    for s in range(2):
        rng = np.random.default_rng([3, s])
        cand = rc.make_values(12, 5, rng=rng)
        for p, n in enumerate([3, 9]):
            k = rc.make_keys(n, 6, rng=rng)
            out = k @ (k.T @ cand[:n])  # additive state K^T V read at every key
            cos = out @ cand.T / np.linalg.norm(out, axis=1, keepdims=True)
            expected[p] += np.mean(np.argmax(cos, axis=1) == np.arange(n)) / 2
    assert np.allclose(acc, expected, rtol=0, atol=1e-12)


def test_vocabulary_recall_orthonormal_features_are_exact_and_feature_map_widens_the_state():
    # a feature map into r = d_k^2 dimensions: the state is r x d_v
    def outer(x):
        return (x[:, :, None] * x[:, None, :]).reshape(x.shape[0], -1)

    seen = []

    def spy(x):
        seen.append(outer(x).shape)
        return outer(x)

    rc.vocabulary_recall("delta", 4, 3, [2], n_candidates=4, n_seeds=1, feature_map=spy)
    assert seen == [(2, 16)]
    # with few pairs and wide values nothing is confused
    assert rc.vocabulary_recall("linear", 16, 64, [2], n_seeds=2)[0] == 1.0


@pytest.mark.parametrize("kwargs, name", [
    (dict(mechanism="softmax"), "mechanism"),
    (dict(n_values=[200]), "n_values"),
    (dict(feature_map=3), "feature_map"),
])
def test_vocabulary_recall_refuses_bad_arguments(kwargs, name):
    args = dict(mechanism="linear", d_k=4, d_v=4, n_values=[2])
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        rc.vocabulary_recall(args.pop("mechanism"), args.pop("d_k"), args.pop("d_v"), args.pop("n_values"),
                             **args)
