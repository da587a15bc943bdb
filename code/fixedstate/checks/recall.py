"""Checks for the exercises of chapter "What a fixed state forgets" (chap-recall).

Numeric answers live in :data:`ANSWERS`, each computed by the package (never
typed in) with its tolerance, and are checked by :func:`check_answer`. The
coding exercises are checked by :func:`check_recall_accuracy` (read a fixed
state at every key and score it by the nearest stored value) and
:func:`check_predicted_crosstalk` (the interference term of additive writes,
equation ``eq-rc-crosstalk``, predicted from the keys alone).

Challenge problem: :func:`check_recall_curve` for
``recall_curve(keys, values, n_values) -> accuracies``, the capacity experiment of
the chapter written from scratch (delta-rule writes, reads, nearest-value scoring,
averaged over seeds), compared with the package's :func:`fixedstate.recall.write_memory`,
:func:`~fixedstate.recall.read_memory` and :func:`~fixedstate.recall.nearest_value`
(which the answer may not call); then the experiment at a state size the chapter
does not measure (:data:`NEW_STATE_SIZE`, answer ``ex-rc-new-size``).
"""

from __future__ import annotations

import numpy as np

from .. import recall as rc
from .. import delta_rule as dr
from .. import linear_attention as la
from ._core import (check_numeric, CheckResult, Failure, call_student, call_without, compare_arrays, compare_number,
                    failed, run_check)

__all__ = ["ANSWERS", "check_answer", "check_recall_accuracy", "check_predicted_crosstalk",
           "largest_exact_n", "two_key_errors", "CROSSTALK_OVERLAP",
           "check_recall_curve", "NEW_STATE_SIZE", "new_size_draws", "reference_recall_curve"]

#: ex-rc-new-size: a delta-rule state of width 24 (the chapter measures 16 and 64), N pairs of the list,
#: random unit keys and values, the seeds of :func:`new_size_draws`.
NEW_STATE_SIZE = dict(d_k=24, d_v=24, n_values=(8, 12, 16, 20, 24, 28, 32, 40, 48), n_seeds=10, seed=2026)


def new_size_draws(d_k=None):
    """The keys and values of ``ex-rc-new-size``: ``(keys (n_seeds, N_max, d_k), values (n_seeds, N_max, d_v))``.

    Seed ``s`` draws ``N_max`` random unit keys and then as many unit values with
    ``np.random.default_rng(seed + s)`` (:func:`fixedstate.recall.make_keys` and
    :func:`~fixedstate.recall.make_values`). ``d_k`` (default 24) also sets ``d_v``.
    """
    p = NEW_STATE_SIZE
    d = p["d_k"] if d_k is None else int(d_k)
    n_max = max(p["n_values"])
    keys, values = [], []
    for s in range(p["n_seeds"]):
        rng = np.random.default_rng(p["seed"] + s)
        keys.append(rc.make_keys(n_max, d, rng=rng))
        values.append(rc.make_values(n_max, d, rng=rng))
    return np.array(keys), np.array(values)


def reference_recall_curve(keys, values, n_values, mechanism="delta") -> np.ndarray:
    """Mean recall accuracy over the seeds for each N: the first N pairs written, read at their keys."""
    curve = []
    for n in n_values:
        acc = []
        for K, V in zip(keys, values):
            memory = rc.write_memory(mechanism, K[:n], V[:n])
            recalled = rc.read_memory(mechanism, memory, K[:n])
            acc.append(np.mean(rc.nearest_value(recalled, V[:n]) == np.arange(n)))
        curve.append(np.mean(acc))
    return np.array(curve)


def _largest_reliable(curve, n_values, level=0.9) -> int:
    """The largest N of the list up to which every mean accuracy is at least ``level`` (0 if none)."""
    best = 0
    for n, a in zip(n_values, curve):
        if a < level:
            break
        best = int(n)
    return best

#: The overlap of the two keys in the crosstalk exercise.
CROSSTALK_OVERLAP = 0.35


def largest_exact_n(d_k: int = 16, *, n_max: int = 24, seed: int = 0, tol: float = 1e-9) -> int:
    """The largest N whose pairs a ``d_k``-wide delta-rule state recalls exactly.

    Keys: the first ``min(N, d_k)`` orthonormal, any beyond ``d_k`` random unit
    vectors (no further orthonormal key exists). "Exactly" means every recall
    error below ``tol``. Scans ``N = 1 .. n_max`` and returns the largest N for
    which every smaller N also passes.
    """
    best = 0
    for n in range(1, n_max + 1):
        rng = np.random.default_rng(seed + n)
        keys = rc.make_keys(min(n, d_k), d_k, orthogonal=True, rng=rng)
        if n > d_k:
            keys = np.vstack([keys, rc.make_keys(n - d_k, d_k, rng=rng)])
        values = rc.make_values(n, d_k, rng=rng)
        if np.max(rc.recall_pairs("delta", keys, values).errors) < tol:
            best = n
        else:
            break
    return best


def two_key_errors(overlap: float = CROSSTALK_OVERLAP) -> dict[str, np.ndarray]:
    """Recall errors (lengths) for two unit keys with the given overlap and orthonormal values.

    Returns ``{"linear": (2,), "delta": (2,)}``: the first entry is the key
    written first.
    """
    keys = rc.make_keys(2, 4, overlap=overlap, orthogonal=True, rng=0)
    values = np.eye(2)
    return {m: rc.recall_pairs(m, keys, values).errors for m in ("linear", "delta")}


def _answers() -> dict[str, dict]:
    errs = two_key_errors()
    p = NEW_STATE_SIZE
    keys, values = new_size_draws()
    new_size = _largest_reliable(reference_recall_curve(keys, values, p["n_values"]), p["n_values"])
    additive = _largest_reliable(reference_recall_curve(keys, values, p["n_values"], "linear"), p["n_values"])
    k16, v16 = new_size_draws(16)
    at_16 = _largest_reliable(reference_recall_curve(k16, v16, p["n_values"]), p["n_values"])
    hints = [(additive, "that is the additive (linear-attention) state's answer: write with the delta rule"),
             (at_16, "that is the answer for a state of width 16: this experiment uses d_k = d_v = 24"),
             (p["d_k"], "N = d_k is the number of orthogonal keys a state can hold exactly; these keys are "
                        "random, so measure rather than reason from d_k")]
    return {
        "ex-rc-new-size": dict(
            value=new_size, tolerance=0, relative=False, hints=[h for h in hints if h[0] != new_size],
            what="the largest N of the list at which a 24-wide delta-rule state keeps a mean accuracy of at "
                 "least 0.9"),
        "ex-rc-largest-exact": dict(
            value=largest_exact_n(16), tolerance=0, relative=False,
            what="the largest number of pairs a 16-wide delta-rule state recalls exactly"),
        "ex-rc-crosstalk-additive": dict(
            value=float(errs["linear"][0]), tolerance=1e-6, relative=False,
            what=f"the length of the additive recall error for the first key (overlap {CROSSTALK_OVERLAP})"),
        "ex-rc-crosstalk-delta-first": dict(
            value=float(errs["delta"][0]), tolerance=1e-6, relative=False,
            what="the length of the delta-rule recall error for the key written first"),
        "ex-rc-crosstalk-delta-second": dict(
            value=float(errs["delta"][1]), tolerance=1e-6, relative=False,
            what="the length of the delta-rule recall error for the key written second"),
    }


ANSWERS = _answers()


def check_answer(label: str, value) -> CheckResult:
    """Check a numeric answer against :data:`ANSWERS` (computed by the package) within its tolerance."""
    return check_numeric(label, value, ANSWERS)


# ---------------------------------------------------------------------------
# Coding exercise: recall accuracy of a fixed state
# ---------------------------------------------------------------------------

def _reference_accuracy(state, keys, values) -> float:
    recalled = rc.read_memory("linear", state, keys)
    return float(np.mean(rc.nearest_value(recalled, values) == np.arange(keys.shape[0])))


def accuracy_cases():
    """Cases where every plausible mistake gives a different number from the right one."""
    cases = []
    # 1. a square, non-symmetric state: reading S q instead of S^T q gives other answers
    rng = np.random.default_rng(21)
    keys = rc.make_keys(6, 6, rng=rng)
    values = rc.make_values(6, 6, rng=rng)
    state = rc.write_memory("delta", keys, values) + 0.8 * rng.standard_normal((6, 6))
    cases.append((state, keys, values, "a 6 x 6 delta-rule state with noise added, 6 pairs"))
    # 2. values of different lengths: the nearest by distance is not the largest dot product
    rng = np.random.default_rng(0)
    keys = rc.make_keys(6, 8, orthogonal=True, rng=rng)
    values = rc.make_values(6, 3, rng=rng) * np.array([0.3, 0.5, 1.0, 1.5, 2.5, 3.5])[:, None]
    state = rc.write_memory("linear", keys, values)
    cases.append((state, keys, values, "an 8 x 3 additive state, 6 orthonormal keys, values of "
                                       "lengths 0.3 to 3.5"))
    # 3. a state that recalls everything exactly
    keys = rc.make_keys(4, 4, orthogonal=True, rng=2)
    values = rc.make_values(4, 7, rng=3)
    cases.append((keys.T @ values, keys, values, "a 4 x 7 state holding 4 orthonormal pairs exactly"))
    return cases


def _accuracy_wrong_answers(state, keys, values):
    n = keys.shape[0]
    right = rc.read_memory("linear", state, keys)
    out = []
    if state.shape[0] == state.shape[1]:
        transposed = keys @ state.T
        out.append((float(np.mean(rc.nearest_value(transposed, values) == np.arange(n))),
                    "you read the state as S q; the book stores S as (d_k, d_v) and reads o = S^T q "
                    "(in numpy: keys @ S)"))
    by_dot = np.argmax(right @ values.T, axis=1)
    out.append((float(np.mean(by_dot == np.arange(n))),
                "you picked the value with the largest dot product; the nearest value is the one at the "
                "smallest distance |o - v_j|, and a long value wins dot products it should not"))
    correct = rc.nearest_value(right, values) == np.arange(n)
    out.append((float(np.sum(correct)), "you returned the number of keys recalled; return the fraction "
                                        "(divide by the number of pairs)"))
    return out


def check_recall_accuracy(recall_accuracy) -> CheckResult:
    """Check ``recall_accuracy(state, keys, values) -> float`` (``eq-rc-readout``, ``eq-rc-accuracy``)."""

    def body():
        for state, keys, values, case in accuracy_cases():
            got = call_student(recall_accuracy, state.copy(), keys.copy(), values.copy(), case=case)
            try:
                value = float(got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected a number (the fraction recalled), "
                              f"got {type(got).__name__}") from None
            expected = _reference_accuracy(state, keys, values)
            if abs(value - expected) <= 1e-12:
                continue
            for wrong, meaning in _accuracy_wrong_answers(state, keys, values):
                if abs(value - wrong) <= 1e-12:
                    raise Failure(f"on {case}: got {value:.4g}, expected {expected:.4g}; {meaning}")
            raise Failure(f"on {case}: expected an accuracy of {expected:.4g}, got {value:.4g}")
        return "reads o = S^T k at every key and scores by the nearest stored value"

    return run_check("ex-rc-capacity", body)


# ---------------------------------------------------------------------------
# Coding exercise: predict the crosstalk
# ---------------------------------------------------------------------------

def _crosstalk_cases():
    cases = []
    keys = rc.make_keys(2, 4, overlap=CROSSTALK_OVERLAP, orthogonal=True, rng=0)
    cases.append((keys, np.eye(2), f"two keys with overlap {CROSSTALK_OVERLAP}, values e_1 and e_2"))
    rng = np.random.default_rng(9)
    cases.append((rc.make_keys(5, 3, rng=rng), rng.standard_normal((5, 4)),
                  "5 random unit keys of width 3, values of width 4"))
    rng = np.random.default_rng(10)
    keys = rng.standard_normal((4, 6))
    cases.append((keys, rng.standard_normal((4, 2)), "4 keys of width 6 that are NOT unit length"))
    return cases


def check_predicted_crosstalk(predicted_crosstalk) -> CheckResult:
    """Check ``predicted_crosstalk(keys, values) -> (N, d_v)`` against the additive layer.

    The expected answer is what the package measures: the additive state's read at
    each key minus the value written under it (equation ``eq-rc-crosstalk``; for
    keys that are not unit length the term ``(|k_i|^2 - 1) v_i`` is part of the error).
    """

    def body():
        for keys, values, case in _crosstalk_cases():
            got = call_student(predicted_crosstalk, keys.copy(), values.copy(), case=case)
            recalled = rc.read_memory("linear", rc.write_memory("linear", keys, values), keys)
            expected = recalled - values
            try:
                arr = np.asarray(got, dtype=float)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected an array (N, d_v), got {type(got).__name__}") from None
            if arr.shape == expected.shape and not np.allclose(arr, expected, rtol=1e-10, atol=1e-12):
                gram = keys @ keys.T
                if np.allclose(arr, gram @ values, rtol=1e-10, atol=1e-12):
                    raise Failure(f"on {case}: you returned the whole recall (K K^T) V; the crosstalk "
                                  "leaves out the pair's own term (j = i)")
                off = gram - np.diag(np.diag(gram))
                if np.allclose(arr, (np.ones_like(gram) - np.eye(len(gram))) @ values, rtol=1e-10,
                               atol=1e-12):
                    raise Failure(f"on {case}: you added the other values unweighted; pair j leaks in "
                                  "with the weight k_j . k_i, its key's overlap with the query")
                if np.allclose(arr, off @ values, rtol=1e-10, atol=1e-12):
                    raise Failure(f"on {case}: your sum over j != i is right for unit keys, but these keys "
                                  "are not unit length: the pair's own term is (k_i . k_i) v_i, so the "
                                  "error also holds (|k_i|^2 - 1) v_i")
            compare_arrays(arr, expected, what="the predicted crosstalk", case=case)
        return "the error of additive writes is sum_{j != i} (k_j . k_i) v_j (plus (|k_i|^2 - 1) v_i)"

    return run_check("ex-rc-crosstalk", body)


# ---------------------------------------------------------------------------
# Challenge problem: the capacity experiment, written from scratch
# ---------------------------------------------------------------------------

_RECALL_FORMS = (rc.write_memory, rc.read_memory, rc.nearest_value, rc.recall_pairs, rc.capacity_curve,
                 rc.batched_final_states, dr.delta_rule_step, dr.delta_rule_recurrent, dr.delta_rule_chunkwise,
                 dr.gated_delta_rule_loop, dr.gated_delta_rule_recurrent, la.linear_attention_recurrent)


def plain_curve(keys, values, n_values, *, write="delta", read="right", score="distance", among="first",
                 written="first", fraction=True):
    """The experiment with switches for the plausible slips (no package call)."""
    curve = []
    for n in n_values:
        acc = []
        for K, V in zip(keys, values):
            m = n if written == "first" else len(K)
            S = np.zeros((K.shape[1], V.shape[1]))
            for k, v in zip(K[:m], V[:m]):
                S = S + np.outer(k, v - (S.T @ k if write == "delta" else 0.0))
            R = K[:n] @ S if read == "right" else K[:n] @ S.T
            cand = V[:n] if among == "first" else V
            if score == "distance":
                pick = np.argmin(np.sum(cand ** 2, axis=1)[None, :] - 2 * R @ cand.T, axis=1)
            else:
                pick = np.argmax(R @ cand.T, axis=1)
            hits = pick == np.arange(n)
            acc.append(np.mean(hits) if fraction else np.sum(hits))
        curve.append(np.mean(acc))
    return np.array(curve)


def _curve_cases():
    cases = []
    rng = np.random.default_rng(90)
    K = np.array([rc.make_keys(10, 6, rng=rng) for _ in range(3)])
    V = np.array([rc.make_values(10, 6, rng=rng) * rng.uniform(0.3, 3.0, (10, 1)) for _ in range(3)])
    cases.append((K, V, (2, 4, 6, 8, 10), "3 seeds of 10 pairs, d_k = d_v = 6, values of lengths 0.3 to 3"))
    rng = np.random.default_rng(91)
    K = np.array([rc.make_keys(12, 8, rng=rng) for _ in range(4)])
    V = np.array([rc.make_values(12, 3, rng=rng) for _ in range(4)])
    cases.append((K, V, (3, 6, 9, 12), "4 seeds of 12 pairs, d_k = 8, d_v = 3, unit values"))
    rng = np.random.default_rng(92)
    K = np.array([rc.make_keys(5, 5, orthogonal=True, rng=rng) for _ in range(2)])
    V = np.array([rc.make_values(9, 4, rng=rng)[:5] for _ in range(2)])
    cases.append((K, V, (1, 5), "2 seeds of 5 orthonormal keys (exact recall expected)"))
    return cases


def check_recall_curve(recall_curve) -> CheckResult:
    """Check ``recall_curve(keys, values, n_values) -> accuracies`` (``eq-rc-delta``, ``eq-rc-readout``,
    ``eq-rc-accuracy``).

    ``keys`` ``(n_seeds, N_max, d_k)`` and ``values`` ``(n_seeds, N_max, d_v)``; for
    each ``N`` of ``n_values`` and each seed, write the first ``N`` pairs into a
    zero delta-rule state (``beta = 1``), read it at those ``N`` keys (``o = S^T k``),
    score each read by the nearest of those ``N`` values, and return the mean
    fraction over the seeds, one number per ``N``. Names additive writes, a
    transposed read, nearest by dot product, scoring against all ``N_max`` values,
    writing all ``N_max`` pairs and counts for fractions.
    """

    def body():
        for K, V, n_values, case in _curve_cases():
            got = call_without(recall_curve, _RECALL_FORMS, K.copy(), V.copy(), tuple(n_values), case=case)
            want = reference_recall_curve(K, V, n_values)
            try:
                arr = np.asarray(got, dtype=float)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected an array of {len(n_values)} accuracies, got "
                              f"{type(got).__name__}") from None
            if arr.shape == (len(K), len(n_values)):
                raise Failure(f"on {case}: expected one mean accuracy per N, shape ({len(n_values)},), got "
                              f"shape {arr.shape}: average over the seeds (axis 0)")
            if arr.shape == want.shape and not np.allclose(arr, want, atol=1e-12):
                for flags, message in [
                    (dict(write="additive"), "these are the accuracies of additive writes S + k v^T; the delta "
                                             "rule writes S + k (v - S^T k)^T"),
                    (dict(read="transposed"), "you read the state as S k; the book stores S as (d_k, d_v) and "
                                              "reads o = S^T k (keys @ S)"),
                    (dict(score="dot"), "you picked the value with the largest dot product; the nearest value "
                                        "is the one at the smallest distance, and a long value wins dot "
                                        "products it should not"),
                    (dict(among="all"), "you scored against all N_max values; only the N values written are "
                                        "candidates"),
                    (dict(written="all"), "you wrote all N_max pairs for every N; write only the first N"),
                    (dict(fraction=False), "you returned the number of keys recalled; return the fraction"),
                ]:
                    try:
                        slip = plain_curve(K, V, n_values, **flags)
                    except ValueError:                      # e.g. a transposed read when d_k != d_v
                        continue
                    if np.allclose(arr, slip, atol=1e-12):
                        raise Failure(f"on {case}: {message}")
            compare_arrays(arr, want, what="the mean accuracy for each N", case=case, rtol=0, atol=1e-12)
        return ("the experiment matches the package's write, read and nearest-value scoring on every case "
                "(values of different lengths and d_k != d_v included)")

    return run_check("ex-rc-new-size", body)
