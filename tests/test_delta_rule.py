"""Tests for fixedstate.delta_rule: the three forms agree, and the properties the chapter claims hold."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fixedstate import delta_rule as dr

LAYERS = ("delta", "gated", "kda")


def make_inputs(rng, T, d_k, d_v, layer, *, gate_low=0.5, unit_keys=True, dtype=np.float64):
    q = rng.standard_normal((T, d_k))
    k = rng.standard_normal((T, d_k))
    if unit_keys:
        k /= np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((T, d_v))
    betas = rng.uniform(0.0, 1.0, T)
    if layer == "delta":
        gates = None
    elif layer == "gated":
        gates = rng.uniform(gate_low, 1.0, T)
    else:
        gates = rng.uniform(gate_low, 1.0, (T, d_k))
    cast = (lambda x: None if x is None else x.astype(dtype))
    return cast(q), cast(k), cast(v), cast(betas), cast(gates)


def step_fn(layer):
    return {"delta": dr.delta_rule_step, "gated": dr.gated_delta_rule_step, "kda": dr.kda_step}[layer]


def recurrent_fn(layer):
    return {"delta": dr.delta_rule_recurrent, "gated": dr.gated_delta_rule_recurrent,
            "kda": dr.kda_recurrent}[layer]


def chunkwise_fn(layer):
    return {"delta": dr.delta_rule_chunkwise, "gated": dr.gated_delta_rule_chunkwise,
            "kda": dr.kda_chunkwise}[layer]


def by_steps(layer, q, k, v, betas, gates, state, scale):
    step = step_fn(layer)
    outs = []
    for t in range(q.shape[0]):
        extra = () if gates is None else (gates[t],)
        o, state = step(state, q[t], k[t], v[t], betas[t], *extra, scale=scale)
        outs.append(o)
    return np.array(outs).reshape(q.shape[0], v.shape[1]), state


def run(fn, q, k, v, betas, gates, **kw):
    extra = () if gates is None else (gates,)
    return fn(q, k, v, betas, *extra, **kw)


def rel_err(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


# --------------------------------------------------------------------------- the forms agree

@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("T,chunk", [(50, 1), (50, 7), (64, 16), (67, 16), (40, 64), (130, 64), (33, 33)])
def test_three_forms_agree(layer, T, chunk):
    rng = np.random.default_rng(T * 31 + chunk)
    d_k, d_v = 6, 4
    q, k, v, betas, gates = make_inputs(rng, T, d_k, d_v, layer)
    s0 = rng.standard_normal((d_k, d_v))
    o_step, s_step = by_steps(layer, q, k, v, betas, gates, s0, 0.7)
    o_rec, s_rec = run(recurrent_fn(layer), q, k, v, betas, gates, initial_state=s0, scale=0.7)
    o_chk, s_chk = run(chunkwise_fn(layer), q, k, v, betas, gates, initial_state=s0, scale=0.7,
                       chunk_size=chunk)
    assert rel_err(o_rec, o_step) <= 1e-10 and rel_err(s_rec, s_step) <= 1e-10
    assert rel_err(o_chk, o_step) <= 1e-10 and rel_err(s_chk, s_step) <= 1e-10


@pytest.mark.parametrize("layer", ("gated", "kda"))
@pytest.mark.parametrize("gate_value", [1e-12, 1e-3, 1.0])
def test_forms_agree_with_gates_near_zero_and_exactly_one(layer, gate_value):
    rng = np.random.default_rng(7)
    T, d_k, d_v = 45, 5, 3
    q, k, v, betas, gates = make_inputs(rng, T, d_k, d_v, layer)
    gates = np.full_like(gates, gate_value)
    if gate_value < 1:  # mix the extreme gate with gates of 1 so both regimes meet in a chunk
        gates[::3] = 1.0
    s0 = rng.standard_normal((d_k, d_v))
    o_step, s_step = by_steps(layer, q, k, v, betas, gates, s0, 1.0)
    for chunk in (4, 16, 64):
        o_chk, s_chk = run(chunkwise_fn(layer), q, k, v, betas, gates, initial_state=s0, chunk_size=chunk)
        assert np.all(np.isfinite(o_chk))
        assert rel_err(o_chk, o_step) <= 1e-10 and rel_err(s_chk, s_step) <= 1e-10


@settings(max_examples=40, deadline=None)
@given(layer=st.sampled_from(LAYERS), T=st.integers(1, 40), d_k=st.integers(1, 6), d_v=st.integers(1, 5),
       chunk=st.integers(1, 20), seed=st.integers(0, 2**31 - 1), with_state=st.booleans())
def test_forms_agree_hypothesis(layer, T, d_k, d_v, chunk, seed, with_state):
    rng = np.random.default_rng(seed)
    q, k, v, betas, gates = make_inputs(rng, T, d_k, d_v, layer, gate_low=0.05)
    s0 = rng.standard_normal((d_k, d_v)) if with_state else None
    start = np.zeros((d_k, d_v)) if s0 is None else s0
    o_step, s_step = by_steps(layer, q, k, v, betas, gates, start, 1.0)
    o_rec, s_rec = run(recurrent_fn(layer), q, k, v, betas, gates, initial_state=s0)
    o_chk, s_chk = run(chunkwise_fn(layer), q, k, v, betas, gates, initial_state=s0, chunk_size=chunk)
    assert o_chk.shape == (T, d_v) and s_chk.shape == (d_k, d_v)
    scale_o = max(np.max(np.abs(o_step)), 1.0)
    scale_s = max(np.max(np.abs(s_step)), 1.0)
    assert np.max(np.abs(o_rec - o_step)) <= 1e-10 * scale_o
    assert np.max(np.abs(o_chk - o_step)) <= 1e-10 * scale_o
    assert np.max(np.abs(s_chk - s_step)) <= 1e-10 * scale_s


@pytest.mark.parametrize("layer", LAYERS)
def test_float32_is_kept_and_close_to_float64(layer):
    rng = np.random.default_rng(3)
    q, k, v, betas, gates = make_inputs(rng, 100, 8, 8, layer)
    o64, _ = run(chunkwise_fn(layer), q, k, v, betas, gates, chunk_size=16)
    args32 = [None if x is None else x.astype(np.float32) for x in (q, k, v, betas, gates)]
    o32, s32 = run(chunkwise_fn(layer), *args32, chunk_size=16)
    r32, _ = run(recurrent_fn(layer), *args32)
    assert o32.dtype == np.float32 and s32.dtype == np.float32 and r32.dtype == np.float32
    assert rel_err(o32.astype(np.float64), o64) < 1e-4


@pytest.mark.parametrize("layer", ("gated", "kda"))
def test_long_float32_strong_decay_has_no_inf_or_nan(layer):
    # The decay is strong enough that the product of gates over the sequence
    # underflows float32 many times over: a form that divided by it would blow up.
    rng = np.random.default_rng(11)
    T, d = 2048, 8
    q, k, v, betas, _ = make_inputs(rng, T, d, d, "delta")
    if layer == "gated":
        gates = rng.uniform(0.2, 0.6, T)
    else:
        gates = dr.kda_decay(rng.standard_normal((T, d)) + 1.0)
    assert np.sum(np.log(gates)) / (gates.size // T) < -1000  # prod of gates underflows float64 too
    o64, _ = run(chunkwise_fn(layer), q, k, v, betas, gates)
    o32, _ = run(chunkwise_fn(layer), *(x.astype(np.float32) for x in (q, k, v, betas, gates)))
    assert np.all(np.isfinite(o32))
    assert np.max(np.abs(o32 - o64)) < 1e-4 * np.max(np.abs(o64))


# --------------------------------------------------------------------------- properties from the text

def test_gate_one_update_is_the_gradient_step_form():
    rng = np.random.default_rng(0)
    S = rng.standard_normal((5, 3))
    k = rng.standard_normal(5)
    k /= np.linalg.norm(k)
    v = rng.standard_normal(3)
    q = rng.standard_normal(5)
    beta = 0.37
    _, new = dr.gated_delta_rule_step(S, q, k, v, beta, 1.0)
    # our orientation: S - beta k (S^T k - v)^T; the S - beta (S k - v) k^T is its transpose
    assert np.allclose(new, S - beta * np.outer(k, S.T @ k - v), rtol=1e-13, atol=1e-14)
    St = S.T  # source 000 stores the state as d_v x d_k
    assert np.allclose(new.T, St - beta * np.outer(St @ k - v, k), rtol=1e-13, atol=1e-14)
    # and the erase-then-write form (I - beta k k^T) S + beta k v^T
    assert np.allclose(new, dr.erase_factor(k, beta) @ S + beta * np.outer(k, v), rtol=1e-13, atol=1e-14)


def test_gated_update_matches_each_source_after_transposition():
    rng = np.random.default_rng(1)
    S = rng.standard_normal((4, 3))
    k = rng.standard_normal(4)
    k /= np.linalg.norm(k)
    v, q = rng.standard_normal(3), rng.standard_normal(4)
    beta, g = 0.6, 0.8
    _, new = dr.gated_delta_rule_step(S, q, k, v, beta, g)
    eye = np.eye(4)
    # source 000 (S is d_v x d_k): g S (I - beta k k^T) + beta v k^T
    src000 = g * S.T @ (eye - beta * np.outer(k, k)) + beta * np.outer(v, k)
    # source 004 (S is d_k x d_v): alpha (I - beta k k^T) S + beta k v^T
    src004 = g * (eye - beta * np.outer(k, k)) @ S + beta * np.outer(k, v)
    assert np.allclose(new, src000.T, rtol=1e-13, atol=1e-14)
    assert np.allclose(new, src004, rtol=1e-13, atol=1e-14)
    # KDA, source 004: (I - beta k k^T) Diag(alpha) S + beta k v^T
    alpha = rng.uniform(0.3, 1.0, 4)
    _, new_kda = dr.kda_step(S, q, k, v, beta, alpha)
    assert np.allclose(new_kda, (eye - beta * np.outer(k, k)) @ np.diag(alpha) @ S + beta * np.outer(k, v),
                       rtol=1e-13, atol=1e-14)


def test_output_reads_the_updated_state():
    rng = np.random.default_rng(2)
    S, q, k, v = rng.standard_normal((4, 3)), rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(3)
    out, new = dr.gated_delta_rule_step(S, q, k, v, 0.5, 0.9, scale=0.25)
    assert np.allclose(out, 0.25 * new.T @ q, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("gate", [1.0, 0.3])
def test_beta_one_unit_key_recalls_new_value_exactly(gate):
    rng = np.random.default_rng(4)
    S = rng.standard_normal((6, 4))
    k = rng.standard_normal(6)
    k /= np.linalg.norm(k)
    v = rng.standard_normal(4)
    out, new = dr.gated_delta_rule_step(S, k, k, v, 1.0, gate)
    assert np.allclose(new.T @ k, v, rtol=1e-13, atol=1e-14)
    assert np.allclose(out, v, rtol=1e-13, atol=1e-14)


def test_orthonormal_keys_written_once_are_all_recalled():
    rng = np.random.default_rng(5)
    d_k, d_v = 7, 3
    keys, _ = np.linalg.qr(rng.standard_normal((d_k, d_k)))
    keys = keys.T  # rows orthonormal
    values = rng.standard_normal((d_k, d_v))
    s0 = rng.standard_normal((d_k, d_v))  # whatever was there before is overwritten
    for fn in (dr.delta_rule_recurrent, dr.delta_rule_chunkwise):
        _, S = fn(keys, keys, values, np.ones(d_k), initial_state=s0)
        assert np.allclose(keys @ S, values, rtol=1e-12, atol=1e-13)
    # plain additive writes would not overwrite: they keep the old content on top
    S_add = s0 + keys.T @ values
    assert not np.allclose(keys @ S_add, values, atol=1e-3)


@pytest.mark.parametrize("key", [np.array([1.0, 0.0]), np.array([0.6, 0.8])])
def test_repeated_writes_with_half_beta_halve_the_error(key):
    v = np.array([3.0, -1.0])
    S = np.array([[0.5, 2.0], [-1.0, 0.25]])
    errors = []
    for _ in range(8):
        errors.append(np.linalg.norm(v - S.T @ key))
        _, S = dr.delta_rule_step(S, key, key, v, 0.5)
    ratios = np.array(errors[1:]) / np.array(errors[:-1])
    assert np.allclose(ratios, 0.5, rtol=1e-12, atol=0)


@pytest.mark.parametrize("sq_norm,beta", [(3.0, 1.0), (1.5, 1.0), (4.0, 0.25)])
def test_non_unit_keys_scale_the_error_by_one_minus_beta_norm_squared(sq_norm, beta):
    # documented behaviour: each write multiplies the recall error by (1 - beta |k|^2);
    # beta |k|^2 > 2 makes the erase factor expand, so the error grows
    k = np.array([1.0, 1.0, 0.0]) * np.sqrt(sq_norm / 2.0)
    v = np.array([1.0, 2.0])
    S = np.zeros((3, 2))
    factor = 1.0 - beta * sq_norm
    err = v - S.T @ k
    for _ in range(5):
        _, S = dr.delta_rule_step(S, k, k, v, beta)
        new_err = v - S.T @ k
        assert np.allclose(new_err, factor * err, rtol=1e-12, atol=1e-13)
        err = new_err
    eig = np.linalg.eigvalsh(dr.erase_factor(k, beta))
    assert np.isclose(eig.min(), factor, rtol=1e-12, atol=1e-14)
    if beta * sq_norm > 2:
        assert np.linalg.norm(err) > 10 * np.linalg.norm(v)  # grew


@pytest.mark.parametrize("form", ["step", "recurrent", "chunkwise"])
def test_gate_without_writes_shrinks_by_gate_per_step(form):
    rng = np.random.default_rng(6)
    d_k, d_v, T, g = 4, 3, 9, 0.7
    s0 = rng.standard_normal((d_k, d_v))
    q = rng.standard_normal((T, d_k))
    k = rng.standard_normal((T, d_k))
    v = rng.standard_normal((T, d_v))
    betas = np.zeros(T)  # no writes
    gates = np.full(T, g)
    if form == "step":
        S = s0
        for t in range(T):
            _, S = dr.gated_delta_rule_step(S, q[t], k[t], v[t], 0.0, g)
            assert np.allclose(S, g ** (t + 1) * s0, rtol=1e-13, atol=1e-15)
    else:
        fn = dr.gated_delta_rule_recurrent if form == "recurrent" else dr.gated_delta_rule_chunkwise
        out, S = fn(q, k, v, betas, gates, initial_state=s0)
        assert np.allclose(S, g ** T * s0, rtol=1e-12, atol=1e-15)
        expected = np.array([g ** (t + 1) * s0.T @ q[t] for t in range(T)])
        assert np.allclose(out, expected, rtol=1e-12, atol=1e-15)
    # KDA: each row of the state shrinks by its own channel decay
    alphas = np.array([0.9, 0.5, 1.0, 0.2])
    _, S_kda = dr.kda_recurrent(q, k, v, betas, np.tile(alphas, (T, 1)), initial_state=s0)
    assert np.allclose(S_kda, (alphas ** T)[:, None] * s0, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("form", ["step", "recurrent", "chunkwise"])
def test_kda_with_equal_channel_decays_is_the_scalar_gated_rule(form):
    rng = np.random.default_rng(8)
    T, d_k, d_v = 37, 5, 4
    q, k, v, betas, gates = make_inputs(rng, T, d_k, d_v, "gated")
    s0 = rng.standard_normal((d_k, d_v))
    wide = np.repeat(gates[:, None], d_k, axis=1)
    if form == "step":
        o1, s1 = by_steps("gated", q, k, v, betas, gates, s0, 1.0)
        o2, s2 = by_steps("kda", q, k, v, betas, wide, s0, 1.0)
    elif form == "recurrent":
        o1, s1 = dr.gated_delta_rule_recurrent(q, k, v, betas, gates, initial_state=s0)
        o2, s2 = dr.kda_recurrent(q, k, v, betas, wide, initial_state=s0)
    else:
        o1, s1 = dr.gated_delta_rule_chunkwise(q, k, v, betas, gates, initial_state=s0, chunk_size=8)
        o2, s2 = dr.kda_chunkwise(q, k, v, betas, wide, initial_state=s0, chunk_size=8)
    assert rel_err(o2, o1) <= 1e-12 and rel_err(s2, s1) <= 1e-12


def test_gated_with_gate_one_is_deltanet():
    rng = np.random.default_rng(9)
    q, k, v, betas, _ = make_inputs(rng, 30, 4, 3, "delta")
    o1, s1 = dr.delta_rule_chunkwise(q, k, v, betas, chunk_size=8)
    o2, s2 = dr.gated_delta_rule_chunkwise(q, k, v, betas, np.ones(30), chunk_size=8)
    assert rel_err(o2, o1) <= 1e-13 and rel_err(s2, s1) <= 1e-13


# --------------------------------------------------------------------------- KDA's bounded decay

def test_kda_decay_is_bounded_and_matches_the_formula():
    z = np.linspace(-30.0, 30.0, 101)
    alpha = dr.kda_decay(z)
    expected = np.exp(-5.0 / (1.0 + np.exp(-z)))
    assert np.allclose(alpha, expected, rtol=1e-13, atol=0)
    assert np.all(alpha >= np.exp(-5.0)) and np.all(alpha <= 1.0)
    extreme = dr.kda_decay(np.array([-1e4, 1e4]), g_min=-2.0)
    assert np.all(np.isfinite(extreme))
    assert np.isclose(extreme[0], 1.0) and np.isclose(extreme[1], np.exp(-2.0), rtol=1e-14)


@pytest.mark.parametrize("bad", [0.0, 1.0, np.nan, np.inf, True, "x"])
def test_kda_decay_rejects_bad_g_min(bad):
    with pytest.raises(ValueError, match="g_min"):
        dr.kda_decay(np.zeros(3), g_min=bad)


# --------------------------------------------------------------------------- the four-writes figure

@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.9])
def test_four_writes(overlap):
    res = dr.four_writes(gate=1.0, beta=1.0, overlap=overlap)
    e = np.eye(4)
    # linear attention piles up: old + new value of a, plus overlap times c's value
    assert np.allclose(res["linear"]["a"], e[0] + e[3] + overlap * e[2], atol=1e-14)
    assert np.allclose(res["linear"]["b"], e[1], atol=1e-14)
    # the delta rule with beta 1 recalls a's new value exactly, and b is untouched
    assert np.allclose(res["delta"]["a"], e[3], atol=1e-14)
    assert np.allclose(res["delta"]["b"], e[1], atol=1e-14)
    # c is disturbed exactly when it overlaps a
    assert np.allclose(res["delta"]["c"], e[2], atol=1e-14) == (overlap == 0.0)


def test_four_writes_gate_fades_b():
    g = 0.5
    res = dr.four_writes(gate=g, beta=1.0, overlap=0.5)
    # b was written second, then two more steps of decay (its key is orthogonal to a and c)
    assert np.allclose(res["delta"]["b"], g ** 2 * np.eye(4)[1], atol=1e-14)


def test_draw_four_writes_has_three_panels():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = dr.draw_four_writes(0.9, 0.5, 0.5)
    assert len(fig.axes) == 3 and [ax.get_title().split("\n")[0] for ax in fig.axes] == [
        "recall of a", "recall of b", "recall of c"]
    plt.close(fig)


def test_time_forms_reports_agreeing_forms():
    res = dr.time_forms(40, 4, 3, chunk_size=8, repeats=1, layer="kda")
    assert res["recurrent"] > 0 and res["chunkwise"] > 0 and res["max_rel_diff"] < 1e-10


# --------------------------------------------------------------------------- validation

def _seq(rng, T=6, d_k=3, d_v=2):
    return rng.standard_normal((T, d_k)), rng.standard_normal((T, d_k)), rng.standard_normal((T, d_v)), \
        np.full(T, 0.5)


@pytest.mark.parametrize("fn", [dr.delta_rule_recurrent, dr.delta_rule_chunkwise])
def test_betas_outside_unit_interval_are_refused(fn):
    q, k, v, b = _seq(np.random.default_rng(0))
    for bad in (-0.1, 1.5):
        b2 = b.copy()
        b2[2] = bad
        with pytest.raises(ValueError, match="betas"):
            fn(q, k, v, b2)


@pytest.mark.parametrize("fn,shape", [(dr.gated_delta_rule_recurrent, (6,)), (dr.gated_delta_rule_chunkwise, (6,)),
                                      (dr.kda_recurrent, (6, 3)), (dr.kda_chunkwise, (6, 3))])
@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01, np.nan])
def test_gates_outside_zero_one_are_refused(fn, shape, bad):
    q, k, v, b = _seq(np.random.default_rng(0))
    g = np.full(shape, 0.9)
    g.flat[1] = bad
    with pytest.raises(ValueError, match="gates"):
        fn(q, k, v, b, g)


def test_shape_mismatches_name_the_argument():
    rng = np.random.default_rng(0)
    q, k, v, b = _seq(rng)
    with pytest.raises(ValueError, match="keys"):
        dr.delta_rule_recurrent(q, k[:, :2], v, b)
    with pytest.raises(ValueError, match="values"):
        dr.delta_rule_chunkwise(q, k, v[:5], b)
    with pytest.raises(ValueError, match="betas"):
        dr.delta_rule_chunkwise(q, k, v, b[:5])
    with pytest.raises(ValueError, match="initial_state"):
        dr.delta_rule_chunkwise(q, k, v, b, initial_state=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="gates"):
        dr.kda_chunkwise(q, k, v, b, np.full(6, 0.9))  # KDA needs (T, d_k)
    with pytest.raises(ValueError, match="gates"):
        dr.gated_delta_rule_recurrent(q, k, v, b, np.full((6, 3), 0.9))
    with pytest.raises(ValueError, match="value"):
        dr.delta_rule_step(np.zeros((3, 2)), q[0], k[0], np.zeros(3), 0.5)
    with pytest.raises(ValueError, match="gate"):
        dr.kda_step(np.zeros((3, 2)), q[0], k[0], v[0], 0.5, np.full(2, 0.9))
    with pytest.raises(ValueError, match="scale"):
        dr.delta_rule_recurrent(q, k, v, b, scale=np.nan)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_chunk_size_below_one_or_not_integer_is_refused(bad):
    q, k, v, b = _seq(np.random.default_rng(0))
    with pytest.raises(ValueError, match="chunk_size"):
        dr.delta_rule_chunkwise(q, k, v, b, chunk_size=bad)


@pytest.mark.parametrize("bad", [-0.01, 1.2, np.nan])
def test_step_beta_and_gate_are_checked(bad):
    S, x = np.zeros((2, 2)), np.ones(2)
    with pytest.raises(ValueError, match="beta"):
        dr.delta_rule_step(S, x, x, x, bad)
    with pytest.raises(ValueError, match="gate"):
        dr.gated_delta_rule_step(S, x, x, x, 0.5, bad if bad != 1.2 else 1.2)


@pytest.mark.parametrize("layer", LAYERS)
def test_forms_agree_over_many_chunk_groups(layer):
    # long enough that the chunkwise form processes several groups of chunks
    rng = np.random.default_rng(12)
    T, d_k, d_v = 1300, 4, 3
    q, k, v, betas, gates = make_inputs(rng, T, d_k, d_v, layer, gate_low=0.9)
    s0 = rng.standard_normal((d_k, d_v))
    o_rec, s_rec = run(recurrent_fn(layer), q, k, v, betas, gates, initial_state=s0)
    for chunk in (16, 100):
        o_chk, s_chk = run(chunkwise_fn(layer), q, k, v, betas, gates, initial_state=s0, chunk_size=chunk)
        assert rel_err(o_chk, o_rec) <= 1e-10 and rel_err(s_chk, s_rec) <= 1e-10
