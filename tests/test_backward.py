"""Backward passes of the cores (chapter 9): every gradient against central finite differences.

Properties:
- for softmax attention (causal and not), linear attention (with and without a
  gate), DeltaNet, Gated DeltaNet, KDA, Mamba-2's SSD and Mamba's selective scan, the gradient of
  ``L = sum <W, out> + <W_S, final state>`` with respect to every input (gates,
  beta, step sizes, decay rates, D and the initial state included) agrees with
  central finite differences (step 1e-5) to a relative error of at most 1e-6
  in float64, over small random shapes (hypothesis: T 1..9, widths 1..5, with
  and without leading axes);
- an input broadcast along leading axes gets the gradient summed over them
  (its own shape back), checked by finite differences on the thin input;
- the forms agree with each other where the book says they are one layer:
  ungated linear attention is the gate ``log_gate = 0``; the SSD with ``delta = 1``
  is gated linear attention with log-decay ``a``;
- a sequence split in two, the halves chained by the state forwards and by
  ``d_final_state``/``d_initial_state`` backwards, gives the whole sequence's
  gradients to 1e-12 (the idea of a chunkwise backward);
- float32 in gives float32 out, close to the float64 gradients; float16 and
  integer inputs follow the package's precision rule;
- bad input raises ValueError naming the argument;
- the checker itself fails on a wrong gradient (a test that can fail).
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import delta_rule as dr
from fixedstate import gradcheck as gc
from fixedstate import linear_attention as la
from fixedstate import softmax_attention as sa
from fixedstate import ssm

SETTINGS = examples(12)
TOL = 1e-6
# step 1e-5, not gradcheck's 1e-6: it balances the rounding of the two evaluations (about 1e-16 |L| / h) against
# the truncation (about h^2), so that an input whose gradient is small by chance (one token, one channel) is still
# checked well below TOL
STEP = 1e-5
LEADS = st.sampled_from([(), (2,), (1, 2)])


def _check(f, inputs, grads, seed=0):
    """Assert the backward pass's gradients match finite differences; return the largest error."""
    weights = gc.random_weights(f(**inputs), seed)
    got = grads(*weights)
    errors = gc.relative_errors(f, inputs, got, weights, step=STEP)
    assert max(errors.values()) <= TOL, errors
    return max(errors.values())


def _normal(rng, *shape):
    return rng.standard_normal(shape)


def _assert_float32_close(got, want):
    """float32 gradients: float32 dtype, and the float64 gradients to float32 accuracy."""
    assert len(got) == len(want)
    for g32, g64 in zip(got, want):
        assert g32.dtype == np.float32
        np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-5 * np.abs(g64).max())


# ---------------------------------------------------------------- softmax attention

def _softmax_case(seed, lead, t, m, d_k, d_v, causal, scale):
    rng = np.random.default_rng(seed)
    m = t if causal else m
    inputs = dict(q=_normal(rng, *lead, t, d_k), k=_normal(rng, *lead, m, d_k), v=_normal(rng, *lead, m, d_v))
    f = lambda q, k, v: sa.softmax_attention(q, k, v, causal=causal, scale=scale)[0]  # noqa: E731

    def grads(w):
        dq, dk, dv = sa.softmax_attention_backward(**inputs, d_out=w, causal=causal, scale=scale)
        return dict(q=dq, k=dk, v=dv)
    return f, inputs, grads


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lead=LEADS, t=st.integers(1, 9), m=st.integers(1, 9),
       d_k=st.integers(1, 5), d_v=st.integers(1, 5), causal=st.booleans(),
       scale=st.sampled_from([None, 0.3, 2.0]))
def test_softmax_attention_backward_matches_finite_differences(seed, lead, t, m, d_k, d_v, causal, scale):
    _check(*_softmax_case(seed, lead, t, m, d_k, d_v, causal, scale), seed=seed)


def test_softmax_attention_backward_sums_over_broadcast_axes():
    rng = np.random.default_rng(1)
    inputs = dict(q=_normal(rng, 2, 3, 4, 3), k=_normal(rng, 1, 3, 4, 3), v=_normal(rng, 3, 4, 2))
    f = lambda q, k, v: sa.softmax_attention(q, k, v)[0]  # noqa: E731

    def grads(w):
        dq, dk, dv = sa.softmax_attention_backward(**inputs, d_out=w)
        assert dq.shape == (2, 3, 4, 3) and dk.shape == (1, 3, 4, 3) and dv.shape == (3, 4, 2)
        return dict(q=dq, k=dk, v=dv)
    _check(f, inputs, grads)


def test_softmax_attention_backward_float32_and_validation():
    rng = np.random.default_rng(2)
    q, k, v, w = _normal(rng, 5, 3), _normal(rng, 5, 3), _normal(rng, 5, 4), _normal(rng, 5, 4)
    want = sa.softmax_attention_backward(q, k, v, w)
    got = sa.softmax_attention_backward(*(a.astype(np.float32) for a in (q, k, v, w)))
    _assert_float32_close(got, want)
    with pytest.raises(ValueError, match="d_out"):
        sa.softmax_attention_backward(q, k, v, w[:4])
    with pytest.raises(ValueError, match="causal"):
        sa.softmax_attention_backward(q, k, v, w, causal=1)
    with pytest.raises(ValueError, match="scale"):
        sa.softmax_attention_backward(q, k, v, w, scale=-1.0)
    with pytest.raises(ValueError, match="k"):
        sa.softmax_attention_backward(q, k[:4], v, w)
    with pytest.raises(ValueError, match="d_out"):
        sa.softmax_attention_backward(q, k, v, np.full((5, 4), np.nan))


# ---------------------------------------------------------------- linear attention

def _gated_linear_attention(q, k, v, log_gate, scale, initial_state):
    """The reference: linear_attention_step token by token, the state decayed by exp(log_gate_t) first."""
    S, outs = initial_state, []
    for t in range(q.shape[-2]):
        if S is not None and log_gate is not None:
            S = np.exp(log_gate[..., t, None, None]) * S
        o, S = la.linear_attention_step(q[..., t, :], k[..., t, :], v[..., t, :], feature_map=la.identity_feature_map,
                                        normalize=False, scale=scale, initial_state=S)
        outs.append(o)
    return np.stack(outs, axis=-2), S


def _linear_case(seed, lead, t, d_k, d_v, gated, with_state, scale):
    rng = np.random.default_rng(seed)
    inputs = dict(q=_normal(rng, *lead, t, d_k), k=_normal(rng, *lead, t, d_k), v=_normal(rng, *lead, t, d_v))
    if gated:
        inputs["log_gate"] = -rng.uniform(0.05, 1.5, lead + (t,))
    if with_state:
        inputs["initial_state"] = _normal(rng, *lead, d_k, d_v)

    def f(q, k, v, log_gate=None, initial_state=None):
        if log_gate is None:
            return la.linear_attention_recurrent(q, k, v, feature_map=la.identity_feature_map, normalize=False,
                                                 scale=scale, initial_state=initial_state)
        return _gated_linear_attention(q, k, v, log_gate, scale, initial_state)

    def grads(w_out, w_state):
        dq, dk, dv, dg, ds0 = la.linear_attention_backward(**inputs, d_out=w_out, scale=scale, d_final_state=w_state)
        assert (dg is None) == (not gated)
        assert ds0.shape == (inputs["initial_state"].shape if with_state else lead + (d_k, d_v))
        out = dict(q=dq, k=dk, v=dv)
        if gated:
            out["log_gate"] = dg
        if with_state:
            out["initial_state"] = ds0
        return out
    return f, inputs, grads


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lead=LEADS, t=st.integers(1, 9), d_k=st.integers(1, 5),
       d_v=st.integers(1, 5), gated=st.booleans(), with_state=st.booleans(), scale=st.sampled_from([1.0, 0.4]))
def test_linear_attention_backward_matches_finite_differences(seed, lead, t, d_k, d_v, gated, with_state, scale):
    _check(*_linear_case(seed, lead, t, d_k, d_v, gated, with_state, scale), seed=seed)


def test_linear_attention_backward_sums_over_broadcast_axes():
    rng = np.random.default_rng(3)
    inputs = dict(q=_normal(rng, 2, 1, 4, 3), k=_normal(rng, 3, 4, 3), v=_normal(rng, 2, 3, 4, 2),
                  log_gate=-rng.uniform(0.1, 1, (1, 4)), initial_state=_normal(rng, 1, 3, 3, 2))
    f = lambda q, k, v, log_gate, initial_state: _gated_linear_attention(q, k, v, log_gate, 1.0,  # noqa: E731
                                                                         initial_state)

    def grads(w_out, w_state):
        got = la.linear_attention_backward(**inputs, d_out=w_out, d_final_state=w_state)
        assert [g.shape for g in got] == [a.shape for a in inputs.values()]
        return dict(zip(inputs, got))
    _check(f, inputs, grads)


def test_linear_attention_backward_ungated_is_gate_zero():
    rng = np.random.default_rng(4)
    q, k, v, w, s0 = (_normal(rng, 2, 6, 3), _normal(rng, 2, 6, 3), _normal(rng, 2, 6, 4), _normal(rng, 2, 6, 4),
                      _normal(rng, 2, 3, 4))
    plain = la.linear_attention_backward(q, k, v, w, initial_state=s0, scale=0.5)
    gated = la.linear_attention_backward(q, k, v, w, initial_state=s0, scale=0.5, log_gate=np.zeros((2, 6)))
    for a, b in zip(plain[:3] + plain[4:], gated[:3] + gated[4:]):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=0)


def test_linear_attention_backward_float32_and_validation():
    rng = np.random.default_rng(5)
    q, k, v, w = _normal(rng, 6, 3), _normal(rng, 6, 3), _normal(rng, 6, 2), _normal(rng, 6, 2)
    lg, s0 = -rng.uniform(0.1, 1, 6), _normal(rng, 3, 2)
    want = la.linear_attention_backward(q, k, v, w, log_gate=lg, initial_state=s0, d_final_state=s0)
    f32 = [a.astype(np.float32) for a in (q, k, v, w, lg, s0)]
    got = la.linear_attention_backward(*f32[:4], log_gate=f32[4], initial_state=f32[5], d_final_state=f32[5])
    _assert_float32_close(got, want)
    with pytest.raises(ValueError, match="d_out"):
        la.linear_attention_backward(q, k, v, w[:, :1])
    with pytest.raises(ValueError, match="log_gate"):
        la.linear_attention_backward(q, k, v, w, log_gate=-lg)
    with pytest.raises(ValueError, match="log_gate"):
        la.linear_attention_backward(q, k, v, w, log_gate=lg[:5])
    with pytest.raises(ValueError, match="initial_state"):
        la.linear_attention_backward(q, k, v, w, initial_state=s0.T)
    with pytest.raises(ValueError, match="d_final_state"):
        la.linear_attention_backward(q, k, v, w, d_final_state=s0.T)
    with pytest.raises(ValueError, match="^initial_state"):
        la.linear_attention_backward(q, k, v, np.stack([w, w, w]), initial_state=np.stack([s0, s0]))
    with pytest.raises(ValueError, match="scale"):
        la.linear_attention_backward(q, k, v, w, scale="1")


# ---------------------------------------------------------------- the delta rule family

DELTA_FORMS = {"delta": (dr.delta_rule_recurrent, dr.delta_rule_backward, None),
               "gated": (dr.gated_delta_rule_recurrent, dr.gated_delta_rule_backward, "scalar"),
               "kda": (dr.kda_recurrent, dr.kda_backward, "channel")}


def _delta_case(form, seed, lead, t, d_k, d_v, with_state, scale, thin_lead=None):
    forward, backward, gate = DELTA_FORMS[form]
    rng = np.random.default_rng(seed)
    small = lead if thin_lead is None else thin_lead          # the leading axes of beta and the gate
    inputs = dict(q=_normal(rng, *lead, t, d_k), k=_normal(rng, *small, t, d_k), v=_normal(rng, *lead, t, d_v),
                  beta=rng.uniform(0.05, 0.95, small + (t,)))
    if gate is not None:
        inputs["log_gate"] = -rng.uniform(0.05, 1.5, small + (t,) + ((d_k,) if gate == "channel" else ()))
    if with_state:
        inputs["initial_state"] = _normal(rng, *small, d_k, d_v)
    f = lambda q, k, v, **kw: forward(q, k, v, scale=scale, **kw)  # noqa: E731

    def grads(w_out, w_state):
        got = list(backward(**inputs, d_out=w_out, scale=scale, d_final_state=w_state))
        assert len(got) == (5 if gate is None else 6)
        assert got[-1].shape == (inputs["initial_state"].shape if with_state else lead + (d_k, d_v))
        if not with_state:
            got.pop()
        assert [g.shape for g in got] == [a.shape for a in inputs.values()]
        assert all(g.dtype == np.float64 for g in got)
        return dict(zip(inputs, got))
    return f, inputs, grads


@SETTINGS
@given(form=st.sampled_from(sorted(DELTA_FORMS)), seed=st.integers(0, 2**32 - 1), lead=LEADS, t=st.integers(1, 9),
       d_k=st.integers(1, 5), d_v=st.integers(1, 5), with_state=st.booleans(), scale=st.sampled_from([1.0, 0.4]))
def test_delta_rule_backward_matches_finite_differences(form, seed, lead, t, d_k, d_v, with_state, scale):
    _check(*_delta_case(form, seed, lead, t, d_k, d_v, with_state, scale), seed=seed)


@pytest.mark.parametrize("form", sorted(DELTA_FORMS))
def test_delta_rule_backward_sums_over_broadcast_axes(form):
    _check(*_delta_case(form, 7, (2, 3), 4, 3, 2, True, 0.5, thin_lead=(1, 3)))


def test_delta_rule_backward_with_unit_keys_and_full_write():
    """beta |k|^2 = 1: the erase factor is a projection (its gradient path included), an edge of the domain."""
    rng = np.random.default_rng(8)
    k = _normal(rng, 5, 3)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    inputs = dict(q=_normal(rng, 5, 3), k=k, v=_normal(rng, 5, 2), initial_state=_normal(rng, 3, 2))
    beta, log_gate = np.ones(5), np.zeros(5)
    f = lambda q, k, v, initial_state: dr.gated_delta_rule_recurrent(  # noqa: E731
        q, k, v, beta=beta, log_gate=log_gate, initial_state=initial_state)

    def grads(w_out, w_state):
        dq, dk, dv, _, _, ds0 = dr.gated_delta_rule_backward(**inputs, d_out=w_out, beta=beta, log_gate=log_gate,
                                                             d_final_state=w_state)
        return dict(q=dq, k=dk, v=dv, initial_state=ds0)
    _check(f, inputs, grads)


@pytest.mark.parametrize("form", sorted(DELTA_FORMS))
def test_delta_rule_backward_float32(form):
    _, backward, gate = DELTA_FORMS[form]
    rng = np.random.default_rng(9)
    args = [_normal(rng, 2, 6, 3), _normal(rng, 2, 6, 3), _normal(rng, 2, 6, 2), _normal(rng, 2, 6, 2)]
    kw = dict(beta=rng.uniform(0.1, 0.9, (2, 6)), initial_state=_normal(rng, 2, 3, 2), d_final_state=_normal(rng, 3, 2))
    if gate is not None:
        kw["log_gate"] = -rng.uniform(0.1, 1, (2, 6) + ((3,) if gate == "channel" else ()))
    want = backward(*args, **kw)
    got = backward(*(a.astype(np.float32) for a in args), **{n: a.astype(np.float32) for n, a in kw.items()})
    _assert_float32_close(got, want)


def test_delta_rule_backward_validation():
    rng = np.random.default_rng(10)
    q, k, v, w = _normal(rng, 4, 3), _normal(rng, 4, 3), _normal(rng, 4, 2), _normal(rng, 4, 2)
    beta, lg = np.full(4, 0.5), np.full(4, -0.1)
    with pytest.raises(ValueError, match="d_out"):
        dr.gated_delta_rule_backward(q, k, v, w[:3], beta=beta, log_gate=lg)
    with pytest.raises(ValueError, match="beta"):
        dr.gated_delta_rule_backward(q, k, v, w, beta=beta + 1, log_gate=lg)
    with pytest.raises(ValueError, match="log_gate"):
        dr.gated_delta_rule_backward(q, k, v, w, beta=beta, log_gate=-lg)
    with pytest.raises(ValueError, match="log_gate"):
        dr.kda_backward(q, k, v, w, beta=beta, log_gate=lg)
    with pytest.raises(ValueError, match="d_final_state"):
        dr.delta_rule_backward(q, k, v, w, beta=beta, d_final_state=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="initial_state"):
        dr.delta_rule_backward(q, k, v, w, beta=beta, initial_state=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="q"):
        dr.delta_rule_backward(q[:0], k[:0], v[:0], w[:0], beta=beta[:0])
    with pytest.raises(ValueError, match="^d_out"):
        dr.delta_rule_backward(q, k, v, np.stack([w, w]), beta=np.stack([beta] * 3))


# ---------------------------------------------------------------- Mamba-2 (SSD) and Mamba's selective scan

def _ssd_case(seed, lead, t, n, p, with_d, with_state, thin=False):
    rng = np.random.default_rng(seed)
    heads = lead[-1:]                                          # a and D: one per head
    small = tuple(1 for _ in lead) if thin else lead           # B, C and the state shared across leading axes
    inputs = dict(x=_normal(rng, *lead, t, p), delta=rng.uniform(0.1, 1.5, lead + (t,)),
                  a=-rng.uniform(0.1, 1.5, heads), B=_normal(rng, *small, t, n), C=_normal(rng, *lead, t, n))
    if with_d:
        inputs["D"] = _normal(rng, *heads)
    if with_state:
        inputs["initial_state"] = _normal(rng, *small, n, p)

    def grads(w_y, w_state):
        got = list(ssm.ssd_backward(**inputs, d_y=w_y, d_final_state=w_state))
        assert (got[5] is None) == (not with_d)
        assert got[6].shape == (inputs["initial_state"].shape if with_state else lead + (n, p))
        got = [g for g, keep in zip(got, [True] * 5 + [with_d, with_state]) if keep]
        assert [g.shape for g in got] == [a.shape for a in inputs.values()]
        return dict(zip(inputs, got))
    return (lambda **kw: ssm.ssd_recurrent(**kw)), inputs, grads


def _selective_case(seed, lead, t, d, n, d_kind, with_state, thin=False):
    rng = np.random.default_rng(seed)
    small = tuple(1 for _ in lead) if thin else lead
    inputs = dict(x=_normal(rng, *lead, t, d), delta=rng.uniform(0.1, 1.5, small + (t, d)),
                  A=-rng.uniform(0.1, 1.5, (d, n)), B=_normal(rng, *small, t, n), C=_normal(rng, *lead, t, n))
    if d_kind is not None:
        inputs["D"] = _normal(rng, *((d,) if d_kind == "vector" else ()))
    if with_state:
        inputs["initial_state"] = _normal(rng, *small, d, n)

    def grads(w_y, w_state):
        got = list(ssm.selective_scan_backward(**inputs, d_y=w_y, d_final_state=w_state))
        assert (got[5] is None) == (d_kind is None)
        got = [g for g, keep in zip(got, [True] * 5 + [d_kind is not None, with_state]) if keep]
        assert [g.shape for g in got] == [a.shape for a in inputs.values()]
        return dict(zip(inputs, got))
    return (lambda **kw: ssm.selective_scan_sequential(**kw)), inputs, grads


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lead=LEADS, t=st.integers(1, 9), n=st.integers(1, 5), p=st.integers(1, 5),
       with_d=st.booleans(), with_state=st.booleans())
def test_ssd_backward_matches_finite_differences(seed, lead, t, n, p, with_d, with_state):
    _check(*_ssd_case(seed, lead, t, n, p, with_d, with_state), seed=seed)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lead=LEADS, t=st.integers(1, 9), d=st.integers(1, 5), n=st.integers(1, 5),
       d_kind=st.sampled_from([None, "scalar", "vector"]), with_state=st.booleans())
def test_selective_scan_backward_matches_finite_differences(seed, lead, t, d, n, d_kind, with_state):
    _check(*_selective_case(seed, lead, t, d, n, d_kind, with_state), seed=seed)


def test_ssm_backward_sums_over_broadcast_axes():
    _check(*_ssd_case(11, (3, 2), 5, 3, 2, True, True, thin=True))
    _check(*_selective_case(12, (3, 2), 5, 2, 3, "vector", True, thin=True))


def test_ssd_backward_is_gated_linear_attention_backward():
    """With delta = 1 the SSD is gated linear attention with log-decay a: the same gradients for C, B, x."""
    rng = np.random.default_rng(13)
    x, B, C, w = _normal(rng, 6, 2), _normal(rng, 6, 3), _normal(rng, 6, 3), _normal(rng, 6, 2)
    a = -0.3
    ssd = ssm.ssd_backward(x, np.ones(6), a, B, C, w)
    lin = la.linear_attention_backward(C, B, x, w, log_gate=np.full(6, a))
    for got, want in zip((ssd[4], ssd[3], ssd[0], ssd[6]), (lin[0], lin[1], lin[2], lin[4])):
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    np.testing.assert_allclose(ssd[2], lin[3].sum(), rtol=1e-13)   # da = sum_t delta_t dlog_gate_t


@pytest.mark.parametrize("which", ["ssd", "selective"])
def test_ssm_backward_float32(which):
    case = _ssd_case(14, (2,), 6, 3, 2, True, True) if which == "ssd" else _selective_case(14, (2,), 6, 2, 3,
                                                                                            "vector", True)
    _, inputs, _ = case
    backward = ssm.ssd_backward if which == "ssd" else ssm.selective_scan_backward
    rng = np.random.default_rng(15)
    y_shape = inputs["x"].shape
    w_y, w_s = rng.standard_normal(y_shape), rng.standard_normal(inputs["initial_state"].shape)
    want = backward(**inputs, d_y=w_y, d_final_state=w_s)
    got = backward(**{n: a.astype(np.float32) for n, a in inputs.items()}, d_y=w_y.astype(np.float32),
                   d_final_state=w_s.astype(np.float32))
    _assert_float32_close(got, want)


def test_ssm_backward_validation():
    rng = np.random.default_rng(16)
    x, B, C, w = _normal(rng, 5, 2), _normal(rng, 5, 3), _normal(rng, 5, 3), _normal(rng, 5, 2)
    delta = np.full(5, 0.5)
    with pytest.raises(ValueError, match="^d_y"):
        ssm.ssd_backward(x, delta, -0.5, B, C, w[:4])
    with pytest.raises(ValueError, match="^delta"):
        ssm.ssd_backward(x, -delta, -0.5, B, C, w)
    with pytest.raises(ValueError, match="^a"):
        ssm.ssd_backward(x, delta, 0.5, B, C, w)
    with pytest.raises(ValueError, match="^C"):
        ssm.ssd_backward(x, delta, -0.5, B, C[:, :2], w)
    with pytest.raises(ValueError, match="^d_final_state"):
        ssm.ssd_backward(x, delta, -0.5, B, C, w, d_final_state=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="^initial_state"):
        ssm.ssd_backward(x, delta, -0.5, B, C, w, initial_state=np.zeros((2, 3)))
    A, deltas = -np.ones((2, 3)), np.full((5, 2), 0.5)
    with pytest.raises(ValueError, match="^d_y"):
        ssm.selective_scan_backward(x, deltas, A, B, C, w[:, :1])
    with pytest.raises(ValueError, match="^A"):
        ssm.selective_scan_backward(x, deltas, A.T, B, C, w)
    with pytest.raises(ValueError, match="^delta"):
        ssm.selective_scan_backward(x, -deltas, A, B, C, w)
    with pytest.raises(ValueError, match="^d_final_state"):
        ssm.selective_scan_backward(x, deltas, A, B, C, w, d_final_state=np.zeros((3, 2)))
    with pytest.raises(ValueError, match="^D"):
        ssm.selective_scan_backward(x, deltas, A, B, C, w, D=np.ones(3))


# ---------------------------------------------------------------- splitting a sequence

def _split_case(layer, rng, T):
    """(forward, backward, per-token inputs with their time axes, shared inputs, gradient names, d_out's name)."""
    d_k, d_v = 3, 2
    if layer in ("ssd", "selective"):
        d = d_v if layer == "ssd" else 3
        tokens = dict(x=(_normal(rng, 2, T, d), -2), B=(_normal(rng, 2, T, d_k), -2), C=(_normal(rng, 2, T, d_k), -2))
        if layer == "ssd":
            tokens["delta"] = (rng.uniform(0.1, 1.5, (2, T)), -1)
            shared, fb = dict(a=-0.4, D=0.5), (ssm.ssd_recurrent, ssm.ssd_backward)
        else:
            tokens["delta"] = (rng.uniform(0.1, 1.5, (2, T, d)), -2)
            shared, fb = dict(A=-rng.uniform(0.1, 1, (d, d_k)), D=0.5), (ssm.selective_scan_sequential,
                                                                          ssm.selective_scan_backward)
        order = ["x", "delta", "a" if layer == "ssd" else "A", "B", "C", "D"]
        return fb, tokens, shared, order, 5, "d_y", _normal(rng, 2, *((d, d_k) if layer == "selective" else (d_k, d)))
    tokens = dict(q=(_normal(rng, 2, T, d_k), -2), k=(_normal(rng, 2, T, d_k), -2), v=(_normal(rng, 2, T, d_v), -2))
    if layer != "linear":
        tokens["beta"] = (rng.uniform(0.1, 0.9, (2, T)), -1)
    if layer in ("linear", "gated"):
        tokens["log_gate"] = (-rng.uniform(0.05, 1, (2, T)), -1)
    if layer == "kda":
        tokens["log_gate"] = (-rng.uniform(0.05, 1, (2, T, d_k)), -2)
    forward = {"linear": lambda q, k, v, log_gate, scale, initial_state: _gated_linear_attention(
                   q, k, v, log_gate, scale, initial_state),
               "delta": dr.delta_rule_recurrent, "gated": dr.gated_delta_rule_recurrent, "kda": dr.kda_recurrent}
    backward = {"linear": la.linear_attention_backward, "delta": dr.delta_rule_backward,
                "gated": dr.gated_delta_rule_backward, "kda": dr.kda_backward}
    order = [n for n in ("q", "k", "v", "beta", "log_gate") if n in tokens]
    return (forward[layer], backward[layer]), tokens, dict(scale=0.7), order, 3, "d_out", _normal(rng, 2, d_k, d_v)


@pytest.mark.parametrize("layer", ["linear", "delta", "gated", "kda", "ssd", "selective"])
@pytest.mark.parametrize("split", [1, 4, 6])
def test_backward_splits_at_a_state_boundary(layer, split):
    """Two halves chained by the state give the whole sequence's gradients (the chunkwise backward's idea).

    Forward: the first half's final state is the second half's initial state. Backward: the second
    half's d_initial_state is the first half's d_final_state; per-token gradients are the halves'
    gradients side by side, those of shared inputs (a, A, D) their sum.
    """
    T = 7
    rng = np.random.default_rng(18)
    (forward, backward), tokens, shared, order, n_positional, d_name, s0 = _split_case(layer, rng, T)

    def call(fn, sl, **kw):
        args = {n: np.take(a, range(T)[sl], axis=axis) for n, (a, axis) in tokens.items()} | shared
        ordered = [args[n] for n in order]
        return fn(*ordered[:n_positional], **dict(zip(order[n_positional:], ordered[n_positional:])),
                  **{n: a for n, a in shared.items() if n not in order}, **kw)

    everything = slice(0, T)
    out, state = call(forward, everything, initial_state=s0)
    w_out, w_state = _normal(rng, *out.shape), _normal(rng, *state.shape)
    whole = call(backward, everything, initial_state=s0, d_final_state=w_state, **{d_name: w_out})
    _, middle = call(forward, slice(0, split), initial_state=s0)
    late = call(backward, slice(split, T), initial_state=middle, d_final_state=w_state,
                **{d_name: w_out[..., split:, :]})
    early = call(backward, slice(0, split), initial_state=s0, d_final_state=late[-1],
                 **{d_name: w_out[..., :split, :]})
    names = [n for n in order if n != "scale"] + ["initial_state"]
    assert len(names) == len(whole)
    for name, g_whole, g_early, g_late in zip(names, whole, early, late):
        if name == "initial_state":                                 # only the first half sees it
            got = g_early
        elif name in tokens:                                        # per-token: side by side
            got = np.concatenate([g_early, g_late], axis=tokens[name][1])
        else:                                                       # shared by every token: summed
            got = g_early + g_late
        np.testing.assert_allclose(got, g_whole, rtol=1e-12, atol=1e-12, err_msg=name)


# ---------------------------------------------------------------- precision of every backward pass

def _calls():
    """One call of each attention-like backward pass on inputs cast by ``c`` (integer-valued, so ints work)."""
    rng = np.random.default_rng(17)
    base = dict(q=rng.integers(-2, 3, (4, 3)), k=rng.integers(-1, 2, (4, 3)), v=rng.integers(-2, 3, (4, 2)),
                w=rng.integers(-2, 3, (4, 2)), s=rng.integers(-1, 2, (3, 2)), gate=-np.ones(4, dtype=int),
                gates=-np.ones((4, 3), dtype=int), beta=np.ones(4, dtype=int))
    return {
        "softmax": lambda c: sa.softmax_attention_backward(c("q"), c("k"), c("v"), c("w")),
        "linear": lambda c: la.linear_attention_backward(c("q"), c("k"), c("v"), c("w"), log_gate=c("gate"),
                                                         initial_state=c("s"), d_final_state=c("s")),
        "delta": lambda c: dr.delta_rule_backward(c("q"), c("k"), c("v"), c("w"), beta=c("beta"),
                                                  initial_state=c("s"), d_final_state=c("s")),
        "gated": lambda c: dr.gated_delta_rule_backward(c("q"), c("k"), c("v"), c("w"), beta=c("beta"),
                                                        log_gate=c("gate"), initial_state=c("s"), d_final_state=c("s")),
        "kda": lambda c: dr.kda_backward(c("q"), c("k"), c("v"), c("w"), beta=c("beta"), log_gate=c("gates"),
                                         initial_state=c("s"), d_final_state=c("s")),
    }, base


CALLS, BASE = _calls()


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("dtype, expected", [(np.float32, np.float32), (np.float64, np.float64),
                                             (np.int64, np.float64), (np.float16, np.float32)])
def test_every_backward_keeps_the_input_precision(name, dtype, expected):
    got = CALLS[name](lambda key: BASE[key].astype(dtype))
    want = CALLS[name](lambda key: BASE[key].astype(np.float64))
    for g, w in zip(got, want):
        assert g.dtype == expected, (name, g.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


# ---------------------------------------------------------------- the checker

def test_gradcheck_catches_a_wrong_gradient_and_validates():
    rng = np.random.default_rng(6)
    q, k, v = _normal(rng, 4, 2), _normal(rng, 4, 2), _normal(rng, 4, 3)
    f = lambda q, k, v: sa.softmax_attention(q, k, v)[0]  # noqa: E731
    weights = gc.random_weights(f(q, k, v), 0)
    dq, dk, dv = sa.softmax_attention_backward(q, k, v, weights[0])
    inputs = dict(q=q, k=k, v=v)
    assert gc.max_relative_error(f, inputs, dict(q=dq, k=dk, v=dv), weights) <= TOL
    assert gc.max_relative_error(f, inputs, dict(k=dq), weights) > 0.1          # the wrong input's gradient
    assert gc.max_relative_error(f, inputs, dict(v=1.01 * dv), weights) > 1e-3  # one percent off
    with pytest.raises(ValueError, match="grads"):
        gc.relative_errors(f, inputs, dict(x=dq), weights)
    with pytest.raises(ValueError, match="grads"):
        gc.relative_errors(f, inputs, dict(q=dq[:3]), weights)
    with pytest.raises(ValueError, match="weights"):
        gc.relative_errors(f, inputs, dict(q=dq), (weights[0][:3],))
    with pytest.raises(ValueError, match="step"):
        gc.relative_errors(f, inputs, dict(q=dq), weights, step=0)
    with pytest.raises(ValueError, match="inputs"):
        gc.relative_errors(f, [q, k, v], dict(q=dq), weights)
