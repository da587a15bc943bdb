"""State-space models: continuous LTI systems, S4's convolution view, HiPPO, Mamba, Mamba-2.

Chapter "State-space models" (label ``chap-ssm``). Shapes follow the book:
a sequence is an array with one token per row.

Continuous system and its discretization (equations ``eq-ssm-continuous``,
``eq-ssm-zoh``, ``eq-ssm-bilinear``, ``eq-ssm-euler``):

- :func:`discretize_zoh`: zero-order hold, exact for an input held constant over
  each step (matrix exponential).
- :func:`discretize_bilinear`: the bilinear (Tustin) transform.
- :func:`discretize_mamba`: Mamba's choice, ``A_bar = exp(delta A)`` (zero-order
  hold) with the Euler step ``B_bar = delta B``.

Linear time-invariant (LTI) SSM, recurrent and convolutional views
(``eq-ssm-recurrence``, ``eq-ssm-kernel``, ``eq-ssm-conv``):

- :func:`lti_recurrence`, :func:`ssm_kernel`, :func:`causal_conv`,
  :func:`causal_conv_fft`, :func:`lti_convolution`. Single-input single-output
  (SISO: ``x`` of shape ``(T,)``) and many independent channels (``x`` of shape
  ``(T, H)``, one SISO system per channel, as in S4).

HiPPO (``eq-ssm-hippo-legs``, ``eq-ssm-legs-basis``): :func:`hippo_legs`,
:func:`s4d_real`, :func:`legs_basis`, :func:`legs_reconstruct`.

Selective SSM, Mamba's S6 (``eq-ssm-selective``): :func:`softplus`,
:func:`selective_delta`, :func:`selective_scan_sequential`,
:func:`selective_scan_parallel`, built on :func:`associative_scan` (``eq-ssm-scan-op``).

Mamba-2 / state-space duality (``eq-ssm-ssd-recurrent``, ``eq-ssm-ssd-matrix``):
:func:`ssd_recurrent`, :func:`ssd_quadratic`, :func:`ssd_mask`.

Costs (the chapter's FLOPs-and-memory table): :func:`ssm_state_bytes`,
:func:`selective_scan_flops`, :func:`s4_fft_conv_flops`, :func:`ssm_decode_flops`.

Conventions shared with Mamba's reference implementation: the output reads the
*updated* state, ``y_t = C_t h_t + D x_t``; the step size goes through softplus
with a bias; ``B_bar = delta B`` is an Euler step, not the exact zero-order-hold
``B_bar``. In the Mamba-2 form the state of one head is ``(N, P)`` = ``(d_k, d_v)``
in the book's orientation, read out as ``o_t = S_t^T q_t`` with ``q_t = C_t``,
``k_t = B_t`` and ``v_t = delta_t x_t``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import scipy.linalg

from ._validate import as_float_array, check_dim, check_positive_int, check_same_length

__all__ = [
    "discretize_zoh",
    "discretize_bilinear",
    "discretize_mamba",
    "lti_recurrence",
    "ssm_kernel",
    "causal_conv",
    "causal_conv_fft",
    "lti_convolution",
    "hippo_legs",
    "s4d_real",
    "legs_basis",
    "legs_reconstruct",
    "softplus",
    "selective_delta",
    "associative_scan",
    "selective_scan_sequential",
    "selective_scan_parallel",
    "selective_scan_step",
    "ssd_mask",
    "ssd_recurrent",
    "ssd_quadratic",
    "ssm_state_bytes",
    "selective_scan_flops",
    "s4_fft_conv_flops",
    "ssm_decode_flops",
]


# ---------------------------------------------------------------------------
# validation helpers

def _square(A, name: str = "A") -> np.ndarray:
    arr = as_float_array(A, name, ndim=2)
    if arr.shape[0] != arr.shape[1] or arr.shape[0] < 1:
        raise ValueError(f"{name}: expected a square (N, N) matrix, got shape {arr.shape}")
    return arr


def _step(delta, name: str = "delta") -> float:
    if isinstance(delta, bool) or not isinstance(delta, (numbers.Real, np.floating, np.integer)):
        arr = as_float_array(delta, name, ndim=0)
    else:
        arr = np.asarray(float(delta))
    value = float(arr)
    if not math.isfinite(value) or not value > 0:
        raise ValueError(f"{name}: expected a positive step size, got {value!r}")
    return value


def _input_matrix(B, n: int, name: str = "B") -> np.ndarray:
    arr = as_float_array(B, name, ndim=(1, 2))
    check_dim(arr, name, 0, n, "N, the size of the state, from A")
    return arr


# ---------------------------------------------------------------------------
# discretization

def discretize_zoh(A, B, delta):
    """Zero-order hold: ``A_bar = exp(delta A)``, ``B_bar = A^{-1}(exp(delta A) - I) B`` (``eq-ssm-zoh``).

    Exact when the input is held constant over each step of length ``delta``.
    ``A`` is ``(N, N)`` and must be invertible (every HiPPO and S4D matrix is);
    ``B`` is ``(N,)`` or ``(N, m)``; ``delta > 0``. Returns ``(A_bar, B_bar)``
    with the shapes of ``A`` and ``B``.
    """
    A = _square(A)
    B = _input_matrix(B, A.shape[0])
    dt = _step(delta)
    n = A.shape[0]
    if np.linalg.cond(A) > 1e12:
        raise ValueError("A: the zero-order-hold formula needs an invertible A; got a singular "
                         f"or nearly singular matrix (condition number {np.linalg.cond(A):.3g})")
    A_bar = scipy.linalg.expm(dt * A)
    B_bar = np.linalg.solve(A, (A_bar - np.eye(n)) @ B)
    return A_bar, B_bar


def discretize_bilinear(A, B, delta):
    """Bilinear (Tustin) transform (``eq-ssm-bilinear``).

    ``A_bar = (I - delta/2 A)^{-1} (I + delta/2 A)``, ``B_bar = (I - delta/2 A)^{-1} delta B``.
    ``A`` is ``(N, N)``, ``B`` is ``(N,)`` or ``(N, m)``, ``delta > 0``; returns
    ``(A_bar, B_bar)`` with the shapes of ``A`` and ``B``. It agrees with the
    zero-order hold up to terms of order ``delta**3`` per step.
    """
    A = _square(A)
    B = _input_matrix(B, A.shape[0])
    dt = _step(delta)
    eye = np.eye(A.shape[0])
    left = eye - 0.5 * dt * A
    A_bar = np.linalg.solve(left, eye + 0.5 * dt * A)
    B_bar = np.linalg.solve(left, dt * B)
    return A_bar, B_bar


def discretize_mamba(A, B, delta):
    """Mamba's discretization: ``A_bar = exp(delta A)`` (zero-order hold), ``B_bar = delta B`` (Euler) (``eq-ssm-euler``).

    ``A`` is ``(N, N)`` (any square matrix), ``B`` is ``(N,)`` or ``(N, m)``,
    ``delta > 0``. ``B_bar`` differs from the zero-order-hold one by
    ``delta**2 A B / 2 + O(delta**3)``.
    """
    A = _square(A)
    B = _input_matrix(B, A.shape[0])
    dt = _step(delta)
    return scipy.linalg.expm(dt * A), dt * B


# ---------------------------------------------------------------------------
# LTI: recurrence, kernel, convolution

def _skip(D, channels: int) -> np.ndarray:
    """The skip term D of ``y = C h + D x``: None (zero), a scalar, or one value per channel."""
    if D is None:
        return np.zeros(channels)
    Dd = as_float_array(D, "D", ndim=(0, 1))
    Dd = np.broadcast_to(Dd, (channels,)) if Dd.ndim == 0 else Dd
    check_dim(Dd, "D", 0, channels, "the number of channels of x")
    return Dd


def _lti_args(A_bar, B_bar, C, x, D):
    """Validate an LTI system; return arrays with a leading channel axis and a flag for SISO."""
    xs = as_float_array(x, "x", ndim=(1, 2))
    if xs.shape[0] < 1:
        raise ValueError(f"x: expected at least one time step, got shape {xs.shape}")
    siso = xs.ndim == 1
    if siso:
        Ab = _square(A_bar, "A_bar")[None]
        n = Ab.shape[1]
        Bb = as_float_array(B_bar, "B_bar", ndim=1)
        check_dim(Bb, "B_bar", 0, n, "N, the size of the state, from A_bar")
        Cc = as_float_array(C, "C", ndim=1)
        check_dim(Cc, "C", 0, n, "N, the size of the state, from A_bar")
        Bb, Cc, xs2 = Bb[None], Cc[None], xs[:, None]
    else:
        h = xs.shape[1]
        Ab = as_float_array(A_bar, "A_bar", ndim=3)
        if Ab.shape[0] != h or Ab.shape[1] != Ab.shape[2]:
            raise ValueError(f"A_bar: expected shape ({h}, N, N) for x with {h} channels, "
                             f"got shape {Ab.shape}")
        n = Ab.shape[1]
        Bb = as_float_array(B_bar, "B_bar", shape=(h, n))
        Cc = as_float_array(C, "C", shape=(h, n))
        xs2 = xs
    h = xs2.shape[1]
    Dd = _skip(D, h)
    return Ab, Bb, Cc, xs2, Dd, siso


def lti_recurrence(A_bar, B_bar, C, x, D=None):
    """Run a discrete LTI SSM step by step (``eq-ssm-recurrence``).

    ``h_t = A_bar h_{t-1} + B_bar x_t``, ``y_t = C h_t + D x_t`` from ``h_0 = 0``
    (the output reads the updated state).

    SISO: ``A_bar`` ``(N, N)``, ``B_bar`` and ``C`` ``(N,)``, ``x`` ``(T,)``.
    Many channels (S4): ``A_bar`` ``(H, N, N)``, ``B_bar`` and ``C`` ``(H, N)``,
    ``x`` ``(T, H)``. ``D`` is a scalar or ``(H,)`` (default 0). Returns ``y``
    with the shape of ``x``.
    """
    Ab, Bb, Cc, xs, Dd, siso = _lti_args(A_bar, B_bar, C, x, D)
    T, H = xs.shape
    h = np.zeros(Bb.shape)
    y = np.empty((T, H))
    for t in range(T):
        h = np.einsum("hij,hj->hi", Ab, h) + Bb * xs[t][:, None]
        y[t] = np.sum(Cc * h, axis=1) + Dd * xs[t]
    return y[:, 0] if siso else y


def ssm_kernel(A_bar, B_bar, C, length: int):
    """The convolution kernel ``K = (C B_bar, C A_bar B_bar, ..., C A_bar^{L-1} B_bar)`` (``eq-ssm-kernel``).

    SISO: ``A_bar`` ``(N, N)``, ``B_bar``, ``C`` ``(N,)``; returns ``(L,)``.
    Many channels: ``A_bar`` ``(H, N, N)``, ``B_bar``, ``C`` ``(H, N)``; returns ``(L, H)``.
    Computed directly, by repeated multiplication of ``A_bar^j B_bar``.
    """
    L = check_positive_int(length, "length")
    Ab = as_float_array(A_bar, "A_bar", ndim=(2, 3))
    siso = Ab.ndim == 2
    dummy = np.zeros((1,) if siso else (1, Ab.shape[0]))
    Ab, Bb, Cc, _, _, _ = _lti_args(A_bar, B_bar, C, dummy, None)
    K = np.empty((L, Ab.shape[0]))
    v = Bb.copy()
    for j in range(L):
        K[j] = np.sum(Cc * v, axis=1)
        v = np.einsum("hij,hj->hi", Ab, v)
    return K[:, 0] if siso else K


def _conv_args(x, K):
    xs = as_float_array(x, "x", ndim=(1, 2))
    if xs.shape[0] < 1:
        raise ValueError(f"x: expected at least one time step, got shape {xs.shape}")
    Kk = as_float_array(K, "K", ndim=xs.ndim)
    if xs.ndim == 2:
        check_dim(Kk, "K", 1, xs.shape[1], "the number of channels of x")
    if Kk.shape[0] < 1:
        raise ValueError(f"K: expected at least one kernel tap, got shape {Kk.shape}")
    return xs, Kk


def causal_conv(x, K):
    """Causal convolution computed directly: ``y_t = sum_{j=0}^{t} K_j x_{t-j}`` (``eq-ssm-conv``).

    ``x`` is ``(T,)`` with ``K`` ``(L,)``, or ``x`` ``(T, H)`` with ``K`` ``(L, H)``
    (one kernel per channel). Taps beyond ``T`` are unused; a kernel shorter
    than ``T`` is treated as zero beyond its end. Returns ``y`` with the shape of ``x``.
    """
    xs, Kk = _conv_args(x, K)
    T = xs.shape[0]
    y = np.zeros_like(xs, dtype=np.result_type(xs, Kk))
    for j in range(min(T, Kk.shape[0])):
        y[j:] += Kk[j] * xs[:T - j]
    return y


def causal_conv_fft(x, K):
    """The same causal convolution through the FFT, zero-padded so that it does not wrap (``eq-ssm-conv``).

    Both signals are padded to a length ``n >= T + L - 1`` (a power of two), so
    the circular convolution the FFT computes equals the linear one on the first
    ``T`` outputs. Shapes as in :func:`causal_conv`.
    """
    xs, Kk = _conv_args(x, K)
    T = xs.shape[0]
    Kk = Kk[:T]
    n = 1 << (T + Kk.shape[0] - 2).bit_length()      # the smallest power of two >= T + L - 1
    y = np.fft.irfft(np.fft.rfft(xs, n=n, axis=0) * np.fft.rfft(Kk, n=n, axis=0), n=n, axis=0)
    return y[:T]


def lti_convolution(A_bar, B_bar, C, x, D=None, *, method: str = "fft"):
    """The convolutional view of an LTI SSM: ``y = K * x + D x`` (``eq-ssm-conv``).

    Shapes as in :func:`lti_recurrence`; ``method`` is ``"fft"`` (zero-padded
    FFT, ``O(T log T)`` per channel) or ``"direct"`` (``O(T^2)``).
    """
    if method not in ("fft", "direct"):
        raise ValueError(f"method: expected 'fft' or 'direct', got {method!r}")
    Ab, Bb, Cc, xs, Dd, siso = _lti_args(A_bar, B_bar, C, x, D)
    K = ssm_kernel(Ab, Bb, Cc, xs.shape[0])
    y = (causal_conv_fft if method == "fft" else causal_conv)(xs, K) + Dd * xs
    return y[:, 0] if siso else y


# ---------------------------------------------------------------------------
# HiPPO and S4D

def hippo_legs(N: int):
    """The HiPPO-LegS matrices ``(A, B)`` (``eq-ssm-hippo-legs``), in the sign convention ``h' = A h + B u``.

    ``A[n, k] = -sqrt(2n+1) sqrt(2k+1)`` for ``n > k``, ``-(n+1)`` for ``n == k``,
    0 above the diagonal; ``B[n] = sqrt(2n+1)``. Returns ``A`` ``(N, N)`` and
    ``B`` ``(N,)`` (Gu et al. 2020, HiPPO).
    """
    N = check_positive_int(N, "N")
    r = np.sqrt(2.0 * np.arange(N) + 1.0)
    A = -np.tril(np.outer(r, r), -1) - np.diag(np.arange(N) + 1.0)
    return A, r.copy()


def s4d_real(N: int):
    """The S4D-Real diagonal initialization ``A = -(1, 2, ..., N)`` (Gu et al. 2022, S4D), as Mamba uses.

    Returns the diagonal of ``A`` as an ``(N,)`` array; these are the
    eigenvalues (the diagonal) of the HiPPO-LegS matrix of ``eq-ssm-hippo-legs``.
    """
    N = check_positive_int(N, "N")
    return -(np.arange(N) + 1.0)


def legs_basis(N: int, lags):
    """The functions the LTI HiPPO-LegS state measures, ``g_n(s) = sqrt(2n+1) P_n(2 e^{-s} - 1)`` (``eq-ssm-legs-basis``).

    The continuous system ``h' = A h + B u`` with :func:`hippo_legs` has impulse
    response ``exp(s A) B = e^{-s} g(s)``, and the ``g_n`` are orthonormal for the
    weight ``e^{-s}`` on ``s >= 0``. ``lags`` ``(M,)`` are look-back times
    ``s >= 0`` (in units of the continuous time); returns ``(M, N)``.
    """
    N = check_positive_int(N, "N")
    s = as_float_array(lags, "lags", ndim=1)
    if np.any(s < 0):
        raise ValueError(f"lags: expected look-back times >= 0, got minimum {float(s.min())!r}")
    z = 2.0 * np.exp(-s) - 1.0
    out = np.empty((s.shape[0], N))
    # Legendre three-term recurrence: (n+1) P_{n+1} = (2n+1) z P_n - n P_{n-1}
    p_prev, p = np.ones_like(z), z
    out[:, 0] = 1.0
    if N > 1:
        out[:, 1] = z
    for n in range(1, N - 1):
        p_prev, p = p, ((2 * n + 1) * z * p - n * p_prev) / (n + 1)
        out[:, n + 1] = p
    return out * np.sqrt(2.0 * np.arange(N) + 1.0)


def legs_reconstruct(state, lags):
    """Reconstruct the past input from a HiPPO-LegS state: ``u(t - s) ~ sum_n h_n(t) g_n(s)`` (``eq-ssm-legs-reconstruct``).

    ``state`` ``(N,)`` is the state at time ``t`` of ``h' = A h + B u`` with
    :func:`hippo_legs` (continuous time, or its zero-order-hold discretization
    with step ``delta``, in which case a lag of ``k`` steps is ``s = k delta``);
    ``lags`` ``(M,)`` are the look-back times ``s >= 0``. Returns ``(M,)``.
    """
    h = as_float_array(state, "state", ndim=1)
    return legs_basis(h.shape[0], lags) @ h


# ---------------------------------------------------------------------------
# selective SSM (Mamba's S6)

def softplus(x):
    """``softplus(x) = log(1 + e^x)`` of ``eq-ssm-selective``, computed without overflow; any shape in, same shape out."""
    return np.logaddexp(0.0, as_float_array(x, "x"))


def selective_delta(raw, bias):
    """Mamba's step size: ``delta = softplus(raw + bias)`` (``eq-ssm-selective``).

    ``raw`` ``(T, d)`` is the projection of the input, ``bias`` ``(d,)`` or a
    scalar; returns ``(T, d)``, every entry positive.
    """
    r = as_float_array(raw, "raw", ndim=2)
    b = as_float_array(bias, "bias", ndim=(0, 1))
    if b.ndim == 1:
        check_dim(b, "bias", 0, r.shape[1], "d, the number of channels of raw")
    return np.logaddexp(0.0, r + b)


def _selective_args(x, delta, A, B, C, D, initial_state):
    xs = as_float_array(x, "x", ndim=2)
    T, d = xs.shape
    if T < 1:
        raise ValueError(f"x: expected at least one time step, got shape {xs.shape}")
    dt = as_float_array(delta, "delta", shape=(T, d))
    if np.any(dt <= 0):
        raise ValueError(f"delta: expected positive step sizes, got minimum {float(dt.min())!r}")
    Aa = as_float_array(A, "A", ndim=2)
    check_dim(Aa, "A", 0, d, "d, the number of channels of x")
    n = Aa.shape[1]
    Bb = as_float_array(B, "B", ndim=2)
    check_same_length("x", xs, "B", Bb)
    check_dim(Bb, "B", 1, n, "N, the state size, from A")
    Cc = as_float_array(C, "C", ndim=2)
    check_same_length("x", xs, "C", Cc)
    check_dim(Cc, "C", 1, n, "N, the state size, from A")
    Dd = _skip(D, d)
    if initial_state is None:
        h0 = np.zeros((d, n))
    else:
        h0 = as_float_array(initial_state, "initial_state", shape=(d, n))
    return xs, dt, Aa, Bb, Cc, Dd, h0


def selective_scan_step(state, x_t, delta_t, A, B_t, C_t, D=None):
    """One step of Mamba's selective SSM (``eq-ssm-selective``), for decoding.

    ``h_t = exp(delta_t A) * h_{t-1} + (delta_t B_t) x_t`` (elementwise over the
    ``(d, N)`` state), ``y_t = h_t C_t + D x_t``. Shapes: ``state`` ``(d, N)``,
    ``x_t`` and ``delta_t`` ``(d,)``, ``A`` ``(d, N)``, ``B_t`` and ``C_t`` ``(N,)``,
    ``D`` scalar or ``(d,)``. Returns ``(y_t, new_state)`` with shapes ``(d,)``, ``(d, N)``.
    """
    h = as_float_array(state, "state", ndim=2)
    xs = as_float_array(x_t, "x_t", ndim=1)
    y, h_new = selective_scan_sequential(xs[None], as_float_array(delta_t, "delta_t", ndim=1)[None],
                                         A, as_float_array(B_t, "B_t", ndim=1)[None],
                                         as_float_array(C_t, "C_t", ndim=1)[None], D,
                                         initial_state=h, return_state=True)
    return y[0], h_new


def selective_scan_sequential(x, delta, A, B, C, D=None, *, initial_state=None,
                              return_state: bool = False):
    """Mamba's selective scan (S6), one token at a time: the reference loop (``eq-ssm-selective``).

    ``selective_scan_sequential(x, delta, A, B, C, D=None, *, initial_state=None,
    return_state=False) -> y`` or ``(y, final_state)``.

    For each channel ``i`` and state index ``n``:
    ``h_t[i, n] = exp(delta_t[i] A[i, n]) h_{t-1}[i, n] + delta_t[i] B_t[n] x_t[i]``
    (``A_bar`` by zero-order hold, ``B_bar = delta B`` by Euler, as Mamba's code),
    ``y_t[i] = sum_n C_t[n] h_t[i, n] + D[i] x_t[i]`` (reads the updated state).

    Shapes: ``x`` and ``delta`` ``(T, d)`` (``delta > 0``, e.g. from
    :func:`selective_delta`), ``A`` ``(d, N)`` (negative entries for a stable
    scan), ``B`` and ``C`` ``(T, N)`` (shared by the channels), ``D`` scalar or
    ``(d,)``, ``initial_state`` ``(d, N)`` (default zeros). Returns ``y`` ``(T, d)``,
    and the final state ``(d, N)`` when ``return_state``.
    """
    xs, dt, Aa, Bb, Cc, Dd, h = _selective_args(x, delta, A, B, C, D, initial_state)
    T, d = xs.shape
    y = np.empty((T, d))
    h = h.copy()
    for t in range(T):
        h = np.exp(dt[t][:, None] * Aa) * h + (dt[t] * xs[t])[:, None] * Bb[t][None, :]
        y[t] = h @ Cc[t] + Dd * xs[t]
    return (y, h) if return_state else y


def associative_scan(a, b, *, initial_state=None):
    """All prefixes of ``h_t = a_t * h_{t-1} + b_t`` by a work-efficient parallel scan (``eq-ssm-scan-op``).

    The pairs ``(a, b)`` compose with the associative operator
    ``(a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2)`` (apply step 1, then step 2).
    Each level combines neighbouring pairs in one vectorized numpy operation, so
    the number of sequential levels is about ``2 log2 T`` and the total work
    ``O(T)``; any length ``T`` works (an odd element waits one level).

    ``a`` and ``b`` have the same shape ``(T, ...)`` (elementwise recurrences);
    ``initial_state`` has shape ``a.shape[1:]`` (default zeros). Returns ``h`` of
    shape ``(T, ...)``.
    """
    aa = as_float_array(a, "a")
    bb = as_float_array(b, "b")
    if aa.ndim < 1 or aa.shape[0] < 1:
        raise ValueError(f"a: expected an array of shape (T, ...) with T >= 1, got shape {aa.shape}")
    if bb.shape != aa.shape:
        raise ValueError(f"b: expected shape {aa.shape} to match a, got shape {bb.shape}")
    bb = bb.astype(np.result_type(aa, bb), copy=True)
    if initial_state is not None:
        h0 = as_float_array(initial_state, "initial_state", shape=aa.shape[1:])
        bb[0] = bb[0] + aa[0] * h0
    _, h = _scan(aa, bb)
    return h


def _scan(a: np.ndarray, b: np.ndarray):
    """Inclusive scan of the pairs (a_t, b_t); returns the cumulative (a, b)."""
    T = a.shape[0]
    if T == 1:
        return a, b
    m = T // 2
    a_l, a_r = a[0:2 * m:2], a[1:2 * m:2]
    b_l, b_r = b[0:2 * m:2], b[1:2 * m:2]
    # combine each even element with its right neighbour: one level
    a_half, b_half = _scan(a_l * a_r, a_r * b_l + b_r)
    out_a = np.empty_like(a)
    out_b = np.empty_like(b)
    out_a[1:2 * m:2], out_b[1:2 * m:2] = a_half, b_half
    out_a[0], out_b[0] = a[0], b[0]
    # even positions 2, 4, ...: the prefix ending just before them, then their own step
    if T > 2:
        a_even, b_even = a[2:T:2], b[2:T:2]
        k = a_even.shape[0]
        out_a[2:T:2] = a_half[:k] * a_even
        out_b[2:T:2] = a_even * b_half[:k] + b_even
    return out_a, out_b


def selective_scan_parallel(x, delta, A, B, C, D=None, *, initial_state=None,
                            return_state: bool = False):
    """Mamba's selective scan computed with the parallel associative scan (``eq-ssm-scan-op``).

    Same signature, conventions and result as :func:`selective_scan_sequential`:
    ``selective_scan_parallel(x, delta, A, B, C, D=None, *, initial_state=None,
    return_state=False) -> y`` or ``(y, final_state)``. Builds every step's
    ``A_bar_t = exp(delta_t A)`` and ``B_bar_t x_t = delta_t B_t x_t`` as
    ``(T, d, N)`` arrays, scans them with :func:`associative_scan` (log depth,
    vectorized) and reads out ``y_t = h_t C_t + D x_t``.
    """
    xs, dt, Aa, Bb, Cc, Dd, h0 = _selective_args(x, delta, A, B, C, D, initial_state)
    a = np.exp(dt[:, :, None] * Aa[None])                     # (T, d, N)
    b = (dt * xs)[:, :, None] * Bb[:, None, :]                # (T, d, N)
    h = associative_scan(a, b, initial_state=h0)
    y = np.einsum("tin,tn->ti", h, Cc) + Dd * xs
    return (y, h[-1].copy()) if return_state else y


# ---------------------------------------------------------------------------
# Mamba-2: state-space duality

def _ssd_args(x, delta, a, B, C, D):
    xs = as_float_array(x, "x", ndim=2)
    T, P = xs.shape
    if T < 1:
        raise ValueError(f"x: expected at least one time step, got shape {xs.shape}")
    dt = as_float_array(delta, "delta", shape=(T,))
    if np.any(dt <= 0):
        raise ValueError(f"delta: expected positive step sizes, got minimum {float(dt.min())!r}")
    aa = float(as_float_array(a, "a", ndim=0))
    if aa > 0:
        raise ValueError(f"a: expected a decay rate <= 0 (a stable scalar A), got {aa!r}")
    Bb = as_float_array(B, "B", ndim=2)
    check_same_length("x", xs, "B", Bb)
    Cc = as_float_array(C, "C", ndim=2)
    check_same_length("x", xs, "C", Cc)
    check_dim(Cc, "C", 1, Bb.shape[1], "N, the state size, from B")
    Dd = 0.0 if D is None else float(as_float_array(D, "D", ndim=0))
    return xs, dt, aa, Bb, Cc, Dd


def ssd_recurrent(x, delta, a, B, C, D=None, *, return_state: bool = False):
    """One Mamba-2 head as a recurrence: linear attention with a scalar decay (``eq-ssm-ssd-recurrent``).

    ``S_t = exp(delta_t a) S_{t-1} + B_t (delta_t x_t)^T``, ``y_t = S_t^T C_t + D x_t``:
    the state ``S`` is ``(N, P)`` = ``(d_k, d_v)``, with query ``q_t = C_t``,
    key ``k_t = B_t``, value ``v_t = delta_t x_t`` and gate ``exp(delta_t a)``.

    Shapes: ``x`` ``(T, P)``, ``delta`` ``(T,)`` positive, ``a`` a scalar ``<= 0``,
    ``B`` and ``C`` ``(T, N)``, ``D`` a scalar. Returns ``y`` ``(T, P)`` (and the
    final ``(N, P)`` state when ``return_state``).
    """
    xs, dt, aa, Bb, Cc, Dd = _ssd_args(x, delta, a, B, C, D)
    T, P = xs.shape
    S = np.zeros((Bb.shape[1], P))
    y = np.empty((T, P))
    for t in range(T):
        S = np.exp(dt[t] * aa) * S + np.outer(Bb[t], dt[t] * xs[t])
        y[t] = S.T @ Cc[t] + Dd * xs[t]
    return (y, S) if return_state else y


def ssd_mask(delta, a):
    """The 1-semiseparable decay mask ``L[t, s] = exp(a * sum_{r=s+1}^{t} delta_r)`` for ``s <= t``, else 0 (``eq-ssm-ssd-matrix``).

    ``delta`` ``(T,)`` positive, ``a`` scalar ``<= 0``; returns ``(T, T)``, lower
    triangular with ones on the diagonal. The sums are formed segment by segment
    (not as differences of one cumulative sum), so no precision is lost to
    cancellation on long sequences.
    """
    dt = as_float_array(delta, "delta", ndim=1)
    if np.any(dt <= 0):
        raise ValueError(f"delta: expected positive step sizes, got minimum {float(dt.min())!r}")
    aa = float(as_float_array(a, "a", ndim=0))
    if aa > 0:
        raise ValueError(f"a: expected a decay rate <= 0, got {aa!r}")
    T = dt.shape[0]
    logs = aa * dt
    # seg[t, s] = sum_{r=s+1}^{t} logs[r]: cumulative sums down each column below the diagonal
    rep = np.where(np.tri(T, k=-1, dtype=bool), logs[:, None] * np.ones((1, T)), 0.0)
    seg = np.cumsum(rep, axis=0)
    return np.where(np.tri(T, dtype=bool), np.exp(seg), 0.0)


def ssd_quadratic(x, delta, a, B, C, D=None):
    """One Mamba-2 head as masked, decayed linear attention (``eq-ssm-ssd-matrix``).

    ``Y = (L o (C B^T)) (delta x) + D x`` with ``L = ssd_mask(delta, a)``: the
    ``(T, T)`` matrix ``M = L o (C B^T)`` is the semiseparable matrix the
    recurrence multiplies by. Shapes as in :func:`ssd_recurrent`; returns ``(T, P)``.
    """
    xs, dt, aa, Bb, Cc, Dd = _ssd_args(x, delta, a, B, C, D)
    M = ssd_mask(dt, aa) * (Cc @ Bb.T)
    return M @ (dt[:, None] * xs) + Dd * xs


# ---------------------------------------------------------------------------
# costs (the chapter's table)

def ssm_state_bytes(d_model: int, n_layers: int, state_size: int, *, bytes_per_number: int = 2,
                    expand: int = 1, batch: int = 1) -> int:
    """Bytes of the recurrent state of a stack of SSM layers (``eq-ssm-memory``): ``batch * expand * d_model * N * layers * bytes``.

    ``expand`` is Mamba's inner-width factor (the state is ``(expand d, N)`` per
    layer; 1 gives the ``N d`` of the chapter's worked problem). The
    short-convolution buffer Mamba also keeps is not counted. Returns an int.
    """
    d = check_positive_int(d_model, "d_model")
    layers = check_positive_int(n_layers, "n_layers")
    n = check_positive_int(state_size, "state_size")
    nbytes = check_positive_int(bytes_per_number, "bytes_per_number")
    e = check_positive_int(expand, "expand")
    b = check_positive_int(batch, "batch")
    return b * e * d * n * layers * nbytes


def selective_scan_flops(seq_len: int, d: int, state_size: int) -> int:
    """FLOPs of one selective scan over ``seq_len`` tokens, ``d`` channels, state ``N`` (``eq-ssm-flops``).

    Per token, channel and state entry: ``delta A`` (1), its exponential (counted
    as 1), ``delta B x`` (2), the update ``a h + b`` (2) and the readout ``C h``
    multiply-add (2): 8 FLOPs, so ``8 T d N`` (a multiply-add counts 2).
    """
    T = check_positive_int(seq_len, "seq_len")
    dd = check_positive_int(d, "d")
    n = check_positive_int(state_size, "state_size")
    return 8 * T * dd * n


def ssm_decode_flops(d: int, state_size: int) -> int:
    """FLOPs of one decoding step of a selective SSM: ``8 d N`` (``eq-ssm-flops``, one token of :func:`selective_scan_flops`)."""
    return selective_scan_flops(1, d, state_size)


def s4_fft_conv_flops(seq_len: int, d: int, state_size: int) -> int:
    """FLOPs of an S4 (diagonal, S4D) layer in its convolution mode, per sequence (``eq-ssm-flops``).

    Kernel by Vandermonde products: ``2 T N`` per channel (``K_j = sum_n c_n
    lambda_n^j``, multiply-add). Zero-padded FFT convolution at length
    ``n = 2^ceil(log2(2T))``: two real forward FFTs and one inverse, each counted
    as ``2.5 n log2 n`` FLOPs, plus ``6 (n/2 + 1)`` for the complex products.
    Returns ``d`` times the per-channel total, an int.
    """
    T = check_positive_int(seq_len, "seq_len")
    dd = check_positive_int(d, "d")
    n_state = check_positive_int(state_size, "state_size")
    n = 1 << int(math.ceil(math.log2(2 * T)))
    fft = 3 * 2.5 * n * math.log2(n) + 6 * (n // 2 + 1)
    return int(round(dd * (2 * T * n_state + fft)))
