"""Tests for fixedstate.layers: the shipped layers.

Properties from chapter 8: prefill-then-decode equals the prefill of the whole
sequence (float64 precision); each layer equals its equations written out token
by token in plain numpy (the wiring: projections, grouping of heads, scale,
gates, norms); a batch equals the loop over its items; float32 in gives
float32 out; the released KDA gate, unbounded below, is safe in the chunkwise
core; bad input raises ValueError naming the argument.
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _examples import examples

from fixedstate import blocks as bl
from fixedstate import layers as L
from fixedstate import ssm

FAST = examples(25)
leading_shapes = st.lists(st.integers(1, 2), min_size=0, max_size=2).map(tuple)


def rel(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


def sig(x):
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


def silu(x):
    return x * sig(x)


def conv_at(xs, w, t, b=None):
    """The short convolution at token t, written out: sum_j w[:, j] x_{t-K+1+j} (zeros before the start)."""
    K = w.shape[1]
    out = np.zeros(xs.shape[-1]) if b is None else b.copy()
    for j in range(K):
        s = t - K + 1 + j
        if s >= 0:
            out = out + w[:, j] * xs[s]
    return out


# ----------------------------------------------------------------------------- configurations

@st.composite
def gdn_configs(draw):
    hk = draw(st.integers(1, 2))
    return L.GatedDeltaNetConfig(d_model=draw(st.integers(2, 6)), n_heads=hk * draw(st.integers(1, 2)), n_key_heads=hk,
                                 d_k=draw(st.integers(1, 4)), d_v=draw(st.integers(1, 4)),
                                 conv_kernel=draw(st.integers(1, 4)), chunk_size=draw(st.integers(1, 5)))


@st.composite
def kda_configs(draw):
    return L.KDAConfig(d_model=draw(st.integers(2, 6)), n_heads=draw(st.integers(1, 3)), d_k=draw(st.integers(1, 4)),
                       d_v=draw(st.integers(1, 4)), gate_rank=draw(st.integers(1, 3)),
                       conv_kernel=draw(st.integers(1, 4)), chunk_size=draw(st.integers(1, 5)))


@st.composite
def mamba_configs(draw):
    return L.MambaConfig(d_model=draw(st.integers(2, 6)), d_inner=draw(st.integers(1, 6)),
                         d_state=draw(st.integers(1, 4)), dt_rank=draw(st.integers(1, 3)),
                         conv_kernel=draw(st.integers(1, 4)), conv_bias=draw(st.booleans()))


@st.composite
def mamba2_configs(draw):
    g = draw(st.integers(1, 2))
    return L.Mamba2Config(d_model=draw(st.integers(2, 6)), n_heads=g * draw(st.integers(1, 2)),
                          head_dim=draw(st.integers(1, 3)), d_state=draw(st.integers(1, 4)), n_groups=g,
                          conv_kernel=draw(st.integers(1, 4)), conv_bias=draw(st.booleans()),
                          chunk_size=draw(st.integers(1, 5)))


LAYERS = {
    "gdn": (gdn_configs, L.init_gated_deltanet, L.gated_deltanet, L.gated_deltanet_step),
    "kda": (kda_configs, L.init_kda, L.kda_layer, L.kda_layer_step),
    "mamba": (mamba_configs, L.init_mamba, L.mamba_block, L.mamba_block_step),
    "mamba2": (mamba2_configs, L.init_mamba2, L.mamba2_block, L.mamba2_block_step),
}


def small_params(name, seed=0):
    configs = {"gdn": L.GatedDeltaNetConfig(8, 4, 2, 3, 2, chunk_size=4),
               "kda": L.KDAConfig(8, 2, 3, 2, chunk_size=4),
               "mamba": L.MambaConfig(8, 6, 3, 2),
               "mamba2": L.Mamba2Config(8, 4, 2, 3, n_groups=2, chunk_size=4)}
    return LAYERS[name][1](configs[name], np.random.default_rng(seed))


# ----------------------------------------------------------------------------- prefill then decode

@pytest.mark.parametrize("name", sorted(LAYERS))
@FAST
@given(data=st.data(), lead=leading_shapes, T=st.integers(1, 14), seed=st.integers(0, 10**6))
def test_prefill_then_decode_equals_the_whole_prefill(name, data, lead, T, seed):
    configs, init, f, f_step = LAYERS[name]
    config = data.draw(configs())
    split = data.draw(st.integers(0, T))
    rng = np.random.default_rng(seed)
    params = init(config, rng)
    x = rng.standard_normal(lead + (T, config.d_model))
    y, cache = f(params, x)
    assert y.shape == x.shape
    if split:
        ys, c = f(params, x[..., :split, :])
        parts = [ys]
    else:
        c, parts = None, []
    for t in range(split, T):
        yt, c = f_step(params, x[..., t, :], c)
        parts.append(yt[..., None, :])
    assert rel(np.concatenate(parts, axis=-2), y) < 1e-12
    for key in ("conv", "state"):
        assert c[key].shape == cache[key].shape == lead + L.empty_cache(config)[key].shape
        assert np.max(np.abs(c[key] - cache[key]), initial=0) <= 1e-12 * np.max(np.abs(cache[key]), initial=1)


@pytest.mark.parametrize("name", sorted(LAYERS))
@FAST
@given(data=st.data(), T=st.integers(2, 14), seed=st.integers(0, 10**6))
def test_prefill_in_two_parts_equals_one_and_a_batch_equals_its_items(name, data, T, seed):
    configs, init, f, _ = LAYERS[name]
    config = data.draw(configs())
    split = data.draw(st.integers(1, T - 1))
    rng = np.random.default_rng(seed)
    params = init(config, rng)
    x = rng.standard_normal((3, T, config.d_model))
    y, cache = f(params, x)
    y1, c1 = f(params, x[:, :split])
    y2, c2 = f(params, x[:, split:], cache=c1)
    assert rel(np.concatenate([y1, y2], axis=1), y) < 1e-12
    for i in range(3):
        yi, ci = f(params, x[i])
        assert rel(yi, y[i]) < 1e-12 and rel(ci["state"] + 1, cache["state"][i] + 1) < 1e-12


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_float32_in_float32_out(name):
    params = small_params(name)
    p32 = {k: (v.astype(np.float32) if isinstance(v, np.ndarray) else v) for k, v in params.items()}
    x = np.random.default_rng(1).standard_normal((2, 7, 8))
    y, cache = LAYERS[name][2](p32, x.astype(np.float32))
    yt, cache = LAYERS[name][3](p32, x[:, 0].astype(np.float32), cache)
    assert y.dtype == yt.dtype == cache["conv"].dtype == cache["state"].dtype == np.float32
    y64, _ = LAYERS[name][2](params, x)
    assert rel(y, y64) < 1e-4


# ----------------------------------------------------------------------------- the equations, token by token

def gdn_reference(p, x):
    c = p["config"]
    r, sc = c.n_heads // c.n_key_heads, c.d_k ** -0.5
    qkv = np.concatenate([x @ p["W_q"], x @ p["W_k"], x @ p["W_v"]], axis=-1)
    S = np.zeros((c.n_heads, c.d_k, c.d_v))
    ys = []
    for t in range(len(x)):
        u = silu(conv_at(qkv, p["conv_weight"], t))
        q = u[:c.n_key_heads * c.d_k].reshape(c.n_key_heads, c.d_k)
        k = u[c.n_key_heads * c.d_k:2 * c.n_key_heads * c.d_k].reshape(c.n_key_heads, c.d_k)
        v = u[2 * c.n_key_heads * c.d_k:].reshape(c.n_heads, c.d_v)
        beta = sig(x[t] @ p["W_b"])
        g = np.exp(-np.exp(p["A_log"]) * softplus(x[t] @ p["W_a"] + p["dt_bias"]))
        z = (x[t] @ p["W_z"]).reshape(c.n_heads, c.d_v)
        outs = []
        for h in range(c.n_heads):
            qh = q[h // r] / np.sqrt(q[h // r] @ q[h // r] + 1e-6)
            kh = k[h // r] / np.sqrt(k[h // r] @ k[h // r] + 1e-6)
            S[h] = g[h] * S[h]
            S[h] = S[h] + beta[h] * np.outer(kh, v[h] - S[h].T @ kh)
            o = sc * S[h].T @ qh
            o = o / np.sqrt(np.mean(o * o) + c.norm_eps) * p["norm_weight"] * silu(z[h])
            outs.append(o)
        ys.append(np.concatenate(outs) @ p["W_o"])
    return np.array(ys)


def kda_reference(p, x):
    c = p["config"]
    qkv = np.concatenate([x @ p["W_q"], x @ p["W_k"], x @ p["W_v"]], axis=-1)
    S = np.zeros((c.n_heads, c.d_k, c.d_v))
    ys = []
    for t in range(len(x)):
        u = silu(conv_at(qkv, p["conv_weight"], t))
        q = u[:c.n_heads * c.d_k].reshape(c.n_heads, c.d_k)
        k = u[c.n_heads * c.d_k:2 * c.n_heads * c.d_k].reshape(c.n_heads, c.d_k)
        v = u[2 * c.n_heads * c.d_k:].reshape(c.n_heads, c.d_v)
        f = (x[t] @ p["W_f_down"] @ p["W_f_up"] + p["dt_bias"]).reshape(c.n_heads, c.d_k)
        gate = (x[t] @ p["W_g_down"] @ p["W_g_up"]).reshape(c.n_heads, c.d_v)
        beta = sig(x[t] @ p["W_b"])
        outs = []
        for h in range(c.n_heads):
            alpha = np.exp(-np.exp(p["A_log"][h]) * softplus(f[h]))          # one decay per key channel
            qh, kh = q[h] / np.sqrt(q[h] @ q[h] + 1e-6), k[h] / np.sqrt(k[h] @ k[h] + 1e-6)
            S[h] = alpha[:, None] * S[h]
            S[h] = S[h] + beta[h] * np.outer(kh, v[h] - S[h].T @ kh)
            o = S[h].T @ qh / np.sqrt(c.d_k)
            outs.append(o / np.sqrt(np.mean(o * o) + c.norm_eps) * p["norm_weight"] * sig(gate[h]))
        ys.append(np.concatenate(outs) @ p["W_o"])
    return np.array(ys)


def mamba_reference(p, x):
    c = p["config"]
    xz = x @ p["W_in"]
    us, zs = xz[:, :c.d_inner], xz[:, c.d_inner:]
    h = np.zeros((c.d_inner, c.d_state))
    A = -np.exp(p["A_log"])
    ys = []
    for t in range(len(x)):
        u = silu(conv_at(us, p["conv_weight"], t, p.get("conv_bias")))
        dbc = u @ p["W_x"]
        delta = softplus(dbc[:c.dt_rank] @ p["W_dt"] + p["dt_bias"])
        B, C = dbc[c.dt_rank:c.dt_rank + c.d_state], dbc[c.dt_rank + c.d_state:]
        h = np.exp(delta[:, None] * A) * h + (delta * u)[:, None] * B[None, :]
        y = h @ C + p["D"] * u
        ys.append((y * silu(zs[t])) @ p["W_out"])
    return np.array(ys)


def mamba2_reference(p, x):
    c = p["config"]
    H, P, N, G = c.n_heads, c.head_dim, c.d_state, c.n_groups
    proj = x @ p["W_in"]
    zs, xbc, dts = proj[:, :c.d_inner], proj[:, c.d_inner:c.d_inner + c.conv_dim], proj[:, c.d_inner + c.conv_dim:]
    S = np.zeros((H, N, P))
    ys = []
    for t in range(len(x)):
        u = silu(conv_at(xbc, p["conv_weight"], t, p.get("conv_bias")))
        xh = u[:c.d_inner].reshape(H, P)
        B = u[c.d_inner:c.d_inner + G * N].reshape(G, N)
        C = u[c.d_inner + G * N:].reshape(G, N)
        delta = softplus(dts[t] + p["dt_bias"])
        y = np.zeros((H, P))
        for h in range(H):
            grp = h // (H // G)
            S[h] = np.exp(-np.exp(p["A_log"][h]) * delta[h]) * S[h] + np.outer(B[grp], delta[h] * xh[h])
            y[h] = S[h].T @ C[grp] + p["D"][h] * xh[h]
        yg = (y.reshape(-1) * silu(zs[t])).reshape(G, -1)
        yg = yg / np.sqrt(np.mean(yg * yg, axis=-1, keepdims=True) + c.norm_eps)
        ys.append((yg.reshape(-1) * p["norm_weight"]) @ p["W_out"])
    return np.array(ys)


REFERENCES = {"gdn": gdn_reference, "kda": kda_reference, "mamba": mamba_reference, "mamba2": mamba2_reference}


@pytest.mark.parametrize("name", sorted(LAYERS))
@examples(15)
@given(data=st.data(), T=st.integers(1, 11), seed=st.integers(0, 10**6))
def test_each_layer_is_its_equations_token_by_token(name, data, T, seed):
    configs, init, f, _ = LAYERS[name]
    config = data.draw(configs())
    rng = np.random.default_rng(seed)
    params = init(config, rng)
    for key in ("norm_weight", "D"):          # not ones, so that a misplaced weight shows
        if key in params:
            params[key] = params[key] + rng.uniform(-0.5, 0.5, params[key].shape)
    x = rng.standard_normal((T, config.d_model))
    assert rel(f(params, x)[0], REFERENCES[name](params, x)) < 1e-10


# ----------------------------------------------------------------------------- gates, caches, budgets

def test_softplus_log_gate_is_the_shipped_gate_and_unbounded_below():
    raw = np.array([-30.0, 0.0, 3.0, 700.0])
    got = bl.softplus_log_gate(raw, np.log(2.0), 0.5)
    np.testing.assert_allclose(got, -2.0 * np.logaddexp(0, raw + 0.5), rtol=1e-15)
    assert np.all(got <= 0) and got[-1] < -1000


def test_kda_layer_is_safe_with_strongly_decaying_gates():
    """The released gate reaches log-decays far below the lower-bounded form's g_min; the chunkwise core is fine."""
    params = small_params("kda", seed=3)
    params["A_log"] = np.full_like(params["A_log"], 6.0)       # exp(6) ~ 403: log-decays of hundreds
    x = 3 * np.random.default_rng(4).standard_normal((2, 13, 8))
    with np.errstate(over="raise", invalid="raise"):
        y, cache = L.kda_layer(params, x)
    assert np.isfinite(y).all() and np.isfinite(cache["state"]).all()
    assert rel(y[0], kda_reference(params, x[0])) < 1e-10


@pytest.mark.parametrize("T, chunk_size", [(1, 4), (7, 4), (8, 4), (13, 64), (13, 3)])
def test_mamba2_core_equals_its_former_path_ssd_quadratic_chunk_by_chunk(T, chunk_size):
    """The Mamba-2 block's core is ssm.ssd_chunkwise; it used to loop ssm.ssd_quadratic chunk after chunk,
    carrying the state. On the block's shapes (a batch, heads, B and C repeated over groups of heads, D
    and a per head, an incoming state) the two agree to float64 precision."""
    rng = np.random.default_rng(T)
    H, P, N, groups = 4, 3, 5, 2
    u = rng.standard_normal((2, H, T, P))
    delta = bl.softplus(rng.standard_normal((2, H, T)))
    a = -np.exp(rng.standard_normal(H))
    B, C = (np.repeat(rng.standard_normal((2, groups, T, N)), H // groups, axis=-3) for _ in range(2))
    D, S = rng.standard_normal(H), rng.standard_normal((2, H, N, P))
    y, S_out = ssm.ssd_chunkwise(u, delta, a, B, C, D=D, initial_state=S, chunk_size=chunk_size)
    ys, S_old = [], S
    for t0 in range(0, T, chunk_size):
        sl = slice(t0, t0 + chunk_size)
        y_c, S_old = ssm.ssd_quadratic(u[..., sl, :], delta[..., sl], a, B[..., sl, :], C[..., sl, :], D=D,
                                       initial_state=S_old)
        ys.append(y_c)
    assert rel(y, np.concatenate(ys, axis=-2)) < 1e-12 and rel(S_out, S_old) < 1e-12


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_cache_numbers_count_the_arrays_of_the_cache(name):
    params = small_params(name)
    config = params["config"]
    _, cache = LAYERS[name][2](params, np.zeros((5, 8)))
    n = L.cache_numbers(config)
    assert n["state"] == cache["state"].size and n["conv"] == cache["conv"].size
    assert n["total"] == n["state"] + n["conv"]
    empty = L.empty_cache(config, (3,), dtype=np.float32)
    assert empty["state"].shape == (3,) + cache["state"].shape and empty["conv"].dtype == np.float32


def test_gated_deltanet_cache_numbers_agree_with_the_hybrid_cost_model():
    from fixedstate import costs, hybrid
    hc = hybrid.qwen35_9b_config()
    c = L.GatedDeltaNetConfig(hc.d_model, hc.n_linear_heads, hc.n_linear_key_heads, hc.linear_key_dim,
                              hc.linear_value_dim, conv_kernel=hc.conv_kernel_size)
    n = L.cache_numbers(c)
    assert n["conv"] == costs.conv_state_numbers(kernel_size=c.conv_kernel, conv_dim=c.conv_dim)
    assert n["conv"] * hc.bytes_per_element * hc.n_linear_layers == hybrid.stack_conv_state_bytes(hc)
    assert n["state"] * hc.state_bytes_per_element * hc.n_linear_layers == hybrid.stack_recurrent_state_bytes(hc)


# ----------------------------------------------------------------------------- validation

def test_configs_refuse_bad_fields():
    with pytest.raises(ValueError, match="n_key_heads"):
        L.GatedDeltaNetConfig(8, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="d_k"):
        L.KDAConfig(8, 2, 0, 4)
    with pytest.raises(ValueError, match="conv_bias"):
        L.MambaConfig(8, 4, 2, 1, conv_bias=1)
    with pytest.raises(ValueError, match="n_groups"):
        L.Mamba2Config(8, 3, 2, 2, n_groups=2)
    with pytest.raises(ValueError, match="norm_eps"):
        L.Mamba2Config(8, 2, 2, 2, norm_eps=0.0)
    with pytest.raises(ValueError, match="config"):
        L.init_kda(L.MambaConfig(8, 4, 2, 1), 0)
    with pytest.raises(ValueError, match="rng"):
        L.init_mamba(L.MambaConfig(8, 4, 2, 1), "seed")
    with pytest.raises(ValueError, match="dtype"):
        L.init_mamba(L.MambaConfig(8, 4, 2, 1), 0, dtype=np.int64)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layers_refuse_bad_input_naming_it(name):
    _, _, f, f_step = LAYERS[name]
    params = small_params(name)
    x = np.zeros((2, 5, 8))
    with pytest.raises(ValueError, match="x: expected shape"):
        f(params, np.zeros((2, 5, 7)))
    with pytest.raises(ValueError, match="x: expected shape"):
        f(params, np.zeros(8))
    with pytest.raises(ValueError, match="x: expected"):
        f(params, np.full((5, 8), np.nan))
    with pytest.raises(ValueError, match=r"params\['config'\]"):
        f({k: v for k, v in params.items() if k != "config"}, x)
    key = next(k for k in params if k != "config")
    with pytest.raises(ValueError, match="params: expected an entry"):
        f({k: v for k, v in params.items() if k != key}, x)
    with pytest.raises(ValueError, match=rf"params\['{key}'\]"):
        f({**params, key: params[key][..., :-1]}, x)
    _, cache = f(params, x)
    with pytest.raises(ValueError, match=r"cache\['state'\]"):
        f_step(params, x[:, 0], {"conv": cache["conv"], "state": cache["state"][..., :-1]})
    with pytest.raises(ValueError, match=r"cache\['conv'\]"):
        f_step(params, np.zeros((3, 8)), cache)
    with pytest.raises(ValueError, match="cache: expected a dict"):
        f_step(params, x[:, 0], {"state": cache["state"]})
    other = small_params("gdn" if name != "gdn" else "kda")
    with pytest.raises(ValueError, match=r"params\['config'\]"):
        f(other, x)


def test_mamba2_norm_before_gate_is_mamba_ssms_flag():
    """False (the default) gates first, rms_norm(y * silu(z)); True normalises first, rms_norm(y) * silu(z)."""
    config = L.Mamba2Config(d_model=8, n_heads=2, head_dim=3, d_state=4)
    params = L.init_mamba2(config, 5)
    x = np.random.default_rng(5).standard_normal((6, 8))
    flipped = dict(params, config=L.Mamba2Config(d_model=8, n_heads=2, head_dim=3, d_state=4, norm_before_gate=True))
    y, _ = L.mamba2_block(params, x)
    y_flipped, _ = L.mamba2_block(flipped, x)
    assert rel(y, y_flipped) > 1e-3                            # the order matters
    with pytest.raises(ValueError, match="norm_before_gate"):
        L.Mamba2Config(d_model=8, n_heads=2, head_dim=3, d_state=4, norm_before_gate="yes")


def test_helpers_refuse_bad_input():
    with pytest.raises(ValueError, match="config"):
        L.cache_numbers("gdn")
    with pytest.raises(ValueError, match="batch_shape"):
        L.empty_cache(L.MambaConfig(8, 4, 2, 1), (0,))
    with pytest.raises(ValueError, match="A_log, dt_bias"):
        bl.softplus_log_gate(np.zeros(3), np.zeros(2), 0.0)
    with pytest.raises(ValueError, match="config"):
        L.parameter_shapes(object())
    assert math.isclose(bl.softplus_log_gate(0.0, 0.0, 0.0), -math.log(2))


def test_qwen3_next_projections_are_unscrambled_group_by_group():
    c = L.GatedDeltaNetConfig(d_model=3, n_heads=4, n_key_heads=2, d_k=2, d_v=3)
    r = 2
    rows, ba = [], []
    for g in range(2):                      # a label per row: (kind, head, channel) as a number
        rows += [(0, g, i) for i in range(2)] + [(1, g, i) for i in range(2)]
        rows += [(2, g * r + h, i) for h in range(r) for i in range(3)]
        rows += [(3, g * r + h, i) for h in range(r) for i in range(3)]
        ba += [(4, g * r + h, 0) for h in range(r)] + [(5, g * r + h, 0) for h in range(r)]
    code = lambda kind, head, i: 100 * kind + 10 * head + i     # noqa: E731
    W = np.array([[code(*row) + 0.001 * j for j in range(3)] for row in rows])
    Wba = np.array([[code(*row) + 0.001 * j for j in range(3)] for row in ba])
    out = L.split_qwen3_next_projections(W, Wba, c)
    widths = {"W_q": (0, 2, 2), "W_k": (1, 2, 2), "W_v": (2, 4, 3), "W_z": (3, 4, 3), "W_b": (4, 4, 1),
              "W_a": (5, 4, 1)}
    for name, (kind, heads, width) in widths.items():
        want = np.array([[code(kind, h, i) + 0.001 * j for h in range(heads) for i in range(width)]
                         for j in range(3)])
        assert np.array_equal(out[name], want), name
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        L.split_qwen3_next_projections(W[:-1], Wba, c)


# ----------------------------------------------------------------------------- reference initialisations
# The laws of transformers 5.24's _init_weights and of the official repositories, checked by their stated
# properties (supports, deterministic values, Kolmogorov-Smirnov against the stated law); the comparison
# with transformers itself is tools/reference/compare_init.py, run in .venv-reference.

from scipy import stats  # noqa: E402

KS_P = 1e-4           # a wrong law of these sizes gives p far below this; the right one fails it once in 10^4


def _wide(name):
    return {"gdn": L.GatedDeltaNetConfig(64, 512, 32, 8, 4), "kda": L.KDAConfig(64, 256, 4, 4),
            "mamba": L.MambaConfig(128, 512, 8, 3), "mamba2": L.Mamba2Config(64, 512, 2, 8, n_groups=2)}[name]


def _step_is_mambas(dt_bias):
    """softplus(dt_bias) is log-uniform on [1e-3, 0.1] (floored at 1e-4, which it never reaches)."""
    delta = bl.softplus(dt_bias)
    assert np.all(delta >= L.DT_MIN * (1 - 1e-12)) and np.all(delta <= L.DT_MAX * (1 + 1e-12))
    u = (np.log(delta) - math.log(L.DT_MIN)) / (math.log(L.DT_MAX) - math.log(L.DT_MIN))
    assert stats.kstest(u.ravel(), "uniform").pvalue > KS_P


def _normal(a, std):
    assert stats.kstest(a.ravel() / std, "norm").pvalue > KS_P


def _uniform(a, bound):
    assert np.all(np.abs(a) <= bound)
    assert stats.kstest((a.ravel() + bound) / (2 * bound), "uniform").pvalue > KS_P


@pytest.mark.parametrize("name", LAYERS)
def test_init_schemes_refuse_an_unknown_one_and_the_book_is_the_default(name):
    _, init, _, _ = LAYERS[name]
    c = small_params(name)["config"]
    with pytest.raises(ValueError, match="scheme"):
        init(c, 0, scheme="pytorch")
    a, b = init(c, 3), init(c, 3, scheme="book")
    assert all(np.array_equal(a[k], b[k]) for k in L.parameter_shapes(c))
    for scheme in L.INIT_SCHEMES:
        p = init(c, 3, scheme=scheme, dtype=np.float32)
        assert {k: v.shape for k, v in p.items() if k != "config"} == L.parameter_shapes(c)
        assert all(p[k].dtype == np.float32 for k in L.parameter_shapes(c))


def test_init_gated_deltanet_as_qwen3_next_and_as_fla():
    c = _wide("gdn")
    p = L.init_gated_deltanet(c, 0, scheme="transformers")
    assert np.array_equal(p["dt_bias"], np.ones(c.n_heads))                      # Qwen3-Next: dt_bias = 1
    A = np.exp(p["A_log"])
    assert np.all((A >= 0.01) & (A <= 16)) and stats.kstest((A - 0.01) / 15.99, "uniform").pvalue > KS_P
    for name in ("W_q", "W_k", "W_v", "W_z", "W_a", "W_b", "W_o", "conv_weight"):
        _normal(p[name], L.INITIALIZER_RANGE["GatedDeltaNetConfig"])
    assert np.array_equal(p["norm_weight"], np.ones(c.d_v))
    q = L.init_gated_deltanet(c, 0, scheme="official")                           # fla: A ~ U(0, 16), Mamba's dt
    assert stats.kstest(np.exp(q["A_log"]) / 16, "uniform").pvalue > KS_P
    _step_is_mambas(q["dt_bias"])


def test_init_kda_as_kimi_linear():
    c = _wide("kda")
    for scheme in ("transformers", "official"):
        p = L.init_kda(c, 1, scheme=scheme)
        A = np.exp(p["A_log"])
        assert A.shape == (c.n_heads,) and np.all((A >= 1) & (A <= 16))
        assert stats.kstest((A - 1) / 15, "uniform").pvalue > KS_P
        assert p["dt_bias"].shape == (c.n_heads * c.d_k,)                         # one step per key channel
        _step_is_mambas(p["dt_bias"])
        for name in ("W_q", "W_f_down", "W_f_up", "W_g_up", "W_o", "conv_weight"):
            _normal(p[name], L.INITIALIZER_RANGE["KDAConfig"])


def test_init_mamba_is_s4d_real_with_mambas_step():
    c = _wide("mamba")
    p = L.init_mamba(c, 2, scheme="transformers")
    assert np.allclose(-np.exp(p["A_log"]), -np.arange(1, c.d_state + 1) * np.ones((c.d_inner, 1)), rtol=1e-15)
    assert np.array_equal(p["D"], np.ones(c.d_inner)) and np.array_equal(p["conv_bias"], np.zeros(c.d_inner))
    _step_is_mambas(p["dt_bias"])
    _uniform(p["W_dt"], c.dt_rank ** -0.5)
    _uniform(p["conv_weight"], c.conv_kernel ** -0.5)
    _uniform(p["W_out"], c.d_inner ** -0.5)
    _normal(p["W_in"], L.INITIALIZER_RANGE["MambaConfig"])


def test_init_mamba2_as_transformers_and_as_mamba_ssm():
    c = _wide("mamba2")
    p = L.init_mamba2(c, 4, scheme="transformers")
    assert np.allclose(np.exp(p["A_log"]), np.arange(1, c.n_heads + 1), rtol=1e-14)   # A = 1..H over the heads
    _step_is_mambas(p["dt_bias"])
    _uniform(p["conv_weight"], c.conv_kernel ** -0.5)
    _uniform(p["W_out"], c.d_inner ** -0.5)
    _normal(p["W_in"], L.INITIALIZER_RANGE["Mamba2Config"])
    q = L.init_mamba2(c, 4, scheme="official")                                    # mamba_ssm: A ~ U(1, 16)
    A = np.exp(q["A_log"])
    assert np.all((A >= 1) & (A <= 16)) and stats.kstest((A - 1) / 15, "uniform").pvalue > KS_P


@pytest.mark.parametrize("name", LAYERS)
def test_initial_decay_is_the_gate_at_a_zero_projection(name):
    p = small_params(name)
    c = p["config"]
    g0 = L.initial_decay(p)
    if name == "mamba":
        assert np.allclose(np.log(g0), -np.exp(p["A_log"]) * bl.softplus(p["dt_bias"])[:, None], rtol=1e-14)
    else:
        zero = np.zeros(p["dt_bias"].shape)
        A_log = np.repeat(p["A_log"], c.d_k) if name == "kda" else p["A_log"]
        assert np.allclose(np.log(g0), bl.softplus_log_gate(zero, A_log, p["dt_bias"]), rtol=1e-14)
    assert np.all((g0 > 0) & (g0 < 1))
    with pytest.raises(ValueError, match="params"):
        L.initial_decay({"config": None})
