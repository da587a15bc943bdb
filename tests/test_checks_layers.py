"""The exercise checks of chapter "The layers as they ship": pass on the reference, fail with a
specific message on each plausible wrong answer."""

import numpy as np
import pytest

from fixedstate import blocks as bl
from fixedstate import layers as fl
from fixedstate.checks import layers as ch


# --- numeric answers ----------------------------------------------------------------------

def test_stored_answers_match_independent_arithmetic():
    a = ch.ANSWERS
    state, conv = 80 * 128 * 64, 3 * (80 * 64 + 2 * 1 * 128)     # H N P; (K - 1)(d_inner + 2 G N)
    assert a["ex-sl-budget/state"]["value"] == state
    assert a["ex-sl-budget/conv"]["value"] == conv
    assert a["ex-sl-budget/kib"]["value"] == pytest.approx(2 * (state + conv) / 1024, rel=1e-12)


@pytest.mark.parametrize("label", sorted(ch.ANSWERS))
def test_check_answer_accepts_the_stored_value_and_refuses_a_wrong_one(label):
    value = ch.ANSWERS[label]["value"]
    assert ch.check_answer(label, value).passed
    assert not ch.check_answer(label, value * 1.5 + 2).passed
    assert not ch.check_answer(label, ...).passed


@pytest.mark.parametrize("label, wrong, words", [
    ("ex-sl-budget/state", 80 * 64, "one number per channel"),
    ("ex-sl-budget/conv", 4 * (80 * 64 + 256), "K - 1"),
    ("ex-sl-budget/conv", 3 * 80 * 64, "B and C"),
    ("ex-sl-budget/kib", 4 * (80 * 128 * 64 + 3 * (80 * 64 + 256)) / 1024, "float32"),
    ("ex-sl-budget/kib", 2 * 80 * 128 * 64 / 1024, "convolution cache"),
])
def test_budget_slips_are_named(label, wrong, words):
    result = ch.check_answer(label, wrong)
    assert not result.passed and words in result.message


# --- Qwen3-Next's interleaved projections -------------------------------------------------

def split_qkvz(weight, c):
    r = c.n_heads // c.n_key_heads
    sizes = [c.d_k, c.d_k, r * c.d_v, r * c.d_v]
    groups = np.asarray(weight).reshape(c.n_key_heads, sum(sizes), c.d_model)
    cuts = np.cumsum([0] + sizes)
    return tuple(groups[:, cuts[i]:cuts[i + 1]].reshape(-1, c.d_model).T for i in range(4))


def test_split_check_passes_the_solution_and_names_the_slips():
    assert ch.check_split_qkvz(split_qkvz).passed
    result = ch.check_split_qkvz(lambda w, c: tuple(m.T for m in split_qkvz(w, c)))
    assert not result.passed and "transpose" in result.message
    result = ch.check_split_qkvz(ch.contiguous_split)
    assert not result.passed and "contiguous block" in result.message
    result = ch.check_split_qkvz(lambda w, c: ...)
    assert not result.passed
    result = ch.check_split_qkvz(lambda w, c: fl.split_qwen3_next_projections(w, np.zeros((2 * c.n_heads, c.d_model)), c))
    assert not result.passed


# --- the Mamba-2 decode step ---------------------------------------------------------------

def mamba2_step(params, x, cache, *, gate_first=True, skip=True):
    c = params["config"]
    H, P, N, G = c.n_heads, c.head_dim, c.d_state, c.n_groups
    di = H * P
    proj = bl.linear(x, params["W_in"])
    z, xbc, dt = proj[..., :di], proj[..., di:di + c.conv_dim], proj[..., di + c.conv_dim:]
    u, conv = bl.short_conv_step(xbc, params["conv_weight"], initial_state=cache["conv"], bias=params.get("conv_bias"))
    u = bl.silu(u)
    xi = u[..., :di].reshape(u.shape[:-1] + (H, P))
    B = np.repeat(u[..., di:di + G * N].reshape(u.shape[:-1] + (G, N)), H // G, axis=-2)
    C = np.repeat(u[..., di + G * N:].reshape(u.shape[:-1] + (G, N)), H // G, axis=-2)
    delta = bl.softplus(dt + params["dt_bias"])
    decay = np.exp(-np.exp(params["A_log"]) * delta)[..., None, None]
    state = decay * cache["state"] + B[..., :, None] * (delta[..., None] * xi)[..., None, :]
    y = np.einsum("...np,...n->...p", state, C) + (params["D"][:, None] * xi if skip else 0)
    y = y.reshape(y.shape[:-2] + (di,))
    groups = y.shape[:-1] + (G, di // G)
    y = bl.gated_rms_norm(y.reshape(groups), z.reshape(groups), eps=c.norm_eps,
                          norm_before_gate=not gate_first).reshape(y.shape)
    return bl.linear(y * params["norm_weight"], params["W_out"]), {"conv": conv, "state": state}


def test_mamba2_check_passes_the_solution():
    assert ch.check_mamba2_step(mamba2_step).passed


@pytest.mark.parametrize("wrong, words", [
    (lambda p, x, c: mamba2_step(p, x, c, gate_first=False), "the gate comes after the norm"),
    (lambda p, x, c: mamba2_step(p, x, c, skip=False), "the skip D x is missing"),
    (lambda p, x, c: (lambda y, k: (y, dict(k, state=np.swapaxes(k["state"], -1, -2))))(*mamba2_step(p, x, c)),
     "the transpose"),
    (lambda p, x, c: fl.mamba2_block_step(p, x, c), "the package's own implementation"),
    (lambda p, x, c: ..., "replace the `...`"),
])
def test_mamba2_check_names_the_slips(wrong, words):
    result = ch.check_mamba2_step(wrong)
    assert not result.passed and words in result.message


def test_mamba2_check_refuses_a_step_that_changes_the_cache_in_place():
    def in_place(p, x, cache):
        y, new = mamba2_step(p, x, cache)
        cache["state"][...] = new["state"]
        return y, new

    result = ch.check_mamba2_step(in_place)
    assert not result.passed and "in place" in result.message


# --- starting a gate at a chosen decay, packed sequences, rollback --------------------------

from fixedstate import delta_rule as dr  # noqa: E402
from fixedstate import serving  # noqa: E402


def _dt_bias_for(decay, A_log):
    delta = -np.log(decay) / np.exp(A_log)
    return delta + np.log(-np.expm1(-delta))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("wrong, words", [
    (lambda d, a: np.log(np.expm1(-np.log(d) / np.exp(a))), "overflows"),
    (lambda d, a: _dt_bias_for(d, np.zeros_like(a)), "divided by -a"),
    (lambda d, a: np.log(-np.log(d) / np.exp(a)), "invert the softplus"),
    (lambda d, a: bl.inverse_softplus(-np.log(d) / np.exp(a)), "inverse_softplus"),
    (lambda d, a: _dt_bias_for(d, a) + 1e-3, "softplus(dt_bias) should be"),
])
def test_dt_bias_check_passes_the_solution_and_names_the_slips(wrong, words):
    assert ch.check_dt_bias_for(_dt_bias_for).passed
    result = ch.check_dt_bias_for(wrong)
    assert not result.passed and words in result.message, result.message
    np.testing.assert_allclose(np.exp(-np.exp(0.7) * bl.softplus(_dt_bias_for(np.array([0.3]), np.array([0.7])))),
                               0.3, rtol=1e-14)


def _packed_decode(q, k, v, beta, log_gate, cu, *, reset=True, late=False):
    starts, ends = set(cu[:-1].tolist()), set(cu[1:].tolist())
    state, outs, finals = None, [], []
    for t in range(q.shape[-2]):
        if reset and (t - late) in starts:
            state = None
        o, state = dr.gated_delta_rule_step(q[..., t, :], k[..., t, :], v[..., t, :], beta=beta[..., t],
                                            log_gate=log_gate[..., t], initial_state=state)
        outs.append(o)
        if t + 1 in ends:
            finals.append(state)
    return np.stack(outs, axis=-2), np.stack(finals)


@pytest.mark.parametrize("wrong, words", [
    (lambda *a: _packed_decode(*a, reset=False), "one long sequence"),
    (lambda *a: _packed_decode(*a, late=True), "differ first at packed token"),
    (lambda *a: (_packed_decode(*a)[0], _packed_decode(*a)[1][::-1]), "final states"),
    (lambda *a: (_packed_decode(*a)[0], _packed_decode(*a)[1][-1]), "final_states should have shape"),
])
def test_packed_check_passes_the_solution_and_names_the_slips(wrong, words):
    assert ch.check_packed_decode(_packed_decode).passed
    result = ch.check_packed_decode(wrong)
    assert not result.passed and words in result.message, result.message


def _draft_rollback(params, cache, x, j, *, live=False, conv_live=False):
    K1 = params["config"].conv_kernel - 1
    states, rows, ys = [cache["state"]], [cache["conv"]], []
    for x_t in x:
        y, cache = fl.gated_deltanet_step(params, x_t, cache)
        ys.append(y)
        states.append(cache["state"])
        rows.append(cache["conv"][-1:])
    window = np.concatenate(rows)
    if live:
        return np.stack(ys), cache
    return np.stack(ys), {"conv": cache["conv"] if conv_live else window[j:j + K1], "state": states[j]}


@pytest.mark.parametrize("wrong, words", [
    (lambda *a: _draft_rollback(*a, live=True), "after all the drafted tokens"),
    (lambda *a: _draft_rollback(*a, conv_live=True), "cache['conv']"),
    (lambda p, c, x, j: serving.rollback(p, serving.verify_draft(p, x, c)[1], j), "serving"),
])
def test_rollback_check_passes_the_solution_and_names_the_slips(wrong, words):
    assert ch.check_draft_rollback(_draft_rollback).passed
    result = ch.check_draft_rollback(wrong)
    assert not result.passed and words in result.message, result.message
