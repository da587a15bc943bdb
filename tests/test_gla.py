"""Tests for fixedstate.gated_linear_attention (chapter "One family, one algorithm").

The chunkwise form equals the recurrence to float64 precision (any length, any
chunk size, decays strong enough to overflow a naive form); GLA with equal
channels is scalar-decay linear attention (Mamba-2's recurrence, RetNet's
parallel form); HGRN2 and mLSTM are GLA; precision and validation as in the
rest of the package.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import gated_linear_attention as gla
from fixedstate import kernels
from fixedstate import ssm

SETTINGS = examples(40)


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def inputs(rng, lead, T, d_k, d_v, *, low=0.3, dtype=np.float64):
    q = rng.standard_normal(lead + (T, d_k))
    k = rng.standard_normal(lead + (T, d_k))
    v = rng.standard_normal(lead + (T, d_v))
    log_gate = np.log(rng.uniform(low, 1.0, lead + (T, d_k)))
    return tuple(x.astype(dtype) for x in (q, k, v, log_gate))


def gla_loop(q, k, v, log_gate, S0=None, scale=1.0):
    """The equation as written, one sequence: S_t = Diag(exp(log_gate_t)) S_{t-1} + k_t v_t^T."""
    S = np.zeros((q.shape[1], v.shape[1])) if S0 is None else S0.copy()
    out = []
    for t in range(len(q)):
        S = np.diag(np.exp(log_gate[t])) @ S + np.outer(k[t], v[t])
        out.append(scale * S.T @ q[t])
    return np.array(out), S


@SETTINGS
@given(T=st.integers(1, 70), d_k=st.integers(1, 6), d_v=st.integers(1, 5), chunk=st.integers(1, 20),
       lead=st.sampled_from([(), (2,), (2, 3)]), with_init=st.booleans(), seed=st.integers(0, 10_000),
       scale=st.sampled_from([1.0, 0.5]))
def test_chunkwise_equals_recurrent(T, d_k, d_v, chunk, lead, with_init, seed, scale):
    rng = np.random.default_rng(seed)
    q, k, v, lg = inputs(rng, lead, T, d_k, d_v)
    S0 = rng.standard_normal(lead + (d_k, d_v)) if with_init else None
    o_r, S_r = gla.gla_recurrent(q, k, v, log_gate=lg, scale=scale, initial_state=S0)
    o_c, S_c = gla.gla_chunkwise(q, k, v, log_gate=lg, scale=scale, initial_state=S0, chunk_size=chunk)
    assert o_c.shape == lead + (T, d_v) and S_c.shape == lead + (d_k, d_v)
    assert rel_err(o_c, o_r) <= 1e-12 and rel_err(S_c, S_r) <= 1e-12


@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 8), (100, 64), (130, 48)])
def test_recurrent_equals_the_equation_as_written(T, chunk):
    rng = np.random.default_rng(T)
    q, k, v, lg = inputs(rng, (), T, 4, 3)
    S0 = rng.standard_normal((4, 3))
    o_ref, S_ref = gla_loop(q, k, v, lg, S0, scale=0.7)
    for fn, kw in ((gla.gla_recurrent, {}), (gla.gla_chunkwise, {"chunk_size": chunk})):
        o, S = fn(q, k, v, log_gate=lg, scale=0.7, initial_state=S0, **kw)
        assert rel_err(o, o_ref) <= 1e-12 and rel_err(S, S_ref) <= 1e-12


def test_steps_equal_the_scan():
    rng = np.random.default_rng(1)
    q, k, v, lg = inputs(rng, (2,), 9, 3, 2)
    o_r, S_r = gla.gla_recurrent(q, k, v, log_gate=lg)
    S = None
    for t in range(9):
        o, S = gla.gla_step(q[:, t], k[:, t], v[:, t], log_gate=lg[:, t], initial_state=S)
        assert rel_err(o, o_r[:, t]) <= 1e-14
    assert rel_err(S, S_r) <= 1e-14


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strong_decays_never_overflow(dtype):
    # log-decays down to -60 per token: within a chunk of 64 the cumulative log-decay reaches about -2000,
    # so exp(-b) (the naive 1/Gamma factorisation) would overflow in either precision
    rng = np.random.default_rng(3)
    T, d_k, d_v = 150, 5, 3
    q, k, v, _ = inputs(rng, (), T, d_k, d_v, dtype=dtype)
    lg = -rng.uniform(0.0, 60.0, (T, d_k)).astype(dtype)
    lg[:, 0] = -1e-3                                      # and one slow channel beside the fast ones
    naive = np.cumsum(lg[:64].astype(np.float64), axis=0)
    with np.errstate(over="ignore"):
        assert not np.all(np.isfinite(np.exp(-naive)))   # the naive form's 1/Gamma is out of range
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        o_c, S_c = gla.gla_chunkwise(q, k, v, log_gate=lg, chunk_size=64)
        o_r, S_r = gla.gla_recurrent(q, k, v, log_gate=lg)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert o_c.dtype == dtype and np.all(np.isfinite(o_c))
    assert rel_err(o_c, o_r) <= tol and rel_err(S_c, S_r) <= tol


def test_the_chunkwise_form_shares_kdas_decay_machinery():
    # GLA's chunkwise form builds its pair products with the function KDA's uses, not a copy
    assert gla.chunk_decays is kernels.chunk_decays
    assert kernels.chunk_decays.__module__ == "fixedstate.kernels"


@SETTINGS
@given(T=st.integers(1, 40), d_k=st.integers(1, 5), d_v=st.integers(1, 4), seed=st.integers(0, 10_000),
       chunk=st.integers(1, 16))
def test_equal_channels_are_scalar_decay_linear_attention(T, d_k, d_v, seed, chunk):
    # GLA with the same log-decay on every channel is Mamba-2's recurrence: q = C, k = B, v = delta x
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, d_v))
    delta = rng.uniform(0.05, 1.0, T)
    a = -rng.uniform(0.0, 3.0)
    B, C = rng.standard_normal((T, d_k)), rng.standard_normal((T, d_k))
    S0 = rng.standard_normal((d_k, d_v))
    y, S = ssm.ssd_recurrent(x, delta, a, B, C, initial_state=S0)
    lg = np.repeat((a * delta)[:, None], d_k, axis=1)
    for fn, kw in ((gla.gla_recurrent, {}), (gla.gla_chunkwise, {"chunk_size": chunk})):
        o, S_g = fn(C, B, delta[:, None] * x, log_gate=lg, initial_state=S0, **kw)
        assert rel_err(o, y) <= 1e-12 and rel_err(S_g, S) <= 1e-12


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_retnet_is_its_parallel_form(chunk):
    # RetNet's parallel retention: o_t = sum_{i<=t} gamma^{t-i} (q_t . k_i) v_i, one gamma per head
    rng = np.random.default_rng(5)
    H, T, d_k, d_v = 3, 41, 4, 3
    q, k, v = rng.standard_normal((H, T, d_k)), rng.standard_normal((H, T, d_k)), rng.standard_normal((H, T, d_v))
    log_decay = gla.retnet_log_decays(H)
    assert np.allclose(np.exp(log_decay), 1 - 2.0 ** (-5 - np.arange(H)))
    t = np.arange(T)
    decay = np.where(t[:, None] >= t[None, :], np.exp(log_decay[:, None, None] * (t[:, None] - t[None, :])), 0.0)
    want = (decay * (q @ k.swapaxes(-1, -2))) @ v
    o_r, S_r = gla.retnet_recurrent(q, k, v, log_gate=log_decay)
    o_c, S_c = gla.retnet_chunkwise(q, k, v, log_gate=log_decay, chunk_size=chunk)
    assert rel_err(o_r, want) <= 1e-12 and rel_err(o_c, want) <= 1e-12 and rel_err(S_c, S_r) <= 1e-12


def test_hgrn2_is_gla_with_the_key_tied_to_the_forget_gate():
    rng = np.random.default_rng(6)
    T, d, d_v = 30, 4, 3
    q, v = rng.standard_normal((T, d)), rng.standard_normal((T, d_v))
    f = rng.uniform(0.5, 0.99, (T, d))
    S = np.zeros((d, d_v))
    want = []
    for t in range(T):
        S = f[t][:, None] * S + np.outer(1 - f[t], v[t])         # h_t = f_t o h_{t-1} + (1 - f_t) i_t^T
        want.append(S.T @ q[t])
    for fn in (gla.hgrn2_recurrent, gla.hgrn2_chunkwise):
        o, S_out = fn(q, v, log_gate=np.log(f))
        assert rel_err(o, np.array(want)) <= 1e-12 and rel_err(S_out, S) <= 1e-12


def test_mlstm_without_stabiliser_is_its_cell():
    rng = np.random.default_rng(7)
    T, d_k, d_v = 25, 4, 3
    q, k, v = rng.standard_normal((T, d_k)), rng.standard_normal((T, d_k)) / 2, rng.standard_normal((T, d_v))
    log_f = np.log(rng.uniform(0.6, 1.0, T))
    log_i = rng.uniform(-2.0, 1.0, T)
    Cm, n = np.zeros((d_v, d_k)), np.zeros(d_k)                   # the paper's orientation: C is d_v x d_k
    want = []
    for t in range(T):
        f, i = np.exp(log_f[t]), np.exp(log_i[t])
        Cm = f * Cm + i * np.outer(v[t], k[t])
        n = f * n + i * k[t]
        want.append(Cm @ q[t] / max(abs(n @ q[t]), 1.0))
    o, S = gla.mlstm_recurrent(q, k, v, log_gate=log_f, log_input=log_i)
    assert rel_err(o, np.array(want)) <= 1e-12
    assert rel_err(S[:, :d_v], Cm.T) <= 1e-12 and rel_err(S[:, d_v], n) <= 1e-12


@pytest.mark.parametrize("form", ["step", "recurrent", "chunkwise", "retnet", "hgrn2", "mlstm"])
def test_float32_in_float32_out(form):
    rng = np.random.default_rng(8)
    q, k, v, lg = inputs(rng, (2,), 10, 3, 2, dtype=np.float32)
    calls = {
        "step": lambda: gla.gla_step(q[:, 0], k[:, 0], v[:, 0], log_gate=lg[:, 0], scale=0.5),
        "recurrent": lambda: gla.gla_recurrent(q, k, v, log_gate=lg, scale=0.5),
        "chunkwise": lambda: gla.gla_chunkwise(q, k, v, log_gate=lg, scale=0.5, chunk_size=4),
        "retnet": lambda: gla.retnet_chunkwise(q, k, v, log_gate=-0.1, chunk_size=4),
        "hgrn2": lambda: gla.hgrn2_chunkwise(q, v, log_gate=lg, chunk_size=4),
        "mlstm": lambda: gla.mlstm_recurrent(q, k, v, log_gate=lg[..., 0], log_input=lg[..., 1]),
    }
    o, S = calls[form]()
    assert o.dtype == np.float32 and S.dtype == np.float32


@pytest.mark.parametrize("name,call", [
    ("log_gate", lambda q, k, v, lg: gla.gla_chunkwise(q, k, v, log_gate=-lg)),
    ("log_gate", lambda q, k, v, lg: gla.gla_recurrent(q, k, v, log_gate=lg[..., 0])),
    ("log_gate", lambda q, k, v, lg: gla.gla_recurrent(q, k, v, log_gate=np.where(lg < -0.5, np.nan, lg))),
    ("k", lambda q, k, v, lg: gla.gla_recurrent(q, k[:, :2], v, log_gate=lg)),
    ("v", lambda q, k, v, lg: gla.gla_chunkwise(q, k, v[:5], log_gate=lg)),
    ("initial_state", lambda q, k, v, lg: gla.gla_chunkwise(q, k, v, log_gate=lg, initial_state=np.zeros((2, 3)))),
    ("chunk_size", lambda q, k, v, lg: gla.gla_chunkwise(q, k, v, log_gate=lg, chunk_size=0)),
    ("scale", lambda q, k, v, lg: gla.gla_recurrent(q, k, v, log_gate=lg, scale=np.inf)),
    ("log_gate", lambda q, k, v, lg: gla.retnet_recurrent(q, k, v, log_gate=0.1)),
    ("log_gate", lambda q, k, v, lg: gla.mlstm_recurrent(q, k, v, log_gate=np.ones(6), log_input=np.ones(6))),
    ("q", lambda q, k, v, lg: gla.gla_step(q.astype(complex), k, v, log_gate=lg)),
])
def test_bad_input_names_the_argument(name, call):
    rng = np.random.default_rng(0)
    q, k, v, lg = inputs(rng, (), 6, 3, 2)
    lg = lg - 0.01
    with pytest.raises(ValueError, match="^" + name):
        call(q, k, v, lg)


def test_leading_axes_broadcast():
    rng = np.random.default_rng(9)
    q, k, v, lg = inputs(rng, (2, 1), 7, 3, 2)
    k2 = rng.standard_normal((3, 7, 3))                    # (1 | 3) broadcast: (2, 3)
    o, S = gla.gla_chunkwise(q, k2, v, log_gate=lg, chunk_size=3)
    assert o.shape == (2, 3, 7, 2)
    for i in range(2):
        for j in range(3):
            o_ij, S_ij = gla.gla_recurrent(q[i, 0], k2[j], v[i, 0], log_gate=lg[i, 0])
            assert rel_err(o[i, j], o_ij) <= 1e-12 and rel_err(S[i, j], S_ij) <= 1e-12


@SETTINGS
@given(T=st.integers(1, 40), d_k=st.integers(1, 5), d_v=st.integers(1, 4), chunk=st.integers(1, 12),
       seed=st.integers(0, 10_000), with_init=st.booleans())
def test_the_reference_loop_and_the_one_chunk_reference_agree_with_the_fast_forms(T, d_k, d_v, chunk, seed,
                                                                                 with_init):
    rng = np.random.default_rng(seed)
    q, k, v, lg = inputs(rng, (), T, d_k, d_v, low=0.05)
    S0 = rng.standard_normal((d_k, d_v)) if with_init else None
    o_l, S_l = gla.gla_loop(q, k, v, log_gate=lg, scale=0.5, initial_state=S0)
    o_c, S_c = gla.gla_chunkwise(q, k, v, log_gate=lg, scale=0.5, initial_state=S0, chunk_size=chunk)
    assert rel_err(o_c, o_l) <= 1e-12 and rel_err(S_c, S_l) <= 1e-12
    S, outs = S0, []
    for start in range(0, T, chunk):                       # the one-chunk reference, chunk after chunk
        c = slice(start, start + chunk)
        o, S = gla.gla_chunk(q[c], k[c], v[c], log_gate=lg[c], scale=0.5, initial_state=S)
        outs.append(o)
    assert rel_err(np.concatenate(outs), o_l) <= 1e-12 and rel_err(S, S_l) <= 1e-12


def test_the_reference_functions_take_one_sequence():
    rng = np.random.default_rng(12)
    q, k, v, lg = inputs(rng, (2,), 5, 3, 2)
    with pytest.raises(ValueError, match="^q"):
        gla.gla_loop(q, k, v, log_gate=lg)
    with pytest.raises(ValueError, match="^initial_state"):
        gla.gla_chunk(q[0], k[0], v[0], log_gate=lg[0], initial_state=np.zeros((2, 3, 2)))
    with pytest.raises(ValueError, match="^q"):
        gla.gla_chunk(q[0, :0], k[0, :0], v[0, :0], log_gate=lg[0, :0])


@pytest.mark.parametrize("form", ["chunkwise", "chunk", "ssd_chunkwise"])
def test_every_exponent_is_at_most_zero(form, monkeypatch):
    # the property the chunkwise forms are built for, checked on every call of np.exp they make
    rng = np.random.default_rng(13)
    q, k, v, lg = inputs(rng, (), 70, 4, 3, low=0.01)
    arguments = []
    real_exp = np.exp

    def watched_exp(x, *args, **kwargs):
        arguments.append(float(np.max(x, initial=-np.inf)))
        return real_exp(x, *args, **kwargs)

    monkeypatch.setattr(np, "exp", watched_exp)
    if form == "chunkwise":
        gla.gla_chunkwise(q, k, v, log_gate=lg, chunk_size=16, initial_state=np.ones((4, 3)))
    elif form == "chunk":
        gla.gla_chunk(q[:16], k[:16], v[:16], log_gate=lg[:16], initial_state=np.ones((4, 3)))
    else:
        ssm.ssd_chunkwise(v, np.ones(70), -3.0, q, k, chunk_size=16, initial_state=np.ones((4, 3)))
    assert arguments and max(arguments) <= 0.0



# --------------------------------------------------------------------------- mLSTM, chunkwise with the stabiliser

def _mlstm_inputs(rng, lead, T, d_k, d_v, *, input_scale=1.0, positive=False):
    q, k = rng.standard_normal((2,) + lead + (T, d_k))
    if positive:
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    v = rng.standard_normal(lead + (T, d_v))
    log_gate = np.log(rng.uniform(0.5, 1.0, lead + (T,)))
    log_input = input_scale * rng.standard_normal(lead + (T,))
    return q, k, v, log_gate, log_input


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@examples(40)
@given(T=st.integers(1, 40), d_k=st.integers(1, 5), d_v=st.integers(1, 4), chunk=st.integers(1, 17),
       lead=st.sampled_from([(), (2,), (2, 3)]), with_init=st.booleans(), seed=st.integers(0, 10_000))
def test_mlstm_chunkwise_equals_the_recurrence(T, d_k, d_v, chunk, lead, with_init, seed):
    rng = np.random.default_rng(seed)
    q, k, v, lf, li = _mlstm_inputs(rng, lead, T, d_k, d_v)
    S0 = rng.standard_normal(lead + (d_k, d_v + 1)) if with_init else None
    o_ref, S_ref = gla.mlstm_recurrent(q, k, v, log_gate=lf, log_input=li, initial_state=S0, scale=0.5)
    o, (S, m) = gla.mlstm_chunkwise(q, k, v, log_gate=lf, log_input=li, initial_state=S0, scale=0.5,
                                    chunk_size=chunk)
    assert _rel(o, o_ref) <= 1e-12
    assert _rel(np.exp(m)[..., None, None] * S, S_ref) <= 1e-12
    assert m.shape == lead and S.shape == lead + (d_k, d_v + 1)


def test_mlstm_chunkwise_carries_its_stabilised_state_across_calls():
    rng = np.random.default_rng(4)
    q, k, v, lf, li = _mlstm_inputs(rng, (2,), 50, 4, 3, input_scale=30.0)
    o_all, (S_all, m_all) = gla.mlstm_chunkwise(q, k, v, log_gate=lf, log_input=li, chunk_size=8)
    o1, state = gla.mlstm_chunkwise(q[:, :21], k[:, :21], v[:, :21], log_gate=lf[:, :21], log_input=li[:, :21],
                                    chunk_size=8)
    o2, (S2, m2) = gla.mlstm_chunkwise(q[:, 21:], k[:, 21:], v[:, 21:], log_gate=lf[:, 21:], log_input=li[:, 21:],
                                       initial_state=state, chunk_size=5)
    assert _rel(np.concatenate([o1, o2], axis=1), o_all) <= 1e-12
    assert np.allclose(m2, m_all, rtol=1e-13, atol=0) and _rel(S2, S_all) <= 1e-12


def test_mlstm_large_input_gates_overflow_only_without_the_stabiliser():
    rng = np.random.default_rng(5)
    q, k, v, lf, li = _mlstm_inputs(rng, (), 200, 8, 4, positive=True)     # a normaliser read with no cancellation
    li = rng.uniform(50.0, 300.0, 200)                         # e^300 fits float64, not float32
    o64, _ = gla.mlstm_recurrent(q, k, v, log_gate=lf, log_input=li)
    assert np.all(np.isfinite(o64))
    f32 = lambda x: x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        try:
            o_rec32, _ = gla.mlstm_recurrent(f32(q), f32(k), f32(v), log_gate=f32(lf), log_input=f32(li))
            overflowed = not np.all(np.isfinite(o_rec32))
        except ValueError:                                     # the input gate e^{log i} itself is inf
            overflowed = True
    assert overflowed
    with np.errstate(over="raise", invalid="raise", divide="raise"):      # the stabilised form raises no warning
        o32, (S32, m32) = gla.mlstm_chunkwise(f32(q), f32(k), f32(v), log_gate=f32(lf), log_input=f32(li),
                                              chunk_size=32)
    assert o32.dtype == np.float32 and np.all(np.isfinite(o32)) and np.all(np.isfinite(S32))
    # against float64 on the same (float32-rounded) inputs: e^{log i} amplifies a rounding of log i by |log i|
    o64r, _ = gla.mlstm_recurrent(*(f32(x).astype(np.float64) for x in (q, k, v)), log_gate=f32(lf).astype(float),
                                  log_input=f32(li).astype(float))
    assert _rel(o32, o64r) <= 2e-4


def test_mlstm_chunkwise_is_exact_where_even_float64_overflows():
    # with q, k > 0 the normaliser's read is far above 1, so the output does not change when every
    # input gate is multiplied by the same factor: e^2000 gives the outputs of e^10
    rng = np.random.default_rng(6)
    q, k, v, lf, li = _mlstm_inputs(rng, (), 120, 4, 3, positive=True)
    o_small, _ = gla.mlstm_chunkwise(q, k, v, log_gate=lf, log_input=li + 10.0, chunk_size=16)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        o_big, (S, m) = gla.mlstm_chunkwise(q, k, v, log_gate=lf, log_input=li + 2000.0, chunk_size=16)
    assert _rel(o_big, o_small) <= 1e-12 and m > 1000 and np.all(np.isfinite(S))
    # without the stabiliser: input gates e^700 to e^709 are finite in float64, the state they add up is not
    with np.errstate(over="ignore", invalid="ignore"):
        o_rec, _ = gla.mlstm_recurrent(q, k, v, log_gate=np.full(120, -1e-3),
                                       log_input=np.random.default_rng(7).uniform(700.0, 709.0, 120))
    assert not np.all(np.isfinite(o_rec))
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        o, _ = gla.mlstm_chunkwise(q, k, v, log_gate=np.full(120, -1e-3),
                                   log_input=np.random.default_rng(7).uniform(700.0, 709.0, 120))
    assert np.all(np.isfinite(o))


@pytest.mark.parametrize("kw,name", [
    ({"log_gate": np.full(5, 0.1)}, "log_gate"),
    ({"log_input": np.zeros(4)}, "log_input"),
    ({"initial_state": np.zeros((3, 2))}, "initial_state"),
    ({"initial_state": (np.zeros((3, 3)), 0.0, 1.0)}, "initial_state"),
    ({"initial_state": (np.zeros((3, 3)), np.nan)}, "initial_state"),
    ({"chunk_size": 0}, "chunk_size"),
])
def test_mlstm_chunkwise_bad_input_names_the_argument(kw, name):
    rng = np.random.default_rng(0)
    args = dict(log_gate=np.zeros(5), log_input=np.zeros(5))
    args.update(kw)
    with pytest.raises(ValueError, match=rf"^{name}"):
        gla.mlstm_chunkwise(rng.standard_normal((5, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2)),
                            **args)
