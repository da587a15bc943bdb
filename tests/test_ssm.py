"""Tests of fixedstate.ssm: each states a property the state-space chapter claims."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings, strategies as st

from fixedstate import ssm

SETTINGS = settings(max_examples=40, deadline=None)


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
        yz = ssm.lti_recurrence(*ssm.discretize_zoh(A, B, d), C, x)
        yb = ssm.lti_recurrence(*ssm.discretize_bilinear(A, B, d), C, x)
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


@pytest.mark.parametrize("bad, name", [
    (lambda: ssm.discretize_zoh(np.ones((2, 3)), np.ones(2), 0.1), "A"),
    (lambda: ssm.discretize_zoh(-np.eye(3), np.ones(2), 0.1), "B"),
    (lambda: ssm.discretize_zoh(-np.eye(3), np.ones(3), 0.0), "delta"),
    (lambda: ssm.discretize_bilinear(-np.eye(3), np.ones(3), -0.1), "delta"),
    (lambda: ssm.discretize_mamba(-np.eye(3), np.ones((3, 1, 1)), 0.1), "B"),
    (lambda: ssm.discretize_zoh(np.zeros((2, 2)), np.ones(2), 0.1), "A"),
    (lambda: ssm.lti_recurrence(np.eye(2), np.ones(2), np.ones(3), np.ones(5)), "C"),
    (lambda: ssm.lti_recurrence(np.eye(2), np.ones(2), np.ones(2), np.ones((5, 2, 1))), "x"),
    (lambda: ssm.lti_recurrence(np.eye(2)[None], np.ones((1, 2)), np.ones((1, 2)), np.ones((5, 2))), "A_bar"),
    (lambda: ssm.causal_conv(np.ones((5, 2)), np.ones((5, 3))), "K"),
    (lambda: ssm.ssm_kernel(np.eye(2), np.ones(2), np.ones(2), 0), "length"),
    (lambda: ssm.selective_scan_sequential(np.ones(5), np.ones(5), -np.ones((1, 2)), np.ones((5, 2)), np.ones((5, 2))), "x"),
    (lambda: ssm.selective_scan_parallel(np.ones((5, 2)), np.zeros((5, 2)), -np.ones((2, 3)), np.ones((5, 3)), np.ones((5, 3))), "delta"),
    (lambda: ssm.selective_scan_parallel(np.ones((5, 2)), np.ones((5, 2)), -np.ones((2, 3)), np.ones((5, 4)), np.ones((5, 3))), "B"),
    (lambda: ssm.selective_scan_sequential(np.ones((5, 2)), np.ones((5, 2)), -np.ones((2, 3)), np.ones((5, 3)), np.ones((4, 3))), "C"),
    (lambda: ssm.selective_scan_sequential(np.ones((5, 2)), np.ones((5, 2)), -np.ones((3, 3)), np.ones((5, 3)), np.ones((5, 3))), "A"),
    (lambda: ssm.selective_scan_sequential(np.ones((5, 2)), np.ones((5, 2)), -np.ones((2, 3)), np.ones((5, 3)), np.ones((5, 3)), initial_state=np.ones((3, 2))), "initial_state"),
    (lambda: ssm.ssd_recurrent(np.ones((5, 2)), np.ones(5), 0.5, np.ones((5, 3)), np.ones((5, 3))), "a"),
    (lambda: ssm.ssd_quadratic(np.ones((5, 2)), np.ones(5), -0.5, np.ones((5, 3)), np.ones((5, 4))), "C"),
    (lambda: ssm.ssd_quadratic(np.ones(5), np.ones(5), -0.5, np.ones((5, 3)), np.ones((5, 3))), "x"),
    (lambda: ssm.hippo_legs(0), "N"),
    (lambda: ssm.legs_basis(3, [-1.0]), "lags"),
    (lambda: ssm.selective_delta(np.ones((4, 3)), np.ones(2)), "bias"),
])
def test_bad_input_raises_value_error_naming_the_argument(bad, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        bad()


# --------------------------------------------------------------------------- recurrence == convolution

def _system(rng, n, method="zoh", delta=0.1):
    A = random_stable(rng, n)
    B, C = rng.normal(size=n), rng.normal(size=n)
    fn = {"zoh": ssm.discretize_zoh, "bilinear": ssm.discretize_bilinear}[method]
    A_bar, B_bar = fn(A, B, delta)
    return A_bar, B_bar, C


@SETTINGS
@given(n=st.integers(1, 6), T=st.integers(1, 70), seed=st.integers(0, 10_000),
       method=st.sampled_from(["zoh", "bilinear"]), delta=st.floats(0.01, 1.0))
def test_recurrence_equals_convolution_siso(n, T, seed, method, delta):
    rng = np.random.default_rng(seed)
    A_bar, B_bar, C = _system(rng, n, method, delta)
    x = rng.normal(size=T)
    D = rng.normal()
    y_rec = ssm.lti_recurrence(A_bar, B_bar, C, x, D)
    assert y_rec.shape == (T,)
    assert rel_err(ssm.lti_convolution(A_bar, B_bar, C, x, D, method="direct"), y_rec) <= 1e-10
    assert rel_err(ssm.lti_convolution(A_bar, B_bar, C, x, D, method="fft"), y_rec) <= 1e-10


@SETTINGS
@given(n=st.integers(1, 4), H=st.integers(1, 4), T=st.integers(1, 50), seed=st.integers(0, 10_000))
def test_recurrence_equals_convolution_many_channels(n, H, T, seed):
    rng = np.random.default_rng(seed)
    systems = [_system(rng, n, "zoh", rng.uniform(0.05, 0.5)) for _ in range(H)]
    A_bar = np.stack([s[0] for s in systems])
    B_bar = np.stack([s[1] for s in systems])
    C = np.stack([s[2] for s in systems])
    x, D = rng.normal(size=(T, H)), rng.normal(size=H)
    y = ssm.lti_recurrence(A_bar, B_bar, C, x, D)
    assert y.shape == (T, H)
    for h in range(H):   # each channel is its own SISO system
        assert rel_err(ssm.lti_recurrence(A_bar[h], B_bar[h], C[h], x[:, h], D[h]), y[:, h]) <= 1e-12
    assert rel_err(ssm.lti_convolution(A_bar, B_bar, C, x, D, method="fft"), y) <= 1e-10
    assert rel_err(ssm.lti_convolution(A_bar, B_bar, C, x, D, method="direct"), y) <= 1e-10


@pytest.mark.parametrize("N, delta", [(4, 0.1), (16, 0.05), (32, 0.01)])
def test_recurrence_equals_convolution_hippo(N, delta):
    rng = np.random.default_rng(N)
    A, B = ssm.hippo_legs(N)
    A_bar, B_bar = ssm.discretize_zoh(A, B, delta)
    C = rng.normal(size=N)
    x = rng.normal(size=300)
    y = ssm.lti_recurrence(A_bar, B_bar, C, x)
    assert rel_err(ssm.lti_convolution(A_bar, B_bar, C, x, method="fft"), y) <= 1e-10
    assert rel_err(ssm.lti_convolution(A_bar, B_bar, C, x, method="direct"), y) <= 1e-10


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
    assert rel_err(ssm.lti_recurrence(A_bar, B_bar, C, impulse), K) <= 1e-12


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
    y_seq, h_seq = ssm.selective_scan_sequential(x, delta, A, B, C, D, initial_state=h0, return_state=True)
    y_par, h_par = ssm.selective_scan_parallel(x, delta, A, B, C, D, initial_state=h0, return_state=True)
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
    y, h = ssm.selective_scan_sequential(x, delta, A, B, C, 0.5, return_state=True)
    y1, h1 = ssm.selective_scan_parallel(x[:11], delta[:11], A, B[:11], C[:11], 0.5, return_state=True)
    y2, h2 = ssm.selective_scan_parallel(x[11:], delta[11:], A, B[11:], C[11:], 0.5,
                                         initial_state=h1, return_state=True)
    assert rel_err(np.vstack([y1, y2]), y) <= 1e-10 and rel_err(h2, h) <= 1e-10
    # decoding token by token with the step function gives the same outputs
    state = np.zeros((3, 4))
    for t in range(29):
        yt, state = ssm.selective_scan_step(state, x[t], delta[t], A, B[t], C[t], 0.5)
        assert rel_err(yt, y[t]) <= 1e-12


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
    y = ssm.selective_scan_parallel(x, np.full((T, d), step), A, np.tile(b, (T, 1)), np.tile(c, (T, 1)), D)
    A_bar = np.stack([np.diag(np.exp(step * A[i])) for i in range(d)])
    B_bar = np.tile(step * b, (d, 1))
    C_lti = np.tile(c, (d, 1))
    assert rel_err(y, ssm.lti_recurrence(A_bar, B_bar, C_lti, x, D)) <= 1e-10
    assert rel_err(y, ssm.lti_convolution(A_bar, B_bar, C_lti, x, D)) <= 1e-10
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
        _, h = ssm.selective_scan_sequential(x, delta, A, B, C, return_state=True)
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


# --------------------------------------------------------------------------- Mamba-2 / SSD

@SETTINGS
@given(T=st.integers(1, 50), P=st.integers(1, 4), N=st.integers(1, 5), seed=st.integers(0, 10_000),
       a=st.floats(-3.0, 0.0))
def test_ssd_matrix_form_equals_recurrence(T, P, N, seed, a):
    rng = np.random.default_rng(seed)
    x, B, C = rng.normal(size=(T, P)), rng.normal(size=(T, N)), rng.normal(size=(T, N))
    delta = rng.uniform(0.05, 1.5, size=T)
    D = rng.normal()
    y_rec = ssm.ssd_recurrent(x, delta, a, B, C, D)
    assert rel_err(ssm.ssd_quadratic(x, delta, a, B, C, D), y_rec) <= 1e-10


@SETTINGS
@given(T=st.integers(1, 40), P=st.integers(1, 3), N=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_ssd_is_a_selective_scan_with_scalar_decay(T, P, N, seed):
    # Mamba-2's head = Mamba's selective scan with A[i, n] = a for all i, n and delta shared by the P channels
    rng = np.random.default_rng(seed)
    x, B, C = rng.normal(size=(T, P)), rng.normal(size=(T, N)), rng.normal(size=(T, N))
    delta, a = rng.uniform(0.05, 1.5, size=T), -rng.uniform(0, 2)
    y_ssd, S = ssm.ssd_recurrent(x, delta, a, B, C, return_state=True)
    y_sel, h = ssm.selective_scan_parallel(x, np.tile(delta[:, None], (1, P)), np.full((P, N), a), B, C,
                                           return_state=True)
    assert rel_err(y_sel, y_ssd) <= 1e-10
    assert rel_err(h.T, S) <= 1e-10        # the selective state (d, N) is the transposed (N, P) state


@SETTINGS
@given(T=st.integers(1, 40), P=st.integers(1, 3), N=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_ssd_without_decay_is_plain_linear_attention(T, P, N, seed):
    # a = 0, delta = 1: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T q_t with q = C, k = B, v = x
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(T, N)), rng.normal(size=(T, N)), rng.normal(size=(T, P))
    y = ssm.ssd_quadratic(v, np.ones(T), 0.0, k, q)
    masked = np.tril(q @ k.T) @ v                      # causal linear attention, matrix form
    assert rel_err(y, masked) <= 1e-10
    # and it is the plain (unnormalized, identity feature map) linear attention of chap-linear-attention
    from fixedstate import linear_attention as la
    out, state, _ = la.linear_attention_recurrent(q, k, v, feature_map=la.identity_feature_map, normalize=False)
    y_rec, S = ssm.ssd_recurrent(v, np.ones(T), 0.0, k, q, return_state=True)
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


# --------------------------------------------------------------------------- costs

def test_state_bytes_and_the_worked_problem():
    # 16 * 4096 * 32 * 2 bytes, counted independently
    assert ssm.ssm_state_bytes(4096, 32, 16) == 16 * 4096 * 32 * 2
    assert ssm.ssm_state_bytes(4096, 32, 16, expand=2, batch=3) == 3 * 2 * 16 * 4096 * 32 * 2


def test_flop_counts_scale_as_stated():
    assert ssm.selective_scan_flops(2000, 64, 16) == 2 * ssm.selective_scan_flops(1000, 64, 16)
    assert ssm.ssm_decode_flops(64, 16) * 1000 == ssm.selective_scan_flops(1000, 64, 16)
    f1, f2 = ssm.s4_fft_conv_flops(1024, 8, 16), ssm.s4_fft_conv_flops(2048, 8, 16)
    assert 2.0 < f2 / f1 < 2.5            # n log n: a little more than doubling
