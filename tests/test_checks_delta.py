"""The delta-rule exercise checks pass on the reference and fail, with a specific message, on wrong answers."""

import numpy as np
import pytest

from fixedstate import delta_rule as dr
from fixedstate import kernels
from fixedstate.checks import delta as chk


# --------------------------------------------------------------------------- delta step

def ref_delta_step(state, key, value, beta):
    return dr.delta_rule_step(key, key, value, beta=beta, initial_state=state)[1]


def test_delta_step_passes_on_reference():
    res = chk.check_delta_step(ref_delta_step)
    assert res.passed, res.message
    assert repr(res).startswith("PASSED")


def test_delta_step_passes_on_an_independent_implementation():
    def mine(state, key, value, beta):
        return state - beta * np.outer(key, state.T @ key - value)
    assert chk.check_delta_step(mine).passed


@pytest.mark.parametrize("wrong,fragment", [
    (lambda S, k, v, b: S + b * np.outer(k, v), "plain linear attention"),
    (lambda S, k, v, b: S + b * np.outer(k, S.T @ k - v), "wrong sign"),
    (lambda S, k, v, b: S + np.outer(k, v - S.T @ k), "beta is missing"),
    (lambda S, k, v, b: (S + b * np.outer(k, v - S.T @ k)).T, "transpose"),
    (lambda S, k, v, b: S + b * np.outer(k, v - S.T @ k) * 1.01, "largest difference"),
    (lambda S, k, v, b: None, "replace the `...`"),
    (lambda S, k, v, b: 1 / 0, "ZeroDivisionError"),
])
def test_delta_step_fails_with_specific_message(wrong, fragment):
    res = chk.check_delta_step(wrong)
    assert not res.passed
    assert fragment in res.message, res.message


# --------------------------------------------------------------------------- gated step

def ref_gated_step(state, key, value, beta, gate):
    return dr.gated_delta_rule_step(key, key, value, beta=beta, log_gate=np.log(gate), initial_state=state)[1]


def test_gated_step_passes_on_reference():
    assert chk.check_gated_delta_step(ref_gated_step).passed


@pytest.mark.parametrize("wrong,fragment", [
    (lambda S, k, v, b, g: g * (S + b * np.outer(k, v - S.T @ k)), "corrected first and then decayed"),
    (lambda S, k, v, b, g: g * S + b * np.outer(k, v - S.T @ k), "undecayed state"),
    (lambda S, k, v, b, g: S + b * np.outer(k, v - S.T @ k), "gate is missing"),
    (lambda S, k, v, b, g: S + b * np.outer(k, g * v - S.T @ k), "not the new value"),
    (lambda S, k, v, b, g: g * S + b * np.outer(k, v), "gated linear attention"),
    (lambda S, k, v, b, g: ref_gated_step(S, k, v, b, g).T, "transpose"),
    (lambda S, k, v, b, g: ref_gated_step(S, k, v, b, g) if g != 1.0 else S, "with gate 1"),
])
def test_gated_step_fails_with_specific_message(wrong, fragment):
    res = chk.check_gated_delta_step(wrong)
    assert not res.passed
    assert fragment in res.message, res.message


# --------------------------------------------------------------------------- exact beta

def test_exact_beta_passes():
    assert chk.check_exact_beta(lambda k: 1.0 / float(k @ k)).passed


@pytest.mark.parametrize("wrong,fragment", [
    (lambda k: 1.0, "exact only for unit keys"),
    (lambda k: 1.0 / np.linalg.norm(k), "norm enters squared"),
    (lambda k: 2.0 / float(k @ k), "expected a beta in [0, 1]"),
    (lambda k: 0.9 / float(k @ k), "recall after one write"),
    (lambda k: "half", "expected a number"),
])
def test_exact_beta_fails_with_specific_message(wrong, fragment):
    res = chk.check_exact_beta(wrong)
    assert not res.passed
    assert fragment in res.message, res.message


# --------------------------------------------------------------------------- numeric answers

def test_halving_answer_is_the_independently_computed_error():
    s = chk.HALVING_SETUP
    # each write with beta 1/2 and a unit key halves the error, starting from |v|
    expected = np.linalg.norm(s["value"]) / 2 ** s["writes"]
    assert chk.ANSWERS["ex-dr-halving"]["value"] == pytest.approx(expected, rel=1e-12)
    assert chk.check_answer("ex-dr-halving", expected).passed
    res = chk.check_answer("ex-dr-halving", np.linalg.norm(s["value"]) / 2)
    assert not res.passed and "too high" in res.message


def test_gated_by_hand_answer():
    s = chk.BY_HAND_SETUP
    decayed = s["gate"] * s["state"]
    recall_before = decayed.T @ s["key"]
    # recall after = recall before + beta |k|^2 (v - recall before)
    expected = recall_before + s["beta"] * (s["key"] @ s["key"]) * (s["value"] - recall_before)
    assert np.allclose(chk.ANSWERS["ex-dr-gated-by-hand"]["value"], expected, atol=1e-14)
    assert chk.check_answer("ex-dr-gated-by-hand", expected.tolist()).passed
    assert not chk.check_answer("ex-dr-gated-by-hand", (s["state"].T @ s["key"]).tolist()).passed


def test_check_answer_unknown_label_and_unfinished():
    assert not chk.check_answer("ex-dr-nothing", 1.0).passed
    res = chk.check_answer("ex-dr-halving", ...)
    assert not res.passed and "`...`" in res.message


# ---------------------------------------------------------------- challenge: one KDA chunk by the UT transform

from scipy.linalg import solve_triangular  # noqa: E402


def kda_chunk(q, k, v, beta, log_gate, state, *, quotient=False, unmasked=False):
    """A worked answer written independently of the check's helpers (per-token loops over the pairs),
    or one of two ways of forming the per-channel pair decays that overflow."""
    C = len(q)
    b = np.cumsum(log_gate, axis=0)                                # (C, d_k)
    with np.errstate(all="ignore"):
        if quotient:                                               # exp(b_r) * exp(-b_i): overflows
            pair = lambda r, i: np.exp(b[r]) * np.exp(-b[i])
        elif unmasked:                                             # every difference exponentiated, then masked
            E = np.exp(b[:, None, :] - b[None, :, :]) * np.tril(np.ones((C, C)))[:, :, None]
            pair = lambda r, i: E[r, i]
        else:
            pair = lambda r, i: np.exp(b[r] - b[i])               # i <= r only: exponent <= 0
        KK, QK = np.zeros((C, C)), np.zeros((C, C))
        for r in range(C):
            for i in range(r + 1):
                KK[r, i] = np.sum(k[r] * k[i] * pair(r, i))
                QK[r, i] = np.sum(q[r] * k[i] * pair(r, i))
        if unmasked:                                               # the masked-out inf * 0 = nan enters the sums
            KK, QK = np.einsum("rc,ic,ric->ri", k, k, E), np.einsum("rc,ic,ric->ri", q, k, E)
        M = np.eye(C) + np.tril(beta[:, None] * KK, -1)
        U_tilde = solve_triangular(M, beta[:, None] * v, lower=True, unit_diagonal=True, check_finite=False)
        W = solve_triangular(M, beta[:, None] * k * np.exp(b), lower=True, unit_diagonal=True, check_finite=False)
        U = U_tilde - W @ state
        O = (q * np.exp(b)) @ state + QK @ U
        S_out = np.exp(b[-1])[:, None] * state + (k * np.exp(b[-1] - b)).T @ U
    return O, S_out


def test_kda_chunk_check_passes_the_worked_answer():
    res = chk.check_kda_chunk(kda_chunk)
    assert res.passed, res.message


def test_kda_chunk_reference_equations_equal_the_token_loop_and_the_gated_rule():
    rng = np.random.default_rng(5)
    C, d_k, d_v = 7, 4, 3
    q, k, v = rng.standard_normal((C, d_k)), rng.standard_normal((C, d_k)), rng.standard_normal((C, d_v))
    beta, S0 = rng.uniform(0.2, 0.9, C), rng.standard_normal((d_k, d_v))
    log_gate = -rng.uniform(0.0, 2.0, (C, d_k))
    for o, s in (kda_chunk(q, k, v, beta, log_gate, S0), chk.kda_chunk_variant(q, k, v, beta, log_gate, S0)):
        want = dr.kda_loop(q, k, v, beta=beta, log_gate=log_gate, initial_state=S0)
        np.testing.assert_allclose(o, want[0], atol=1e-12)
        np.testing.assert_allclose(s, want[1], atol=1e-12)
    equal = np.repeat(log_gate[:, :1], d_k, axis=1)
    o, s = kda_chunk(q, k, v, beta, equal, S0)
    want = dr.gated_delta_rule_loop(q, k, v, beta=beta, log_gate=equal[:, 0], initial_state=S0)
    np.testing.assert_allclose(o, want[0], atol=1e-12)
    np.testing.assert_allclose(s, want[1], atol=1e-12)


def _scalar_gate(q, k, v, beta, log_gate, S):
    """The chapter's Gated DeltaNet chunk with the channel mean as its scalar gate."""
    mean = np.repeat(log_gate.mean(axis=1, keepdims=True), log_gate.shape[1], axis=1)
    return kda_chunk(q, k, v, beta, mean, S)


@pytest.mark.parametrize("wrong,fragment", [
    (_scalar_gate, "one scalar gate per token (the mean over the channels)"),
    (lambda *a: chk.kda_loop_variant(*a, order="correct_then_decay"), '"correct, then decay"'),
    (lambda *a: chk.kda_loop_variant(*a, order="decay_carried_only"), "the correction uses the undecayed state"),
    (lambda *a: chk.kda_chunk_variant(*a, subtract_ws=False), "U = U~ - W S_0"),
    (lambda *a: chk.kda_chunk_variant(*a, decay_state_in_out=False), "read the incoming state undecayed"),
    (lambda *a: chk.kda_chunk_variant(*a, decay_in_a=False), "A has no decays"),
    (lambda *a: chk.kda_chunk_variant(*a, decay_in_w=False), "W has no decays"),
    (lambda *a: chk.kda_chunk_variant(*a, own_write=False), "does not see its own write"),
    (lambda *a: (lambda o, s: (o, s.T))(*kda_chunk(*a)), "the transpose"),
    (lambda *a: kda_chunk(*a, quotient=True), "a positive exponent overflowed"),
    (lambda *a: kda_chunk(*a, unmasked=True), "a positive exponent overflowed"),
    (lambda *a: (lambda o, s: (1.01 * o, s))(*kda_chunk(*a)), "largest difference"),
    (lambda *a: kda_chunk(*a)[0], "expected a pair (O, S_out)"),
    (lambda *a: ..., "replace the `...`"),
])
def test_kda_chunk_check_names_the_slips(wrong, fragment):
    res = chk.check_kda_chunk(wrong)
    assert not res.passed
    assert fragment in res.message, res.message


def test_kda_chunk_overflow_raised_inside_the_function_is_named():
    def strict(q, k, v, beta, log_gate, state):      # solve_triangular's own finiteness check raises
        b = np.cumsum(log_gate, axis=0)
        with np.errstate(all="ignore"):
            solve_triangular(np.eye(len(q)) + np.tril((k * np.exp(b)) @ (k * np.exp(-b)).T, -1), v, lower=True)
        return kda_chunk(q, k, v, beta, log_gate, state)
    res = chk.check_kda_chunk(strict)
    assert not res.passed
    assert "ValueError" in res.message and "a positive exponent overflowed" in res.message, res.message


@pytest.mark.parametrize("package", [
    lambda q, k, v, beta, g, S: dr.kda_loop(q, k, v, beta=beta, log_gate=g, initial_state=S),
    lambda q, k, v, beta, g, S: dr.kda_chunkwise(q, k, v, beta=beta, log_gate=g, initial_state=S, chunk_size=len(q)),
    lambda q, k, v, beta, g, S: dr.kda_recurrent(q, k, v, beta=beta, log_gate=g, initial_state=S),
    lambda q, k, v, beta, g, S: (kernels.kda_prep(q[None], k[None], beta[None, :, None], np.exp(g)[None]),
                                 kda_chunk(q, k, v, beta, g, S))[1],
])
def test_kda_chunk_check_refuses_the_package(package):
    res = chk.check_kda_chunk(package)
    assert not res.passed
    assert "the package's own implementation" in res.message, res.message
