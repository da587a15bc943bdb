"""Tests for fixedstate.precision: bfloat16 storage, float32 arithmetic and state.

Properties from chapter 8: rounding to bfloat16 is idempotent and within half its spacing;
with float32 storage and a float32 state the mixed-precision gated delta rule is the
float32 core, recurrent and chunkwise alike, within float32 rounding of the float64 run;
a bfloat16 state loses more than a float32 one by orders of magnitude when the decays are
weak, and loses a decay closer to 1 than its spacing altogether.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _examples import examples

from fixedstate import delta_rule as dr
from fixedstate import layers as L
from fixedstate import precision as pr
from fixedstate import ssm
from fixedstate.prose import max_relative_error


@given(seed=st.integers(0, 2 ** 16), scale=st.floats(1e-3, 1e3))
@examples(30)
def test_round_to_bfloat16_is_idempotent_and_within_half_a_spacing(seed, scale):
    x = scale * np.random.default_rng(seed).standard_normal(50)
    r = pr.round_to(x)
    assert r.dtype == np.float32 and np.array_equal(pr.round_to(r), r)
    assert np.all(np.abs(r - x) <= 2.0 ** -8 * np.abs(x) * (1 + 2.0 ** -15))      # 8 significant bits
    assert np.array_equal(pr.round_to(x, np.float64), x)


def inputs(seed, T, log_gate_scale, H=1, d=8):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, H, T, d))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((H, T, d))
    beta = rng.uniform(0.1, 0.9, (H, T))
    log_gate = -log_gate_scale * rng.uniform(0.5, 1.5, (H, T))
    return q, k, v, beta, log_gate


@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
@given(seed=st.integers(0, 2 ** 16), T=st.integers(1, 70), chunk=st.integers(1, 20))
@examples(15)
def test_float32_state_is_the_float32_core_within_float32_rounding(form, seed, T, chunk):
    q, k, v, beta, log_gate = inputs(seed, T, 0.05)
    o, S = pr.gated_delta_rule_mixed(q, k, v, beta=beta, log_gate=log_gate, scale=0.5, form=form, chunk_size=chunk,
                                     io_dtype=np.float32)
    assert o.dtype == S.dtype == np.float32
    ref, S_ref = dr.gated_delta_rule_recurrent(q, k, v, beta=beta, log_gate=log_gate.astype(np.float32), scale=0.5)
    assert max_relative_error(o, ref) < 1e-5 and max_relative_error(S, S_ref) < 1e-5


def test_a_bfloat16_state_loses_orders_of_magnitude_more_than_a_float32_one():
    q, k, v, beta, log_gate = inputs(0, 300, 1e-3)
    qr, kr, vr, br = (pr.round_to(a).astype(np.float64) for a in (q, k, v, beta))
    ref, _ = dr.gated_delta_rule_recurrent(qr, kr, vr, beta=br, log_gate=log_gate.astype(np.float32).astype(float),
                                           scale=0.5)
    for form in ("recurrent", "chunkwise"):
        err = {st: max_relative_error(pr.gated_delta_rule_mixed(q, k, v, beta=beta, log_gate=log_gate, scale=0.5,
                                                                form=form, chunk_size=16, state_dtype=st)[0], ref)
               for st in (np.float32, pr.BFLOAT16)}
        assert err[np.float32] < 1e-5 and err[pr.BFLOAT16] > 100 * err[np.float32]


def test_a_decay_closer_to_one_than_bfloat16s_spacing_is_rounded_away():
    s32 = s16 = np.float32(1.0)
    g = np.float32(np.exp(-1e-3))
    for _ in range(1000):
        s32 = s32 * g
        s16 = pr.round_to(s16 * g)
    assert abs(s32 - np.exp(-1.0)) < 1e-4 and s16 == 1.0


def test_round_params_keeps_A_log_and_gated_deltanets_norm_weight_in_float32_and_rounds_the_rest():
    p = L.init_gated_deltanet(L.GatedDeltaNetConfig(8, 2, 1, 4, 4), 0)
    p["norm_weight"] = 1.0 + 0.1 * np.random.default_rng(1).standard_normal(p["norm_weight"].shape)  # as trained
    r = pr.round_params(p)
    assert r["config"] is p["config"]
    for name in ("A_log", "norm_weight"):                               # float32, unrounded, as Qwen3.5 ships them
        assert r[name].dtype == np.float32 and np.array_equal(r[name], p[name].astype(np.float32))
        assert not np.array_equal(pr.round_to(r[name]), r[name])        # not on bfloat16's grid
    for name in set(p) - {"config", "A_log", "norm_weight"}:           # weights and dt_bias are rounded
        assert r[name].dtype == np.float32 and np.array_equal(r[name], pr.round_to(p[name]))
    assert not np.array_equal(r["dt_bias"], p["dt_bias"]) and not np.array_equal(r["W_q"], p["W_q"])


@pytest.mark.parametrize("init, config", [(L.init_kda, L.KDAConfig(8, 2, 4, 4)),
                                          (L.init_mamba2, L.Mamba2Config(8, 2, 4, 4, 1))])
def test_round_params_rounds_the_norm_weight_of_other_layers(init, config):
    p = init(config, 0)
    p["norm_weight"] = 1.0 + 0.1 * np.random.default_rng(1).standard_normal(p["norm_weight"].shape)
    r = pr.round_params(p)
    assert np.array_equal(r["norm_weight"], pr.round_to(p["norm_weight"]))
    assert not np.array_equal(r["norm_weight"], p["norm_weight"].astype(np.float32))
    assert np.array_equal(r["A_log"], p["A_log"].astype(np.float32))


def test_precision_refuses_bad_input_naming_it():
    q, k, v, beta, log_gate = inputs(0, 5, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        pr.round_to(q, np.float16)
    with pytest.raises(ValueError, match="state_dtype"):
        pr.gated_delta_rule_mixed(q, k, v, beta=beta, log_gate=log_gate, state_dtype="int8")
    with pytest.raises(ValueError, match="form"):
        pr.gated_delta_rule_mixed(q, k, v, beta=beta, log_gate=log_gate, form="parallel")
    with pytest.raises(ValueError, match="T"):
        pr.gated_delta_rule_mixed(q, k, v[..., :4, :], beta=beta, log_gate=log_gate)
    with pytest.raises(ValueError, match="params"):
        pr.round_params([1.0])


def stored_chunks_reference(q, k, v, beta, log_gate, scale, chunk, rd):
    """flash-linear-attention's chunkwise forward for one sequence, chunk by chunk, in float64: ``eq-dr-ut``,
    ``eq-dr-chunk-out``, ``eq-dr-chunk-state`` written plainly, with ``rd`` where ``chunk_delta_h.py`` stores
    (the incoming state, read by the outputs and by ``v_new = u - w h``; ``v_new`` as the outputs read it; the
    decayed ``v_new`` the scalar gate's carry adds, or ``v_new`` itself beside KDA's decayed keys)."""
    r = lambda a: a.astype(rd).astype(np.float64)
    channelwise = log_gate.ndim == 2
    S = np.zeros((k.shape[1], v.shape[1]))
    out = []
    for s in range(0, len(q), chunk):
        Q, K, V, bt = q[s:s + chunk], k[s:s + chunk], v[s:s + chunk], beta[s:s + chunk, None]
        lg = log_gate[s:s + chunk] if channelwise else np.repeat(log_gate[s:s + chunk, None], k.shape[1], 1)
        b = np.cumsum(lg, axis=0)                                             # (C, d_k)
        C = len(Q)
        below = np.tril(np.ones((C, C), bool))[:, :, None]
        D = np.exp(np.where(below, b[:, None, :] - b[None, :, :], -np.inf))  # e^{b_r - b_i}, i <= r, per channel
        A = np.tril(bt * np.einsum("rc,ic,ric->ri", K, K, D), -1)
        T_inv = np.linalg.inv(np.eye(C) + A)
        u_free, w = T_inv @ (bt * V), T_inv @ (bt * np.exp(b) * K)           # U~ and W
        S_read = r(S)
        U = u_free - w @ S_read                                               # v_new
        out.append(scale * ((np.exp(b) * Q) @ S_read + np.einsum("rc,ic,ric->ri", Q, K, D) @ r(U)))
        to_end = np.exp(b[-1] - b)
        if channelwise:
            S = np.exp(b[-1])[:, None] * S + (to_end * K).T @ r(U)
        else:
            S = np.exp(b[-1, 0]) * S + K.T @ r(to_end[:, :1] * U)
    return np.concatenate(out), S


@pytest.mark.parametrize("core", ["gated_delta", "kda"])
@given(seed=st.integers(0, 2 ** 16), T=st.integers(1, 50), chunk=st.integers(1, 12), strength=st.floats(1e-3, 3.0))
@examples(10)
def test_the_delta_rules_stored_intermediates_are_flash_linear_attentions(core, seed, T, chunk, strength):
    # with float64 arithmetic only the rounding to bfloat16 remains: the same roundings as the plain chunk loop
    mixed, _, args, kwargs, _ = core_case(core, seed, T, strength, lead=(2,))
    o, S = mixed(*args, **kwargs, chunk_size=chunk, read_dtype=pr.BFLOAT16, **F64)
    for h in range(2):
        one = [a[h] for a in args]
        ref, S_ref = stored_chunks_reference(*one, kwargs["beta"][h], kwargs["log_gate"][h], 0.5, chunk, pr.BFLOAT16)
        assert output_error(o[h], ref, S_ref) < 1e-12 and max_relative_error(S[h], S_ref) < 1e-12


@pytest.mark.parametrize("core", ["gated_delta", "kda"])
def test_in_the_delta_rules_the_bfloat16_stores_reach_the_float32_carry(core):
    # flash-linear-attention's carry reads its stored bfloat16 state and adds bfloat16 v_new: the carry changes,
    # by about one bfloat16 rounding of what it holds (the state's own size), not by orders more
    mixed, _, args, kwargs, _ = core_case(core, 2, 200, 1e-3)
    _, S_ref = rounded_reference(core, 2, 200, 1e-3)
    o32, S32 = mixed(*args, **kwargs, chunk_size=16)
    o_rd, S_rd = mixed(*args, **kwargs, chunk_size=16, read_dtype=pr.BFLOAT16)
    assert o_rd.dtype == S_rd.dtype == np.float32
    assert max_relative_error(S32, S_ref) < 1e-5
    assert 100 * max_relative_error(S32, S_ref) < max_relative_error(S_rd, S_ref) < 2.0 ** -8 * 8


def test_the_ssds_bfloat16_chunk_states_read_do_not_accumulate_over_the_sequence():
    # mamba_ssm's SSD: the carry stays float32, so the rounding of what the outputs read cannot build up, while a
    # carry rounded once per chunk does (no skip term D, so that the outputs are what reads the state)
    mixed, exact, args, _, stored = core_case("ssd", 1, 1200, 1e-3)
    (xr, delta, a, Br, Cr), _ = stored(lambda a: pr.round_to(a).astype(np.float64))
    to32 = lambda a: np.asarray(a, np.float32).astype(np.float64)
    x, _, _, B, C = args
    err = {}
    for T in (150, 1200):
        ref, _ = exact(xr[..., :T, :], to32(delta[..., :T]), to32(a), Br[..., :T, :], Cr[..., :T, :])
        for name, kw in (("read", dict(read_dtype=pr.BFLOAT16)), ("carry", dict(state_dtype=pr.BFLOAT16))):
            o, _ = mixed(x[..., :T, :], delta[..., :T], a, B[..., :T, :], C[..., :T, :], chunk_size=16, **kw)
            err[name, T] = max_relative_error(o, ref)
    assert err["read", 1200] < 2 * err["read", 150] and err["read", 1200] < 2.0 ** -8   # about one rounding
    assert err["carry", 1200] > 2 * err["read", 1200]


def test_read_dtype_only_with_the_chunkwise_form():
    q, k, v, beta, log_gate = inputs(0, 5, 0.1)
    with pytest.raises(ValueError, match="read_dtype"):
        pr.gated_delta_rule_mixed(q, k, v, beta=beta, log_gate=log_gate, form="recurrent", read_dtype=pr.BFLOAT16)
    with pytest.raises(ValueError, match="read_dtype"):
        pr.gated_delta_rule_mixed(q, k, v, beta=beta, log_gate=log_gate, read_dtype="int8")


# --------------------------------------------------------------------------- the four cores, one driver
#
# Each case draws one core's inputs at a given decay strength (the log-decays per token are about
# -strength), with leading axes `lead`, and names the mixed run, the float64 core it must reproduce,
# and the inputs the core reads in float64 after the mixed run's rounding.

CORES = ["gated_delta", "kda", "ssd", "selective"]


def core_case(core, seed, T, strength, lead=(1,), d=6, N=5):
    rng = np.random.default_rng(seed)
    spread = rng.uniform(0.5, 1.5, lead + (T,))
    if core in ("gated_delta", "kda"):
        q, k = rng.standard_normal((2,) + lead + (T, d))
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.standard_normal(lead + (T, d))
        beta = rng.uniform(0.1, 0.9, lead + (T,))
        log_gate = -strength * (spread if core == "gated_delta" else rng.uniform(0.5, 1.5, lead + (T, d)))
        mixed = pr.gated_delta_rule_mixed if core == "gated_delta" else pr.kda_mixed
        exact = dr.gated_delta_rule_recurrent if core == "gated_delta" else dr.kda_recurrent
        return (mixed, exact, (q, k, v), dict(beta=beta, log_gate=log_gate, scale=0.5),
                lambda r: ((r(q), r(k), r(v)), dict(beta=r(beta), log_gate=log_gate, scale=0.5)))
    x = rng.standard_normal(lead + (T, d))
    B, C = rng.standard_normal((2,) + lead + (T, N))
    if core == "ssd":
        a = -rng.uniform(0.5, 1.5, lead)                      # one a per head
        delta = strength * spread                             # log g = a delta, about -strength
        D = rng.standard_normal(lead)
        return (pr.ssd_mixed, ssm.ssd_recurrent, (x, delta, a, B, C), dict(D=D),
                lambda r: ((r(x), delta, a, r(B), r(C)), dict(D=D)))
    A = -rng.uniform(0.5, 1.5, (d, N))
    delta = strength * rng.uniform(0.5, 1.5, lead + (T, d))
    D = rng.standard_normal(d)
    return (pr.selective_scan_mixed, ssm.selective_scan_sequential, (x, delta, A, B, C), dict(D=D),
            lambda r: ((r(x), delta, A, r(B), r(C)), dict(D=D)))


def rounded_reference(core, seed, T, strength, **shape):
    """The float64 core on the mixed run's stored inputs (bfloat16 values; gates through float32)."""
    _, exact, _, _, stored = core_case(core, seed, T, strength, **shape)
    args, kwargs = stored(lambda a: pr.round_to(a).astype(np.float64))
    if "log_gate" in kwargs:
        kwargs["log_gate"] = kwargs["log_gate"].astype(np.float32).astype(np.float64)
    else:                                                  # delta and the decay rates through float32
        args = tuple(a if i not in (1, 2) else np.asarray(a, np.float32).astype(np.float64)
                     for i, a in enumerate(args))
        kwargs = {"D": np.asarray(kwargs["D"], np.float32).astype(np.float64)}
    return exact(*args, **kwargs)


F64 = dict(io_dtype=np.float64, state_dtype=np.float64, compute_dtype=np.float64)


def output_error(o, ref, S_ref):
    """``|o - ref|`` relative to the larger of the outputs and the final state: an output reads the state
    (``S^T q``, ``S^T C``), so its rounding error scales with the state even where cancellation in the
    read makes the output itself small (one token whose key nearly misses the query)."""
    return float(np.max(np.abs(o - ref))) / max(float(np.max(np.abs(ref))), float(np.max(np.abs(S_ref))))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
@given(seed=st.integers(0, 2 ** 16), T=st.integers(1, 40), chunk=st.integers(1, 12),
       lead=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple), strength=st.floats(1e-3, 3.0))
@examples(12)
def test_in_float64_every_mixed_run_is_its_float64_core(core, form, seed, T, chunk, lead, strength):
    mixed, exact, args, kwargs, _ = core_case(core, seed, T, strength, lead=lead)
    o, S = mixed(*args, **kwargs, form=form, chunk_size=chunk, **F64)
    ref, S_ref = exact(*args, **kwargs)
    assert o.dtype == S.dtype == np.float64 and o.shape == ref.shape and S.shape == S_ref.shape
    assert output_error(o, ref, S_ref) < 1e-12 and max_relative_error(S, S_ref) < 1e-12
    if form == "chunkwise":                                  # the stored intermediates in float64 change nothing
        o, S = mixed(*args, **kwargs, form=form, chunk_size=chunk, read_dtype=np.float64, **F64)
        assert o.shape == ref.shape and S.shape == S_ref.shape
        assert output_error(o, ref, S_ref) < 1e-12 and max_relative_error(S, S_ref) < 1e-12


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
@given(seed=st.integers(0, 2 ** 16), T=st.integers(1, 70), chunk=st.integers(1, 20), strength=st.floats(1e-3, 3.0))
@examples(10)
def test_a_float32_state_stays_within_float32_rounding_of_float64_on_the_rounded_inputs(core, form, seed, T, chunk,
                                                                                        strength):
    mixed, _, args, kwargs, _ = core_case(core, seed, T, strength)
    o, S = mixed(*args, **kwargs, form=form, chunk_size=chunk)
    assert o.dtype == S.dtype == np.float32
    ref, S_ref = rounded_reference(core, seed, T, strength)
    assert output_error(o, ref, S_ref) < 1e-5 and max_relative_error(S, S_ref) < 1e-5


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
def test_with_weak_decays_a_bfloat16_state_is_orders_of_magnitude_worse(core, form):
    mixed, _, args, kwargs, _ = core_case(core, 3, 300, 1e-3)
    ref, _ = rounded_reference(core, 3, 300, 1e-3)
    err = {s: max_relative_error(mixed(*args, **kwargs, form=form, chunk_size=16, state_dtype=s)[0], ref)
           for s in (np.float32, pr.BFLOAT16)}
    assert err[np.float32] < 1e-5 and err[pr.BFLOAT16] > 100 * err[np.float32]


@pytest.mark.parametrize("core", ["ssd", "selective"])
@given(seed=st.integers(0, 2 ** 16), T=st.integers(1, 50), chunk=st.integers(1, 12))
@examples(8)
def test_the_state_space_cores_read_bfloat16_chunk_states_without_touching_the_carry(core, seed, T, chunk):
    mixed, _, args, kwargs, _ = core_case(core, seed, T, 0.05)
    o32, S32 = mixed(*args, **kwargs, chunk_size=chunk)
    o_rd, S_rd = mixed(*args, **kwargs, chunk_size=chunk, read_dtype=pr.BFLOAT16)
    assert np.array_equal(S_rd, S32) and np.array_equal(o_rd[..., :chunk, :], o32[..., :chunk, :])
    assert 0 < max_relative_error(o_rd, o32) < 2.0 ** -8 * 8 or T <= chunk


@pytest.mark.parametrize("core", CORES)
def test_the_mixed_runs_refuse_bad_input_naming_it(core):
    mixed, _, args, kwargs, _ = core_case(core, 0, 6, 0.1)
    with pytest.raises(ValueError, match="compute_dtype"):
        mixed(*args, **kwargs, compute_dtype=pr.BFLOAT16)
    with pytest.raises(ValueError, match="io_dtype"):
        mixed(*args, **kwargs, io_dtype=np.float16)
    with pytest.raises(ValueError, match="form"):
        mixed(*args, **kwargs, form="parallel")
    with pytest.raises(ValueError, match="chunk_size"):
        mixed(*args, **kwargs, chunk_size=0)
    with pytest.raises(ValueError, match="read_dtype"):
        mixed(*args, **kwargs, form="recurrent", read_dtype=pr.BFLOAT16)
    short = (args[0][..., :5, :],) + tuple(args[1:])                 # one input a token short
    with pytest.raises(ValueError, match="T >= 1"):
        mixed(*short, **kwargs)
    empty = tuple(np.asarray(a)[..., :0, :] if np.ndim(a) >= 2 and np.shape(a)[-2] == 6 else a for a in args)
    with pytest.raises(ValueError, match="T >= 1"):
        mixed(*empty, **kwargs)
