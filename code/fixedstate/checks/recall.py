"""Checks for the exercises of chapter "What a fixed state forgets" (chap-recall).

Numeric answers live in :data:`ANSWERS`, each computed by the package (never
typed in) with its tolerance, and are checked by :func:`check_answer`. The
coding exercises are checked by :func:`check_recall_accuracy` (read a fixed
state at every key and score it by the nearest stored value) and
:func:`check_predicted_crosstalk` (the interference term of additive writes,
equation ``eq-rc-crosstalk``, predicted from the keys alone).
"""

from __future__ import annotations

import numpy as np

from .. import recall as rc
from ._core import check_numeric, CheckResult, Failure, call_student, compare_arrays, compare_number, failed, run_check

__all__ = ["ANSWERS", "check_answer", "check_recall_accuracy", "check_predicted_crosstalk",
           "largest_exact_n", "two_key_errors", "CROSSTALK_OVERLAP"]

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
    return {
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


def _accuracy_cases():
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
        for state, keys, values, case in _accuracy_cases():
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
