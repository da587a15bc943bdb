"""The state-space chapter's exercise checks pass on the reference and name each plausible mistake."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import scipy.linalg

from fixedstate import costs, kernels, ssm
from fixedstate.checks import ssm as checks


# --------------------------------------------------------------------------- numeric answers

def test_answers_are_the_package_values():
    # recomputed here from the formulas, independently of the checks module's calls
    state = 2 * 2560 * 128 * 4           # 2d channels, N = 128, float32
    per_token = 2 * 8 * 128 * 2          # a key and a value, 8 heads of width 128, bf16
    assert checks.ANSWERS["ex-ssm-kv-vs-state/state-bytes"]["value"] == state
    assert checks.ANSWERS["ex-ssm-kv-vs-state/kv-bytes-per-token"]["value"] == per_token
    assert checks.ANSWERS["ex-ssm-kv-vs-state/crossover"]["value"] == 641
    assert 640 * per_token == state
    assert checks.ANSWERS["ex-ssm-half-step"]["value"] == pytest.approx(np.log(2), rel=1e-12)
    # the off-by-one (the context at which the two are equal) is named
    r = checks.check_answer("ex-ssm-kv-vs-state/crossover", 640)
    assert not r.passed and "same size" in r.message


def test_scan_level_count_matches_the_recursion():
    calls = []

    def counting(frame, event, arg):              # every call of the recursion, with its length
        if event == "call" and frame.f_code is kernels.scan_pairs.__code__:
            calls.append(frame.f_locals["a"].shape[0])

    for T in (1, 2, 3, 5, 8, 37, 1000):
        calls.clear()
        sys.setprofile(counting)
        try:
            ssm.associative_scan(np.ones((T, 1)), np.ones((T, 1)))
        finally:
            sys.setprofile(None)
        # each call that recurses does one pairing level, and one fill-in level when T > 2
        levels = sum(1 + (n > 2) for n in calls if n > 1)
        assert levels == checks.scan_levels(T)
    assert checks.ANSWERS["ex-ssm-scan-levels"]["value"] == checks.scan_levels(128_000) == 32


def test_check_answer_passes_and_fails():
    for label, spec in checks.ANSWERS.items():
        assert checks.check_answer(label, spec["value"]).passed
    r = checks.check_answer("ex-ssm-kv-vs-state/state-bytes", 2 * 2560 * 128 * 2)
    assert not r.passed and "float32" in r.message
    assert not checks.check_answer("ex-ssm-kv-vs-state/crossover", ...).passed
    assert "no numeric answer" in checks.check_answer("ex-nope", 1.0).message


# --------------------------------------------------------------------------- discretization

def reference_zoh(A, B, delta):
    return ssm.discretize_zoh(A, B, delta)


def test_zoh_check_passes_on_reference_and_on_augmented_exponential():
    assert checks.check_discretize_zoh(reference_zoh).passed

    def augmented(A, B, delta):
        n = A.shape[0]
        big = np.zeros((n + 1, n + 1))
        big[:n, :n], big[:n, n] = A, B
        E = scipy.linalg.expm(delta * big)
        return E[:n, :n], E[:n, n]
    r = checks.check_discretize_zoh(augmented)
    assert r.passed, r


@pytest.mark.parametrize("wrong, phrase", [
    (lambda A, B, d: (np.exp(d * A), np.linalg.solve(A, np.exp(d * A) - np.eye(len(B))) @ B),
     "entrywise exponential"),
    (lambda A, B, d: (scipy.linalg.expm(d * A), d * B), "Euler step"),
    (lambda A, B, d: (scipy.linalg.expm(A), np.linalg.solve(A, scipy.linalg.expm(A) - np.eye(len(B))) @ B),
     "step size delta is missing"),
    (lambda A, B, d: (scipy.linalg.expm(d * A),
                      d * np.linalg.solve(A, scipy.linalg.expm(d * A) - np.eye(len(B))) @ B), "extra factor delta"),
    (lambda A, B, d: (scipy.linalg.expm(d * A), (scipy.linalg.expm(d * A) - np.eye(len(B))) @ np.linalg.solve(A.T, B)),
     "B_bar on"),
    (lambda A, B, d: ..., "replace the `...`"),
])
def test_zoh_check_names_the_mistake(wrong, phrase):
    r = checks.check_discretize_zoh(wrong)
    assert not r.passed
    assert phrase in r.message, r.message


# --------------------------------------------------------------------------- kernel

def test_kernel_check_passes_on_reference():
    assert checks.check_ssm_kernel(ssm.ssm_kernel).passed

    def by_powers(A_bar, B_bar, C, length):
        return np.array([C @ np.linalg.matrix_power(A_bar, j) @ B_bar for j in range(length)])
    assert checks.check_ssm_kernel(by_powers).passed


@pytest.mark.parametrize("wrong, phrase", [
    (lambda A, B, C, L: np.array([C @ np.linalg.matrix_power(A, j + 1) @ B for j in range(L)]), "K_0 = C B_bar"),
    (lambda A, B, C, L: np.array([C @ np.linalg.matrix_power(A.T, j) @ B for j in range(L)]), "transpose of A_bar"),
    (lambda A, B, C, L: np.array([C @ np.linalg.matrix_power(A, j) @ B for j in range(L - 1)]), "expected shape"),
    (lambda A, B, C, L: np.array([C @ (A ** j) @ B for j in range(L)]), "largest difference"),
])
def test_kernel_check_names_the_mistake(wrong, phrase):
    r = checks.check_ssm_kernel(wrong)
    assert not r.passed
    assert phrase in r.message, r.message


# --------------------------------------------------------------------------- selective step

def reference_step(state, x_t, delta_t, A, B_t, C_t, D):
    # the exercise keeps its own argument order; the package's step takes the state as initial_state
    return ssm.selective_scan_step(x_t, delta_t, A, B_t, C_t, D=D, initial_state=state)


def test_selective_step_check_passes_on_reference_and_handwritten():
    assert checks.check_selective_step(reference_step).passed

    def handwritten(state, x_t, delta_t, A, B_t, C_t, D):
        new = np.exp(delta_t[:, None] * A) * state + np.outer(delta_t * x_t, B_t)
        return new @ C_t + D * x_t, new
    assert checks.check_selective_step(handwritten).passed


def _zoh_b(state, x, dt, A, B, C, D):
    decay = np.exp(dt[:, None] * A)
    new = decay * state + (decay - 1) / A * B[None, :] * x[:, None]
    return new @ C + D * x, new


def _old_readout(state, x, dt, A, B, C, D):
    new = np.exp(dt[:, None] * A) * state + np.outer(dt * x, B)
    return state @ C + D * x, new


def _no_skip(state, x, dt, A, B, C, D):
    new = np.exp(dt[:, None] * A) * state + np.outer(dt * x, B)
    return new @ C, new


def _transposed(state, x, dt, A, B, C, D):
    new = np.exp(dt[:, None] * A) * state + np.outer(dt * x, B)
    return new @ C + D * x, new.T


def _exp_a(state, x, dt, A, B, C, D):
    new = np.exp(A) * state + np.outer(dt * x, B)
    return new @ C + D * x, new


def _no_decay(state, x, dt, A, B, C, D):
    new = state + np.outer(dt * x, B)
    return new @ C + D * x, new


@pytest.mark.parametrize("wrong, phrase", [
    (_zoh_b, "Euler step"),
    (_old_readout, "reads the old state"),
    (_no_skip, "skip term D"),
    (_transposed, "transpose of (d, N)"),
    (_exp_a, "exp(delta * A)"),
    (_no_decay, "does not decay the old state"),
])
def test_selective_step_check_names_the_mistake(wrong, phrase):
    r = checks.check_selective_step(wrong)
    assert not r.passed
    assert phrase in r.message, r.message


def test_crashing_student_code_is_reported_not_raised():
    def crash(*args):
        raise IndexError("oops")
    for check in (checks.check_discretize_zoh, checks.check_ssm_kernel, checks.check_selective_step):
        r = check(crash)
        assert not r.passed and "IndexError" in r.message


# ---------------------------------------------------------------- challenge: the parallel scan

def _pairwise_scan(a, b):
    T = a.shape[0]
    if T == 1:
        return b.copy()
    m = T // 2
    h_odd = _pairwise_scan(a[1:2 * m:2] * a[0:2 * m:2], a[1:2 * m:2] * b[0:2 * m:2] + b[1:2 * m:2])
    h = np.empty_like(b)
    h[0] = b[0]
    h[1:2 * m:2] = h_odd
    h[2:T:2] = a[2:T:2] * h_odd[:(T - 1) // 2] + b[2:T:2]
    return h


def _doubling_scan(a, b):
    a, h, s = a.copy(), b.copy(), 1
    while s < len(a):
        h[s:] = a[s:] * h[:-s] + h[s:]
        a[s:] = a[s:] * a[:-s]
        s *= 2
    return h


def _loop_scan(a, b):
    h, prev = np.empty_like(b), np.zeros_like(b[0])
    for t in range(len(a)):
        prev = a[t] * prev + b[t]
        h[t] = prev
    return h


def test_parallel_scan_check_passes_scans_and_names_the_slips():
    from fixedstate.checks.ssm import check_parallel_scan, scan_loop
    assert check_parallel_scan(_pairwise_scan).passed
    assert check_parallel_scan(_doubling_scan).passed
    result = check_parallel_scan(_loop_scan)
    assert not result.passed and "loops over the time steps" in result.message
    exclusive = lambda a, b: np.concatenate([np.zeros_like(b[:1]), _loop_scan(a, b)[:-1]])
    assert "exclusive scan" in check_parallel_scan(exclusive).message
    assert "wrong order" in check_parallel_scan(lambda a, b: scan_loop(a, b, order="wrong")).message
    assert "a-part" in check_parallel_scan(lambda a, b: np.cumprod(a, axis=0)).message
    package = lambda a, b: ssm.associative_scan(a, b)
    assert "the package's own implementation" in check_parallel_scan(package).message


def test_parallel_scan_check_refuses_dividing_by_cumulative_products():
    from fixedstate.checks.ssm import check_parallel_scan

    def cumprod_trick(a, b):             # h_t = P_t sum_s b_s / P_s: right on paper, underflows in float64
        P = np.cumprod(a, axis=0)
        with np.errstate(all="ignore"):
            return P * np.cumsum(b / P, axis=0)

    result = check_parallel_scan(cumprod_trick)
    assert not result.passed and "cumulative products" in result.message
