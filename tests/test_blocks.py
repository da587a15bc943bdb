"""Tests for fixedstate.blocks: each part against its definition, written out directly."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _examples import examples
from _finite_differences import BOUND, check

from fixedstate import blocks as bl

FAST = examples(30)
leading_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


def rel(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


# ----------------------------------------------------------------------------- activations

def test_activations_match_their_formulas_and_do_not_overflow():
    x = np.linspace(-30, 30, 121)
    np.testing.assert_allclose(bl.sigmoid(x), 1 / (1 + np.exp(-x)), rtol=1e-14)
    np.testing.assert_allclose(bl.silu(x), x / (1 + np.exp(-x)), rtol=1e-14)
    np.testing.assert_allclose(bl.softplus(x), np.log1p(np.exp(x)), rtol=1e-14)
    big = np.array([-1e4, 1e4])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        assert np.array_equal(bl.sigmoid(big), [0.0, 1.0])
        assert np.array_equal(bl.softplus(big), [0.0, 1e4])
        assert np.array_equal(bl.silu(big), [-0.0, 1e4])
    assert np.all(bl.softplus(np.array([-50.0, 0.0])) > 0)


# ----------------------------------------------------------------------------- projections

@FAST
@given(lead=leading_shapes, d_in=st.integers(1, 5), d_out=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_linear_and_mlp_are_row_by_row_and_their_backwards_match_finite_differences(lead, d_in, d_out, seed):
    """One set-up for the forward passes (row by row, written out) and the backward passes (central
    finite differences, relative error <= BOUND, the bound chapter 9 states)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (d_in,))
    w, b = rng.standard_normal((d_in, d_out)), rng.standard_normal(d_out)
    w2 = rng.standard_normal((d_out, 3))
    y, m = bl.linear(x, w, b), bl.mlp(x, w, w2)
    assert y.shape == lead + (d_out,) and m.shape == lead + (3,)
    for idx in np.ndindex(*lead):
        row = x[idx]
        want = np.array([sum(row[i] * w[i, j] for i in range(d_in)) + b[j] for j in range(d_out)])
        np.testing.assert_allclose(y[idx], want, rtol=1e-12, atol=1e-12)
        u = row @ w
        np.testing.assert_allclose(m[idx], (u / (1 + np.exp(-u))) @ w2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bl.linear(x, w), y - b, rtol=1e-12, atol=1e-12)
    err = check(lambda x, weight, bias: bl.linear(x, weight, bias), {"x": x, "weight": w, "bias": b},
                lambda d: dict(zip(("x", "weight", "bias"), bl.linear_backward(x, w, d))))
    assert err <= BOUND
    err = check(lambda x, W_1, W_2: bl.mlp(x, W_1, W_2), {"x": x, "W_1": w, "W_2": w2},
                lambda d: dict(zip(("x", "W_1", "W_2"), bl.mlp_backward(x, w, w2, d))))
    assert err <= BOUND


def test_embedding_looks_up_rows():
    table = np.arange(12.0).reshape(4, 3)
    tokens = np.array([[0, 3], [2, 2]])
    out = bl.embedding(tokens, table)
    assert out.shape == (2, 2, 3)
    assert np.array_equal(out[1, 0], table[2]) and np.array_equal(out[0, 1], table[3])
    assert bl.embedding(np.array([1]), table.astype(np.float32)).dtype == np.float32


# ----------------------------------------------------------------------------- norms

@FAST
@given(lead=leading_shapes, d=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_norms_match_their_formulas(lead, d, seed):
    rng = np.random.default_rng(seed)
    x, z = rng.standard_normal(lead + (d,)), rng.standard_normal(lead + (d,))
    w = rng.standard_normal(d)
    rms = np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(bl.rms_norm(x), x / rms, rtol=1e-13)
    np.testing.assert_allclose(bl.rms_norm(x, w), x / rms * w, rtol=1e-13)
    gate = z / (1 + np.exp(-z))
    np.testing.assert_allclose(bl.gated_rms_norm(x, z, w), x / rms * w * gate, rtol=1e-12, atol=1e-15)
    xg = x * gate
    gated_first = xg / np.sqrt(np.mean(xg ** 2, axis=-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(bl.gated_rms_norm(x, z, w, norm_before_gate=False), gated_first,
                               rtol=1e-12, atol=1e-15)
    unit = bl.l2_normalize(x, eps=1e-30)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=-1), 1.0, rtol=1e-13)


def test_rms_norm_gives_unit_mean_square_and_zero_stays_zero():
    x = np.random.default_rng(0).standard_normal((5, 8)) * 7
    assert np.allclose(np.mean(bl.rms_norm(x, eps=1e-12) ** 2, axis=-1), 1.0, rtol=1e-10)
    assert np.array_equal(bl.l2_normalize(np.zeros(4)), np.zeros(4))
    assert np.array_equal(bl.rms_norm(np.zeros((2, 4))), np.zeros((2, 4)))


def test_gated_norm_broadcasts_the_gate_over_leading_axes():
    rng = np.random.default_rng(1)
    x, z = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 4))
    out = bl.gated_rms_norm(x, z)
    for i in range(2):
        np.testing.assert_allclose(out[i], bl.gated_rms_norm(x[i], z), rtol=1e-14)


# ----------------------------------------------------------------------------- short convolution

def direct_conv(x, weight, history):
    """y_t[c] = sum_j weight[c, j] x_{t-K+1+j}[c], inputs before t = 0 read from history (T, d)."""
    T, d = x.shape
    K = weight.shape[1]
    full = np.vstack([history, x])  # history has K - 1 rows
    y = np.zeros((T, d))
    for t in range(T):
        for c in range(d):
            y[t, c] = sum(weight[c, j] * full[t + j, c] for j in range(K))
    return y


@FAST
@given(T=st.integers(0, 12), d=st.integers(1, 4), K=st.integers(1, 5), seed=st.integers(0, 10**6),
       with_state=st.booleans())
def test_short_conv_is_the_direct_sum(T, d, K, seed, with_state):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((T, d)), rng.standard_normal((d, K))
    history = rng.standard_normal((K - 1, d)) if with_state else np.zeros((K - 1, d))
    y, state = bl.short_conv(x, w, initial_state=history if with_state else None)
    assert y.shape == (T, d) and state.shape == (K - 1, d)
    np.testing.assert_allclose(y, direct_conv(x, w, history), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(state, np.vstack([history, x])[T:])
    b = rng.standard_normal(d)
    np.testing.assert_allclose(bl.short_conv(x, w, initial_state=history, bias=b)[0],
                               direct_conv(x, w, history) + b, rtol=1e-12, atol=1e-12)


@FAST
@given(lead=leading_shapes, T=st.integers(1, 10), split=st.integers(0, 10), d=st.integers(1, 3),
       K=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_prefill_then_steps_equals_one_prefill(lead, T, split, d, K, seed):
    split = min(split, T)
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(lead + (T, d)), rng.standard_normal((d, K))
    y_all, s_all = bl.short_conv(x, w)
    y_head, state = bl.short_conv(x[..., :split, :], w)
    ys = [y_head]
    for t in range(split, T):
        y_t, state = bl.short_conv_step(x[..., t, :], w, initial_state=state)
        ys.append(y_t[..., None, :])
    np.testing.assert_allclose(np.concatenate(ys, axis=-2), y_all, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(state, s_all)


@FAST
@given(lead=leading_shapes, T=st.integers(1, 6), d=st.integers(1, 3), K=st.integers(1, 4),
       seed=st.integers(0, 10**6))
def test_short_conv_with_leading_axes_is_the_loop_over_them(lead, T, d, K, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(lead + (T, d)), rng.standard_normal((d, K))
    state = rng.standard_normal((K - 1, d))  # shared by every item: broadcast
    y, s = bl.short_conv(x, w, initial_state=state)
    assert y.shape == lead + (T, d) and s.shape == lead + (K - 1, d)
    for idx in np.ndindex(*lead):
        y1, s1 = bl.short_conv(x[idx], w, initial_state=state)
        np.testing.assert_allclose(y[idx], y1, rtol=1e-14, atol=0)
        np.testing.assert_array_equal(s[idx], s1)
    # the state may carry the leading axes and x not
    states = rng.standard_normal((2, K - 1, d))
    y2, _ = bl.short_conv(x[(0,) * len(lead)], w, initial_state=states)
    for i in range(2):
        np.testing.assert_allclose(y2[i], bl.short_conv(x[(0,) * len(lead)], w, initial_state=states[i])[0],
                                   rtol=1e-14, atol=0)


# ----------------------------------------------------------------------------- backward passes

@FAST
@given(lead=leading_shapes, d=st.integers(2, 5), seed=st.integers(0, 10**6), with_weight=st.booleans())
def test_norm_backwards_match_finite_differences(lead, d, seed, with_weight):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (d,)) + 0.1
    w = rng.standard_normal(d) if with_weight else None
    if with_weight:
        err = check(lambda x, weight: bl.rms_norm(x, weight), {"x": x, "weight": w},
                    lambda g: dict(zip(("x", "weight"), bl.rms_norm_backward(x, g, w))))
    else:
        err = check(lambda x: bl.rms_norm(x), {"x": x}, lambda g: {"x": bl.rms_norm_backward(x, g)[0]})
    assert err <= BOUND
    err = check(lambda x: bl.l2_normalize(x), {"x": x}, lambda g: {"x": bl.l2_normalize_backward(x, g)})
    assert err <= BOUND


@pytest.mark.parametrize("name", ["silu", "sigmoid", "softplus"])
def test_activation_backwards_match_finite_differences(name):
    x = np.linspace(-6, 6, 25).reshape(5, 5)
    fwd, bwd = getattr(bl, name), getattr(bl, name + "_backward")
    assert check(lambda x: fwd(x), {"x": x}, lambda g: {"x": bwd(x, g)}) <= BOUND


@FAST
@given(lead=leading_shapes, T=st.integers(1, 6), d=st.integers(1, 3), K=st.integers(1, 4), seed=st.integers(0, 10**6),
       with_state=st.booleans(), with_bias=st.booleans())
def test_short_conv_backward_matches_finite_differences(lead, T, d, K, seed, with_state, with_bias):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(lead + (T, d)), rng.standard_normal((d, K))
    inputs = {"x": x, "weight": w}
    if with_state:
        inputs["initial_state"] = rng.standard_normal(lead + (K - 1, d))
    if with_bias:
        inputs["bias"] = rng.standard_normal(d)

    def f(**kw):
        return bl.short_conv(**kw)

    def backward(d_y, d_state):
        dx, dw, db, ds = bl.short_conv_backward(x, w, d_y, initial_state=inputs.get("initial_state"),
                                                bias=inputs.get("bias"), d_final_state=d_state)
        grads = {"x": dx, "weight": dw}
        if with_state:
            grads["initial_state"] = ds
        if with_bias:
            grads["bias"] = db
        return grads

    assert check(f, inputs, backward) <= BOUND


@pytest.mark.parametrize("x_lead, state_lead", [((2, 3), (3,)), ((), (2,)), ((2, 1), (1, 3)), ((2,), (1,))])
def test_short_conv_backward_gives_each_gradient_its_input_shape(x_lead, state_lead):
    """x and initial_state broadcast against each other; each gradient is summed back to its input's shape."""
    rng = np.random.default_rng(7)
    T, d, K = 5, 2, 3
    x, w = rng.standard_normal(x_lead + (T, d)), rng.standard_normal((d, K))
    state = rng.standard_normal(state_lead + (K - 1, d))
    inputs = {"x": x, "weight": w, "initial_state": state}

    def backward(d_y, d_state):
        dx, dw, _, ds = bl.short_conv_backward(x, w, d_y, initial_state=state, d_final_state=d_state)
        assert dx.shape == x.shape and ds.shape == state.shape
        return {"x": dx, "weight": dw, "initial_state": ds}

    assert check(lambda **kw: bl.short_conv(**kw), inputs, backward) <= BOUND


def test_embedding_backward_sums_over_repeated_tokens():
    rng = np.random.default_rng(0)
    tokens = np.array([[1, 3, 1], [0, 1, 4]])
    table = rng.standard_normal((6, 3))
    err = check(lambda table: bl.embedding(tokens, table), {"table": table},
                lambda g: {"table": bl.embedding_backward(tokens, table, g)})
    assert err <= BOUND
    g = rng.standard_normal((2, 3, 3))
    d = bl.embedding_backward(tokens, table, g)
    np.testing.assert_allclose(d[1], g[0, 0] + g[0, 2] + g[1, 1], rtol=1e-14)
    assert not d[2].any() and not d[5].any()


def test_block_backwards_keep_float32_and_name_a_bad_gradient():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    g = np.ones((2, 4, 2), np.float32)
    assert all(a.dtype == np.float32 for a in bl.linear_backward(x, w, g))
    assert bl.rms_norm_backward(x, x)[0].dtype == np.float32
    assert bl.l2_normalize_backward(x, x).dtype == np.float32
    assert bl.silu_backward(x, x).dtype == np.float32
    conv = bl.short_conv_backward(x, np.ones((3, 2), np.float32), x)
    assert conv[0].dtype == np.float32 and conv[1].dtype == np.float32
    with pytest.raises(ValueError, match="d_out"):
        bl.linear_backward(x, w, np.ones((2, 4, 3)))
    with pytest.raises(ValueError, match="d_y"):
        bl.short_conv_backward(x, np.ones((3, 2)), np.ones((2, 5, 3)))
    with pytest.raises(ValueError, match="d_out"):
        bl.rms_norm_backward(x, np.ones(3))


# ----------------------------------------------------------------------------- gate forms

def test_gate_forms_match_their_formulas():
    z = np.linspace(-30, 30, 61)
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        log_g = bl.sigmoid_log_gate(z)
        assert np.all(log_g <= 0)
        np.testing.assert_allclose(np.exp(log_g), bl.sigmoid(z), rtol=1e-14)
        assert np.array_equal(bl.sigmoid_log_gate(np.array([1e4])), [-0.0]) and bl.sigmoid_log_gate(-1e4) == -1e4
    raw = np.linspace(-5, 5, 12).reshape(4, 3)
    A_log, dt_bias = np.array([0.0, 1.0, -2.0]), np.array([0.5, -0.5, 0.0])
    np.testing.assert_allclose(bl.softplus_log_gate(raw, A_log, dt_bias),
                               -np.exp(A_log) * np.log1p(np.exp(raw + dt_bias)), rtol=1e-14)
    y = np.array([1e-8, 1e-3, 0.01, 0.7, 5.0, 40.0, 800.0])
    np.testing.assert_allclose(bl.softplus(bl.inverse_softplus(y)), y, rtol=1e-14)
    with np.errstate(over="raise"):
        assert bl.inverse_softplus(800.0) == 800.0


@pytest.mark.parametrize("bad", [0.0, -1.0, np.array([0.5, 0.0])])
def test_inverse_softplus_refuses_values_softplus_never_gives(bad):
    with pytest.raises(ValueError, match="y"):
        bl.inverse_softplus(bad)


@FAST
@given(lead=leading_shapes, d=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_sigmoid_log_gate_backward_matches_finite_differences(lead, d, seed):
    z = 3 * np.random.default_rng(seed).standard_normal(lead + (d,))
    assert check(lambda z: bl.sigmoid_log_gate(z), {"z": z},
                 lambda g: {"z": bl.sigmoid_log_gate_backward(z, g)}) <= BOUND


# ----------------------------------------------------------------------------- the residual block

def toy_mixer(W):
    """A mixer for the tests: ``m = tanh(u) W``, with its backward."""
    def forward(u):
        return np.tanh(u) @ W, u

    def backward(u, d_m):
        return (d_m @ W.T) * (1 - np.tanh(u) ** 2)

    return forward, backward


@FAST
@given(lead=leading_shapes, d=st.integers(2, 4), ff=st.integers(1, 5), seed=st.integers(0, 10**6),
       with_mlp=st.booleans(), with_norms=st.booleans())
def test_residual_block_is_its_formula_and_its_backward_matches_finite_differences(lead, d, ff, seed, with_mlp,
                                                                                   with_norms):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (d,))
    W = rng.standard_normal((d, d))
    W_1, W_2 = (rng.standard_normal((d, ff)), rng.standard_normal((ff, d))) if with_mlp else (None, None)
    n1, n2 = (1 + 0.3 * rng.standard_normal(d), 1 + 0.3 * rng.standard_normal(d)) if with_norms else (None, None)
    # d >= 2, as for the norms' own test: at d = 1, RMSNorm is sign(x) smoothed over |x| ~ sqrt(eps), and a
    # residual stream that passes near 0 there has a curvature no finite difference resolves
    forward, backward = toy_mixer(W)
    y, saved = bl.residual_block(x, forward, W_1, W_2, norm_mixer=n1, norm_mlp=n2)
    want = x + np.tanh(bl.rms_norm(x, n1)) @ W
    if with_mlp:
        want = want + bl.mlp(bl.rms_norm(want, n2), W_1, W_2)
    np.testing.assert_allclose(y, want, rtol=1e-13, atol=1e-13)

    def f(x):
        return bl.residual_block(x, forward, W_1, W_2, norm_mixer=n1, norm_mlp=n2)[0]

    def grads(g):
        dx, weights = bl.residual_block_backward(saved, g, backward, W_1, W_2, norm_mixer=n1, norm_mlp=n2)
        assert (weights["W_1"] is None) == (not with_mlp) and (weights["norm_mixer"] is None) == (not with_norms)
        return {"x": dx}

    assert check(f, {"x": x}, grads) <= BOUND


def test_residual_block_weight_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    x, W = rng.standard_normal((2, 5, 3)), rng.standard_normal((3, 3))
    forward, backward = toy_mixer(W)
    weights = {"W_1": rng.standard_normal((3, 4)), "W_2": rng.standard_normal((4, 3)),
               "norm_mixer": 1 + 0.3 * rng.standard_normal(3), "norm_mlp": 1 + 0.3 * rng.standard_normal(3)}

    def f(W_1, W_2, norm_mixer, norm_mlp):
        return bl.residual_block(x, forward, W_1, W_2, norm_mixer=norm_mixer, norm_mlp=norm_mlp)[0]

    _, saved = bl.residual_block(x, forward, **{k: weights[k] for k in ("W_1", "W_2")},
                                 norm_mixer=weights["norm_mixer"], norm_mlp=weights["norm_mlp"])
    assert check(f, weights, lambda g: bl.residual_block_backward(
        saved, g, backward, weights["W_1"], weights["W_2"], norm_mixer=weights["norm_mixer"],
        norm_mlp=weights["norm_mlp"])[1]) <= BOUND


def test_residual_block_refuses_a_half_mlp_and_a_non_function():
    x, W = np.ones((3, 2)), np.eye(2)
    with pytest.raises(ValueError, match="W_1, W_2"):
        bl.residual_block(x, toy_mixer(W)[0], W, None)
    with pytest.raises(ValueError, match="mixer"):
        bl.residual_block(x, W)
    with pytest.raises(ValueError, match="saved"):
        bl.residual_block_backward({}, x, toy_mixer(W)[1])


# ----------------------------------------------------------------------------- dtype

F32_CALLS = {
    "linear": lambda a: bl.linear(a["x"], a["W"], a["b"]),
    "mlp": lambda a: bl.mlp(a["x"], a["W"], a["W"].T),
    "rms_norm": lambda a: bl.rms_norm(a["x"], a["b"]),
    "gated_rms_norm": lambda a: bl.gated_rms_norm(a["x"], a["x"], a["b"]),
    "l2_normalize": lambda a: bl.l2_normalize(a["x"]),
    "silu": lambda a: bl.silu(a["x"]),
    "sigmoid": lambda a: bl.sigmoid(a["x"]),
    "softplus": lambda a: bl.softplus(a["x"]),
    "sigmoid_log_gate": lambda a: bl.sigmoid_log_gate(a["x"]),
    "softplus_log_gate": lambda a: bl.softplus_log_gate(a["x"], a["b"], a["b"]),
    "inverse_softplus": lambda a: bl.inverse_softplus(np.abs(a["x"]) + 1),
    "embedding": lambda a: bl.embedding(np.array([0, 2]), a["W"]),
    "short_conv": lambda a: bl.short_conv(a["x"], a["conv"], initial_state=a["state"]),
    "short_conv_step": lambda a: bl.short_conv_step(a["x"][:, 0], a["conv"], initial_state=a["state"]),
}


@pytest.mark.parametrize("name", sorted(F32_CALLS))
def test_float32_in_float32_out_and_integers_give_float64(name):
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((2, 3, 3)), "W": rng.standard_normal((3, 3)),
              "b": rng.standard_normal(3), "conv": rng.standard_normal((3, 4)),
              "state": rng.standard_normal((2, 3, 3))}
    out32 = F32_CALLS[name]({k: v.astype(np.float32) for k, v in arrays.items()})
    out64 = F32_CALLS[name](arrays)
    for o32, o64 in zip(*(o if isinstance(o, tuple) else (o,) for o in (out32, out64))):
        assert o32.dtype == np.float32 and o64.dtype == np.float64
        np.testing.assert_allclose(o32, o64, rtol=1e-4, atol=1e-5)
    ints = F32_CALLS[name]({k: np.round(3 * v).astype(int) for k, v in arrays.items()})
    for o in ints if isinstance(ints, tuple) else (ints,):
        assert o.dtype == np.float64


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, name", [
    (lambda: bl.linear(np.ones((2, 3)), np.ones((4, 2))), "weight"),
    (lambda: bl.linear(np.ones((2, 3)), np.ones(3)), "weight"),
    (lambda: bl.linear(np.ones((2, 3)), np.ones((3, 2)), np.ones(3)), "bias"),
    (lambda: bl.linear(np.array(["a"]), np.ones((1, 1))), "x"),
    (lambda: bl.linear(np.array([np.nan]), np.ones((1, 1))), "x"),
    (lambda: bl.linear(np.zeros((2, 2)), np.array([[1.0, np.inf], [0.0, 1.0]])), "weight"),
    (lambda: bl.mlp(np.ones((2, 2)), np.ones((2, 3)), np.full((3, 2), np.nan)), "W_2"),
    (lambda: bl.embedding(np.array([1]), np.array([[0.0], [np.nan]])), "table"),
    (lambda: bl.rms_norm(np.ones((2, 3)), np.ones(2)), "weight"),
    (lambda: bl.rms_norm(np.ones(3), eps=0.0), "eps"),
    (lambda: bl.rms_norm(np.ones(3), eps=-1e-6), "eps"),
    (lambda: bl.rms_norm(np.float64(1.0)), "x"),
    (lambda: bl.gated_rms_norm(np.ones((2, 3)), np.ones((2, 4))), "z"),
    (lambda: bl.gated_rms_norm(np.ones((2, 3)), np.ones((3, 3))), "z"),
    (lambda: bl.gated_rms_norm(np.ones(3), np.ones(3), norm_before_gate="yes"), "norm_before_gate"),
    (lambda: bl.l2_normalize(np.ones(3), eps=float("inf")), "eps"),
    (lambda: bl.silu(np.array([1 + 2j])), "x"),
    (lambda: bl.mlp(np.ones((2, 3)), np.ones((4, 5)), np.ones((5, 3))), "W_1"),
    (lambda: bl.mlp(np.ones((2, 3)), np.ones((3, 5)), np.ones((4, 3))), "W_2"),
    (lambda: bl.embedding(np.array([0.5]), np.ones((3, 2))), "tokens"),
    (lambda: bl.embedding(np.array([3]), np.ones((3, 2))), "tokens"),
    (lambda: bl.embedding(np.array([-1]), np.ones((3, 2))), "tokens"),
    (lambda: bl.embedding(np.array([0]), np.ones(3)), "table"),
    (lambda: bl.short_conv(np.ones(3), np.ones((3, 4))), "x"),
    (lambda: bl.short_conv(np.ones((5, 3)), np.ones((2, 4))), "weight"),
    (lambda: bl.short_conv(np.ones((5, 3)), np.ones((3, 0))), "weight"),
    (lambda: bl.short_conv(np.ones((5, 3)), np.ones((3, 4)), initial_state=np.ones((4, 3))), "initial_state"),
    (lambda: bl.short_conv(np.ones((2, 5, 3)), np.ones((3, 4)), initial_state=np.ones((3, 3, 3))),
     "initial_state"),
    (lambda: bl.short_conv(np.ones((5, 3)), np.ones((3, 4)), bias=np.ones(2)), "bias"),
    (lambda: bl.short_conv_step(np.ones(3), np.ones((3, 4)), initial_state=np.ones((3, 2))), "initial_state"),
])
def test_bad_input_raises_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_overflow_from_finite_inputs_is_the_arithmetic_not_an_error():
    with np.errstate(over="ignore"):
        out = bl.linear(np.array([1e200, 1e200]), np.full((2, 1), 1e200))
    assert np.isinf(out).all()
    # a NaN in a row of the table that is not looked up does not matter
    assert bl.embedding(np.array([0]), np.array([[2.0], [np.nan]]))[0, 0] == 2.0
