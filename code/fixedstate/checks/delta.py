"""Automatic feedback for the exercises of chapter {ref}`chap-delta-rule`.

Coding exercises (the student's function is compared with the package's
reference on several cases, and the commonest wrong answers get a specific
message):

- :func:`check_delta_step` for ``delta_step(state, key, value, beta) -> new_state``;
- :func:`check_gated_delta_step` for ``gated_delta_step(state, key, value, beta, gate) -> new_state``;
- :func:`check_exact_beta` for ``exact_beta(key) -> beta``.

Numeric exercises: :func:`check_answer` with the labels in :data:`ANSWERS`
(values computed by the package, not typed in).
"""

from __future__ import annotations

import numpy as np

from .. import delta_rule as dr
from ._core import check_numeric, CheckResult, Failure, call_student, compare_arrays, compare_number, failed, run_check

__all__ = ["check_delta_step", "check_gated_delta_step", "check_exact_beta", "check_answer", "ANSWERS",
           "HALVING_SETUP", "BY_HAND_SETUP"]


# --------------------------------------------------------------------------- numeric answers

#: ex-dr-halving: key (1, 0), value (4, -2), start from the zero state, beta = 1/2.
HALVING_SETUP = {"key": np.array([1.0, 0.0]), "value": np.array([4.0, -2.0]), "beta": 0.5, "writes": 3}

#: ex-dr-gated-by-hand: one gated delta step on a 2x2 state.
BY_HAND_SETUP = {
    "state": np.array([[1.0, 2.0], [0.0, 1.0]]),
    "key": np.array([0.6, 0.8]),
    "value": np.array([1.0, -1.0]),
    "beta": 0.5,
    "gate": 0.8,
}


def _halving_error():
    s = HALVING_SETUP
    state = np.zeros((2, 2))
    for _ in range(s["writes"]):
        _, state = dr.delta_rule_step(s["key"], s["key"], s["value"], beta=s["beta"], initial_state=state)
    return float(np.linalg.norm(s["value"] - state.T @ s["key"]))


def _by_hand_recall():
    s = BY_HAND_SETUP
    _, new = dr.gated_delta_rule_step(s["key"], s["key"], s["value"], beta=s["beta"], log_gate=np.log(s["gate"]),
                                      initial_state=s["state"])
    return new.T @ s["key"]


#: label -> the answer (computed by the package), its absolute tolerance and what it is
ANSWERS = {
    "ex-dr-halving": dict(value=_halving_error(), tolerance=1e-6,
                          what="the recall error |v - S_3^T k| after three writes"),
    "ex-dr-gated-by-hand": dict(value=_by_hand_recall(), tolerance=1e-6,
                                what="the recall S_t^T k after the gated step"),
}


def check_answer(label: str, value) -> CheckResult:
    """Check a numeric answer against :data:`ANSWERS` (computed by the package) within its tolerance."""
    return check_numeric(label, value, ANSWERS)


# --------------------------------------------------------------------------- cases

def _cases(rng, with_gate=False):
    """(description, state, key, value, beta[, gate]) with non-square states first."""
    cases = []
    for d_k, d_v, unit in ((3, 2, True), (4, 5, True), (3, 3, True), (5, 2, False)):
        state = rng.standard_normal((d_k, d_v))
        key = rng.standard_normal(d_k)
        if unit:
            key /= np.linalg.norm(key)
        else:
            key *= 0.6 / np.linalg.norm(key)
        value = rng.standard_normal(d_v)
        beta = float(rng.uniform(0.3, 0.9))
        desc = f"a {d_k}x{d_v} state, beta={beta:.3f}" + ("" if unit else ", key of length 0.6")
        row = (desc, state, key, value, beta)
        if with_gate:
            gate = float(rng.uniform(0.4, 0.9))
            row = (desc + f", gate={gate:.3f}", state, key, value, beta, gate)
        cases.append(row)
    return cases


def _diagnose(got, candidates, case):
    """Raise a Failure naming the first wrong-answer pattern that ``got`` matches."""
    got = np.asarray(got, dtype=float)
    for name, (arr, message) in candidates.items():
        if got.shape == arr.shape and np.allclose(got, arr, rtol=1e-9, atol=1e-12):
            raise Failure(f"on {case}: {message}")


# --------------------------------------------------------------------------- delta step

def check_delta_step(delta_step) -> CheckResult:
    """Check ``delta_step(state, key, value, beta) -> new_state`` (eq-dr-delta).

    ``state`` is (d_k, d_v), ``key`` (d_k,), ``value`` (d_v,); the result is the
    new (d_k, d_v) state.
    """
    label = "ex-dr-delta-step"

    def body():
        rng = np.random.default_rng(20)
        for desc, S, k, v, beta in _cases(rng):
            got = call_student(delta_step, S.copy(), k.copy(), v.copy(), beta, case=desc)
            _, expected = dr.delta_rule_step(k, k, v, beta=beta, initial_state=S)
            recall = S.T @ k
            _diagnose(got, {
                "additive": (S + beta * np.outer(k, v),
                             "this is plain linear attention's write S + beta k v^T: the delta rule first "
                             "subtracts what the state already recalls for the key, S^T k"),
                "sign": (S + beta * np.outer(k, recall - v),
                         "the correction has the wrong sign: write beta k (v - S^T k)^T, the value minus the "
                         "recall (a gradient step goes downhill)"),
                "no_beta": (S + np.outer(k, v - recall),
                            "beta is missing: the correction must be scaled by beta"),
            }, desc)
            got_arr = np.asarray(got, dtype=float)
            if got_arr.shape == S.T.shape and S.shape[0] != S.shape[1]:
                raise Failure(f"on {desc}: expected shape {S.shape}, got {got_arr.shape}: the transpose. "
                              "The book stores S as d_k x d_v, so a write is k v^T (np.outer(key, value)) "
                              "and a read is S^T k")
            compare_arrays(got, expected, what="the new state", case=desc)
        return "your delta step matches eq-dr-delta on every case (non-square states, a short key)"

    return run_check(label, body)


# --------------------------------------------------------------------------- gated step

def check_gated_delta_step(gated_delta_step) -> CheckResult:
    """Check ``gated_delta_step(state, key, value, beta, gate) -> new_state`` (eq-dr-gated).

    Catches the wrong orders: correcting then decaying, and decaying only the
    carried state while computing the correction from the undecayed state.
    """
    label = "ex-dr-gated-step"

    def body():
        rng = np.random.default_rng(21)
        for desc, S, k, v, beta, g in _cases(rng, with_gate=True):
            got = call_student(gated_delta_step, S.copy(), k.copy(), v.copy(), beta, g, case=desc)
            _, expected = dr.gated_delta_rule_step(k, k, v, beta=beta, log_gate=np.log(g), initial_state=S)
            plain = S + beta * np.outer(k, v - S.T @ k)
            _diagnose(got, {
                "correct_then_decay": (g * plain,
                                       "you corrected first and then decayed, g (S + beta k (v - S^T k)^T); "
                                       "the gate must act first, and the correction then uses the decayed "
                                       "state g S"),
                "decay_carried_only": (g * S + beta * np.outer(k, v - S.T @ k),
                                       "you decayed the carried state but computed the correction from the "
                                       "undecayed state (v - S^T k); the erase term must use the decayed "
                                       "state too: v - (g S)^T k"),
                "no_gate": (plain, "the gate is missing: the old state must be multiplied by g"),
                "gate_on_value": (S + beta * np.outer(k, g * v - S.T @ k),
                                  "the gate multiplies the old state, not the new value"),
                "additive": (g * S + beta * np.outer(k, v),
                             "this is gated linear attention (decay, then add beta k v^T): the delta rule "
                             "also subtracts what the decayed state recalls for the key"),
            }, desc)
            got_arr = np.asarray(got, dtype=float)
            if got_arr.shape == S.T.shape and S.shape[0] != S.shape[1]:
                raise Failure(f"on {desc}: expected shape {S.shape}, got {got_arr.shape}: the transpose. "
                              "The book stores S as d_k x d_v")
            compare_arrays(got, expected, what="the new state", case=desc)
        # gate 1 must give back the delta rule
        desc, S, k, v, beta, _ = _cases(np.random.default_rng(22), with_gate=True)[0]
        got = call_student(gated_delta_step, S.copy(), k.copy(), v.copy(), beta, 1.0, case=desc + " with gate 1")
        compare_arrays(got, dr.delta_rule_step(k, k, v, beta=beta, initial_state=S)[1],
                       what="the new state with gate 1 (should equal the plain delta rule)", case=desc)
        return "your gated step decays first and corrects with the decayed state, as in eq-dr-gated"

    return run_check(label, body)


# --------------------------------------------------------------------------- exact beta

def check_exact_beta(exact_beta) -> CheckResult:
    """Check ``exact_beta(key) -> beta``: the beta after which one write is recalled exactly.

    Tried on keys of length 1, 2 and 1.25 (so the answers lie in [0, 1] and the
    package's delta step can verify them).
    """
    label = "ex-dr-exact-beta"

    def body():
        rng = np.random.default_rng(23)
        for length in (1.0, 2.0, 1.25):
            key = rng.standard_normal(4)
            key *= length / np.linalg.norm(key)
            case = f"a key of length {length:g}"
            got = call_student(exact_beta, key.copy(), case=case)
            try:
                beta = float(got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected a number, got {got!r}") from None
            if np.isclose(beta, 1.0) and length != 1.0:
                raise Failure(f"on {case}: beta = 1 is exact only for unit keys; with |k| = {length:g} one "
                              "write changes the recall by beta |k|^2 times the error")
            if np.isclose(beta, 1.0 / length) and length != 1.0:
                raise Failure(f"on {case}: you returned 1/|k|; the erase factor shrinks the error by "
                              "(1 - beta |k|^2), so the norm enters squared")
            if not 0.0 <= beta <= 1.0:
                raise Failure(f"on {case}: expected a beta in [0, 1], got {beta:.6g}")
            state = rng.standard_normal((4, 3))
            value = rng.standard_normal(3)
            _, new = dr.delta_rule_step(key, key, value, beta=beta, initial_state=state)
            compare_arrays(new.T @ key, value, what=f"the recall after one write with your beta={beta:.6g}",
                           case=case, rtol=1e-9, atol=1e-9)
        return "one write with your beta is recalled exactly for keys of any length: beta = 1 / |k|^2"

    return run_check(label, body)
