"""The chunkwise backward passes (chapter 9, "How a chunkwise backward follows").

Properties, in float64:
- the chunkwise backward of Gated DeltaNet, DeltaNet, linear attention (with and without a
  gate) and Mamba-2's SSD gives the gradients of the token-by-token backward
  (``*_backward``) to a relative error of at most 1e-12 (the largest difference over the
  largest entry, per gradient), over hypothesis-drawn shapes: leading axes (none, one,
  two, with inputs broadcast along them), lengths 1..40 that need not be multiples of
  the chunk, chunk sizes 1..20 (powers of two and not), with and without an initial
  state and a gradient of the final state;
- it agrees with central finite differences of the chunkwise forward (the bound
  of chapter 9, 1e-6), for every input, the gates and the initial state included;
- the one-chunk reference ``gated_delta_rule_chunk_backward`` is the token backward on
  one chunk, and run from the last chunk to the first (each given the state the forward
  gave it) it is the whole sequence's backward;
- the result does not depend on the chunk size, and tiny decays give finite gradients equal
  to the token backward's: a log-decay of -200 (e^-200 is about 1e-87, whose products over
  four or more such tokens underflow to 0 in a chunk of 64) and of -800 (e^-800 is 0 itself);
- float32 in gives float32 out, within 1e-5 of the float64 gradients (Gated DeltaNet and
  gated linear attention);
- the mixer table's backward entries are these chunkwise passes: with the token-by-token
  backward passes made to raise, they still run and give the token backward's numbers;
- bad input raises ValueError naming the argument.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples
from _finite_differences import BOUND, check

from fixedstate import delta_rule as dr
from fixedstate import linear_attention as la
from fixedstate import mixers
from fixedstate import ssm

TOL = 1e-12           # chunkwise against token backward, float64, relative to the largest entry
F32_TOL = 1e-5        # float32 chunkwise against float64 token backward (float32's epsilon is 1.2e-7)
LEADS = st.sampled_from([(), (2,), (2, 3)])


def rel(got, want):
    """Largest difference relative to the largest entry of ``want``."""
    scale = float(np.max(np.abs(want))) if np.size(want) else 0.0
    return float(np.max(np.abs(np.asarray(got) - want))) / (scale if scale > 0 else 1.0) if np.size(want) else 0.0


def assert_same(got, want, tol=TOL):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, i
            continue
        assert np.shape(g) == np.shape(w), (i, np.shape(g), np.shape(w))
        assert rel(g, w) <= tol, (i, rel(g, w))


def delta_inputs(rng, lead, T, d_k, d_v, *, thin_beta=False, thin_state=False):
    """Unit keys, beta in [0, 1], gates in (0.3, 1]; optional inputs broadcast along the leading axes."""
    k = rng.standard_normal(lead + (T, d_k))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta_lead = lead[1:] if thin_beta and lead else lead
    return {"q": rng.standard_normal(lead + (T, d_k)), "k": k, "v": rng.standard_normal(lead + (T, d_v)),
            "beta": rng.uniform(0.0, 1.0, beta_lead + (T,)),
            "log_gate": np.log(rng.uniform(0.3, 1.0, beta_lead + (T,))),
            "initial_state": rng.standard_normal(((() if thin_state else lead) + (d_k, d_v)))}


shapes = st.tuples(LEADS, st.integers(1, 40), st.integers(1, 5), st.integers(1, 4), st.integers(1, 20),
                   st.booleans(), st.booleans(), st.booleans(), st.integers(0, 2 ** 31))


@examples(40)
@given(shapes)
def test_gated_delta_rule_chunkwise_backward_is_the_token_backward(case):
    lead, T, d_k, d_v, chunk, with_state, with_final, thin, seed = case
    rng = np.random.default_rng(seed)
    x = delta_inputs(rng, lead, T, d_k, d_v, thin_beta=thin, thin_state=thin)
    S0 = x.pop("initial_state") if with_state else None
    d_out = rng.standard_normal(lead + (T, d_v))
    dSf = rng.standard_normal(lead + (d_k, d_v)) if with_final else None
    want = dr.gated_delta_rule_backward(x["q"], x["k"], x["v"], d_out, beta=x["beta"], log_gate=x["log_gate"],
                                        scale=0.7, initial_state=S0, d_final_state=dSf)
    got = dr.gated_delta_rule_chunkwise_backward(x["q"], x["k"], x["v"], d_out, beta=x["beta"],
                                                 log_gate=x["log_gate"], scale=0.7, initial_state=S0,
                                                 d_final_state=dSf, chunk_size=chunk)
    assert_same(got, want)
    want = dr.delta_rule_backward(x["q"], x["k"], x["v"], d_out, beta=x["beta"], initial_state=S0,
                                  d_final_state=dSf)
    got = dr.delta_rule_chunkwise_backward(x["q"], x["k"], x["v"], d_out, beta=x["beta"], initial_state=S0,
                                           d_final_state=dSf, chunk_size=chunk)
    assert_same(got, want)


@examples(40)
@given(shapes)
def test_linear_attention_chunkwise_backward_is_the_token_backward(case):
    lead, T, d_k, d_v, chunk, with_state, with_final, gated, seed = case
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal(lead + (T, d_k)), rng.standard_normal(lead + (T, d_k))
    v, d_out = rng.standard_normal(lead + (T, d_v)), rng.standard_normal(lead + (T, d_v))
    log_gate = np.log(rng.uniform(0.3, 1.0, lead[1:] + (T,))) if gated else None     # broadcast along lead[0]
    S0 = rng.standard_normal((d_k, d_v)) if with_state else None                      # broadcast along all
    dSf = rng.standard_normal(lead + (d_k, d_v)) if with_final else None
    kw = dict(log_gate=log_gate, scale=1.3, initial_state=S0, d_final_state=dSf)
    want = la.linear_attention_backward(q, k, v, d_out, **kw)
    got = la.linear_attention_chunkwise_backward(q, k, v, d_out, **kw, chunk_size=chunk)
    assert_same(got, want)


@examples(40)
@given(shapes)
def test_ssd_chunkwise_backward_is_the_token_backward(case):
    lead, T, N, P, chunk, with_state, with_final, with_D, seed = case
    rng = np.random.default_rng(seed)
    heads = lead[-1:] if lead else ()
    x, B, C = (rng.standard_normal(lead + (T, n)) for n in (P, N, N))
    delta = rng.uniform(0.05, 1.5, lead + (T,))
    a = -rng.uniform(0.1, 2.0, heads)                                                  # one per head
    D = rng.standard_normal(heads) if with_D else None
    S0 = rng.standard_normal(lead + (N, P)) if with_state else None
    d_y = rng.standard_normal(lead + (T, P))
    dSf = rng.standard_normal(lead + (N, P)) if with_final else None
    kw = dict(D=D, initial_state=S0, d_final_state=dSf)
    want = ssm.ssd_backward(x, delta, a, B, C, d_y, **kw)
    got = ssm.ssd_chunkwise_backward(x, delta, a, B, C, d_y, **kw, chunk_size=chunk)
    assert_same(got, want)


@examples(12)
@given(st.integers(1, 9), st.integers(1, 4), st.integers(1, 3), st.integers(1, 5), st.integers(0, 2 ** 31))
def test_chunkwise_backward_matches_finite_differences(T, d_k, d_v, chunk, seed):
    rng = np.random.default_rng(seed)
    x = delta_inputs(rng, (2,), T, d_k, d_v)

    def forward(q, k, v, beta, log_gate, initial_state):
        return dr.gated_delta_rule_chunkwise(q, k, v, beta=beta, log_gate=log_gate, scale=0.8,
                                             initial_state=initial_state, chunk_size=chunk)

    def backward(d_out, d_state):
        g = dr.gated_delta_rule_chunkwise_backward(**x, d_out=d_out, scale=0.8, d_final_state=d_state,
                                                   chunk_size=chunk)
        return dict(zip(["q", "k", "v", "beta", "log_gate", "initial_state"], g))
    assert check(forward, x, backward) <= BOUND

    la_in = {"q": x["q"], "k": x["k"], "v": x["v"], "log_gate": x["log_gate"], "initial_state": x["initial_state"]}

    def la_forward(q, k, v, log_gate, initial_state):      # the gated recurrence through the token scan's forward
        S, outs = initial_state, []
        for t in range(q.shape[-2]):
            S = np.exp(log_gate[..., t])[..., None, None] * S + k[..., t, :, None] * v[..., t, None, :]
            outs.append(0.8 * np.einsum("...kv,...k->...v", S, q[..., t, :]))
        return np.stack(outs, axis=-2), S

    def la_backward(d_out, d_state):
        g = la.linear_attention_chunkwise_backward(**la_in, d_out=d_out, scale=0.8, d_final_state=d_state,
                                                   chunk_size=chunk)
        return dict(zip(["q", "k", "v", "log_gate", "initial_state"], g))
    assert check(la_forward, la_in, la_backward) <= BOUND

    P, N = d_v, d_k
    ssd_in = {"x": rng.standard_normal((2, T, P)), "delta": rng.uniform(0.1, 1.0, (2, T)), "a": np.array(-0.7),
              "B": rng.standard_normal((2, T, N)), "C": rng.standard_normal((2, T, N)), "D": np.array(0.3),
              "initial_state": rng.standard_normal((2, N, P))}

    def ssd_forward(x, delta, a, B, C, D, initial_state):
        return ssm.ssd_chunkwise(x, delta, a, B, C, D=D, initial_state=initial_state, chunk_size=chunk)

    def ssd_backward(d_y, d_state):
        g = ssm.ssd_chunkwise_backward(**ssd_in, d_y=d_y, d_final_state=d_state, chunk_size=chunk)
        return dict(zip(["x", "delta", "a", "B", "C", "D", "initial_state"], g))
    assert check(ssd_forward, ssd_in, ssd_backward) <= BOUND


@examples(20)
@given(st.integers(1, 12), st.integers(1, 5), st.integers(1, 4), st.booleans(), st.integers(0, 2 ** 31))
def test_one_chunk_reference_is_the_token_backward(C, d_k, d_v, with_final, seed):
    rng = np.random.default_rng(seed)
    x = delta_inputs(rng, (), C, d_k, d_v)
    d_out = rng.standard_normal((C, d_v))
    dSf = rng.standard_normal((d_k, d_v)) if with_final else None
    want = dr.gated_delta_rule_backward(**x, d_out=d_out, scale=0.6, d_final_state=dSf)
    got = dr.gated_delta_rule_chunk_backward(**x, d_out=d_out, scale=0.6, d_final_state=dSf)
    assert_same(got, want)


def test_one_chunk_reference_chunk_after_chunk_is_the_whole_backward():
    rng = np.random.default_rng(3)
    T, d_k, d_v, C = 45, 6, 5, 8
    x = delta_inputs(rng, (), T, d_k, d_v)
    d_out, dSf = rng.standard_normal((T, d_v)), rng.standard_normal((d_k, d_v))
    starts, S = [], x["initial_state"]
    for s in range(0, T, C):                                   # forwards: the state each chunk starts from
        starts.append(S)
        r = slice(s, s + C)
        _, S = dr.gated_delta_rule_chunk(x["q"][r], x["k"][r], x["v"][r], beta=x["beta"][r],
                                         log_gate=x["log_gate"][r], scale=0.9, initial_state=S)
    parts, dS = [], dSf
    for j, s in reversed(list(enumerate(range(0, T, C)))):    # backwards: each chunk hands dS_0 to the one before
        r = slice(s, s + C)
        *grads, dS = dr.gated_delta_rule_chunk_backward(x["q"][r], x["k"][r], x["v"][r], d_out[r],
                                                         beta=x["beta"][r], log_gate=x["log_gate"][r], scale=0.9,
                                                         initial_state=starts[j], d_final_state=dS)
        parts.append(grads)
    got = [np.concatenate([p[i] for p in reversed(parts)]) for i in range(5)] + [dS]
    want = dr.gated_delta_rule_backward(**x, d_out=d_out, scale=0.9, d_final_state=dSf)
    assert_same(got, want)
    fast = dr.gated_delta_rule_chunkwise_backward(**x, d_out=d_out, scale=0.9, d_final_state=dSf, chunk_size=C)
    assert_same(fast, got)


@pytest.mark.parametrize("tiny", [-200.0, -800.0])          # e^-200 ~ 1e-87 (products underflow); e^-800 = 0
def test_underflowing_decays_give_the_token_backward(tiny):
    rng = np.random.default_rng(5)
    T, d_k, d_v = 50, 4, 3
    x = delta_inputs(rng, (2,), T, d_k, d_v)
    x["log_gate"][:, ::7] = tiny                              # the state is (all but) erased there
    d_out = rng.standard_normal((2, T, d_v))
    want = dr.gated_delta_rule_backward(**x, d_out=d_out)
    for chunk in (4, 16, 64):
        got = dr.gated_delta_rule_chunkwise_backward(**x, d_out=d_out, chunk_size=chunk)
        assert all(np.isfinite(g).all() for g in got)
        assert_same(got, want)
    want = la.linear_attention_backward(x["q"], x["k"], x["v"], d_out, log_gate=x["log_gate"])
    got = la.linear_attention_chunkwise_backward(x["q"], x["k"], x["v"], d_out, log_gate=x["log_gate"],
                                                 chunk_size=16)
    assert_same(got, want)


def test_float32_in_float32_out():
    rng = np.random.default_rng(7)
    x = delta_inputs(rng, (3,), 70, 16, 8)
    d_out = rng.standard_normal((3, 70, 8))
    want = dr.gated_delta_rule_backward(**x, d_out=d_out)
    got = dr.gated_delta_rule_chunkwise_backward(**{n: a.astype(np.float32) for n, a in x.items()},
                                                 d_out=d_out.astype(np.float32), chunk_size=16)
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        assert rel(g, w) <= F32_TOL
    la_want = la.linear_attention_backward(x["q"], x["k"], x["v"], d_out, log_gate=x["log_gate"])
    la_got = la.linear_attention_chunkwise_backward(x["q"].astype(np.float32), x["k"].astype(np.float32),
                                                    x["v"].astype(np.float32), d_out.astype(np.float32),
                                                    log_gate=x["log_gate"].astype(np.float32))
    for g, w in zip(la_got, la_want):
        assert g.dtype == np.float32
        assert rel(g, w) <= F32_TOL


def test_mixer_backward_entries_are_the_chunkwise_passes(monkeypatch):
    rng = np.random.default_rng(11)
    x = delta_inputs(rng, (2,), 37, 8, 8)
    q, k, v, d_out = x["q"], x["k"], x["v"], rng.standard_normal((2, 37, 8))
    gates = {"beta": x["beta"], "log_gate": x["log_gate"]}
    ssd_gates = {"delta": rng.uniform(0.1, 1.0, (2, 37)), "a": -0.5}
    # the token backward's numbers, computed before the token passes are made to raise
    want_gated = dr.gated_delta_rule_backward(q, k, v, d_out, beta=x["beta"], log_gate=x["log_gate"])[:5]
    want_delta = dr.delta_rule_backward(q, k, v, d_out, beta=x["beta"])[:4]
    want_linear = la.linear_attention_backward(q, k, v, d_out)[:3]
    dx, ddelta, da, dB, dC, _, _ = ssm.ssd_backward(v, ssd_gates["delta"], -0.5, k, q, d_out)

    def refuse(*args, **kwargs):
        raise AssertionError("a mixer's backward called a token-by-token backward pass")
    for module, name in ((dr, "gated_delta_rule_backward"), (dr, "delta_rule_backward"),
                         (la, "linear_attention_backward"), (ssm, "ssd_backward")):
        monkeypatch.setattr(module, name, refuse)             # the table must not reach the token passes ...
    called = []

    def spy(module, name):                                     # ... and must reach the chunkwise ones
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            called.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)
    for module, name in ((dr, "gated_delta_rule_chunkwise_backward"), (dr, "delta_rule_chunkwise_backward"),
                         (la, "linear_attention_chunkwise_backward"), (ssm, "ssd_chunkwise_backward")):
        spy(module, name)
    dq, dk, dv, dg = mixers.MIXERS["gated_delta"].backward(q, k, v, gates, d_out, scale=1.0)
    assert_same([dq, dk, dv, dg["beta"], dg["log_gate"]], want_gated)
    assert called[:1] == ["gated_delta_rule_chunkwise_backward"]
    called.clear()
    dq, dk, dv, dg = mixers.MIXERS["delta"].backward(q, k, v, gates, d_out, scale=1.0, chunk_size=5)
    assert_same([dq, dk, dv, dg["beta"]], want_delta)
    assert called[:1] == ["delta_rule_chunkwise_backward"]
    called.clear()
    dq, dk, dv, _ = mixers.MIXERS["linear"].backward(q, k, v, {}, d_out, scale=1.0)
    assert_same([dq, dk, dv], want_linear)
    assert called[:1] == ["linear_attention_chunkwise_backward"]
    called.clear()
    dq, dk, dv, dg = mixers.MIXERS["ssd"].backward(q, k, v, ssd_gates, d_out, scale=1.0)
    assert_same([dq, dk, dv, dg["delta"], dg["a"]], [dC, dB, dx, ddelta, da])
    assert called[:1] == ["ssd_chunkwise_backward"]               # the first call: the mixer's own


def test_bad_input_names_the_argument():
    rng = np.random.default_rng(13)
    x = delta_inputs(rng, (), 10, 3, 2)
    d_out = rng.standard_normal((10, 2))
    with pytest.raises(ValueError, match="chunk_size"):
        dr.gated_delta_rule_chunkwise_backward(**x, d_out=d_out, chunk_size=0)
    with pytest.raises(ValueError, match="d_out"):
        dr.gated_delta_rule_chunkwise_backward(**x, d_out=d_out[:, :1])
    with pytest.raises(ValueError, match="log_gate"):
        dr.gated_delta_rule_chunkwise_backward(**{**x, "log_gate": -x["log_gate"] + 0.1}, d_out=d_out)
    with pytest.raises(ValueError, match="beta"):
        dr.delta_rule_chunkwise_backward(x["q"], x["k"], x["v"], d_out, beta=x["beta"] + 1.5)
    with pytest.raises(ValueError, match="d_final_state"):
        dr.gated_delta_rule_chunkwise_backward(**x, d_out=d_out, d_final_state=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="q"):
        dr.gated_delta_rule_chunk_backward(**{**x, "q": x["q"][None]}, d_out=d_out)
    with pytest.raises(ValueError, match="d_out"):
        dr.gated_delta_rule_chunk_backward(**x, d_out=d_out[:5])
    with pytest.raises(ValueError, match="chunk_size"):
        la.linear_attention_chunkwise_backward(x["q"], x["k"], x["v"], d_out, chunk_size=1.5)
    with pytest.raises(ValueError, match="initial_state"):
        la.linear_attention_chunkwise_backward(x["q"], x["k"], x["v"], d_out, initial_state=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="chunk_size"):
        ssm.ssd_chunkwise_backward(x["v"], np.ones(10), -1.0, x["k"], x["q"], d_out, chunk_size=-2)
    with pytest.raises(ValueError, match="d_y"):
        ssm.ssd_chunkwise_backward(x["v"], np.ones(10), -1.0, x["k"], x["q"], d_out[:3])
