"""Tests for fixedstate.delta_family: DeltaProduct, RWKV-7, Longhorn, parity.

Reductions (DeltaProduct with n_h = 1 is DeltaNet and Gated DeltaNet; RWKV-7
with the right choices is the gated delta rule, with no rank-one term it is
GLA, in the recurrent and the chunkwise form), form equalities (chunkwise =
recurrent, step = scan, each equal to the
transition written as a matrix), the parity tracker exact on long random
strings, and the diagonal positive-decay layer's limit.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import delta_family as df
from fixedstate import delta_rule as dr
from fixedstate import gated_linear_attention as gla

SETTINGS = examples(40)


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def product_inputs(rng, lead, T, n_h, d_k, d_v, *, beta_max=2.0, unit=True):
    q = rng.standard_normal(lead + (T, d_k))
    k = rng.standard_normal(lead + (T, n_h, d_k))
    if unit:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal(lead + (T, n_h, d_v))
    beta = rng.uniform(0.0, beta_max, lead + (T, n_h))
    log_gate = np.log(rng.uniform(0.5, 1.0, lead + (T,)))
    return q, k, v, beta, log_gate


# --------------------------------------------------------------------------- DeltaProduct

@SETTINGS
@given(T=st.integers(1, 30), d_k=st.integers(1, 5), d_v=st.integers(1, 4), lead=st.sampled_from([(), (2,), (2, 2)]),
       gated=st.booleans(), with_init=st.booleans(), seed=st.integers(0, 10_000), chunk=st.integers(1, 16))
def test_one_householder_step_is_deltanet(T, d_k, d_v, lead, gated, with_init, seed, chunk):
    rng = np.random.default_rng(seed)
    q, k, v, beta, lg = product_inputs(rng, lead, T, 1, d_k, d_v, beta_max=1.0)
    S0 = rng.standard_normal(lead + (d_k, d_v)) if with_init else None
    if gated:
        o_ref, S_ref = dr.gated_delta_rule_recurrent(q, k[..., 0, :], v[..., 0, :], beta=beta[..., 0], log_gate=lg,
                                                     initial_state=S0)
    else:
        lg = None
        o_ref, S_ref = dr.delta_rule_recurrent(q, k[..., 0, :], v[..., 0, :], beta=beta[..., 0], initial_state=S0)
    o, S = df.deltaproduct_recurrent(q, k, v, beta=beta, log_gate=lg, initial_state=S0)
    assert rel_err(o, o_ref) <= 1e-13 and rel_err(S, S_ref) <= 1e-13
    o, S = df.deltaproduct_chunkwise(q, k, v, beta=beta, log_gate=lg, initial_state=S0, chunk_size=chunk)
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(S, S_ref) <= 1e-12


@SETTINGS
@given(T=st.integers(1, 30), n_h=st.integers(1, 4), d_k=st.integers(1, 5), d_v=st.integers(1, 4),
       lead=st.sampled_from([(), (3,)]), gated=st.booleans(), with_init=st.booleans(), seed=st.integers(0, 10_000),
       chunk=st.integers(1, 24))
def test_chunkwise_equals_recurrent(T, n_h, d_k, d_v, lead, gated, with_init, seed, chunk):
    rng = np.random.default_rng(seed)
    q, k, v, beta, lg = product_inputs(rng, lead, T, n_h, d_k, d_v)
    lg = lg if gated else None
    S0 = rng.standard_normal(lead + (d_k, d_v)) if with_init else None
    o_r, S_r = df.deltaproduct_recurrent(q, k, v, beta=beta, log_gate=lg, initial_state=S0, scale=0.5)
    o_c, S_c = df.deltaproduct_chunkwise(q, k, v, beta=beta, log_gate=lg, initial_state=S0, scale=0.5,
                                         chunk_size=chunk)
    assert o_c.shape == lead + (T, d_v) and S_c.shape == lead + (d_k, d_v)
    assert rel_err(o_c, o_r) <= 1e-12 and rel_err(S_c, S_r) <= 1e-12


@pytest.mark.parametrize("n_h", [1, 2, 3])
def test_the_transition_is_a_product_of_householder_factors(n_h):
    # S_t = H_{n_h} ... H_1 g_t S_{t-1} + (writes), H_j = I - beta_j k_j k_j^T, from the erase factors of chapter 3
    rng = np.random.default_rng(n_h)
    T, d_k, d_v = 6, 4, 3
    q, k, v, beta, lg = product_inputs(rng, (), T, n_h, d_k, d_v)
    S0 = rng.standard_normal((d_k, d_v))
    o, S = df.deltaproduct_recurrent(q, k, v, beta=beta, log_gate=lg, initial_state=S0)
    state = S0
    for t in range(T):
        M, write = np.exp(lg[t]) * np.eye(d_k), np.zeros((d_k, d_v))
        for j in range(n_h):
            H = np.eye(d_k) - beta[t, j] * np.outer(k[t, j], k[t, j])
            M, write = H @ M, H @ write + beta[t, j] * np.outer(k[t, j], v[t, j])
        state = M @ state + write
        assert rel_err(o[t], state.T @ q[t]) <= 1e-12
        assert np.linalg.matrix_rank(M - np.exp(lg[t]) * np.eye(d_k)) <= n_h   # identity plus rank n_h
    assert rel_err(S, state) <= 1e-12


def test_steps_equal_the_scan():
    rng = np.random.default_rng(2)
    q, k, v, beta, lg = product_inputs(rng, (2,), 8, 2, 3, 2)
    o_r, S_r = df.deltaproduct_recurrent(q, k, v, beta=beta, log_gate=lg)
    S = None
    for t in range(8):
        o, S = df.deltaproduct_step(q[:, t], k[:, t], v[:, t], beta=beta[:, t], log_gate=lg[:, t], initial_state=S)
        assert rel_err(o, o_r[:, t]) <= 1e-14
    assert rel_err(S, S_r) <= 1e-14


def test_beta_up_to_two_is_accepted_and_beyond_refused():
    rng = np.random.default_rng(3)
    q, k, v, beta, _ = product_inputs(rng, (), 5, 2, 3, 2)
    beta[:] = 2.0
    df.deltaproduct_recurrent(q, k, v, beta=beta)
    for bad in (2.01, -0.1, np.nan):
        beta[1, 1] = bad
        for fn in (df.deltaproduct_recurrent, df.deltaproduct_chunkwise):
            with pytest.raises(ValueError, match="^beta"):
                fn(q, k, v, beta=beta)


@pytest.mark.parametrize("name,kw", [
    ("k", dict(k=np.ones((5, 3)))),                          # no n_h axis
    ("v", dict(v=np.ones((5, 3, 2)))),                       # n_h differs from k's
    ("beta", dict(beta=np.ones((5,)))),
    ("log_gate", dict(log_gate=np.full(5, 0.1))),
    ("log_gate", dict(log_gate=np.zeros((5, 2)))),
    ("initial_state", dict(initial_state=np.zeros((2, 3)))),
    ("scale", dict(scale="2")),
    ("chunk_size", dict(chunk_size=0)),
])
def test_deltaproduct_bad_input_names_the_argument(name, kw):
    rng = np.random.default_rng(4)
    q, k, v, beta, _ = product_inputs(rng, (), 5, 2, 3, 2)
    args = dict(q=q, k=k, v=v, beta=beta, log_gate=None)
    args.update(kw)
    chunk = {"chunk_size": args.pop("chunk_size")} if "chunk_size" in args else {}
    with pytest.raises(ValueError, match="^" + name):
        df.deltaproduct_chunkwise(args.pop("q"), args.pop("k"), args.pop("v"), **args, **chunk)


# --------------------------------------------------------------------------- RWKV-7

@SETTINGS
@given(T=st.integers(1, 25), d_k=st.integers(1, 5), d_v=st.integers(1, 4), seed=st.integers(0, 10_000),
       with_init=st.booleans())
def test_rwkv7_with_the_right_choices_is_the_gated_delta_rule(T, d_k, d_v, seed, with_init):
    # log_gate = log g on every channel, a = -k, b = g beta k, key beta k
    rng = np.random.default_rng(seed)
    q, k, v, beta, lg = product_inputs(rng, (2,), T, 1, d_k, d_v, beta_max=1.0)
    k, v, beta = k[..., 0, :], v[..., 0, :], beta[..., 0]
    S0 = rng.standard_normal((2, d_k, d_v)) if with_init else None
    o_ref, S_ref = dr.gated_delta_rule_recurrent(q, k, v, beta=beta, log_gate=lg, initial_state=S0)
    g = np.exp(lg)[..., None]
    o, S = df.rwkv7_recurrent(q, beta[..., None] * k, v, log_gate=np.broadcast_to(lg[..., None], k.shape), a=-k,
                              b=g * beta[..., None] * k, initial_state=S0)
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(S, S_ref) <= 1e-12


def test_rwkv7_is_the_papers_update_transposed():
    # the paper: S_t = S_{t-1} (diag(w_t) - kappa_t^T (a_t o kappa_t)) + v_t^T k~_t, S of shape (d_v, d_k),
    # read out as S_t r_t; kappa the normalised removal key, a the in-context learning rate in (0, 1)^{d_k}
    rng = np.random.default_rng(6)
    T, d_k, d_v = 15, 4, 3
    r, k_rep = rng.standard_normal((2, T, d_k))
    v = rng.standard_normal((T, d_v))
    kappa = rng.standard_normal((T, d_k))
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    iclr = rng.uniform(0.0, 1.0, (T, d_k))
    w = rng.uniform(0.4, 1.0, (T, d_k))
    S_paper = np.zeros((d_v, d_k))
    want = []
    for t in range(T):
        S_paper = S_paper @ (np.diag(w[t]) - np.outer(kappa[t], iclr[t] * kappa[t])) + np.outer(v[t], k_rep[t])
        want.append(S_paper @ r[t])
    o, S = df.rwkv7_recurrent(r, k_rep, v, log_gate=np.log(w), a=-kappa, b=kappa * iclr)
    assert rel_err(o, np.array(want)) <= 1e-12 and rel_err(S, S_paper.T) <= 1e-12
    S1 = None
    for t in range(T):
        o1, S1 = df.rwkv7_step(r[t], k_rep[t], v[t], log_gate=np.log(w[t]), a=-kappa[t], b=kappa[t] * iclr[t],
                               initial_state=S1)
        assert rel_err(o1, o[t]) <= 1e-14


_RWKV7_BAD = [("log_gate", dict(log_gate=np.full((4, 3), 0.5))), ("a", dict(a=np.ones((4, 2)))), ("b", dict(b=np.ones(3))),
              ("v", dict(v=np.ones((3, 2)))), ("log_gate", dict(log_gate=np.full((4, 3), np.nan))),
              ("initial_state", dict(initial_state=np.ones((2, 3))))]
_CHUNK_BAD = [("chunk_size", dict(chunk_size=0)), ("chunk_size", dict(chunk_size=2.5)),
              ("chunk_size", dict(chunk_size=True))]


@pytest.mark.parametrize("form,name,kw", [("recurrent",) + c for c in _RWKV7_BAD]
                         + [("chunkwise",) + c for c in _RWKV7_BAD + _CHUNK_BAD])
def test_rwkv7_bad_input_names_the_argument(form, name, kw):
    args = dict(q=np.ones((4, 3)), k=np.ones((4, 3)), v=np.ones((4, 2)), log_gate=-np.ones((4, 3)),
                a=np.ones((4, 3)), b=np.ones((4, 3)))
    args.update(kw)
    fn = df.rwkv7_recurrent if form == "recurrent" else df.rwkv7_chunkwise
    with pytest.raises(ValueError, match="^" + name):
        fn(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def rwkv7_inputs(rng, lead, T, d_k, d_v, *, like_rwkv7=True, log_w_min=None):
    """Random RWKV-7 arguments. RWKV-7-like: decays w = exp(-e^{-1/2} sigmoid(z)) in [0.545, 1] as in
    the paper, a = -kappa_hat (unit removal key), b = kappa_hat o eta (learning rate eta in [0, 1]);
    generic: a, b independent with entries of size about 1/sqrt(d_k), decays in [0.3, 1]."""
    q, k = rng.standard_normal((2,) + lead + (T, d_k))
    v = rng.standard_normal(lead + (T, d_v))
    if like_rwkv7:
        kappa = rng.standard_normal(lead + (T, d_k))
        kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
        a, b = -kappa, kappa * rng.uniform(0.0, 1.0, lead + (T, d_k))
        log_gate = -np.exp(-0.5) / (1.0 + np.exp(-rng.standard_normal(lead + (T, d_k))))
    else:
        a, b = rng.standard_normal((2,) + lead + (T, d_k)) / np.sqrt(d_k)
        log_gate = np.log(rng.uniform(0.3, 1.0, lead + (T, d_k)))
    if log_w_min is not None:
        log_gate = rng.uniform(log_w_min, 0.0, lead + (T, d_k))
    return q, k, v, dict(log_gate=log_gate, a=a, b=b)


@examples(150)
@given(T=st.integers(1, 140), d_k=st.integers(1, 6), d_v=st.integers(1, 5),
       lead=st.sampled_from([(), (2,), (2, 3)]), chunk=st.sampled_from([1, 3, 8, 16, 64]),
       with_init=st.booleans(), like_rwkv7=st.booleans(), seed=st.integers(0, 10_000))
def test_rwkv7_chunkwise_equals_recurrent(T, d_k, d_v, lead, chunk, with_init, like_rwkv7, seed):
    rng = np.random.default_rng(seed)
    q, k, v, kw = rwkv7_inputs(rng, lead, T, d_k, d_v, like_rwkv7=like_rwkv7)
    S0 = rng.standard_normal(lead + (d_k, d_v)) if with_init else None
    o_ref, S_ref = df.rwkv7_recurrent(q, k, v, **kw, scale=0.7, initial_state=S0)
    o, S = df.rwkv7_chunkwise(q, k, v, **kw, scale=0.7, initial_state=S0, chunk_size=chunk)
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(S, S_ref) <= 1e-12


def test_rwkv7_chunkwise_ignores_how_the_sequence_is_cut():
    # one sequence of 4 chunks, then the same sequence in two calls carrying the state
    rng = np.random.default_rng(21)
    q, k, v, kw = rwkv7_inputs(rng, (), 64, 5, 3)
    o, S = df.rwkv7_chunkwise(q, k, v, **kw, chunk_size=16)
    half = {name: x[:24] for name, x in kw.items()}
    rest = {name: x[24:] for name, x in kw.items()}
    o1, S1 = df.rwkv7_chunkwise(q[:24], k[:24], v[:24], **half, chunk_size=16)
    o2, S2 = df.rwkv7_chunkwise(q[24:], k[24:], v[24:], **rest, chunk_size=16, initial_state=S1)
    assert rel_err(np.concatenate([o1, o2]), o) <= 1e-13 and rel_err(S2, S) <= 1e-13


@pytest.mark.parametrize("like_rwkv7", [True, False])
@pytest.mark.parametrize("chunk", [8, 64])
def test_rwkv7_chunkwise_in_float32_agrees_to_float32_precision(like_rwkv7, chunk):
    rng = np.random.default_rng(12)
    q, k, v, kw = rwkv7_inputs(rng, (2,), 300, 16, 8, like_rwkv7=like_rwkv7)
    S0 = rng.standard_normal((2, 16, 8))
    o64, S64 = df.rwkv7_recurrent(q, k, v, **kw, initial_state=S0)
    f32 = lambda x: x.astype(np.float32)
    kw32 = {name: f32(x) for name, x in kw.items()}
    o32, S32 = df.rwkv7_chunkwise(f32(q), f32(k), f32(v), **kw32, initial_state=f32(S0), chunk_size=chunk)
    assert o32.dtype == np.float32 and S32.dtype == np.float32
    assert rel_err(o32, o64) <= 2e-6 and rel_err(S32, S64) <= 2e-6


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rwkv7_chunkwise_survives_strong_decay_over_long_sequences(dtype):
    # log-decays down to -20 per token: across a chunk of 64 the cumulative decay reaches about
    # e^{-640}, below float64's smallest number; its inverse, which the form never builds, would overflow
    rng = np.random.default_rng(13)
    q, k, v, kw = rwkv7_inputs(rng, (), 2048, 8, 4, log_w_min=-20.0)
    cast = lambda x: x.astype(dtype)
    kw = {name: cast(x) for name, x in kw.items()}
    o_ref, S_ref = df.rwkv7_recurrent(cast(q), cast(k), cast(v), **kw)
    o, S = df.rwkv7_chunkwise(cast(q), cast(k), cast(v), **kw, chunk_size=64)
    assert np.isfinite(o).all() and np.isfinite(S).all()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(o, o_ref) <= tol and rel_err(S, S_ref) <= tol


def test_rwkv7_chunkwise_with_decay_zero_and_no_rank_one_term_forgets_everything():
    # log_gate = -800 and b = 0 on a token: w = exp(-800) is exactly 0 in float64 and the rank-one term is
    # off, so the token wipes the state before its own write and what follows does not depend on anything
    # earlier (a form dividing by cumulative decays would divide by zero here)
    rng = np.random.default_rng(14)
    q, k, v, kw = rwkv7_inputs(rng, (), 40, 4, 3)
    kw["log_gate"][20] = -800.0
    kw["b"][20] = 0.0
    assert np.exp(kw["log_gate"][20]).max() == 0.0
    o, S = df.rwkv7_chunkwise(q, k, v, **kw, chunk_size=16)
    later = {name: x[20:] for name, x in kw.items()}
    o_late, S_late = df.rwkv7_recurrent(q[20:], k[20:], v[20:], **later)
    assert np.isfinite(o).all()
    assert rel_err(o[20:], o_late) <= 1e-13 and rel_err(S, S_late) <= 1e-13


@SETTINGS
@given(T=st.integers(1, 40), d_k=st.integers(1, 5), d_v=st.integers(1, 4), seed=st.integers(0, 10_000),
       with_init=st.booleans(), chunk=st.sampled_from([1, 3, 8, 16]))
def test_rwkv7_chunkwise_with_the_right_choices_is_the_gated_delta_rule(T, d_k, d_v, seed, with_init, chunk):
    rng = np.random.default_rng(seed)
    q, k, v, beta, lg = product_inputs(rng, (2,), T, 1, d_k, d_v, beta_max=1.0)
    k, v, beta = k[..., 0, :], v[..., 0, :], beta[..., 0]
    S0 = rng.standard_normal((2, d_k, d_v)) if with_init else None
    o_ref, S_ref = dr.gated_delta_rule_chunkwise(q, k, v, beta=beta, log_gate=lg, initial_state=S0, chunk_size=chunk)
    g = np.exp(lg)[..., None]
    o, S = df.rwkv7_chunkwise(q, beta[..., None] * k, v, log_gate=np.broadcast_to(lg[..., None], k.shape), a=-k,
                              b=g * beta[..., None] * k, initial_state=S0, chunk_size=chunk)
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(S, S_ref) <= 1e-12


# RWKV-7 without its rank-one term (a = b = 0) is GLA: one test for both forms, each against GLA's same form
# (the recurrent forms on one sequence without an initial state, the chunkwise forms on a batch with one).
@pytest.mark.parametrize("form, chunk", [("recurrent", None), ("chunkwise", 1), ("chunkwise", 5),
                                         ("chunkwise", 16)])
def test_rwkv7_without_the_rank_one_term_is_gla(form, chunk):
    rng = np.random.default_rng(5 if chunk is None else 15)
    lead, T = ((), 12) if chunk is None else ((2,), 37)
    d_k, d_v = 4, 3
    q, k = rng.standard_normal((2,) + lead + (T, d_k))
    v = rng.standard_normal(lead + (T, d_v))
    S0 = None if chunk is None else rng.standard_normal(lead + (d_k, d_v))
    lw = np.log(rng.uniform(0.3, 1.0, lead + (T, d_k)))
    zero = np.zeros(lead + (T, d_k))
    extra = {} if chunk is None else {"chunk_size": chunk}
    o, S = getattr(df, f"rwkv7_{form}")(q, k, v, log_gate=lw, a=zero, b=zero, initial_state=S0, **extra)
    o_g, S_g = getattr(gla, f"gla_{form}")(q, k, v, log_gate=lw, initial_state=S0, **extra)
    bound = 1e-14 if chunk is None else 1e-13
    assert rel_err(o, o_g) <= bound and rel_err(S, S_g) <= bound


# --------------------------------------------------------------------------- Longhorn

def test_longhorn_is_the_diagonal_of_the_implicit_update():
    rng = np.random.default_rng(7)
    T, d_k, d_v = 14, 4, 3
    q, k = rng.standard_normal((2, T, d_k))
    v = rng.standard_normal((T, d_v))
    beta = rng.uniform(0.0, 2.0, (T, d_v))
    S = np.zeros((d_k, d_v))
    want = []
    for t in range(T):
        for j in range(d_v):            # each value channel: the implicit step with k k^T kept on its diagonal
            eps = beta[t, j] / (1 + beta[t, j] * k[t] @ k[t])
            S[:, j] = (np.ones(d_k) - eps * k[t] ** 2) * S[:, j] + eps * v[t, j] * k[t]
        want.append(S.T @ q[t])
    o, S_out = df.longhorn_recurrent(q, k, v, beta=beta)
    assert rel_err(o, np.array(want)) <= 1e-12 and rel_err(S_out, S) <= 1e-12


def test_longhorn_with_one_hot_keys_solves_the_online_regression_exactly():
    # with k = e_i, k k^T is diagonal, so Longhorn is the exact minimiser of |s - s_prev|^2 + beta (s^T k - v)^2
    rng = np.random.default_rng(8)
    d_k, d_v = 3, 2
    S0 = rng.standard_normal((d_k, d_v))
    k = np.eye(d_k)[[1]] * 1.0
    v = rng.standard_normal((1, d_v))
    beta = np.array([[0.7, 1.3]])
    _, S = df.longhorn_recurrent(np.zeros((1, d_k)), k, v, beta=beta, initial_state=S0)
    for j in range(d_v):
        M = np.eye(d_k) + beta[0, j] * np.outer(k[0], k[0])
        exact = np.linalg.solve(M, S0[:, j] + beta[0, j] * v[0, j] * k[0])
        assert rel_err(S[:, j], exact) <= 1e-14


def test_longhorn_refuses_negative_steps():
    with pytest.raises(ValueError, match="^beta"):
        df.longhorn_recurrent(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 2)), beta=-np.ones((2, 2)))


# --------------------------------------------------------------------------- parity

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_reflection_tracks_parity_exactly_at_length_ten_thousand(dtype, seed):
    bits = np.random.default_rng(seed).integers(0, 2, 10_000)
    predicted, outputs = df.parity_delta_rule(bits, dtype=dtype)
    assert outputs.dtype == dtype
    assert np.array_equal(predicted, np.cumsum(bits) % 2)
    assert np.array_equal(np.abs(outputs), np.ones(10_000))   # exactly +-1: no drift at any length


def test_parity_on_a_string_of_ones_alternates():
    predicted, outputs = df.parity_delta_rule(np.ones(1001, dtype=int))
    assert df.sign_changes(outputs) == 1000 and predicted[-1] == 1


@SETTINGS
@given(d_k=st.integers(1, 6), seed=st.integers(0, 10_000), threshold=st.floats(-2.0, 2.0))
def test_a_diagonal_positive_decay_layer_changes_sign_at_most_d_k_times_on_ones(d_k, seed, threshold):
    # the argument of the docstring: on 1^T the readout is an exponential polynomial of at most d_k + 1 terms
    rng = np.random.default_rng(seed)
    log_gates = np.log(rng.uniform(0.05, 1.0, (2, d_k)))
    log_gates[:, rng.integers(0, d_k)] = 0.0                # a channel without decay, whose state grows with t
    out = df.diagonal_parity_layer(np.ones(300, dtype=int), log_gates=log_gates, keys=rng.standard_normal((2, d_k)),
                                   values=rng.standard_normal((2, 1)), query=rng.standard_normal(d_k),
                                   initial_state=rng.standard_normal((d_k, 1)))
    assert df.sign_changes(out[:, 0], threshold) <= d_k
    truth = 1.0 - 2.0 * (np.arange(1, 301) % 2)             # the parity of 1^t as +-1
    errors = np.sum(np.sign(out[:, 0] - threshold) != truth)
    assert errors >= (300 - d_k) // 2 - 1


def test_even_the_best_fitted_diagonal_layer_is_near_chance_on_random_strings():
    rng = np.random.default_rng(9)
    bits = rng.integers(0, 2, 3000)
    for _ in range(3):
        log_gates = np.log(rng.uniform(0.05, 1.0, (2, 16)))
        accuracy, fitted = df.fit_diagonal_parity(bits, log_gates)
        assert fitted.shape == (3000,)
        assert accuracy < 0.6
    predicted, _ = df.parity_delta_rule(bits)
    assert np.mean(predicted == df.parity(bits)) == 1.0


def test_the_diagonal_layer_is_gla():
    rng = np.random.default_rng(10)
    bits = rng.integers(0, 2, 20)
    lg, keys, values, query = np.log(rng.uniform(0.3, 1, (2, 3))), rng.standard_normal((2, 3)), \
        rng.standard_normal((2, 2)), rng.standard_normal(3)
    out = df.diagonal_parity_layer(bits, log_gates=lg, keys=keys, values=values, query=query)
    want, _ = gla.gla_recurrent(np.tile(query, (20, 1)), keys[bits], values[bits], log_gate=lg[bits])
    assert np.array_equal(out, want)


@pytest.mark.parametrize("bad", [np.array([0, 2, 1]), np.array([[0, 1]]), np.array([]), np.array([0.0, 1.0])])
def test_bits_must_be_zeros_and_ones(bad):
    with pytest.raises(ValueError, match="^bits"):
        df.parity_delta_rule(bad)


def test_diagonal_layer_refuses_positive_log_gates():
    with pytest.raises(ValueError, match="^log_gates"):
        df.diagonal_parity_layer([0, 1], log_gates=np.full((2, 2), 0.1), keys=np.ones((2, 2)), values=np.ones((2, 1)),
                                 query=np.ones(2))


@pytest.mark.parametrize("form", ["dp_step", "dp_rec", "dp_chunk", "rwkv7", "rwkv7_chunk", "longhorn"])
def test_float32_in_float32_out(form):
    rng = np.random.default_rng(11)
    q, k, v, beta, lg = (x.astype(np.float32) for x in product_inputs(rng, (2,), 6, 2, 3, 2))
    k1, v1 = k[..., 0, :], v[..., 0, :]
    calls = {
        "dp_step": lambda: df.deltaproduct_step(q[:, 0], k[:, 0], v[:, 0], beta=beta[:, 0], log_gate=lg[:, 0]),
        "dp_rec": lambda: df.deltaproduct_recurrent(q, k, v, beta=beta, log_gate=lg, scale=0.5),
        "dp_chunk": lambda: df.deltaproduct_chunkwise(q, k, v, beta=beta, log_gate=lg, chunk_size=4),
        "rwkv7": lambda: df.rwkv7_recurrent(q, k1, v1, log_gate=-np.abs(k1), a=-k1, b=k1, scale=0.5),
        "rwkv7_chunk": lambda: df.rwkv7_chunkwise(q, k1, v1, log_gate=-np.abs(k1), a=-k1, b=k1, scale=0.5,
                                                  chunk_size=4),
        "longhorn": lambda: df.longhorn_recurrent(q, k1, v1, beta=np.abs(v1), scale=0.5),
    }
    o, S = calls[form]()
    assert o.dtype == np.float32 and S.dtype == np.float32


# --------------------------------------------------------------------------- the objective behind each update

def central_difference_gradient(loss, S, h=0.5):
    """The gradient of ``loss`` at ``S`` by central differences; exact (to rounding) for a quadratic, at any h."""
    grad = np.zeros_like(S)
    for idx in np.ndindex(S.shape):
        E = np.zeros_like(S)
        E[idx] = h
        grad[idx] = (loss(S + E) - loss(S - E)) / (2 * h)
    return grad


@SETTINGS
@given(d_k=st.integers(1, 5), d_v=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_the_objectives_gradients_are_their_central_differences(d_k, d_v, seed):
    rng = np.random.default_rng(seed)
    S, k, v = rng.standard_normal((d_k, d_v)), rng.standard_normal(d_k), rng.standard_normal(d_v)
    lg = -rng.uniform(0.0, 2.0, d_k)
    for fn in (lambda X: df.regression_objective(X, k, v), lambda X: df.score_objective(X, k, v),
               lambda X: df.decay_objective(X, log_gate=lg)):
        loss, grad = fn(S)
        assert np.ndim(loss) == 0 and grad.shape == S.shape
        fd = central_difference_gradient(lambda X: float(fn(X)[0]), S)
        assert rel_err(grad, fd) <= 1e-12


@SETTINGS
@given(d_k=st.integers(1, 5), d_v=st.integers(1, 4), seed=st.integers(0, 10_000), lead=st.sampled_from([(), (3,), (2, 2)]))
def test_one_step_of_each_objective_is_the_layers_update(d_k, d_v, seed, lead):
    rng = np.random.default_rng(seed)
    S = rng.standard_normal(lead + (d_k, d_v))
    q, k, v = rng.standard_normal(lead + (d_k,)), rng.standard_normal(lead + (d_k,)), rng.standard_normal(lead + (d_v,))
    u = k / np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0.0, 1.0, lead)
    g = rng.uniform(0.3, 1.0, lead)
    alpha = rng.uniform(0.3, 1.0, lead + (d_k,))
    b_ = beta[..., None, None]
    # DeltaNet: one gradient step of size beta on the regression loss
    step = S - b_ * df.regression_objective(S, u, v)[1]
    assert rel_err(step, dr.delta_rule_step(q, u, v, beta=beta, initial_state=S)[1]) <= 1e-13
    # Gated DeltaNet: a scalar weight-decay step (size 1), then the regression step from the decayed state
    scalar_lg = np.repeat(np.log(g)[..., None], d_k, axis=-1)
    shrunk = S - df.decay_objective(S, log_gate=scalar_lg)[1]
    step = shrunk - b_ * df.regression_objective(shrunk, u, v)[1]
    ref = dr.gated_delta_rule_step(q, u, v, beta=beta, log_gate=np.log(g), initial_state=S)[1]
    assert rel_err(step, ref) <= 1e-13
    # KDA: the decay per key channel
    shrunk = S - df.decay_objective(S, log_gate=np.log(alpha))[1]
    step = shrunk - b_ * df.regression_objective(shrunk, u, v)[1]
    assert rel_err(step, dr.kda_step(q, u, v, beta=beta, log_gate=np.log(alpha), initial_state=S)[1]) <= 1e-13
    # GLA: the per-channel decay, then one unit step on the score loss
    shrunk = S - df.decay_objective(S, log_gate=np.log(alpha))[1]
    step = shrunk - df.score_objective(shrunk, k, v)[1]
    assert rel_err(step, gla.gla_step(q, k, v, log_gate=np.log(alpha), initial_state=S)[1]) <= 1e-13


def test_rwkv7_is_one_preconditioned_step_with_coupled_decay():
    """S - Diag(eta) grad L(S), L = 1/2 sum_c (1 - w_c)/eta_c |S_c|^2 + 1/2 |S^T kappa|^2 - <S^T (k~/eta), v>."""
    rng = np.random.default_rng(5)
    d_k, d_v = 5, 3
    S, q, k, v = (rng.standard_normal((d_k, d_v)), rng.standard_normal(d_k), rng.standard_normal(d_k),
                  rng.standard_normal(d_v))
    kappa = rng.standard_normal(d_k)
    kappa /= np.linalg.norm(kappa)
    eta, w = rng.uniform(0.1, 1.0, d_k), rng.uniform(0.4, 1.0, d_k)
    decay_grad = df.decay_objective(S, log_gate=np.log(w))[1] / eta[:, None]
    erase_grad = df.regression_objective(S, kappa, np.zeros(d_v))[1]
    write_grad = df.score_objective(S, k / eta, v)[1]
    step = S - eta[:, None] * (decay_grad + erase_grad + write_grad)
    ref = df.rwkv7_step(q, k, v, log_gate=np.log(w), a=-kappa, b=eta * kappa, initial_state=S)[1]
    assert rel_err(step, ref) <= 1e-13


@SETTINGS
@given(d_k=st.integers(1, 6), d_v=st.integers(1, 4), seed=st.integers(0, 10_000), per_column=st.booleans(),
       lead=st.sampled_from([(), (2,), (2, 3)]))
def test_the_implicit_step_is_the_proximal_minimiser(d_k, d_v, seed, per_column, lead):
    rng = np.random.default_rng(seed)
    S0 = rng.standard_normal(lead + (d_k, d_v))
    k, v = rng.standard_normal(lead + (d_k,)) * rng.uniform(0.2, 3.0), rng.standard_normal(lead + (d_v,))
    beta = rng.uniform(0.0, 5.0, lead + ((d_v,) if per_column else ()))
    S = df.implicit_regression_step(S0, k, v, beta=beta if per_column else beta[..., None])
    bcol = beta if per_column else np.broadcast_to(beta[..., None], lead + (d_v,))
    grad = df.regression_objective(S, k, v)[1]                      # the gradient at the NEW state
    # optimality of 1/2|S - S0|^2 + 1/2 sum_j beta_j (s_j^T k - v_j)^2: S - S0 + grad Diag(beta) = 0
    residual = S - S0 + grad * bcol[..., None, :]
    assert float(np.max(np.abs(residual))) <= 1e-12 * max(1.0, float(np.max(np.abs(S0))), float(np.max(np.abs(v))))
    # equivalently the delta rule with eps = beta / (1 + beta |k|^2), an explicit step from S0
    eps = bcol / (1 + bcol * np.sum(k * k, axis=-1, keepdims=True))
    explicit = S0 - df.regression_objective(S0, k, v)[1] * eps[..., None, :]
    assert rel_err(S, explicit) <= 1e-13


@SETTINGS
@given(d_k=st.integers(1, 6), d_v=st.integers(1, 4), seed=st.integers(0, 10_000), scalar=st.booleans())
def test_the_implicit_step_equals_a_direct_solve_column_by_column(d_k, d_v, seed, scalar):
    """Each column solves (I + beta_j k k^T) s_j = s0_j + beta_j v_j k, by numpy's dense solver, not Sherman-Morrison."""
    rng = np.random.default_rng(seed)
    S0 = rng.standard_normal((d_k, d_v))
    k, v = rng.standard_normal(d_k) * rng.uniform(0.2, 3.0), rng.standard_normal(d_v)
    beta = rng.uniform(0.0, 10.0, () if scalar else (d_v,))
    S = df.implicit_regression_step(S0, k, v, beta=beta)
    bcol = np.broadcast_to(beta, (d_v,))
    solved = np.stack([np.linalg.solve(np.eye(d_k) + bcol[j] * np.outer(k, k), S0[:, j] + bcol[j] * v[j] * k)
                       for j in range(d_v)], axis=1)
    assert rel_err(S, solved) <= 1e-12


def test_the_implicit_step_never_overshoots_where_the_explicit_one_does():
    """For a huge step the explicit step diverges from the target, the implicit one lands on it."""
    rng = np.random.default_rng(3)
    S0, k, v = rng.standard_normal((4, 2)), rng.standard_normal(4), rng.standard_normal(2)
    big = 1e6
    implicit = df.implicit_regression_step(S0, k, v, beta=big)
    explicit = S0 - big * df.regression_objective(S0, k, v)[1]
    assert np.max(np.abs(implicit.T @ k - v)) < 1e-5
    assert np.max(np.abs(explicit.T @ k - v)) > 1e3


def test_longhorn_is_the_implicit_step_with_the_diagonal_erase():
    rng = np.random.default_rng(11)
    d_k, d_v = 4, 3
    S0, q, k, v = (rng.standard_normal((d_k, d_v)), rng.standard_normal(d_k), rng.standard_normal(d_k),
                   rng.standard_normal(d_v))
    beta = rng.uniform(0.0, 1.0, d_v)
    _, S_lh = df.longhorn_recurrent(q[None], k[None], v[None], beta=beta[None], initial_state=S0)
    eps = beta / (1 + beta * (k @ k))
    diag = (1 - np.outer(k * k, eps)) * S0 + np.outer(k, eps * v)
    assert rel_err(S_lh, diag) <= 1e-13
    # with a one-hot key the diagonal is the whole k k^T: Longhorn is the exact implicit step
    e = np.zeros(d_k)
    e[2] = 1.7
    _, S_lh = df.longhorn_recurrent(q[None], e[None], v[None], beta=beta[None], initial_state=S0)
    assert rel_err(S_lh, df.implicit_regression_step(S0, e, v, beta=beta)) <= 1e-13


@pytest.mark.parametrize("call, name", [
    (lambda: df.regression_objective(np.zeros(3), np.zeros(3), np.zeros(2)), "state"),
    (lambda: df.regression_objective(np.zeros((3, 2)), np.zeros(4), np.zeros(2)), "k"),
    (lambda: df.score_objective(np.zeros((3, 2)), np.zeros(3), np.zeros(5)), "v"),
    (lambda: df.regression_objective(np.zeros((2, 3, 2)), np.zeros((4, 3)), np.zeros(2)), "k"),
    (lambda: df.decay_objective(np.zeros((3, 2)), log_gate=np.array([0.0, 0.1, -1.0])), "log_gate"),
    (lambda: df.decay_objective(np.zeros((3, 2)), log_gate=np.zeros(2)), "log_gate"),
    (lambda: df.implicit_regression_step(np.zeros((3, 2)), np.zeros(3), np.zeros(2), beta=-1.0), "beta"),
    (lambda: df.implicit_regression_step(np.zeros((3, 2)), np.zeros(3), np.zeros(2), beta=np.ones(3)), "beta"),
])
def test_objectives_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()


def test_objectives_keep_float32():
    S, k, v = (np.ones((3, 2), np.float32), np.ones(3, np.float32), np.ones(2, np.float32))
    assert df.regression_objective(S, k, v)[1].dtype == np.float32
    assert df.score_objective(S, k, v)[1].dtype == np.float32
    assert df.decay_objective(S, log_gate=np.zeros(3, np.float32))[1].dtype == np.float32
    assert df.implicit_regression_step(S, k, v, beta=0.5).dtype == np.float32


# --------------------------------------------------------------------------- KDA as DPLR; DeltaProduct as a longer DeltaNet

@SETTINGS
@given(T=st.integers(1, 40), d_k=st.integers(1, 5), d_v=st.integers(1, 4), chunk=st.integers(1, 17),
       lead=st.sampled_from([(), (2,)]), with_init=st.booleans(), seed=st.integers(0, 10_000))
def test_kda_is_dplr_with_tied_vectors(T, d_k, d_v, chunk, lead, with_init, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2,) + lead + (T, d_k))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal(lead + (T, d_v))
    beta = rng.uniform(0.0, 1.0, lead + (T,))
    lg = np.log(rng.uniform(0.3, 1.0, lead + (T, d_k)))
    S0 = rng.standard_normal(lead + (d_k, d_v)) if with_init else None
    o_ref, S_ref = dr.kda_recurrent(q, k, v, beta=beta, log_gate=lg, initial_state=S0)
    bk = beta[..., None] * k
    o, S = df.rwkv7_chunkwise(q, bk, v, log_gate=lg, a=-np.exp(lg) * k, b=bk, initial_state=S0, chunk_size=chunk)
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(S, S_ref) <= 1e-12


@SETTINGS
@given(T=st.integers(1, 25), n_h=st.integers(1, 4), d_k=st.integers(1, 5), d_v=st.integers(1, 4),
       seed=st.integers(0, 10_000))
def test_deltaproduct_is_gated_deltanet_over_interleaved_substeps(T, n_h, d_k, d_v, seed):
    rng = np.random.default_rng(seed)
    q, k, v, beta, lg = product_inputs(rng, (), T, n_h, d_k, d_v, beta_max=1.0)
    S0 = rng.standard_normal((d_k, d_v))
    o_ref, S_ref = df.deltaproduct_recurrent(q, k, v, beta=beta, log_gate=lg, initial_state=S0)
    q_long = np.zeros((T, n_h, d_k))
    q_long[:, -1] = q
    g_long = np.zeros((T, n_h))
    g_long[:, 0] = lg
    o, S = dr.gated_delta_rule_recurrent(q_long.reshape(-1, d_k), k.reshape(-1, d_k), v.reshape(-1, d_v),
                                         beta=beta.reshape(-1), log_gate=g_long.reshape(-1), initial_state=S0)
    assert rel_err(o.reshape(T, n_h, d_v)[:, -1], o_ref) <= 1e-13 and rel_err(S, S_ref) <= 1e-13
