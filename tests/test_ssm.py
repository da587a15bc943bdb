"""Tests of fixedstate.ssm: each states a property the state-space chapter claims."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import ssm
from fixedstate.blocks import softplus

SETTINGS = examples(40)


def rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def random_stable(rng, n, radius=0.95):
    """A random continuous A whose ZOH discretization is stable (eigenvalues shifted left)."""
    M = rng.normal(size=(n, n)) / np.sqrt(n)
    shift = np.max(np.linalg.eigvals(M).real) + rng.uniform(0.2, 1.0)
    return M - shift * np.eye(n)


# --------------------------------------------------------------------------- discretization

@SETTINGS
@given(n=st.integers(1, 6), delta=st.floats(1e-3, 2.0), seed=st.integers(0, 10_000), m=st.integers(1, 3))
def test_zoh_equals_augmented_matrix_exponential(n, delta, seed, m):
    # exp(delta [[A, B], [0, 0]]) = [[A_bar, B_bar], [0, I]]: an identity independent of A^{-1}
    rng = np.random.default_rng(seed)
    A = random_stable(rng, n)
    B = rng.normal(size=(n, m))
    A_bar, B_bar = ssm.discretize_zoh(A, B, delta)
    big = np.zeros((n + m, n + m))
    big[:n, :n], big[:n, n:] = A, B
    E = scipy.linalg.expm(delta * big)
    assert rel_err(A_bar, E[:n, :n]) <= 1e-10
    assert rel_err(B_bar, E[:n, n:]) <= 1e-9
    # a vector B gives the same as a one-column B
    _, b_vec = ssm.discretize_zoh(A, B[:, 0], delta)
    assert b_vec.shape == (n,) and rel_err(b_vec, B_bar[:, 0]) <= 1e-12


def test_zoh_is_exact_for_constant_input():
    # h(delta) of h' = A h + B u with constant u, solved by an ODE integrator, is A_bar h0 + B_bar u
    from scipy.integrate import solve_ivp
    rng = np.random.default_rng(1)
    A, B = random_stable(rng, 4), rng.normal(size=4)
    h0, u, delta = rng.normal(size=4), 0.7, 0.3
    sol = solve_ivp(lambda t, h: A @ h + B * u, (0, delta), h0, rtol=1e-12, atol=1e-14)
    A_bar, B_bar = ssm.discretize_zoh(A, B, delta)
    assert rel_err(A_bar @ h0 + B_bar * u, sol.y[:, -1]) <= 1e-9


def _order(deltas, errors):
    return float(np.polyfit(np.log(deltas), np.log(errors), 1)[0])


def test_bilinear_agrees_with_zoh_at_third_order_per_step():
    A, B = ssm.hippo_legs(4)
    deltas = 0.01 / 2.0 ** np.arange(5)
    errs_a, errs_b = [], []
    for d in deltas:
        Az, Bz = ssm.discretize_zoh(A, B, d)
        Al, Bl = ssm.discretize_bilinear(A, B, d)
        errs_a.append(np.linalg.norm(Az - Al))
        errs_b.append(np.linalg.norm(Bz - Bl))
    assert abs(_order(deltas, errs_a) - 3) < 0.05
    assert abs(_order(deltas, errs_b) - 3) < 0.05
    # leading term of A_bar: exp(dA) - Cayley(dA) = -(dA)^3 / 12 + O(d^4)
    d = deltas[-1]
    lead = -np.linalg.matrix_power(d * A, 3) / 12
    diff = ssm.discretize_zoh(A, B, d)[0] - ssm.discretize_bilinear(A, B, d)[0]
    assert rel_err(diff, lead) < 0.01


def test_bilinear_and_zoh_outputs_converge_at_second_order_over_fixed_time():
    # over a fixed continuous horizon, the per-step O(delta^3) adds up to O(delta^2)
    A, B = ssm.hippo_legs(4)
    C = np.ones(4)
    horizon = 2.0
    errs, deltas = [], []
    for steps in (40, 80, 160, 320):
        d = horizon / steps
        t = np.arange(1, steps + 1) * d
        x = np.sin(3 * t)
        yz, _ = ssm.lti_recurrence(x, *ssm.discretize_zoh(A, B, d), C)
        yb, _ = ssm.lti_recurrence(x, *ssm.discretize_bilinear(A, B, d), C)
        errs.append(abs(yz[-1] - yb[-1]))
        deltas.append(d)
    assert abs(_order(deltas, errs) - 2) < 0.1


def test_mamba_euler_b_differs_from_zoh_at_second_order():
    A, B = ssm.hippo_legs(5)
    deltas = 0.01 / 2.0 ** np.arange(5)
    diffs = []
    for d in deltas:
        Az, Bz = ssm.discretize_zoh(A, B, d)
        Am, Bm = ssm.discretize_mamba(A, B, d)
        assert np.array_equal(Am, Az)          # same A_bar
        assert np.array_equal(Bm, d * B)       # Euler B
        diffs.append(Bz - Bm)
    norms = [np.linalg.norm(x) for x in diffs]
    assert abs(_order(deltas, norms) - 2) < 0.05
    # leading term: B_zoh - delta B = delta^2 A B / 2 + O(delta^3)
    # (the next term is delta^3 A^2 B / 6, so the relative error of the leading term is O(delta ||A||))
    for d, diff in zip(deltas, diffs):
        assert rel_err(diff / d ** 2, A @ B / 2) < d * np.linalg.norm(A, 2)


# --------------------------------------------------------------------------- ZOH: slow and singular modes
# (issue #13, point 14)

def _zoh_exact_diagonal(lam, b, dt):
    """B_bar of a diagonal A, mode by mode: expm1(dt lam) / lam * b, or dt * b when lam = 0 (no cancellation)."""
    lam = np.asarray(lam, dtype=float)
    safe = np.where(lam == 0, 1.0, lam)
    return np.where(lam == 0, dt, np.expm1(dt * lam) / safe) * b


def _cont2discrete_b(A, B, dt):
    from scipy.signal import cont2discrete
    B2 = np.asarray(B, dtype=float).reshape(A.shape[0], -1)
    Ad, Bd, *_ = cont2discrete((A, B2, np.eye(A.shape[0]), np.zeros((A.shape[0], B2.shape[1]))), dt, method="zoh")
    return Ad, Bd.reshape(np.shape(B))


def test_zoh_keeps_full_precision_on_the_slow_mode_of_the_review():
    # issue #13: A = diag(-1e-10, -1), B = (1, 1), dt = 1e-3. A^{-1}(expm(dt A) - I) B gives 1.00031e-3 for the
    # slow mode (relative error 3e-4: expm(dt A) - I cancels); the exact value is 1e-3 (to 5e-14).
    A, B, dt = np.diag([-1e-10, -1.0]), np.array([1.0, 1.0]), 1e-3
    exact = _zoh_exact_diagonal([-1e-10, -1.0], B, dt)
    A_bar, B_bar = ssm.discretize_zoh(A, B, dt)
    assert np.max(np.abs(B_bar - exact) / exact) <= 1e-15
    assert np.array_equal(A_bar, scipy.linalg.expm(dt * A))
    _, B_scipy = _cont2discrete_b(A, B, dt)
    assert np.max(np.abs(B_bar - B_scipy) / B_scipy) <= 1e-15
    # the formula of eq-ssm-zoh evaluated as written is what the review measured
    textbook = np.linalg.solve(A, (scipy.linalg.expm(dt * A) - np.eye(2)) @ B)
    assert abs(textbook[0] - exact[0]) / exact[0] > 1e-4


@SETTINGS
@given(log_rates=st.lists(st.floats(-14.0, 1.0), min_size=1, max_size=5), dt=st.floats(1e-4, 1.0),
       seed=st.integers(0, 10_000), m=st.integers(1, 2))
def test_zoh_on_slow_modes_matches_expm1_and_cont2discrete(log_rates, dt, seed, m):
    rng = np.random.default_rng(seed)
    lam = -(10.0 ** np.array(log_rates))                    # decay rates from 1e-14 to 10
    n = lam.size
    B = rng.normal(size=(n, m))
    # diagonal A: mode by mode (entry by entry), to a few ulps, against expm1 and against scipy
    A_bar, B_bar = ssm.discretize_zoh(np.diag(lam), B, dt)
    exact = _zoh_exact_diagonal(lam[:, None], B, dt)
    assert np.max(np.abs(B_bar - exact) / np.abs(exact)) <= 1e-15
    # A_bar is scipy's expm, on a diagonal A the exponential of each entry and zeros off the diagonal, to an ulp:
    # scipy 1.18 takes the C library's exp there, scipy 1.17 took numpy's, and the two round some last bits apart
    e = np.exp(dt * lam)
    assert np.array_equal(A_bar, np.diag(np.diag(A_bar)))
    assert np.all(np.abs(np.diag(A_bar) - e) <= np.spacing(e))
    # scipy's zero-order hold agrees entry by entry where its expm does not square (a small dt |A|); with
    # squarings it loses the slow modes of a triangular A (see the test below), so it is not compared there
    if dt * (np.max(np.abs(lam)) + np.max(np.abs(B))) <= 1.0:
        Bd = _cont2discrete_b(np.diag(lam), B, dt)[1]
        assert np.max(np.abs(B_bar - Bd) / np.abs(exact)) <= 1e-14
    # the same modes rotated by an orthogonal basis: a full A with slow eigenvalues
    Q = np.linalg.qr(rng.normal(size=(n, n)))[0]
    A_full = Q @ np.diag(lam) @ Q.T
    A_bar, B_bar = ssm.discretize_zoh(A_full, B, dt)
    exact_full = Q @ _zoh_exact_diagonal(lam[:, None], Q.T @ B, dt)
    assert rel_err(B_bar, exact_full) <= 1e-12
    assert rel_err(A_bar, Q @ np.diag(np.exp(dt * lam)) @ Q.T) <= 1e-11     # expm's accuracy after squarings
    # scipy's zero-order hold (the same augmented exponential) agrees; its A_bar, read off the augmented
    # matrix, is the less accurate of the two (3e-13 at dt |lambda| = 3.75), so only B_bar is compared
    assert rel_err(B_bar, _cont2discrete_b(A_full, B, dt)[1]) <= 1e-12


@pytest.mark.parametrize("rate", [1e-3, 1e-6, 1e-10, 1e-14, 0.0])
def test_zoh_on_a_triangular_a_with_a_fast_and_a_slow_mode(rate):
    # A = [[a, c], [0, b]], a = -10 (fast), b = -rate (slow), dt = 1, in closed form with phi(l) = expm1(l dt) / l:
    # B_bar_2 = phi(b) B_2 and B_bar_1 = phi(a) B_1 + c (phi(a) - phi(b)) / (a - b) B_2.
    # (scipy 1.17's expm, on this triangular augmented matrix, squares with a fix-up of the first off-diagonal,
    # (e^a - e^b) / (a - b) as a plain difference, and loses up to 8e-4 here; discretize_zoh squares itself.)
    a, b, c, dt = -10.0, -rate, 1.0, 1.0
    B = np.array([1.0, -2.0])
    phi_a, phi_b = _zoh_exact_diagonal([a, b], 1.0, dt)
    exact = np.array([phi_a * B[0] + c * (phi_a - phi_b) / (a - b) * B[1], phi_b * B[1]])
    A_bar, B_bar = ssm.discretize_zoh(np.array([[a, c], [0.0, b]]), B, dt)
    assert np.max(np.abs(B_bar - exact) / np.abs(exact)) <= 2e-15
    assert rel_err(A_bar, scipy.linalg.expm(dt * np.array([[a, c], [0.0, b]]))) <= 1e-15


def test_zoh_accepts_a_singular_a():
    # a zero eigenvalue is an integrator: B_bar = dt B on that mode (A^{-1} does not exist, the integral does)
    dt, B = 0.1, np.array([1.0, 2.0])
    A_bar, B_bar = ssm.discretize_zoh(np.zeros((2, 2)), B, dt)
    assert np.array_equal(A_bar, np.eye(2)) and rel_err(B_bar, dt * B) <= 1e-16
    A = np.diag([0.0, -1.0])
    A_bar, B_bar = ssm.discretize_zoh(A, B, dt)
    assert rel_err(B_bar, _zoh_exact_diagonal([0.0, -1.0], B, dt)) <= 1e-15
    assert rel_err(B_bar, _cont2discrete_b(A, B, dt)[1]) <= 1e-15
    # the double integrator (nilpotent A): A_bar = [[1, dt], [0, 1]], B_bar = (dt^2 / 2, dt)
    A_bar, B_bar = ssm.discretize_zoh(np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([0.0, 1.0]), dt)
    assert rel_err(A_bar, [[1.0, dt], [0.0, 1.0]]) <= 1e-16
    assert rel_err(B_bar, [dt ** 2 / 2, dt]) <= 1e-15


def test_zoh_is_exact_for_constant_input_with_a_singular_a():
    from scipy.integrate import solve_ivp
    rng = np.random.default_rng(4)
    A = rng.normal(size=(3, 3))
    A -= np.outer(A @ np.ones(3), np.ones(3)) / 3          # A @ 1 = 0: a zero eigenvalue
    assert np.min(np.abs(np.linalg.eigvals(A))) < 1e-12
    B, h0, u, delta = rng.normal(size=3), rng.normal(size=3), -1.3, 0.4
    sol = solve_ivp(lambda t, h: A @ h + B * u, (0, delta), h0, rtol=1e-12, atol=1e-14)
    A_bar, B_bar = ssm.discretize_zoh(A, B, delta)
    assert rel_err(A_bar @ h0 + B_bar * u, sol.y[:, -1]) <= 1e-9


# --------------------------------------------------------------------------- validation

_sel = dict(x=np.ones((5, 2)), delta=np.ones((5, 2)), A=-np.ones((2, 3)), B=np.ones((5, 3)), C=np.ones((5, 3)))
_ssd = dict(x=np.ones((5, 2)), delta=np.ones(5), a=-0.5, B=np.ones((5, 3)), C=np.ones((5, 3)))


def _with(base, **changes):
    return {**base, **changes}


def _selective(fn, **changes):
    args = _with(_sel, **changes)
    kw = {k: args.pop(k) for k in ("D", "initial_state") if k in args}
    return lambda: fn(*args.values(), **kw)


def _ssd_call(fn, **changes):
    args = _with(_ssd, **changes)
    kw = {k: args.pop(k) for k in ("D", "initial_state") if k in args}
    return lambda: fn(*args.values(), **kw)


_step = dict(x=np.ones(2), delta=np.ones(2), A=-np.ones((2, 3)), B=np.ones(3), C=np.ones(3))
_stack = (np.eye(2)[None].repeat(3, 0), np.ones((3, 2)), np.ones((3, 2)))   # three channels, N = 2


@pytest.mark.parametrize("bad, name", [
    # discretization
    (lambda: ssm.discretize_zoh(np.ones((2, 3)), np.ones(2), 0.1), "A"),
    (lambda: ssm.discretize_zoh(-np.eye(3), np.ones(2), 0.1), "B"),
    (lambda: ssm.discretize_zoh(-np.eye(3), np.ones(3), 0.0), "delta"),
    (lambda: ssm.discretize_zoh(-np.eye(3), np.ones(3), np.ones(2)), "delta"),
    (lambda: ssm.discretize_bilinear(-np.eye(3), np.ones(3), -0.1), "delta"),
    (lambda: ssm.discretize_mamba(-np.eye(3), np.ones((3, 1, 1)), 0.1), "B"),
    # LTI
    (lambda: ssm.lti_recurrence(np.ones(5), np.eye(2), np.ones(2), np.ones(3)), "C"),
    (lambda: ssm.lti_recurrence(np.ones(5), np.ones((2, 3)), np.ones(2), np.ones(2)), "A_bar"),
    (lambda: ssm.lti_recurrence(np.ones(5), np.eye(2), np.ones((4, 2)), np.ones(2)), "B_bar"),
    (lambda: ssm.lti_recurrence(np.ones((5, 2)), *_stack), "x"),
    (lambda: ssm.lti_recurrence(np.ones((5, 0)), np.eye(2), np.ones(2), np.ones(2)), "x"),
    (lambda: ssm.lti_recurrence(np.ones((5, 3)), *_stack, D=np.ones(2)), "D"),
    (lambda: ssm.lti_recurrence(np.ones((4, 5)), np.eye(2), np.ones(2), np.ones(2), initial_state=np.ones(3)),
     "initial_state"),
    (lambda: ssm.lti_recurrence(np.ones((4, 5)), np.eye(2), np.ones(2), np.ones(2),
                                initial_state=np.ones((3, 2))), "initial_state"),
    (lambda: ssm.lti_recurrence(np.ones((5, 3)), *_stack, initial_state=np.ones((2, 2))), "initial_state"),
    (lambda: ssm.lti_convolution(np.ones(5), np.eye(2), np.ones(2), np.ones(2), method="fast"), "method"),
    (lambda: ssm.lti_convolution(np.ones((5, 2)), *_stack), "x"),
    (lambda: ssm.causal_conv(np.ones((5, 2)), np.ones((5, 3))), "x"),
    (lambda: ssm.causal_conv_fft(np.ones(5), np.ones((0,))), "K"),
    (lambda: ssm.causal_conv(np.ones(5), np.ones((2, 2, 2))), "K"),
    (lambda: ssm.ssm_kernel(np.eye(2), np.ones(2), np.ones(2), 0), "length"),
    # selective scans
    (_selective(ssm.selective_scan_sequential, x=np.ones(5)), "x"),
    (_selective(ssm.selective_scan_parallel, delta=np.zeros((5, 2))), "delta"),
    (_selective(ssm.selective_scan_parallel, delta=np.ones((5, 3))), "delta"),
    (_selective(ssm.selective_scan_parallel, B=np.ones((5, 4))), "B"),
    (_selective(ssm.selective_scan_sequential, C=np.ones((4, 3))), "C"),
    (_selective(ssm.selective_scan_sequential, A=-np.ones((3, 3))), "A"),
    (_selective(ssm.selective_scan_sequential, A=-np.ones((1, 2, 3))), "A"),
    (_selective(ssm.selective_scan_sequential, D=np.ones(3)), "D"),
    (_selective(ssm.selective_scan_sequential, initial_state=np.ones((3, 2))), "initial_state"),
    (_selective(ssm.selective_scan_parallel, x=np.ones((2, 5, 2)), initial_state=np.ones((3, 2, 3))),
     "initial_state"),
    (_selective(ssm.selective_scan_parallel, x=np.ones((2, 5, 2)), B=np.ones((3, 5, 3))), "B"),
    (_selective(ssm.selective_scan_sequential, x=np.ones((2, 5, 2)), delta=np.ones((4, 1, 5, 2)),
                C=np.ones((3, 5, 3))), "C"),
    (lambda: ssm.selective_scan_step(*_with(_step, delta=np.ones(3)).values()), "delta"),
    (lambda: ssm.selective_scan_step(*_with(_step, B=np.ones((5, 4))).values()), "B"),
    (lambda: ssm.selective_scan_step(*_step.values(), initial_state=np.ones((2, 2))), "initial_state"),
    # SSD
    (_ssd_call(ssm.ssd_recurrent, a=0.5), "a"),
    (_ssd_call(ssm.ssd_recurrent, a=np.array([-1.0, 0.1])), "a"),
    (_ssd_call(ssm.ssd_quadratic, C=np.ones((5, 4))), "C"),
    (_ssd_call(ssm.ssd_quadratic, x=np.ones(5)), "x"),
    (_ssd_call(ssm.ssd_quadratic, delta=np.ones(4)), "delta"),
    (_ssd_call(ssm.ssd_recurrent, delta=-np.ones(5)), "delta"),
    (_ssd_call(ssm.ssd_recurrent, x=np.ones((2, 5, 2)), a=-np.ones(3)), "a"),
    (_ssd_call(ssm.ssd_quadratic, x=np.ones((2, 5, 2)), D=np.ones(3)), "D"),
    (_ssd_call(ssm.ssd_quadratic, initial_state=np.ones((2, 3))), "initial_state"),
    (_ssd_call(ssm.ssd_recurrent, x=np.ones((2, 5, 2)), initial_state=np.ones((4, 3, 2))), "initial_state"),
    (_ssd_call(ssm.ssd_chunk, x=np.ones((2, 5, 2))), "x"),
    (_ssd_call(ssm.ssd_chunk, a=-np.ones(2)), "a"),
    (_ssd_call(ssm.ssd_chunk, D=np.ones(2)), "D"),
    (_ssd_call(ssm.ssd_chunk, initial_state=np.ones((1, 3, 2))), "initial_state"),
    (_ssd_call(ssm.ssd_chunk, a=0.1), "a"),
    (_ssd_call(ssm.ssd_chunkwise, a=0.1), "a"),
    (_ssd_call(ssm.ssd_chunkwise, C=np.ones((5, 4))), "C"),
    (_ssd_call(ssm.ssd_chunkwise, x=np.ones((2, 5, 2)), initial_state=np.ones((4, 3, 2))), "initial_state"),
    (lambda: ssm.ssd_chunkwise(*_ssd.values(), chunk_size=0), "chunk_size"),
    (lambda: ssm.ssd_chunkwise(*_ssd.values(), chunk_size=2.5), "chunk_size"),
    (lambda: ssm.ssd_mask(np.ones(4), 0.5), "a"),
    (lambda: ssm.ssd_mask(np.zeros(4), -0.5), "delta"),
    (lambda: ssm.ssd_mask(np.ones((2, 4)), -np.ones(3)), "a"),
    # the rest
    (lambda: ssm.associative_scan(np.ones((4, 2)), np.ones((4, 3))), "b"),
    (lambda: ssm.associative_scan(np.ones((4, 2)), np.ones((4, 2)), initial_state=np.ones(3)), "initial_state"),
    (lambda: ssm.hippo_legs(0), "N"),
    (lambda: ssm.legs_basis(3, [-1.0]), "lags"),
    (lambda: ssm.legs_reconstruct(np.ones(3), [[1.0]]), "lags"),
    (lambda: ssm.selective_delta(np.ones((4, 3)), np.ones(2)), "bias"),
])
def test_bad_input_raises_value_error_naming_the_argument(bad, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        bad()


def test_no_return_state_flags_and_no_old_names():
    import inspect
    for fn in (ssm.selective_scan_sequential, ssm.selective_scan_parallel, ssm.ssd_recurrent, ssm.ssd_quadratic,
               ssm.lti_recurrence, ssm.lti_convolution):
        assert "return_state" not in inspect.signature(fn).parameters
    assert "softplus" not in ssm.__all__
    params = inspect.signature(ssm.selective_scan_sequential).parameters
    assert list(params) == ["x", "delta", "A", "B", "C", "D", "initial_state"]
    assert params["D"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(ssm.ssd_chunk).parameters) == ["x", "delta", "a", "B", "C", "D", "initial_state"]
    assert list(inspect.signature(ssm.lti_convolution).parameters) == ["x", "A_bar", "B_bar", "C", "D", "method"]


# --------------------------------------------------------------------------- recurrence == convolution

def _system(rng, n, method="zoh", delta=0.1):
    A = random_stable(rng, n)
    B, C = rng.normal(size=n), rng.normal(size=n)
    fn = {"zoh": ssm.discretize_zoh, "bilinear": ssm.discretize_bilinear}[method]
    A_bar, B_bar = fn(A, B, delta)
    return A_bar, B_bar, C


def _systems(rng, n, H):
    systems = [_system(rng, n, "zoh", rng.uniform(0.05, 0.5)) for _ in range(H)]
    return tuple(np.stack([s[i] for s in systems]) for i in range(3))


@SETTINGS
@given(n=st.integers(1, 6), T=st.integers(1, 70), seed=st.integers(0, 10_000),
       method=st.sampled_from(["zoh", "bilinear"]), delta=st.floats(0.01, 1.0))
def test_recurrence_equals_convolution_siso(n, T, seed, method, delta):
    rng = np.random.default_rng(seed)
    A_bar, B_bar, C = _system(rng, n, method, delta)
    x = rng.normal(size=T)
    D = rng.normal()
    y_rec, h_rec = ssm.lti_recurrence(x, A_bar, B_bar, C, D=D)
    assert y_rec.shape == (T,) and h_rec.shape == (n,)
    for method in ("direct", "fft"):
        y, h = ssm.lti_convolution(x, A_bar, B_bar, C, D=D, method=method)
        assert rel_err(y, y_rec) <= 1e-10
        assert rel_err(h, h_rec) <= 1e-12          # the same sums of A_bar^j B_bar x_{T-j}, in another order


@SETTINGS
@given(n=st.integers(1, 4), H=st.integers(1, 4), T=st.integers(1, 50), seed=st.integers(0, 10_000))
def test_recurrence_equals_convolution_many_channels(n, H, T, seed):
    rng = np.random.default_rng(seed)
    A_bar, B_bar, C = _systems(rng, n, H)
    x, D = rng.normal(size=(T, H)), rng.normal(size=H)
    y, h = ssm.lti_recurrence(x, A_bar, B_bar, C, D=D)
    assert y.shape == (T, H) and h.shape == (H, n)
    for c in range(H):   # each channel is its own SISO system
        y_c, h_c = ssm.lti_recurrence(x[:, c], A_bar[c], B_bar[c], C[c], D=D[c])
        assert rel_err(y_c, y[:, c]) <= 1e-12 and rel_err(h_c, h[c]) <= 1e-12
    for method in ("fft", "direct"):
        y_conv, h_conv = ssm.lti_convolution(x, A_bar, B_bar, C, D=D, method=method)
        assert rel_err(y_conv, y) <= 1e-10 and rel_err(h_conv, h) <= 1e-12


@pytest.mark.parametrize("N, delta", [(4, 0.1), (16, 0.05), (32, 0.01)])
def test_recurrence_equals_convolution_hippo(N, delta):
    rng = np.random.default_rng(N)
    A, B = ssm.hippo_legs(N)
    A_bar, B_bar = ssm.discretize_zoh(A, B, delta)
    C = rng.normal(size=N)
    x = rng.normal(size=300)
    y, h = ssm.lti_recurrence(x, A_bar, B_bar, C)
    for method in ("fft", "direct"):
        y_conv, h_conv = ssm.lti_convolution(x, A_bar, B_bar, C, method=method)
        assert rel_err(y_conv, y) <= 1e-10 and rel_err(h_conv, h) <= 1e-12


@SETTINGS
@given(T=st.integers(2, 40), split=st.integers(1, 39), H=st.integers(0, 3), seed=st.integers(0, 10_000))
def test_lti_split_sequence_with_carried_state_equals_whole(T, split, H, seed):
    # prefill with the convolution, carry its final state into the recurrence: the same as one recurrence
    split = min(split, T - 1)
    rng = np.random.default_rng(seed)
    if H == 0:
        A_bar, B_bar, C = _system(rng, 3)
        x = rng.normal(size=T)
    else:
        A_bar, B_bar, C = _systems(rng, 3, H)
        x = rng.normal(size=(T, H))
    y, h = ssm.lti_recurrence(x, A_bar, B_bar, C, D=0.5)
    y1, h1 = ssm.lti_convolution(x[:split], A_bar, B_bar, C, D=0.5)
    y2, h2 = ssm.lti_recurrence(x[split:], A_bar, B_bar, C, D=0.5, initial_state=h1)
    assert rel_err(np.concatenate([y1, y2]), y) <= 1e-10
    assert rel_err(h2, h) <= 1e-12


@SETTINGS
@given(n=st.integers(1, 5), L=st.integers(1, 30), seed=st.integers(0, 10_000))
def test_kernel_is_powers_of_a(n, L, seed):
    rng = np.random.default_rng(seed)
    A_bar, B_bar, C = _system(rng, n)
    K = ssm.ssm_kernel(A_bar, B_bar, C, L)
    expected = [C @ np.linalg.matrix_power(A_bar, j) @ B_bar for j in range(L)]
    assert rel_err(K, expected) <= 1e-10
    # the kernel is the impulse response of the recurrence
    impulse = np.zeros(L)
    impulse[0] = 1.0
    assert rel_err(ssm.lti_recurrence(impulse, A_bar, B_bar, C)[0], K) <= 1e-12


@SETTINGS
@given(T=st.integers(1, 90), L=st.integers(1, 120), H=st.integers(0, 3), seed=st.integers(0, 10_000))
def test_fft_convolution_equals_direct_convolution(T, L, H, seed):
    rng = np.random.default_rng(seed)
    shape_x, shape_k = ((T,), (L,)) if H == 0 else ((T, H), (L, H))
    x, K = rng.normal(size=shape_x), rng.normal(size=shape_k)
    direct = ssm.causal_conv(x, K)
    # an independent definition: numpy's full linear convolution, cut to T
    if H == 0:
        ref = np.convolve(x, K)[:T]
    else:
        ref = np.stack([np.convolve(x[:, h], K[:, h])[:T] for h in range(H)], axis=1)
    assert rel_err(direct, ref) <= 1e-12
    assert rel_err(ssm.causal_conv_fft(x, K), ref) <= 1e-10


def test_circular_convolution_without_padding_is_wrong():
    # the reason for the zero padding: an unpadded FFT wraps the end of the signal onto its start
    rng = np.random.default_rng(3)
    x, K = rng.normal(size=64), rng.normal(size=64)
    circular = np.fft.irfft(np.fft.rfft(x) * np.fft.rfft(K), n=64)
    assert rel_err(circular, ssm.causal_conv(x, K)) > 0.1
    assert rel_err(ssm.causal_conv_fft(x, K), ssm.causal_conv(x, K)) <= 1e-10


# --------------------------------------------------------------------------- HiPPO

def test_hippo_legs_structure():
    A, B = ssm.hippo_legs(5)
    n = np.arange(5)
    for i in range(5):
        for j in range(5):
            want = -np.sqrt((2 * i + 1) * (2 * j + 1)) if i > j else (-(i + 1) if i == j else 0.0)
            assert A[i, j] == pytest.approx(want, rel=1e-15)
    assert np.allclose(B, np.sqrt(2 * n + 1), rtol=1e-15)
    # its eigenvalues are its diagonal, -(1..N): the S4D-Real initialization
    assert np.allclose(np.sort(np.linalg.eigvals(A).real), np.sort(ssm.s4d_real(5)), rtol=1e-8)
    assert np.array_equal(ssm.s4d_real(3), [-1.0, -2.0, -3.0])


@pytest.mark.parametrize("s", [0.0, 0.3, 1.1, 2.5])
def test_hippo_impulse_response_is_the_warped_legendre_basis(s):
    # exp(s A) B = e^{-s} g(s) with g_n(s) = sqrt(2n+1) P_n(2 e^{-s} - 1)  (scipy's Legendre)
    from scipy.special import eval_legendre
    N = 10
    A, B = ssm.hippo_legs(N)
    n = np.arange(N)
    want = np.exp(-s) * np.sqrt(2 * n + 1) * eval_legendre(n, 2 * np.exp(-s) - 1)
    assert rel_err(scipy.linalg.expm(s * A) @ B, want) <= 1e-10
    assert rel_err(ssm.legs_basis(N, [s])[0], want / np.exp(-s)) <= 1e-12


def test_legs_basis_is_orthonormal_for_the_exponential_weight():
    # int_0^inf g_n(s) g_m(s) e^{-s} ds = delta_nm, computed with z = e^{-s} by Gauss-Legendre on [0, 1]
    z, w = np.polynomial.legendre.leggauss(40)
    z01, w01 = (z + 1) / 2, w / 2
    G = ssm.legs_basis(12, -np.log(z01))
    gram = G.T @ (w01[:, None] * G)
    assert np.max(np.abs(gram - np.eye(12))) <= 1e-12


def test_hippo_state_reconstructs_a_polynomial_history_exactly():
    # an input that, read through the warp z = e^{-s}, is a polynomial of degree < N is stored exactly:
    # u(t - s) = p(e^{-s}). Run the continuous system from far in the past (t0 large) with the exact
    # state as the answer: h_n(t) = int_0^inf g_n(s) e^{-s} p(e^{-s}) ds.
    N = 6
    p = np.polynomial.Polynomial([0.3, -1.0, 2.0, 0.5])     # degree 3 < N
    z, w = np.polynomial.legendre.leggauss(30)
    z01, w01 = (z + 1) / 2, w / 2
    G = ssm.legs_basis(N, -np.log(z01))
    h = G.T @ (w01 * p(z01))
    lags = np.linspace(0, 4, 9)
    assert rel_err(ssm.legs_reconstruct(h, lags), p(np.exp(-lags))) <= 1e-12


def test_discrete_hippo_state_reconstruction_improves_with_n():
    delta, T = 0.01, 1500
    t = np.arange(1, T + 1) * delta
    u = np.sin(2 * t) + 0.5 * np.cos(5.3 * t)
    k = np.arange(200)
    errors = []
    for N in (4, 16, 64):
        A, B = ssm.hippo_legs(N)
        A_bar, B_bar = ssm.discretize_zoh(A, B, delta)
        h = np.zeros(N)
        for x in u:
            h = A_bar @ h + B_bar * x
        rec = ssm.legs_reconstruct(h, (k + 0.5) * delta)
        errors.append(np.sqrt(np.mean((rec - u[T - 1 - k]) ** 2) / np.mean(u[T - 1 - k] ** 2)))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.05


# --------------------------------------------------------------------------- selective scan

def _selective(rng, T, d, N):
    x = rng.normal(size=(T, d))
    delta = ssm.selective_delta(rng.normal(size=(T, d)), rng.normal(size=d))
    A = -np.exp(rng.normal(size=(d, N)))
    B, C = rng.normal(size=(T, N)), rng.normal(size=(T, N))
    return x, delta, A, B, C


@SETTINGS
@given(T=st.integers(1, 70), d=st.integers(1, 4), N=st.integers(1, 5), seed=st.integers(0, 10_000),
       with_init=st.booleans())
def test_parallel_scan_equals_sequential_scan(T, d, N, seed, with_init):
    rng = np.random.default_rng(seed)
    x, delta, A, B, C = _selective(rng, T, d, N)
    D = rng.normal(size=d)
    h0 = rng.normal(size=(d, N)) if with_init else None
    y_seq, h_seq = ssm.selective_scan_sequential(x, delta, A, B, C, D=D, initial_state=h0)
    y_par, h_par = ssm.selective_scan_parallel(x, delta, A, B, C, D=D, initial_state=h0)
    assert y_par.shape == (T, d) and h_par.shape == (d, N)
    assert rel_err(y_par, y_seq) <= 1e-10
    assert rel_err(h_par, h_seq) <= 1e-10


@SETTINGS
@given(T=st.integers(1, 40), seed=st.integers(0, 10_000))
def test_associative_scan_equals_loop_and_operator_is_associative(T, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(-1, 1, size=(T, 3)), rng.normal(size=(T, 3))
    h, want = np.zeros(3), []
    for t in range(T):
        h = a[t] * h + b[t]
        want.append(h)
    assert rel_err(ssm.associative_scan(a, b), np.array(want)) <= 1e-10

    def op(p, q):
        return p[0] * q[0], q[0] * p[1] + q[1]
    p, q, r = [(rng.normal(size=3), rng.normal(size=3)) for _ in range(3)]
    left, right = op(op(p, q), r), op(p, op(q, r))
    assert rel_err(left[0], right[0]) <= 1e-12 and rel_err(left[1], right[1]) <= 1e-12


def test_split_sequence_with_carried_state_equals_whole():
    rng = np.random.default_rng(7)
    x, delta, A, B, C = _selective(rng, 29, 3, 4)
    y, h = ssm.selective_scan_sequential(x, delta, A, B, C, D=0.5)
    y1, h1 = ssm.selective_scan_parallel(x[:11], delta[:11], A, B[:11], C[:11], D=0.5)
    y2, h2 = ssm.selective_scan_parallel(x[11:], delta[11:], A, B[11:], C[11:], D=0.5, initial_state=h1)
    assert rel_err(np.vstack([y1, y2]), y) <= 1e-10 and rel_err(h2, h) <= 1e-10
    # decoding token by token with the step function gives the same outputs
    state = None
    for t in range(29):
        yt, state = ssm.selective_scan_step(x[t], delta[t], A, B[t], C[t], D=0.5, initial_state=state)
        assert rel_err(yt, y[t]) <= 1e-12
    assert rel_err(state, h) <= 1e-12


@SETTINGS
@given(T=st.integers(1, 40), d=st.integers(1, 3), N=st.integers(1, 4), seed=st.integers(0, 10_000),
       step=st.floats(0.01, 1.0))
def test_input_independent_selective_ssm_is_the_lti_ssm(T, d, N, seed, step):
    # constant delta, B, C: the selective scan is d SISO LTI systems with A_bar = diag(exp(step A)), B_bar = step B
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T, d))
    A = -np.exp(rng.normal(size=(d, N)))
    b, c = rng.normal(size=N), rng.normal(size=N)
    D = rng.normal(size=d)
    y, h = ssm.selective_scan_parallel(x, np.full((T, d), step), A, np.tile(b, (T, 1)), np.tile(c, (T, 1)), D=D)
    A_bar = np.stack([np.diag(np.exp(step * A[i])) for i in range(d)])
    B_bar = np.tile(step * b, (d, 1))
    C_lti = np.tile(c, (d, 1))
    y_rec, h_rec = ssm.lti_recurrence(x, A_bar, B_bar, C_lti, D=D)
    assert rel_err(y, y_rec) <= 1e-10 and rel_err(h, h_rec) <= 1e-10
    assert rel_err(y, ssm.lti_convolution(x, A_bar, B_bar, C_lti, D=D)[0]) <= 1e-10
    # and the same A_bar, B_bar are what discretize_mamba gives for the diagonal A
    Am, Bm = ssm.discretize_mamba(np.diag(A[0]), b, step)
    assert rel_err(Am, A_bar[0]) <= 1e-12 and rel_err(Bm, B_bar[0]) <= 1e-12


def test_large_delta_writes_small_delta_coasts():
    # the behaviour the chapter's slider shows: with A < 0, a large step forgets the old state and writes
    # the token; a small step keeps the old state and barely writes
    A = -np.ones((1, 1))
    B = C = np.ones((2, 1))
    x = np.array([[1.0], [5.0]])
    for step, keep_old in [(5.0, False), (1e-3, True)]:
        delta = np.array([[1.0], [step]])
        _, h = ssm.selective_scan_sequential(x, delta, A, B, C)
        h1 = 1.0                               # state after the first token (Euler B: delta B x = 1)
        carried = np.exp(-step) * h1
        assert h[0, 0] == pytest.approx(carried + step * 5.0, rel=1e-12)
        if keep_old:
            assert carried > 0.99 * h1 and step * 5.0 < 0.01
        else:
            assert carried < 0.01 * h1


def test_softplus_and_selective_delta():
    raw = np.array([[-800.0, 0.0, 30.0, 800.0]])
    out = ssm.selective_delta(raw, 0.0)
    assert np.all(np.isfinite(out)) and np.all(out >= 0)
    assert out[0, 1] == pytest.approx(np.log(2.0), rel=1e-15)
    assert out[0, 3] == pytest.approx(800.0, rel=1e-15)
    assert np.allclose(ssm.selective_delta([[0.0, 1.0]], [1.0, -1.0]), np.log1p(np.exp([1.0, 0.0])), rtol=1e-15)
    # leading axes: the softplus of blocks, entry by entry
    raw = np.random.default_rng(0).normal(size=(2, 3, 5, 4))
    assert np.array_equal(ssm.selective_delta(raw, np.arange(4.0)), softplus(raw + np.arange(4.0)))


# --------------------------------------------------------------------------- Mamba-2 / SSD

def _ssd_inputs(rng, T, P, N, lead=()):
    x, B, C = rng.normal(size=lead + (T, P)), rng.normal(size=lead + (T, N)), rng.normal(size=lead + (T, N))
    return x, rng.uniform(0.05, 1.5, size=lead + (T,)), B, C


@SETTINGS
@given(T=st.integers(1, 50), P=st.integers(1, 4), N=st.integers(1, 5), seed=st.integers(0, 10_000),
       a=st.floats(-3.0, 0.0), with_init=st.booleans())
def test_ssd_matrix_form_equals_recurrence(T, P, N, seed, a, with_init):
    rng = np.random.default_rng(seed)
    x, delta, B, C = _ssd_inputs(rng, T, P, N)
    D = rng.normal()
    S0 = rng.normal(size=(N, P)) if with_init else None
    y_rec, S_rec = ssm.ssd_recurrent(x, delta, a, B, C, D=D, initial_state=S0)
    y_quad, S_quad = ssm.ssd_quadratic(x, delta, a, B, C, D=D, initial_state=S0)
    assert y_quad.shape == (T, P) and S_quad.shape == (N, P)
    assert rel_err(y_quad, y_rec) <= 1e-12
    assert rel_err(S_quad, S_rec) <= 1e-12


@SETTINGS
@given(T=st.integers(1, 50), P=st.integers(1, 4), N=st.integers(1, 4), chunk=st.integers(1, 12),
       seed=st.integers(0, 10_000), a=st.floats(-3.0, 0.0), with_init=st.booleans())
def test_ssd_chunk_after_chunk_equals_recurrence(T, P, N, chunk, seed, a, with_init):
    # Mamba-2's chunked algorithm: each chunk's outgoing state is the next chunk's incoming state
    rng = np.random.default_rng(seed)
    x, delta, B, C = _ssd_inputs(rng, T, P, N)
    D = rng.normal()
    S0 = rng.normal(size=(N, P)) if with_init else None
    y_rec, S_rec = ssm.ssd_recurrent(x, delta, a, B, C, D=D, initial_state=S0)
    S, ys = S0, []
    for start in range(0, T, chunk):
        c = slice(start, start + chunk)
        y, S = ssm.ssd_chunk(x[c], delta[c], a, B[c], C[c], D=D, initial_state=S)
        ys.append(y)
    assert rel_err(np.vstack(ys), y_rec) <= 1e-12
    assert rel_err(S, S_rec) <= 1e-12
    # the whole sequence as one chunk is the matrix form
    y_one, S_one = ssm.ssd_chunk(x, delta, a, B, C, D=D, initial_state=S0)
    y_quad, S_quad = ssm.ssd_quadratic(x, delta, a, B, C, D=D, initial_state=S0)
    assert rel_err(y_one, y_quad) <= 1e-13 and rel_err(S_one, S_quad) <= 1e-13


def test_ssd_chunk_terms_one_by_one():
    # the three terms of one chunk, each checked on its own against the recurrence
    rng = np.random.default_rng(11)
    x, delta, B, C = _ssd_inputs(rng, 6, 2, 3)
    S_in, a = rng.normal(size=(3, 2)), -0.7
    zero = np.zeros((3, 2))
    # no incoming state: the intra-chunk part alone
    y_intra, S_intra = ssm.ssd_chunk(x, delta, a, B, C)
    assert rel_err(y_intra, ssm.ssd_recurrent(x, delta, a, B, C)[0]) <= 1e-13
    # no input: only the incoming state, decayed by Gamma_t = exp(a sum_{r<=t} delta_r) and read by C_t
    y_in, S_out = ssm.ssd_chunk(np.zeros_like(x), delta, a, B, C, initial_state=S_in)
    Gamma = np.exp(a * np.cumsum(delta))
    assert rel_err(y_in, Gamma[:, None] * (C @ S_in)) <= 1e-14
    assert rel_err(S_out, Gamma[-1] * S_in) <= 1e-15
    # linearity in (input, incoming state)
    y, S = ssm.ssd_chunk(x, delta, a, B, C, initial_state=S_in)
    assert rel_err(y, y_intra + y_in) <= 1e-14 and rel_err(S, S_intra + S_out) <= 1e-14
    assert np.array_equal(ssm.ssd_chunk(x, delta, a, B, C, initial_state=zero)[0], y_intra)


@SETTINGS
@given(T=st.integers(1, 40), P=st.integers(1, 3), N=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_ssd_is_a_selective_scan_with_scalar_decay(T, P, N, seed):
    # Mamba-2's head = Mamba's selective scan with A[i, n] = a for all i, n and delta shared by the P channels
    rng = np.random.default_rng(seed)
    x, delta, B, C = _ssd_inputs(rng, T, P, N)
    a = -rng.uniform(0, 2)
    y_ssd, S = ssm.ssd_recurrent(x, delta, a, B, C)
    y_sel, h = ssm.selective_scan_parallel(x, np.tile(delta[:, None], (1, P)), np.full((P, N), a), B, C)
    assert rel_err(y_sel, y_ssd) <= 1e-10
    assert rel_err(h.T, S) <= 1e-10        # the selective state (d, N) is the transposed (N, P) state


@SETTINGS
@given(T=st.integers(1, 40), P=st.integers(1, 3), N=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_ssd_without_decay_is_plain_linear_attention(T, P, N, seed):
    # a = 0, delta = 1: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T q_t with q = C, k = B, v = x
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(T, N)), rng.normal(size=(T, N)), rng.normal(size=(T, P))
    y, S_quad = ssm.ssd_quadratic(v, np.ones(T), 0.0, k, q)
    masked = np.tril(q @ k.T) @ v                      # causal linear attention, matrix form
    assert rel_err(y, masked) <= 1e-10
    assert rel_err(S_quad, k.T @ v) <= 1e-12
    # and it is the plain (unnormalized, identity feature map) linear attention of chap-linear-attention
    from fixedstate import linear_attention as la
    result = la.linear_attention_recurrent(q, k, v, feature_map=la.identity_feature_map, normalize=False)
    out, state = result[0], result[1]
    y_rec, S = ssm.ssd_recurrent(v, np.ones(T), 0.0, k, q)
    assert rel_err(y, out) <= 1e-10
    assert rel_err(S, state) <= 1e-10          # same (d_k, d_v) = (N, P) state, same orientation


def test_ssd_mask_is_one_semiseparable():
    rng = np.random.default_rng(5)
    delta, a = rng.uniform(0.1, 1.0, size=12), -0.8
    L = ssm.ssd_mask(delta, a)
    gates = np.exp(delta * a)
    assert np.allclose(np.diag(L), 1.0, rtol=0, atol=0) and np.all(np.triu(L, 1) == 0)
    for t in range(12):
        for s in range(t + 1):
            assert L[t, s] == pytest.approx(np.prod(gates[s + 1:t + 1]), rel=1e-12)
    # every submatrix taken from the lower triangle has rank 1
    assert np.linalg.matrix_rank(L[6:, :6], tol=1e-12) == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strong_decay_underflows_to_zero_without_inf_or_nan(dtype):
    # a log-decay of -120 per token: exp(-120) underflows in float32; no form may overflow or produce NaN
    rng = np.random.default_rng(2)
    T, P, N, d = 9, 2, 3, 2
    x, delta, B, C = (v.astype(dtype) for v in _ssd_inputs(rng, T, P, N))
    delta = np.ones(T, dtype=dtype)
    S0 = rng.normal(size=(N, P)).astype(dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y_rec, S_rec = ssm.ssd_recurrent(x, delta, dtype(-120.0), B, C, initial_state=S0)
        y_quad, S_quad = ssm.ssd_quadratic(x, delta, dtype(-120.0), B, C, initial_state=S0)
        y_chunk, S_chunk = ssm.ssd_chunk(x, delta, dtype(-120.0), B, C, initial_state=S0)
        xs = x[:, :d]
        A = np.full((d, N), -120.0, dtype=dtype)
        y_seq, h_seq = ssm.selective_scan_sequential(xs, np.ones((T, d), dtype), A, B, C, initial_state=S0.T)
        y_par, h_par = ssm.selective_scan_parallel(xs, np.ones((T, d), dtype), A, B, C, initial_state=S0.T)
    # with every gate ~ 0, each token forgets the past: S_t = B_t x_t^T, y_t = (C_t . B_t) x_t
    want_y = np.sum(C * B, axis=1)[:, None] * x
    want_S = np.outer(B[-1], x[-1])
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for y, S in ((y_rec, S_rec), (y_quad, S_quad), (y_chunk, S_chunk)):
        assert y.dtype == dtype and S.dtype == dtype
        assert rel_err(y, want_y) <= tol and rel_err(S, want_S) <= tol
    for y, h in ((y_seq, h_seq), (y_par, h_par)):
        assert y.dtype == dtype and h.dtype == dtype
        assert rel_err(y, want_y[:, :d]) <= tol and rel_err(h, want_S[:, :d].T) <= tol


# --------------------------------------------------------------------------- leading axes
# a batched call is the loop over its items

@st.composite
def lead_shapes(draw, max_axes=3):
    return tuple(draw(st.lists(st.integers(1, 3), max_size=max_axes)))


@st.composite
def broadcasts_to(draw, lead):
    """A shape that broadcasts to ``lead``: some of its first axes dropped, some of the others set to 1."""
    kept = lead[draw(st.integers(0, len(lead))):]
    return tuple(draw(st.sampled_from([n, 1])) for n in kept)


def _item(arr, n_core, lead, idx):
    """Item ``idx`` of the leading axes ``lead`` of an array that broadcasts to them (None stays None)."""
    if arr is None:
        return None
    arr = np.asarray(arr)
    return np.broadcast_to(arr, lead + arr.shape[arr.ndim - n_core:])[idx]


def _lead_of(*pairs):
    return np.broadcast_shapes(*(np.shape(a)[:np.ndim(a) - k] for a, k in pairs if a is not None))


BATCH_SETTINGS = examples(30)


@BATCH_SETTINGS
@given(data=st.data(), T=st.integers(1, 9), d=st.integers(1, 3), N=st.integers(1, 3), seed=st.integers(0, 10_000),
       form=st.sampled_from(["sequential", "parallel"]), with_init=st.booleans(), with_D=st.booleans())
def test_selective_scan_batched_equals_loop(data, T, d, N, seed, form, with_init, with_D):
    lead = data.draw(lead_shapes())
    shapes = {name: data.draw(broadcasts_to(lead)) for name in ("x", "delta", "B", "C", "h0")}
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shapes["x"] + (T, d))
    delta = rng.uniform(0.05, 2.0, size=shapes["delta"] + (T, d))
    A = -np.exp(rng.normal(size=(d, N)))
    B, C = rng.normal(size=shapes["B"] + (T, N)), rng.normal(size=shapes["C"] + (T, N))
    h0 = rng.normal(size=shapes["h0"] + (d, N)) if with_init else None
    D = rng.normal(size=d) if with_D else None
    fn = getattr(ssm, f"selective_scan_{form}")
    y, h = fn(x, delta, A, B, C, D=D, initial_state=h0)
    full = _lead_of((x, 2), (delta, 2), (B, 2), (C, 2), (h0, 2))
    assert y.shape == full + (T, d) and h.shape == full + (d, N)
    for idx in np.ndindex(full):
        y_i, h_i = fn(*(_item(a, 2, full, idx) for a in (x, delta)), A, *(_item(a, 2, full, idx) for a in (B, C)),
                      D=D, initial_state=_item(h0, 2, full, idx))
        assert rel_err(y[idx], y_i) <= 1e-13 and rel_err(h[idx], h_i) <= 1e-13


@BATCH_SETTINGS
@given(data=st.data(), T=st.integers(1, 6), d=st.integers(1, 3), N=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_selective_steps_with_leading_axes_equal_the_scan(data, T, d, N, seed):
    lead = data.draw(lead_shapes())
    rng = np.random.default_rng(seed)
    x = rng.normal(size=lead + (T, d))
    delta = rng.uniform(0.05, 2.0, size=data.draw(broadcasts_to(lead)) + (T, d))
    A = -np.exp(rng.normal(size=(d, N)))
    B, C = rng.normal(size=(T, N)), rng.normal(size=lead + (T, N))
    h0 = rng.normal(size=data.draw(broadcasts_to(lead)) + (d, N))
    y, h = ssm.selective_scan_parallel(x, delta, A, B, C, D=0.3, initial_state=h0)
    state = h0
    for t in range(T):
        y_t, state = ssm.selective_scan_step(x[..., t, :], delta[..., t, :], A, B[t], C[..., t, :], D=0.3,
                                             initial_state=state)
        assert y_t.shape == lead + (d,) and rel_err(y_t, y[..., t, :]) <= 1e-12
    assert rel_err(state, h) <= 1e-12


@BATCH_SETTINGS
@given(data=st.data(), T=st.integers(1, 9), P=st.integers(1, 3), N=st.integers(1, 3), seed=st.integers(0, 10_000),
       form=st.sampled_from(["recurrent", "quadratic", "chunkwise"]), with_init=st.booleans(), with_D=st.booleans())
def test_ssd_batched_equals_loop(data, T, P, N, seed, form, with_init, with_D):
    # a and D: one scalar per head, broadcast against the leading axes (e.g. (H,) for leading axes (batch, H))
    lead = data.draw(lead_shapes())
    shapes = {name: data.draw(broadcasts_to(lead)) for name in ("x", "delta", "a", "B", "C", "D", "S0")}
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shapes["x"] + (T, P))
    delta = rng.uniform(0.05, 1.5, size=shapes["delta"] + (T,))
    a = -rng.uniform(0.0, 2.0, size=shapes["a"])
    B, C = rng.normal(size=shapes["B"] + (T, N)), rng.normal(size=shapes["C"] + (T, N))
    D = rng.normal(size=shapes["D"]) if with_D else None
    S0 = rng.normal(size=shapes["S0"] + (N, P)) if with_init else None
    fn = getattr(ssm, f"ssd_{form}")
    if form == "chunkwise":
        fn = functools.partial(fn, chunk_size=data.draw(st.integers(1, 4)))
    y, S = fn(x, delta, a, B, C, D=D, initial_state=S0)
    full = _lead_of((x, 2), (delta, 1), (a, 0), (B, 2), (C, 2), (D, 0), (S0, 2))
    assert y.shape == full + (T, P) and S.shape == full + (N, P)
    for idx in np.ndindex(full):
        y_i, S_i = fn(_item(x, 2, full, idx), _item(delta, 1, full, idx), _item(a, 0, full, idx),
                      _item(B, 2, full, idx), _item(C, 2, full, idx), D=_item(D, 0, full, idx),
                      initial_state=_item(S0, 2, full, idx))
        assert rel_err(y[idx], y_i) <= 1e-13 and rel_err(S[idx], S_i) <= 1e-13
        # and each item is what the one-chunk reference gives
        y_c, S_c = ssm.ssd_chunk(_item(x, 2, full, idx), _item(delta, 1, full, idx), _item(a, 0, full, idx),
                                 _item(B, 2, full, idx), _item(C, 2, full, idx), D=_item(D, 0, full, idx),
                                 initial_state=_item(S0, 2, full, idx))
        assert rel_err(y_c, y_i) <= 1e-12 and rel_err(S_c, S_i) <= 1e-12


def test_ssd_heads_with_a_per_head():
    # leading axes (batch, H) with a and D of shape (H,): head h of every batch item uses a[h], D[h]
    rng = np.random.default_rng(8)
    batch, H, T, P, N = 2, 3, 7, 2, 4
    x, delta, B, C = _ssd_inputs(rng, T, P, N, lead=(batch, H))
    a, D = -rng.uniform(0.1, 2.0, size=H), rng.normal(size=H)
    y, S = ssm.ssd_quadratic(x, delta, a, B, C, D=D)
    for b in range(batch):
        for h in range(H):
            y_bh, S_bh = ssm.ssd_recurrent(x[b, h], delta[b, h], a[h], B[b, h], C[b, h], D=D[h])
            assert rel_err(y[b, h], y_bh) <= 1e-12 and rel_err(S[b, h], S_bh) <= 1e-12


@BATCH_SETTINGS
@given(data=st.data(), T=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_ssd_mask_batched_equals_loop(data, T, seed):
    lead = data.draw(lead_shapes())
    rng = np.random.default_rng(seed)
    delta = rng.uniform(0.05, 1.5, size=data.draw(broadcasts_to(lead)) + (T,))
    a = -rng.uniform(0.0, 2.0, size=data.draw(broadcasts_to(lead)))
    L = ssm.ssd_mask(delta, a)
    full = _lead_of((delta, 1), (a, 0))
    assert L.shape == full + (T, T)
    for idx in np.ndindex(full):
        assert np.array_equal(L[idx], ssm.ssd_mask(_item(delta, 1, full, idx), _item(a, 0, full, idx)))


@BATCH_SETTINGS
@given(data=st.data(), T=st.integers(1, 9), n=st.integers(1, 3), H=st.integers(0, 3), seed=st.integers(0, 10_000),
       with_init=st.booleans())
def test_lti_batched_equals_loop(data, T, n, H, seed, with_init):
    # the system has no leading axes; x and initial_state carry them and broadcast
    lead = data.draw(lead_shapes())
    rng = np.random.default_rng(seed)
    if H == 0:
        A_bar, B_bar, C = _system(rng, n)
        channels, D = (), 0.7
    else:
        A_bar, B_bar, C = _systems(rng, n, H)
        channels, D = (H,), rng.normal(size=H)
    x = rng.normal(size=data.draw(broadcasts_to(lead)) + (T,) + channels)
    h0 = rng.normal(size=data.draw(broadcasts_to(lead)) + channels + (n,)) if with_init else None
    core = 1 + len(channels)
    y, h = ssm.lti_recurrence(x, A_bar, B_bar, C, D=D, initial_state=h0)
    full = _lead_of((x, core), (h0, core))
    assert y.shape == full + (T,) + channels and h.shape == full + channels + (n,)
    y_conv, h_conv = ssm.lti_convolution(x, A_bar, B_bar, C, D=D)
    for idx in np.ndindex(full):
        y_i, h_i = ssm.lti_recurrence(_item(x, core, full, idx), A_bar, B_bar, C, D=D,
                                      initial_state=_item(h0, core, full, idx))
        assert rel_err(y[idx], y_i) <= 1e-13 and rel_err(h[idx], h_i) <= 1e-13
    x_lead = x.shape[:x.ndim - core]
    for idx in np.ndindex(x_lead):
        y_i, h_i = ssm.lti_convolution(x[idx], A_bar, B_bar, C, D=D)
        assert rel_err(y_conv[idx], y_i) <= 1e-12 and rel_err(h_conv[idx], h_i) <= 1e-13
        assert np.array_equal(ssm.causal_conv(x[idx], ssm.ssm_kernel(A_bar, B_bar, C, T)),
                              ssm.causal_conv(x, ssm.ssm_kernel(A_bar, B_bar, C, T))[idx])


def test_legs_reconstruct_with_leading_axes():
    rng = np.random.default_rng(1)
    states, lags = rng.normal(size=(2, 3, 6)), np.linspace(0.0, 3.0, 5)
    out = ssm.legs_reconstruct(states, lags)
    assert out.shape == (2, 3, 5)
    for idx in np.ndindex(2, 3):
        assert rel_err(out[idx], ssm.legs_reconstruct(states[idx], lags)) <= 1e-15


# --------------------------------------------------------------------------- precision
# (issue #13, point 15)

def _public_calls():
    """One call of every public function that takes floating input, built from inputs of a given dtype."""
    T, d, N, P, H = 6, 2, 3, 2, 2
    base = dict(   # integer values, so that integer inputs are possible too
        A=-np.diag([1.0, 2.0, 3.0]), B=np.array([1.0, 0.0, -1.0]), x_seq=np.array([1.0, -1.0, 2.0, 0.0, 1.0, 1.0]),
        x=np.arange(T * d).reshape(T, d) % 3 - 1.0, delta=np.ones((T, d)) + np.arange(d), A_sel=-np.ones((d, N)),
        Bt=np.arange(T * N).reshape(T, N) % 2 * 1.0, Ct=np.arange(T * N).reshape(T, N) % 3 - 1.0,
        h0=np.ones((d, N)), Dd=np.ones(d), x_ssd=np.arange(T * P).reshape(T, P) % 2 - 0.0, delta_ssd=np.ones(T),
        S0=np.ones((N, P)), K=np.array([1.0, 2.0, 1.0]), x_lti=np.arange(T * H).reshape(T, H) % 2 * 1.0,
        A_bars=np.stack([np.eye(N), -np.eye(N)]), B_bars=np.ones((H, N)), C_bars=np.ones((H, N)),
        a=np.array([[0.0, 1.0], [2.0, 3.0]]), b=np.ones((2, 2)), lags=np.array([0.0, 1.0, 2.0]), raw=np.zeros((T, d)),
    )
    return {
        "discretize_zoh": lambda c: ssm.discretize_zoh(c("A"), c("B"), 0.1),
        "discretize_bilinear": lambda c: ssm.discretize_bilinear(c("A"), c("B"), 0.1),
        "discretize_mamba": lambda c: ssm.discretize_mamba(c("A"), c("B"), 0.1),
        "lti_recurrence": lambda c: ssm.lti_recurrence(c("x_lti"), c("A_bars"), c("B_bars"), c("C_bars"),
                                                       D=c("Dd"), initial_state=c("B_bars")),
        "lti_convolution": lambda c: ssm.lti_convolution(c("x_lti"), c("A_bars"), c("B_bars"), c("C_bars"),
                                                         D=c("Dd")),
        "ssm_kernel": lambda c: ssm.ssm_kernel(c("A_bars"), c("B_bars"), c("C_bars"), 5),
        "causal_conv": lambda c: ssm.causal_conv(c("x_seq"), c("K")),
        "causal_conv_fft": lambda c: ssm.causal_conv_fft(c("x_seq"), c("K")),
        "legs_basis": lambda c: ssm.legs_basis(4, c("lags")),
        "legs_reconstruct": lambda c: ssm.legs_reconstruct(c("B"), c("lags")),
        "selective_delta": lambda c: ssm.selective_delta(c("raw"), c("Dd")),
        "associative_scan": lambda c: ssm.associative_scan(c("a"), c("b"), initial_state=c("b")[0]),
        "selective_scan_sequential": lambda c: ssm.selective_scan_sequential(
            c("x"), c("delta"), c("A_sel"), c("Bt"), c("Ct"), D=c("Dd"), initial_state=c("h0")),
        "selective_scan_parallel": lambda c: ssm.selective_scan_parallel(
            c("x"), c("delta"), c("A_sel"), c("Bt"), c("Ct"), D=c("Dd"), initial_state=c("h0")),
        "selective_scan_step": lambda c: ssm.selective_scan_step(
            c("x")[0], c("delta")[0], c("A_sel"), c("Bt")[0], c("Ct")[0], D=c("Dd"), initial_state=c("h0")),
        "ssd_mask": lambda c: ssm.ssd_mask(c("delta_ssd"), -c("delta_ssd")[0]),
        "ssd_recurrent": lambda c: ssm.ssd_recurrent(c("x_ssd"), c("delta_ssd"), -c("delta_ssd")[0], c("Bt"),
                                                     c("Ct"), D=c("delta_ssd")[0], initial_state=c("S0")),
        "ssd_quadratic": lambda c: ssm.ssd_quadratic(c("x_ssd"), c("delta_ssd"), -c("delta_ssd")[0], c("Bt"),
                                                     c("Ct"), D=c("delta_ssd")[0], initial_state=c("S0")),
        "ssd_chunk": lambda c: ssm.ssd_chunk(c("x_ssd"), c("delta_ssd"), -c("delta_ssd")[0], c("Bt"), c("Ct"),
                                             D=c("delta_ssd")[0], initial_state=c("S0")),
        "ssd_chunkwise": lambda c: ssm.ssd_chunkwise(c("x_ssd"), c("delta_ssd"), -c("delta_ssd")[0], c("Bt"),
                                                     c("Ct"), D=c("delta_ssd")[0], initial_state=c("S0"),
                                                     chunk_size=4),
    }, base


PUBLIC_CALLS, _BASE = _public_calls()
PUBLIC_CALLS.update({   # the backward passes (chapter 9); their gradients are checked in test_backward.py
    "ssd_backward": lambda c: ssm.ssd_backward(c("x_ssd"), c("delta_ssd"), -c("delta_ssd")[0], c("Bt"), c("Ct"),
                                               c("x_ssd"), D=c("delta_ssd")[0], initial_state=c("S0"),
                                               d_final_state=c("S0")),
    "ssd_chunkwise_backward": lambda c: ssm.ssd_chunkwise_backward(
        c("x_ssd"), c("delta_ssd"), -c("delta_ssd")[0], c("Bt"), c("Ct"), c("x_ssd"), D=c("delta_ssd")[0],
        initial_state=c("S0"), d_final_state=c("S0"), chunk_size=4),
    "selective_scan_backward": lambda c: ssm.selective_scan_backward(
        c("x"), c("delta"), c("A_sel"), c("Bt"), c("Ct"), c("x"), D=c("Dd"), initial_state=c("h0"),
        d_final_state=c("h0")),
})
NO_FLOAT_INPUT = {"hippo_legs", "s4d_real"}


def test_every_public_function_is_in_the_precision_test():
    assert set(PUBLIC_CALLS) | NO_FLOAT_INPUT == set(ssm.__all__)


@pytest.mark.parametrize("name", sorted(PUBLIC_CALLS))
@pytest.mark.parametrize("dtype, expected", [(np.float32, np.float32), (np.float64, np.float64),
                                             (np.int64, np.float64), (np.float16, np.float32)])
def test_every_public_function_keeps_the_input_precision(name, dtype, expected):
    def cast(key):
        return _BASE[key].astype(dtype)

    out = PUBLIC_CALLS[name](cast)
    arrays = out if isinstance(out, tuple) else (out,)
    for arr in arrays:
        assert isinstance(arr, np.ndarray) and arr.dtype == expected, (name, arr.dtype)
        assert np.all(np.isfinite(arr))
    if dtype == np.float32:   # and float32 computes the float64 result to float32 precision
        want = PUBLIC_CALLS[name](lambda key: _BASE[key])
        for got, ref in zip(arrays, want if isinstance(want, tuple) else (want,)):
            assert rel_err(got, ref) <= 1e-5, name


def test_precision_rule_for_mixed_inputs():
    rng = np.random.default_rng(0)
    x, delta, A, B, C = (v.astype(np.float32) for v in _selective(rng, 5, 2, 3))
    # Python numbers do not upcast (numpy's rule); a float64 array does
    y, h = ssm.selective_scan_parallel(x, delta, A, B, C, D=0.5)
    assert y.dtype == h.dtype == np.float32
    y, h = ssm.selective_scan_sequential(x, delta, A, B, C, initial_state=np.zeros((2, 3)))
    assert y.dtype == h.dtype == np.float64
    y, S = ssm.ssd_recurrent(x, delta[:, 0], -1.0, B, C, D=2)
    assert y.dtype == S.dtype == np.float32
    y, S = ssm.ssd_quadratic(x, delta[:, 0], np.float64(-1.0), B, C)
    assert y.dtype == S.dtype == np.float64
    A_bar, B_bar = ssm.discretize_zoh(np.diag([-1.0, -2.0]).astype(np.float32), np.ones(2, np.float32), 0.1)
    assert A_bar.dtype == B_bar.dtype == np.float32
    assert ssm.hippo_legs(3)[0].dtype == ssm.s4d_real(3).dtype == np.float64


@SETTINGS
@given(T=st.integers(1, 80), P=st.integers(1, 4), N=st.integers(1, 4), chunk=st.integers(1, 24),
       seed=st.integers(0, 10_000), a=st.floats(-3.0, 0.0), with_init=st.booleans(), with_D=st.booleans())
def test_ssd_chunkwise_equals_quadratic_and_recurrent(T, P, N, chunk, seed, a, with_init, with_D):
    # the whole sequence in chunks (T need not be a multiple of the chunk) equals both other forms
    rng = np.random.default_rng(seed)
    x, delta, B, C = _ssd_inputs(rng, T, P, N)
    D = rng.normal() if with_D else None
    S0 = rng.normal(size=(N, P)) if with_init else None
    y, S = ssm.ssd_chunkwise(x, delta, a, B, C, D=D, initial_state=S0, chunk_size=chunk)
    assert y.shape == (T, P) and S.shape == (N, P)
    for form in (ssm.ssd_quadratic, ssm.ssd_recurrent):
        y_ref, S_ref = form(x, delta, a, B, C, D=D, initial_state=S0)
        assert rel_err(y, y_ref) <= 1e-12 and rel_err(S, S_ref) <= 1e-12


def test_ssd_chunkwise_is_ssd_chunk_applied_chunk_after_chunk():
    # steps 1, 2 and 4 are ssd_chunk's equations for every chunk at once; step 3 carries the state
    rng = np.random.default_rng(16)
    T, P, N, Q = 23, 3, 4, 5
    x, delta, B, C = _ssd_inputs(rng, T, P, N)
    S = rng.normal(size=(N, P))
    y, S_final = ssm.ssd_chunkwise(x, delta, -0.7, B, C, initial_state=S, chunk_size=Q)
    for start in range(0, T, Q):
        c = slice(start, start + Q)
        y_c, S = ssm.ssd_chunk(x[c], delta[c], -0.7, B[c], C[c], initial_state=S)
        assert rel_err(y[c], y_c) <= 1e-12
    assert rel_err(S_final, S) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ssd_chunkwise_strong_decay_has_no_positive_exponent(dtype):
    # a delta of 1 and a = -120 per token; over a chunk of 64 the log-decays sum to -7680, so a form that
    # divided by Gamma would overflow; the chunked form forms every decay from segment sums <= 0
    rng = np.random.default_rng(17)
    T, P, N = 150, 2, 3
    x, _, B, C = (v.astype(dtype) for v in _ssd_inputs(rng, T, P, N))
    delta = np.ones(T, dtype=dtype)
    S0 = rng.normal(size=(N, P)).astype(dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y, S = ssm.ssd_chunkwise(x, delta, dtype(-120.0), B, C, initial_state=S0, chunk_size=64)
        y_r, S_r = ssm.ssd_recurrent(x, delta, dtype(-120.0), B, C, initial_state=S0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert y.dtype == dtype and rel_err(y, y_r) <= tol and rel_err(S, S_r) <= tol
    assert rel_err(y, np.sum(C * B, axis=1)[:, None] * x) <= tol     # every token forgets the past


def test_ssd_chunkwise_at_4096_tokens_equals_the_recurrence():
    # the benchmark's shape (one head, N = 64, P = 64, chunk 64), in float64
    rng = np.random.default_rng(18)
    T, N, P = 4096, 64, 64
    x = rng.normal(size=(T, P))
    delta = rng.uniform(0.001, 0.1, T)
    B, C = rng.normal(size=(T, N)) / 8, rng.normal(size=(T, N)) / 8
    y, S = ssm.ssd_chunkwise(x, delta, -4.0, B, C, chunk_size=64)
    y_r, S_r = ssm.ssd_recurrent(x, delta, -4.0, B, C)
    assert rel_err(y, y_r) <= 1e-12 and rel_err(S, S_r) <= 1e-12
