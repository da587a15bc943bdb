"""The delta-rule exercise checks pass on the reference and fail, with a specific message, on wrong answers."""

import numpy as np
import pytest

from fixedstate import delta_rule as dr
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
