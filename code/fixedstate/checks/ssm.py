"""Checks for the exercises of chapter "State-space models" (chap-ssm).

Numeric answers live in :data:`ANSWERS`, each computed by the package (never
typed in) with its tolerance, and are checked by :func:`check_answer`. The
coding exercises are checked by:

- :func:`check_discretize_zoh`: ``discretize_zoh(A, B, delta) -> (A_bar, B_bar)``;
- :func:`check_ssm_kernel`: ``ssm_kernel(A_bar, B_bar, C, length) -> K``;
- :func:`check_selective_step`: ``selective_step(state, x_t, delta_t, A, B_t, C_t, D) -> (y_t, new_state)``.

Each check compares with :mod:`fixedstate.ssm` and, when the answer is wrong,
recognises the usual mistakes and names them.

Challenge problem: :func:`check_parallel_scan` for ``parallel_scan(a, b) -> h``,
all prefixes of ``h_t = a_t h_{t-1} + b_t`` in a logarithmic number of levels
(compared with a plain loop and :func:`fixedstate.ssm.associative_scan`, which the
answer may not call; a loop over the time steps is recognised by the lines of
Python it executes).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg

from .. import costs
from .. import kernels
from .. import ssm
from ._core import (CheckResult, check_numeric, Failure, call_student, call_without, compare_arrays, compare_number,
                    count_student_lines, failed, has_nonfinite, run_check)

__all__ = ["ANSWERS", "check_answer", "check_discretize_zoh", "check_ssm_kernel",
           "check_selective_step", "check_parallel_scan", "KV_CROSSOVER"]

#: Exercise ex-ssm-kv-vs-state: one grouped-query attention layer (8 key-value heads of width 128,
#: bf16) against one Mamba-2-shaped layer (d = 2560 expanded by 2, N = 128, float32 state).
KV_CROSSOVER = dict(n_kv_heads=8, head_dim=128, kv_bytes=2, d_model=2560, expand=2, state_size=128,
                    state_bytes=4)


def _answers() -> dict[str, dict]:
    p = KV_CROSSOVER
    state = costs.ssm_state_bytes(p["d_model"], 1, p["state_size"], bytes_per_number=p["state_bytes"],
                                expand=p["expand"])
    per_token = costs.kv_cache_bytes(1, n_kv_heads=p["n_kv_heads"], head_dim=p["head_dim"],
                                     bytes_per_element=p["kv_bytes"])
    crossover = state // per_token + 1        # the first context s with s * per_token > state
    # selectivity: with A = -1, the step at which a token's write leaves half of the old state
    a = -1.0
    half = math.log(0.5) / a
    # associativity: the pairwise scan's number of sequential levels for T = 128,000 (up and down)
    levels = scan_levels(128_000)
    return {
        "ex-ssm-kv-vs-state/state-bytes": dict(
            value=state, tolerance=0, what="the state of the SSM layer, in bytes",
            hints=[(state // 2, "half: the state has N numbers for each of the 2d expanded channels, "
                                "each in 4 bytes (float32)")]),
        "ex-ssm-kv-vs-state/kv-bytes-per-token": dict(
            value=per_token, tolerance=0, what="the bytes one token adds to the KV cache",
            hints=[(per_token // 2, "half: a token leaves a key AND a value in each key-value head")]),
        "ex-ssm-kv-vs-state/crossover": dict(
            value=crossover, tolerance=0,
            what="the shortest context at which the KV cache is strictly larger than the state, in tokens",
            hints=[(crossover - 1, "at that context the cache and the state are the same size; the "
                                   "question asks for the first context at which the cache is larger")]),
        "ex-ssm-half-step": dict(value=half, tolerance=1e-3, relative=True,
                                 what="the step size delta that keeps half of the old state when A = -1"),
        "ex-ssm-scan-levels": dict(value=levels, tolerance=0, relative=False,
                                   what="the number of sequential levels of the pairwise scan at T = 128,000"),
    }


def scan_levels(T: int) -> int:
    """Sequential levels of :func:`fixedstate.ssm.associative_scan`: one pairing and one fill-in per halving."""
    levels = 0
    while T > 1:
        levels += 1 if T == 2 else 2     # pair up; fill in the even positions (none to fill when T == 2)
        T //= 2
    return levels


ANSWERS = _answers()


def check_answer(label: str, value) -> CheckResult:
    """Check a numeric answer against :data:`ANSWERS` (computed by the package) within its tolerance."""
    return check_numeric(label, value, ANSWERS)


# ---------------------------------------------------------------------------
# discretize an SSM by zero-order hold

def _zoh_cases():
    rng = np.random.default_rng(20)
    A_h, B_h = ssm.hippo_legs(4)
    M = rng.normal(size=(3, 3))
    A_r = M - (np.max(np.linalg.eigvals(M).real) + 0.5) * np.eye(3)
    return [(A_h, B_h, 0.1, "HiPPO-LegS with N = 4 and delta = 0.1"),
            (A_r, rng.normal(size=3), 0.5, "a random stable 3 x 3 A with delta = 0.5"),
            (np.diag([-1.0, -2.0]), np.array([1.0, -1.0]), 0.8, "a diagonal A = diag(-1, -2) with delta = 0.8")]


def _close(got, want, tol=1e-8) -> bool:
    got = np.asarray(got, dtype=float)
    return got.shape == np.shape(want) and bool(np.allclose(got, want, rtol=tol, atol=tol))


def check_discretize_zoh(discretize_zoh) -> CheckResult:
    """Check ``discretize_zoh(A, B, delta) -> (A_bar, B_bar)`` against ``eq-ssm-zoh``."""
    label = "ex-ssm-zoh"

    def body():
        for A, B, delta, case in _zoh_cases():
            out = call_student(discretize_zoh, A.copy(), B.copy(), delta, case=case)
            if not isinstance(out, tuple) or len(out) != 2:
                raise Failure(f"on {case}: expected a pair (A_bar, B_bar), got {type(out).__name__}")
            A_bar, B_bar = out
            want_A, want_B = ssm.discretize_zoh(A, B, delta)
            if not _close(A_bar, want_A) and _close(A_bar, np.exp(delta * A)):
                raise Failure(f"A_bar on {case} is the entrywise exponential np.exp(delta * A); the zero-order "
                              "hold needs the matrix exponential scipy.linalg.expm(delta * A)")
            if _close(A_bar, scipy.linalg.expm(A)) and not _close(A_bar, want_A):
                raise Failure(f"A_bar on {case} is expm(A): the step size delta is missing, A_bar = expm(delta * A)")
            compare_arrays(A_bar, want_A, what="A_bar", case=case, rtol=1e-8, atol=1e-10)
            if _close(B_bar, delta * B) and not _close(B_bar, want_B):
                raise Failure(f"B_bar on {case} is delta * B, the Euler step Mamba's code uses; the exact "
                              "zero-order hold is A^{-1} (expm(delta A) - I) B")
            if _close(B_bar, np.linalg.solve(A, want_A - np.eye(len(B))) @ B * delta) and not _close(B_bar, want_B):
                raise Failure(f"B_bar on {case} has an extra factor delta: A^{{-1}} (expm(delta A) - I) B "
                              "already contains it (write it as (delta A)^{-1} (expm(delta A) - I) delta B)")
            compare_arrays(B_bar, want_B, what="B_bar", case=case, rtol=1e-8, atol=1e-10)
        return "A_bar = expm(delta A) and B_bar = A^-1 (expm(delta A) - I) B on all cases"

    return run_check(label, body)


# ---------------------------------------------------------------------------
# compute the convolution kernel

def _kernel_cases():
    rng = np.random.default_rng(21)
    A, B = ssm.hippo_legs(5)
    A_bar, B_bar = ssm.discretize_zoh(A, B, 0.2)
    M = rng.normal(size=(3, 3)) * 0.5
    return [(A_bar, B_bar, rng.normal(size=5), 12, "HiPPO-LegS (N = 5, delta = 0.2), length 12"),
            (M, rng.normal(size=3), rng.normal(size=3), 7, "a random non-symmetric 3 x 3 A_bar, length 7"),
            (np.array([[0.5]]), np.array([2.0]), np.array([1.0]), 4, "a scalar system a = 0.5, b = 2, c = 1")]


def check_ssm_kernel(ssm_kernel) -> CheckResult:
    """Check ``ssm_kernel(A_bar, B_bar, C, length) -> K`` (shape ``(length,)``) against ``eq-ssm-kernel``,
    and that convolving with it reproduces the recurrence."""
    label = "ex-ssm-kernel"

    def body():
        for A_bar, B_bar, C, L, case in _kernel_cases():
            K = call_student(ssm_kernel, A_bar.copy(), B_bar.copy(), C.copy(), L, case=case)
            want = ssm.ssm_kernel(A_bar, B_bar, C, L)
            K_arr = np.asarray(K, dtype=float)
            if K_arr.shape == (L,):
                shifted = ssm.ssm_kernel(A_bar, A_bar @ B_bar, C, L)
                if np.allclose(K_arr, shifted, rtol=1e-8) and not np.allclose(K_arr, want, rtol=1e-8):
                    raise Failure(f"K on {case} starts at C A_bar B_bar: the first tap is K_0 = C B_bar "
                                  "(A_bar to the power 0), the current token's own contribution")
                transposed = ssm.ssm_kernel(A_bar.T, B_bar, C, L)
                if np.allclose(K_arr, transposed, rtol=1e-8) and not np.allclose(K_arr, want, rtol=1e-8):
                    raise Failure(f"K on {case} uses the transpose of A_bar: K_j = C A_bar^j B_bar with the "
                                  "matrix power applied to B_bar (A_bar @ v, not v @ A_bar)")
            compare_arrays(K, want, what="K", case=case, rtol=1e-9, atol=1e-12)
            # the kernel's raison d'etre: convolution reproduces the recurrence
            x = np.random.default_rng(L).normal(size=L)
            compare_arrays(ssm.causal_conv(x, K_arr), ssm.lti_recurrence(x, A_bar, B_bar, C)[0],
                           what="the convolution of your kernel with an input", case=case)
        return "K_j = C A_bar^j B_bar, and K * x equals the recurrence on all cases"

    return run_check(label, body)


# ---------------------------------------------------------------------------
# one selective-scan step

def _step_cases():
    rng = np.random.default_rng(22)
    d, N = 3, 4
    A = -np.exp(rng.normal(size=(d, N)))
    cases = []
    for i, desc in enumerate(["a zero state", "a random state", "a random state and large steps"]):
        state = np.zeros((d, N)) if i == 0 else rng.normal(size=(d, N))
        delta = ssm.selective_delta(rng.normal(size=(1, d)), 2.0 if i == 2 else 0.0)[0]
        cases.append((state, rng.normal(size=d), delta, A, rng.normal(size=N), rng.normal(size=N),
                      rng.normal(size=d), f"{desc} (d = {d}, N = {N})"))
    return cases


def check_selective_step(selective_step) -> CheckResult:
    """Check ``selective_step(state, x_t, delta_t, A, B_t, C_t, D) -> (y_t, new_state)`` (``eq-ssm-selective``).

    Shapes: ``state`` ``(d, N)``, ``x_t``, ``delta_t``, ``D`` ``(d,)``, ``A`` ``(d, N)``,
    ``B_t``, ``C_t`` ``(N,)``; returns ``y_t`` ``(d,)`` and the new ``(d, N)`` state.
    """
    label = "ex-ssm-selective-step"

    def body():
        for state, x, delta, A, B, C, D, case in _step_cases():
            out = call_student(selective_step, state.copy(), x.copy(), delta.copy(), A.copy(), B.copy(),
                               C.copy(), D.copy(), case=case)
            if not isinstance(out, tuple) or len(out) != 2:
                raise Failure(f"on {case}: expected a pair (y_t, new_state), got {type(out).__name__}")
            y, new = (np.asarray(o, dtype=float) for o in out)
            want_y, want_h = ssm.selective_scan_step(x, delta, A, B, C, D=D, initial_state=state)
            decay = np.exp(delta[:, None] * A)
            if new.shape == want_h.T.shape and new.shape != want_h.shape:
                raise Failure(f"new_state on {case} has shape {new.shape}, the transpose of (d, N) = "
                              f"{want_h.shape}: keep one row per channel, one column per state entry")
            zoh_b = (decay - 1.0) / A * B[None, :]
            right = _close(new, want_h)
            if _close(new, decay * state + zoh_b * x[:, None]) and not right:
                raise Failure(f"new_state on {case} uses the exact zero-order-hold B_bar = (exp(delta A) - 1)/A * B; "
                              "Mamba's selective scan uses the Euler step B_bar = delta * B")
            if _close(new, np.exp(A) * state + (delta * x)[:, None] * B[None, :]) and not right:
                raise Failure(f"new_state on {case} decays by exp(A): the decay depends on the step, exp(delta * A)")
            if _close(new, state + (delta * x)[:, None] * B[None, :]) and not right:
                raise Failure(f"new_state on {case} does not decay the old state: multiply it by exp(delta * A)")
            compare_arrays(new, want_h, what="new_state", case=case)
            if _close(y, state @ C + D * x) and not _close(y, want_y):
                raise Failure(f"y_t on {case} reads the old state: the output reads the updated state, "
                              "y_t = new_state @ C_t + D * x_t")
            if _close(y, new @ C) and not _close(y, want_y):
                raise Failure(f"y_t on {case} misses the skip term D * x_t")
            compare_arrays(y, want_y, what="y_t", case=case)
        return "the state decays by exp(delta A), writes delta B x, and y reads the updated state plus D x"

    return run_check(label, body)


# ---------------------------------------------------------------------------
# the parallel associative scan (challenge)

_SCAN_FORMS = (ssm.associative_scan, kernels.scan_pairs, ssm.selective_scan_parallel, ssm.selective_scan_sequential,
               ssm.lti_recurrence)


def scan_loop(a, b, *, order="right"):
    """h_t = a_t h_{t-1} + b_t by a loop (``order="wrong"``: the pairs composed in the opposite order)."""
    h = np.empty_like(b)
    if order == "right":
        prev = np.zeros_like(b[0])
        for t in range(len(a)):
            prev = a[t] * prev + b[t]
            h[t] = prev
    else:                                    # (a1, b1) . (a2, b2) = (a1 a2, a1 b2 + b1): later steps decayed by earlier gates
        acc_a, acc_b = np.ones_like(a[0]), np.zeros_like(b[0])
        for t in range(len(a)):
            acc_b = acc_b + acc_a * b[t]
            acc_a = acc_a * a[t]
            h[t] = acc_b
    return h


def _scan_cases():
    rng = np.random.default_rng(80)
    cases = []
    for T, shape, desc in [(7, (), "T = 7 (odd)"), (1, (), "T = 1"), (2, (), "T = 2"),
                           (16, (3,), "T = 16 with 3 channels, a and b of shape (16, 3)"),
                           (13, (2, 4), "T = 13 with a (d, N) = (2, 4) state per step, shape (13, 2, 4)")]:
        cases.append((rng.uniform(0.3, 1.0, (T,) + shape), rng.standard_normal((T,) + shape), desc))
    # strong gates: the product of the first t gates underflows to 0 (about 1e-700 at t = 200), so an
    # answer that divides by cumulative products (h = P cumsum(b / P)) returns inf or nan here
    cases.append((rng.uniform(1e-4, 1e-3, 200), rng.standard_normal(200),
                  "T = 200 with strong gates a_t between 1e-4 and 1e-3"))
    return cases


#: The length at which the check counts the lines of Python a scan executes, and the budget it allows.
SCAN_LINE_TEST = dict(T=8192, budget=2048)


def check_parallel_scan(parallel_scan) -> CheckResult:
    """Check ``parallel_scan(a, b) -> h`` (``eq-ssm-scan-op``): ``h_t = a_t h_{t-1} + b_t`` with ``h_0 = b_0``.

    ``a`` and ``b`` have shape ``(T, ...)``; ``h`` the same. Compared with a plain
    loop on lengths 1, 2, 7, 16, 13 (with trailing state axes) and 200 (strong gates); names an
    exclusive scan (the state before each step), the pairs composed in the wrong
    order and a loop over the time steps (more than 2,048 lines of Python executed
    at T = 8,192, where about 2 log2 T levels of array operations need a few
    hundred). Refuses an answer that calls :func:`fixedstate.ssm.associative_scan`.
    """
    label = "ex-ssm-parallel-scan"

    def body():
        for a, b, case in _scan_cases():
            h = call_without(parallel_scan, _SCAN_FORMS, a.copy(), b.copy(), case=case)
            want = scan_loop(a, b)
            got = np.asarray(h, dtype=float) if not isinstance(h, tuple) else None
            if got is None:
                raise Failure(f"on {case}: expected the array h of shape {a.shape}, got a tuple; return h only "
                              "(the b-part of the scanned pairs)")
            if got.shape == want.shape and has_nonfinite(got):
                raise Failure(f"on {case}: h holds inf or nan. Dividing by the cumulative products of the "
                              "gates (h_t = P_t sum_s b_s / P_s) is not a scan and fails once the products "
                              "underflow to 0; combine the pairs (a, b) with the associative operator, "
                              "which only multiplies gates together")
            if got.shape == want.shape and not np.allclose(got, want, rtol=1e-9, atol=1e-12):
                exclusive = np.concatenate([np.zeros_like(want[:1]), want[:-1]])
                if len(a) > 1 and np.allclose(got, exclusive, rtol=1e-9, atol=1e-12):
                    raise Failure(f"on {case}: you returned the state BEFORE each step (an exclusive scan, "
                                  "shifted by one); h_t includes step t: h_0 = b_0")
                if len(a) > 1 and np.allclose(got, scan_loop(a, b, order="wrong"), rtol=1e-9, atol=1e-12):
                    raise Failure(f"on {case}: the pairs are composed in the wrong order: applying step 1 "
                                  "then step 2 gives (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2); the later "
                                  "gate multiplies the earlier b")
                cumulative_a = np.cumprod(a, axis=0)
                if np.allclose(got, cumulative_a, rtol=1e-9, atol=1e-12):
                    raise Failure(f"on {case}: you returned the a-part of the scanned pairs (the products "
                                  "of the gates); h is the b-part")
            compare_arrays(h, want, what="h", case=case, rtol=1e-9, atol=1e-12)
        T, budget = SCAN_LINE_TEST["T"], SCAN_LINE_TEST["budget"]
        rng = np.random.default_rng(81)
        a, b = rng.uniform(0.9, 1.0, T), rng.standard_normal(T) * 0.01
        case = f"T = {T:,} (counting the lines of Python your function executes)"
        h, lines = count_student_lines(parallel_scan, a, b, case=case)
        compare_arrays(h, scan_loop(a, b), what="h", case=case, rtol=1e-8, atol=1e-10)
        if lines > budget:
            raise Failure(f"on {case}: your function executed {lines:,} lines of Python, more than the "
                          f"{budget:,} a parallel scan needs: it loops over the time steps. Combine whole "
                          "arrays of neighbouring pairs at once, level by level (about 2 log2 T levels)")
        return (f"every prefix of h_t = a_t h_(t-1) + b_t is right (odd lengths and state axes included), "
                f"and at T = {T:,} your scan executed {lines:,} lines of Python, not one per step")

    return run_check(label, body)
