"""Automatic feedback for the exercises of chapter {ref}`chap-delta-rule`.

Coding exercises (the student's function is compared with the package's
reference on several cases, and the commonest wrong answers get a specific
message):

- :func:`check_delta_step` for ``delta_step(state, key, value, beta) -> new_state``;
- :func:`check_gated_delta_step` for ``gated_delta_step(state, key, value, beta, gate) -> new_state``;
- :func:`check_exact_beta` for ``exact_beta(key) -> beta``.

Challenge problem: :func:`check_kda_chunk` for
``kda_chunk(q, k, v, beta, log_gate, state) -> (O, S_out)``, one chunk of Kimi
Delta Attention (a decay per key channel) by the UT transform, compared with the
package's token loop :func:`fixedstate.delta_rule.kda_loop` (an answer that calls
any of the package's delta-rule forms is refused).

Numeric exercises: :func:`check_answer` with the labels in :data:`ANSWERS`
(values computed by the package, not typed in).
"""

from __future__ import annotations

import re

import numpy as np
from scipy.linalg import solve_triangular

from .. import delta_rule as dr
from .. import kernels
from ._core import (check_numeric, CheckResult, Failure, call_student, call_without, compare_arrays, compare_number,
                    failed, has_nonfinite, run_check)

__all__ = ["check_delta_step", "check_gated_delta_step", "check_exact_beta", "check_answer", "ANSWERS",
           "check_kda_chunk", "HALVING_SETUP", "BY_HAND_SETUP"]


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


# --------------------------------------------------------------------------- one KDA chunk (challenge)

#: Every form of the delta rule in the package, public and internal (fixedstate.kernels): an answer that
#: reaches one is refused.
_DR_FORMS = (dr.gated_delta_rule_chunk, dr.gated_delta_rule_loop, dr.gated_delta_rule_step,
             dr.gated_delta_rule_recurrent, dr.gated_delta_rule_chunkwise, dr.delta_rule_step,
             dr.delta_rule_recurrent, dr.delta_rule_chunkwise, dr.kda_step, dr.kda_recurrent, dr.kda_chunkwise,
             dr.kda_loop, kernels.delta_step, kernels.delta_scan, kernels.delta_chunks, kernels.chunk_decays,
             kernels.kda_prep, kernels.state_pass)


def kda_loop_variant(q, k, v, beta, log_gate, S, *, order="right"):
    """KDA's token loop, in the right order or in one of the two wrong orders of decay and correction."""
    S = S.copy()
    O = np.empty((len(q), v.shape[1]))
    for t in range(len(q)):
        a = np.exp(log_gate[t])[:, None]                   # one decay per key channel: scales the rows of S
        if order == "correct_then_decay":
            S = a * (S + beta[t] * np.outer(k[t], v[t] - S.T @ k[t]))
        elif order == "decay_carried_only":
            S = a * S + beta[t] * np.outer(k[t], v[t] - S.T @ k[t])
        else:
            S = a * S
            S = S + beta[t] * np.outer(k[t], v[t] - S.T @ k[t])
        O[t] = S.T @ q[t]
    return O, S


def kda_chunk_variant(q, k, v, beta, log_gate, S0, *, subtract_ws=True, decay_state_in_out=True,
                       own_write=True, decay_in_a=True, decay_in_w=True):
    """One KDA chunk by the UT transform, with switches for the slips (all True: the right answer)."""
    C = len(q)
    b = np.cumsum(log_gate, axis=0)                                    # (C, d_k), per channel
    i_le_r = np.tril(np.ones((C, C), dtype=bool))
    D = np.exp(np.where(i_le_r[:, :, None], b[:, None, :] - b[None, :, :], -np.inf))   # (C, C, d_k)
    KK = np.einsum("rc,ic,ric->ri", k, k, D if decay_in_a else i_le_r[:, :, None] * 1.0)
    QK = np.einsum("rc,ic,ric->ri", q, k, D)
    M = np.eye(C) + np.tril(beta[:, None] * KK, -1)
    U_tilde = solve_triangular(M, beta[:, None] * v, lower=True, unit_diagonal=True)
    W = solve_triangular(M, beta[:, None] * k * (np.exp(b) if decay_in_w else 1.0), lower=True,
                         unit_diagonal=True)
    U = U_tilde - W @ S0 if subtract_ws else U_tilde
    O = ((q * np.exp(b)) if decay_state_in_out else q) @ S0 + (QK if own_write else np.tril(QK, -1)) @ U
    S_C = np.exp(b[-1])[:, None] * S0 + (k * np.exp(b[-1] - b)).T @ U
    return O, S_C


def _kda_cases():
    """(description, C, d_k, d_v, incoming state, log-gate kind); every state is non-square."""
    return [("a chunk of 4 tokens from the zero state (d_k = 3, d_v = 2)", 4, 3, 2, "zero", "random"),
            ("a chunk of 6 tokens entering with a random state (d_k = 4, d_v = 3)", 6, 4, 3, "random", "random"),
            ("a chunk of 1 token with a random state (d_k = 2, d_v = 4)", 1, 2, 4, "random", "random"),
            ("a chunk of 5 tokens with a random state and log_gate = -200 in every other channel "
             "(decays of about 1e-87; d_k = 4, d_v = 2)", 5, 4, 2, "random", "strong"),
            ("a chunk of 8 tokens with a random state and the same log_gate in every channel, where KDA is "
             "Gated DeltaNet (d_k = 5, d_v = 2)", 8, 5, 2, "random", "equal")]


def _kda_inputs(seed, C, d_k, d_v, state_kind, gate_kind):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((C, d_k))
    k = rng.standard_normal((C, d_k))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((C, d_v))
    beta = rng.uniform(0.2, 0.9, C)
    log_gate = -rng.uniform(0.05, 1.5, (C, d_k))          # channels decay at clearly different rates
    if gate_kind == "strong":
        log_gate[:, ::2] = -200.0
    elif gate_kind == "equal":
        log_gate = np.repeat(-rng.uniform(0.05, 1.0, (C, 1)), d_k, axis=1)
    S0 = np.zeros((d_k, d_v)) if state_kind == "zero" else rng.standard_normal((d_k, d_v))
    return q, k, v, beta, log_gate, S0


_NONFINITE = re.compile(r"\b(infs?|nans?)\b", re.IGNORECASE)
_OVERFLOW = ("a positive exponent overflowed. A quotient of cumulative decays, exp(b_r) / exp(b_i) or "
             "exp(b_r) * exp(-b_i), forms exp(-b_i) (exp(1000) is inf, exp(-1000) is 0, and 0 * inf is nan); "
             "form each pair's exp(b_r - b_i) for i <= r only, masking the pairs i > r before exponentiating")


def check_kda_chunk(kda_chunk) -> CheckResult:
    """Check ``kda_chunk(q, k, v, beta, log_gate, state) -> (O, S_out)``: one chunk of Kimi Delta
    Attention (``eq-dr-kda``) by the UT transform.

    ``q, k`` ``(C, d_k)`` (unit keys), ``v`` ``(C, d_v)``, ``beta`` ``(C,)``, ``log_gate``
    ``(C, d_k)`` (one log-decay per key channel, <= 0), ``state`` the incoming
    ``(d_k, d_v)`` state; the output scale is 1. The result must equal the package's
    token loop :func:`fixedstate.delta_rule.kda_loop` from the same state; an answer
    that calls any of the package's delta-rule forms is refused. Names a scalar gate
    (the channel mean) in place of the per-channel one, the two wrong orders of decay
    and correction, a missing ``- W S_0``, an undecayed incoming state in the outputs,
    pair products or ``W`` without their decays, a token that does not see its own
    write, a transposed state and an inf or nan from a positive exponent.
    """
    label = "ex-dr-ut-solve"

    def body():
        for seed, (desc, C, d_k, d_v, state_kind, gate_kind) in enumerate(_kda_cases()):
            q, k, v, beta, log_gate, S0 = _kda_inputs(80 + seed, C, d_k, d_v, state_kind, gate_kind)
            try:
                with np.errstate(all="ignore"):
                    out = call_without(kda_chunk, _DR_FORMS, q.copy(), k.copy(), v.copy(), beta.copy(),
                                       log_gate.copy(), S0.copy(), case=desc)
            except Failure as failure:
                if "the package's own" not in str(failure) and _NONFINITE.search(str(failure)):
                    raise Failure(f"{failure}: an inf or nan appeared inside your function, {_OVERFLOW}") from None
                raise
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise Failure(f"on {desc}: expected a pair (O, S_out), got {type(out).__name__}")
            O, S_out = out
            want_O, want_S = dr.kda_loop(q, k, v, beta=beta, log_gate=log_gate, initial_state=S0)
            if has_nonfinite(O) or has_nonfinite(S_out):
                raise Failure(f"on {desc}: the result holds inf or nan, {_OVERFLOW}")
            S_arr = _as_array(S_out)
            if S_arr is not None and S_arr.shape == want_S.T.shape:
                raise Failure(f"S_out on {desc} has shape {S_arr.shape}, the transpose: the book stores S as "
                              f"(d_k, d_v) = {want_S.shape}, a write is np.outer(k, u) and a read S.T @ q")
            if _close_pair(O, S_out, want_O, want_S):
                continue
            mean_gate = np.repeat(log_gate.mean(axis=1, keepdims=True), d_k, axis=1)
            with np.errstate(all="ignore"):
                mean_decay = np.repeat(np.log(np.exp(log_gate).mean(axis=1, keepdims=True)), d_k, axis=1)
            scalar = ("this is Gated DeltaNet with one scalar gate per token (the mean over the channels): "
                      "KDA keeps one decay per key channel, so every pair product carries exp(b_rc - b_ic) "
                      "inside the sum over the channels c, and b is a (C, d_k) cumulative sum")
            candidates = [
                (kda_loop_variant(q, k, v, beta, mean_gate, S0), scalar),
                (kda_loop_variant(q, k, v, beta, mean_decay, S0), scalar),
                (kda_loop_variant(q, k, v, beta, log_gate, S0, order="correct_then_decay"),
                 "this is \"correct, then decay\": each token must decay the state first, "
                 "Diag(exp(gamma_t)) S_{t-1}, and compute its correction from the decayed state"),
                (kda_loop_variant(q, k, v, beta, log_gate, S0, order="decay_carried_only"),
                 "the correction uses the undecayed state: the pair products in A carry exp(b_r - b_i) and "
                 "the rows of W are beta_i (k_i * exp(b_i)), so that the correction is measured against the "
                 "decayed state"),
                (kda_chunk_variant(q, k, v, beta, log_gate, S0, subtract_ws=False),
                 "the incoming state's recall is not subtracted: U = U~ - W S_0 (eq-dr-ut), so that the "
                 "correction is measured against what the decayed S_0 already returns"),
                (kda_chunk_variant(q, k, v, beta, log_gate, S0, decay_state_in_out=False),
                 "the outputs read the incoming state undecayed: token r reads (q_r * exp(b_r))^T S_0, "
                 "each channel decayed since the chunk's start"),
                (kda_chunk_variant(q, k, v, beta, log_gate, S0, decay_in_a=False),
                 "A has no decays: A_ri = beta_r sum_c k_rc k_ic exp(b_rc - b_ic) for i < r"),
                (kda_chunk_variant(q, k, v, beta, log_gate, S0, decay_in_w=False),
                 "W has no decays: its rows are beta_i (k_i * exp(b_i)), the key decayed per channel since "
                 "the chunk's start"),
                (kda_chunk_variant(q, k, v, beta, log_gate, S0, own_write=False),
                 "token r does not see its own write: the output's pair sum runs over i <= r, the diagonal "
                 "included"),
            ]
            for (mo, ms), message in candidates:
                if _close_pair(O, S_out, mo, ms):
                    raise Failure(f"on {desc}: {message}")
            compare_arrays(O, want_O, what="the chunk's outputs O (C, d_v)", case=desc, rtol=1e-9, atol=1e-10)
            compare_arrays(S_out, want_S, what="the outgoing state S_out (d_k, d_v)", case=desc, rtol=1e-9,
                           atol=1e-10)
        return ("one chunk of KDA by the UT transform equals the token loop, from the zero state and a random "
                "one, for 1 to 8 tokens, with decays of 1e-87 (no inf or nan) and, with equal channels, as "
                "Gated DeltaNet")

    return run_check(label, body)


def _as_array(x):
    try:
        return np.asarray(x, dtype=float)
    except (TypeError, ValueError):
        return None


def _close_pair(O, S, want_O, want_S) -> bool:
    def close(a, b):
        a = _as_array(a)
        return a is not None and a.shape == np.shape(b) and bool(np.allclose(a, b, rtol=1e-8, atol=1e-10))
    return close(O, want_O) and close(S, want_S)
