"""Building blocks: the parts every layer of the book is built from.

The cores (:mod:`fixedstate.linear_attention`, :mod:`fixedstate.delta_rule`,
:mod:`fixedstate.ssm`, :mod:`fixedstate.softmax_attention`) mix tokens; a real
layer wraps a core in the small parts collected here, and a model stacks the
layers with the same parts. Each part is a few lines of numpy:

- :func:`linear`: a projection ``x W + b``;
- :func:`rms_norm`, :func:`gated_rms_norm`: RMSNorm, and RMSNorm with a SiLU gate
  (the output norm of Gated DeltaNet in Qwen3-Next and of Mamba-2);
- :func:`l2_normalize`: unit-length queries and keys (the delta-rule family);
- :func:`silu`, :func:`sigmoid`, :func:`softplus`: the activations and gates;
- the two gate forms of the book's layers, each a log-decay ``<= 0`` (the cores take
  gates in log space): :func:`sigmoid_log_gate`, ``log sigmoid(z)`` (the toy stacks of
  chapters 6 and 9), and :func:`softplus_log_gate`, ``-exp(A_log) softplus(raw + dt_bias)``
  (the shipped Gated DeltaNet, KDA and Mamba-2); :func:`inverse_softplus`, which stores a
  chosen step as its softplus pre-image;
- :func:`short_conv`, :func:`short_conv_step`: the depthwise causal convolution
  over a few tokens that Mamba, Mamba-2, Gated DeltaNet and KDA put in front of
  their core, with its decode cache (the last ``K - 1`` inputs);
- :func:`mlp`: the SiLU MLP of a block (no residual inside);
- :func:`embedding`: token ids to vectors;
- :func:`residual_block`: the pre-norm residual block every stack of the book repeats,
  ``x + mixer(rms_norm(x))`` then ``+ mlp(rms_norm(.))``, around any token mixer.

Beside each forward pass that the training chapter needs sits its backward pass,
``*_backward``: given the forward's inputs and the gradient ``d_out`` of a loss
with respect to the forward's output, it returns the gradients with respect to
the inputs and weights (chapter 9, section "The small parts"). A backward pass
recomputes what it needs of the forward by calling the forward, so no forward
exists twice.

Conventions, as in the rest of the package: vectors are rows and the feature
axis is the last one, so every part accepts leading axes (batch, heads, time,
...): ``x`` is ``(..., d)``. Weight matrices are ``(d_in, d_out)`` and a
projection is ``x @ W`` (PyTorch's ``nn.Linear`` stores the transpose,
``(d_out, d_in)``, and computes ``x W^T``). The floating precision of the
input is kept (float32 in, float32 out; integers become float64); a float64
weight with a float32 ``x`` gives float64, numpy's usual promotion. Bad input
raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from scipy.special import expit

from . import kernels as kn
from ._grad import sum_to
from ._validate import as_float_array, broadcast_leading, check_dim

__all__ = [
    "linear",
    "rms_norm",
    "gated_rms_norm",
    "l2_normalize",
    "silu",
    "sigmoid",
    "softplus",
    "inverse_softplus",
    "sigmoid_log_gate",
    "softplus_log_gate",
    "short_conv",
    "short_conv_step",
    "mlp",
    "embedding",
    "residual_block",
    "linear_backward",
    "rms_norm_backward",
    "l2_normalize_backward",
    "silu_backward",
    "sigmoid_backward",
    "softplus_backward",
    "sigmoid_log_gate_backward",
    "short_conv_backward",
    "mlp_backward",
    "embedding_backward",
    "residual_block_backward",
]


# ---------------------------------------------------------------------------- checks

def _eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a positive finite number, got {eps!r}")
    return float(eps)


def _features(x, name: str, *, min_ndim: int = 1, finite: bool = True) -> np.ndarray:
    """``x`` as a float array with at least ``min_ndim`` axes and a non-empty feature axis.

    ``finite=False`` leaves the check for NaN and infinity to :func:`_finite_result`.
    """
    arr = as_float_array(x, name, allow_nonfinite=not finite)
    if arr.ndim < min_ndim:
        raise ValueError(f"{name}: expected an array with at least {min_ndim} axes "
                         f"(..., {'T, ' if min_ndim == 2 else ''}d), got shape {arr.shape}")
    if arr.shape[-1] < 1:
        raise ValueError(f"{name}: expected at least one feature on the last axis, got shape {arr.shape}")
    return arr


def _finite_result(out: np.ndarray, *inputs) -> np.ndarray:
    """Return ``out``; if it holds NaN or infinity, raise naming the input that brought them.

    For the products with a weight matrix: a NaN or infinity in an input reaches
    the output, so checking the (smaller) output first spares checking every
    weight at every call, which for one decoded token costs as much as the
    product itself. ``inputs`` are ``(name, array)`` pairs, checked only when the
    output is not finite; if all are finite the overflow is the arithmetic's, and
    ``out`` is returned as it is.
    """
    if np.isfinite(out).all():
        return out
    for name, arr in inputs:
        as_float_array(arr, name)
    return out


def _weight_vector(weight, name: str, d: int, what: str) -> np.ndarray:
    w = as_float_array(weight, name, ndim=1)
    check_dim(w, name, 0, d, what)
    return w


def _grad(d_out, name: str, shape: tuple) -> np.ndarray:
    """``d_out`` as a float array of the forward output's ``shape``, or a ``ValueError``."""
    g = as_float_array(d_out, name)
    if g.shape != tuple(shape):
        raise ValueError(f"{name}: expected the shape of the forward output, {tuple(shape)}, got shape {g.shape}")
    return g


def _rows(a: np.ndarray) -> np.ndarray:
    """``a`` ``(..., d)`` as a matrix ``(n, d)`` of its rows."""
    return a.reshape(-1, a.shape[-1])


# ---------------------------------------------------------------------------- activations

def sigmoid(x):
    """The logistic function ``1 / (1 + e^{-x})``, computed without overflow.

    Any shape in, the same shape out. Gates in ``(0, 1)`` (``beta`` of the
    delta rule, output gates) are sigmoids of projections.
    """
    return expit(as_float_array(x, "x"))


def silu(x):
    """SiLU (swish): ``x * sigmoid(x)``. Any shape in, the same shape out."""
    x = as_float_array(x, "x")
    return x * expit(x)


def softplus(x):
    """``softplus(x) = log(1 + e^x)``, computed without overflow (``np.logaddexp(0, x)``).

    Mamba's step size is ``delta = softplus(raw + bias)`` (equation
    ``eq-ssm-selective``): positive, but for ``x`` below about -745 (float64) it underflows
    to 0. Any shape in, the same shape out.
    """
    return np.logaddexp(0.0, as_float_array(x, "x"))


def sigmoid_backward(x, d_out):
    """Gradient through :func:`sigmoid`: ``d_out * s (1 - s)`` with ``s = sigmoid(x)`` (``eq-tr-act-grads``).

    ``x`` and ``d_out`` of one shape; returns the gradient with respect to ``x``.
    """
    s = sigmoid(x)
    return _grad(d_out, "d_out", s.shape) * s * (1 - s)


def silu_backward(x, d_out):
    """Gradient through :func:`silu`: ``d_out * (s + x s (1 - s))``, ``s = sigmoid(x)`` (``eq-tr-act-grads``).

    ``x`` and ``d_out`` of one shape; returns the gradient with respect to ``x``.
    """
    x = as_float_array(x, "x")
    return kn.silu_grad(x, expit(x), _grad(d_out, "d_out", x.shape))


def softplus_backward(x, d_out):
    """Gradient through :func:`softplus`: ``d_out * sigmoid(x)`` (``eq-tr-act-grads``).

    ``x`` and ``d_out`` of one shape; returns the gradient with respect to ``x``.
    """
    s = sigmoid(x)
    return _grad(d_out, "d_out", s.shape) * s


def inverse_softplus(y):
    """``softplus^{-1}(y) = log(e^y - 1)``, written ``y + log(-expm1(-y))`` so that a large ``y`` cannot overflow.

    A step size ``delta = softplus(raw + dt_bias)`` starts at a chosen ``delta_0``
    when ``dt_bias = inverse_softplus(delta_0)`` (Mamba's initialisation of
    ``dt_bias``, and chapter 9's ``ssd_dt_init``). ``y`` ``> 0``, any shape; the same shape out.
    """
    y = as_float_array(y, "y")
    if np.any(y <= 0):
        raise ValueError(f"y: expected positive values (softplus is positive), got a minimum of {float(y.min())!r}")
    return y + np.log(-np.expm1(-y))


# ---------------------------------------------------------------------------- gate forms

def sigmoid_log_gate(z):
    """The log of a sigmoid gate, ``log sigmoid(z) = -softplus(-z)``: a log-decay ``<= 0``, with no overflow.

    The toy stacks of chapters 6 and 9 (:mod:`fixedstate.hybrid`,
    :mod:`fixedstate.training`) gate their Gated DeltaNet layers with the decay
    ``g = sigmoid(z)``, ``z`` a projection of the token plus a bias; the cores take
    it as ``log_gate = log g``. Any shape in, the same shape out.
    """
    return -softplus(-as_float_array(z, "z"))


def sigmoid_log_gate_backward(z, d_out):
    """Gradient through :func:`sigmoid_log_gate`: ``d_out * sigmoid(-z)`` (``eq-tr-act-grads``).

    The derivative of ``-softplus(-z)`` is ``sigmoid(-z)``, which is
    :func:`softplus_backward` at ``-z``. ``z`` and ``d_out`` of one shape.
    """
    return softplus_backward(-as_float_array(z, "z"), d_out)


def softplus_log_gate(raw, A_log, dt_bias):
    """The log-decay of the shipped gated layers: ``-exp(A_log) * softplus(raw + dt_bias)`` (``eq-sl-gate``).

    Qwen3-Next's Gated DeltaNet (one per value head), Kimi Linear's KDA (one per
    key channel) and Mamba-2 (``a * delta`` with ``a = -exp(A_log)`` and
    ``delta = softplus(dt + dt_bias)``) all compute this. It is ``<= 0`` and
    unbounded below. ``raw`` ``(..., n)``; ``A_log`` and ``dt_bias`` broadcast
    against it (``(n,)``). Returns ``raw``'s shape.
    """
    raw = as_float_array(raw, "raw")
    A_log = as_float_array(A_log, "A_log")
    dt_bias = as_float_array(dt_bias, "dt_bias")
    try:
        np.broadcast_shapes(raw.shape, A_log.shape, dt_bias.shape)
    except ValueError:
        raise ValueError(f"A_log, dt_bias: expected shapes that broadcast against raw {raw.shape}, "
                         f"got {A_log.shape} and {dt_bias.shape}") from None
    return -np.exp(A_log) * softplus(raw + dt_bias)


# ---------------------------------------------------------------------------- projections

def linear(x, weight, bias=None):
    """A projection, ``x @ weight + bias``.

    Parameters
    ----------
    x : ``(..., d_in)``
    weight : ``(d_in, d_out)`` (the transpose of PyTorch's ``nn.Linear.weight``)
    bias : ``(d_out,)`` or None

    Returns
    -------
    ``(..., d_out)``
    """
    x = _features(x, "x", finite=False)
    w = as_float_array(weight, "weight", ndim=2, allow_nonfinite=True)
    check_dim(w, "weight", 0, x.shape[-1], "d_in, the last axis of x")
    with np.errstate(invalid="ignore"):  # NaN from a non-finite input: reported below, by name
        out = x @ w
    if bias is not None:
        out = out + _weight_vector(bias, "bias", w.shape[1], "d_out, the second axis of weight")
    return _finite_result(out, ("x", x), ("weight", w))


def linear_backward(x, weight, d_out):
    """Gradients of :func:`linear` (``eq-tr-linear-grad``): ``(dx, dweight, dbias)``.

    ``dx = d_out W^T``, ``dweight = X^T d_out`` and ``dbias`` the sum of ``d_out``
    over every leading axis (rows of all sequences in the batch share the weight).

    Parameters
    ----------
    x : ``(..., d_in)``
    weight : ``(d_in, d_out)``
    d_out : ``(..., d_out)``, the gradient with respect to the output

    Returns
    -------
    dx ``(..., d_in)``, dweight ``(d_in, d_out)``, dbias ``(d_out,)``
    """
    x = _features(x, "x")
    w = as_float_array(weight, "weight", ndim=2)
    check_dim(w, "weight", 0, x.shape[-1], "d_in, the last axis of x")
    g = _grad(d_out, "d_out", x.shape[:-1] + (w.shape[1],))
    return (*kn.linear_grad(x, w, g), _rows(g).sum(axis=0))


def mlp(x, W_1, W_2):
    """The SiLU MLP of a block: ``silu(x @ W_1) @ W_2``, with no residual inside.

    A pre-norm block adds it to its input: ``x + mlp(rms_norm(x), W_1, W_2)``.

    Parameters
    ----------
    x : ``(..., d)``
    W_1 : ``(d, d_ff)``
    W_2 : ``(d_ff, d)`` (any output width ``(d_ff, d_out)``)

    Returns
    -------
    ``(..., d_out)``
    """
    x = _features(x, "x", finite=False)
    w1 = as_float_array(W_1, "W_1", ndim=2, allow_nonfinite=True)
    w2 = as_float_array(W_2, "W_2", ndim=2, allow_nonfinite=True)
    check_dim(w1, "W_1", 0, x.shape[-1], "d, the last axis of x")
    check_dim(w2, "W_2", 0, w1.shape[1], "d_ff, the second axis of W_1")
    return _mlp(x, w1, w2)[0]


def _mlp(x, w1, w2):
    """:func:`mlp` on checked arrays: ``(out, inner)``, ``inner`` the values :func:`fixedstate.kernels.mlp_grad`
    reuses (the residual block keeps them rather than recompute them)."""
    with np.errstate(invalid="ignore"):  # NaN from a non-finite input: reported below, by name
        out, inner = kn.mlp_parts(x, w1, w2)
    return _finite_result(out, ("x", x), ("W_1", w1), ("W_2", w2)), inner


def mlp_backward(x, W_1, W_2, d_out):
    """Gradients of :func:`mlp` (``eq-tr-mlp-grad``): ``(dx, dW_1, dW_2)``.

    The chain rule through ``u = x W_1``, ``h = silu(u)``, ``y = h W_2``: it
    composes :func:`linear_backward` and :func:`silu_backward`.

    Parameters
    ----------
    x : ``(..., d)``; W_1 : ``(d, d_ff)``; W_2 : ``(d_ff, d_out)``
    d_out : ``(..., d_out)``

    Returns
    -------
    dx ``(..., d)``, dW_1 ``(d, d_ff)``, dW_2 ``(d_ff, d_out)``
    """
    x = _features(x, "x")
    w1 = as_float_array(W_1, "W_1", ndim=2)
    w2 = as_float_array(W_2, "W_2", ndim=2)
    check_dim(w1, "W_1", 0, x.shape[-1], "d, the last axis of x")
    check_dim(w2, "W_2", 0, w1.shape[1], "d_ff, the second axis of W_1")
    g = _grad(d_out, "d_out", x.shape[:-1] + (w2.shape[1],))
    _, inner = _mlp(x, w1, w2)
    return kn.mlp_grad(x, inner, w1, w2, g)


def embedding(tokens, table):
    """Token ids to vectors: row ``tokens[...]`` of ``table``.

    Parameters
    ----------
    tokens : integer array ``(...)``, every id in ``[0, vocab_size)``
    table : ``(vocab_size, d)``; the rows looked up must be finite

    Returns
    -------
    ``(..., d)``, the dtype of ``table``
    """
    ids = np.asarray(tokens)
    if ids.dtype == bool or ids.dtype.kind not in "iu":
        raise ValueError(f"tokens: expected an integer array of token ids, got dtype {ids.dtype}")
    tab = as_float_array(table, "table", ndim=2, allow_nonfinite=True)
    if ids.size and (ids.min() < 0 or ids.max() >= tab.shape[0]):
        raise ValueError(f"tokens: expected ids in [0, {tab.shape[0]}) (the rows of table), got values "
                         f"in [{int(ids.min())}, {int(ids.max())}]")
    out = tab[ids]
    if not np.isfinite(out).all():
        raise ValueError("table: expected finite values in the rows looked up, got NaN or infinity")
    return out


def embedding_backward(tokens, table, d_out):
    """Gradient of :func:`embedding` with respect to the table (``eq-tr-embedding-grad``).

    Row ``i`` of the result is the sum of ``d_out`` over every position whose
    token is ``i`` (zero for tokens that do not occur).

    Parameters
    ----------
    tokens : integer array ``(...)``; table : ``(vocab_size, d)``
    d_out : ``(..., d)``

    Returns
    -------
    dtable ``(vocab_size, d)``
    """
    out = embedding(tokens, table)
    g = _grad(d_out, "d_out", out.shape)
    dtable = np.zeros(np.shape(table), dtype=np.result_type(out, g))
    np.add.at(dtable, np.asarray(tokens).ravel(), _rows(g))
    return dtable


# ---------------------------------------------------------------------------- norms

def rms_norm(x, weight=None, *, eps=1e-6):
    """RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight`` over the last axis.

    Parameters
    ----------
    x : ``(..., d)``
    weight : ``(d,)`` or None (no scaling)
    eps : positive, added to the mean square

    Returns
    -------
    ``(..., d)``
    """
    x = _features(x, "x")
    eps = _eps(eps)
    out, _ = kn.rms_norm_parts(x, eps)
    if weight is not None:
        out = out * _weight_vector(weight, "weight", x.shape[-1], "d, the last axis of x")
    return out


def rms_norm_backward(x, d_out, weight=None, *, eps=1e-6):
    """Gradients of :func:`rms_norm` (``eq-tr-rms-grad``): ``(dx, dweight)``.

    With ``r = 1 / sqrt(mean(x^2) + eps)`` and ``g = d_out * weight``:
    ``dx = r g - r^3 x mean(g x)``; ``dweight`` sums ``d_out * x r`` over the
    leading axes (None when ``weight`` is None).

    Parameters
    ----------
    x : ``(..., d)``; d_out : ``(..., d)``; weight : ``(d,)`` or None; eps : positive

    Returns
    -------
    dx ``(..., d)``, dweight ``(d,)`` or None
    """
    x = _features(x, "x")
    normed, r = kn.rms_norm_parts(x, _eps(eps))
    g = _grad(d_out, "d_out", x.shape)
    w = None if weight is None else _weight_vector(weight, "weight", x.shape[-1], "d, the last axis of x")
    return kn.rms_norm_grad(normed, r, g, w)


def gated_rms_norm(x, z, weight=None, *, eps=1e-6, norm_before_gate=True):
    """RMSNorm with a SiLU gate: ``rms_norm(x, weight) * silu(z)``.

    The output norm of a Gated DeltaNet layer (Qwen3-Next's ``RMSNormGated``):
    normalise the core's output ``x``, then multiply by ``silu(z)`` with ``z`` a
    projection of the layer's input. With ``norm_before_gate=False`` the gate
    comes first, ``rms_norm(x * silu(z), weight)``: the default of Mamba-2's
    gated norm (``mamba_ssm``'s ``RMSNormGated``, ``norm_before_gate=False``).

    Parameters
    ----------
    x : ``(..., d)``
    z : ``(..., d)``, leading axes broadcasting with those of ``x``
    weight : ``(d,)`` or None
    eps : positive
    norm_before_gate : bool

    Returns
    -------
    ``(..., d)`` with the broadcast leading axes
    """
    x = _features(x, "x")
    z = _features(z, "z")
    check_dim(z, "z", -1, x.shape[-1], "d, the last axis of x")
    broadcast_leading(("x", x, 1), ("z", z, 1))
    if not isinstance(norm_before_gate, (bool, np.bool_)):
        raise ValueError(f"norm_before_gate: expected True or False, got {norm_before_gate!r}")
    gate = z * expit(z)
    if norm_before_gate:
        return rms_norm(x, weight, eps=eps) * gate
    return rms_norm(x * gate, weight, eps=eps)


def l2_normalize(x, *, eps=1e-6):
    """Unit length along the last axis: ``x / sqrt(sum(x^2) + eps)``.

    The form of ``flash-linear-attention``'s and Qwen3-Next's ``l2norm`` (the
    ``eps`` sits inside the square root, so a zero vector stays zero). Keys
    of the delta-rule family are normalised so that the erase factor
    ``I - beta k k^T`` only shrinks.

    ``x`` ``(..., d)``; returns ``(..., d)``.
    """
    x = _features(x, "x")
    return kn.l2_normalize_parts(x, _eps(eps))[0]


def l2_normalize_backward(x, d_out, *, eps=1e-6):
    """Gradient of :func:`l2_normalize` (``eq-tr-l2-grad``).

    With ``r = 1 / sqrt(sum(x^2) + eps)`` and ``y = r x``:
    ``dx = r (d_out - y (y . d_out))``, the part of ``d_out`` orthogonal to
    ``y``, scaled (exactly orthogonal only when ``eps = 0``).

    ``x`` and ``d_out`` ``(..., d)``; returns ``dx`` ``(..., d)``.
    """
    x = _features(x, "x")
    y, r = kn.l2_normalize_parts(x, _eps(eps))
    return kn.l2_normalize_grad(y, r, _grad(d_out, "d_out", x.shape))


# ---------------------------------------------------------------------------- short convolution

def _conv_args(x, weight, initial_state, bias, *, token: bool):
    x = _features(x, "x", min_ndim=1 if token else 2)
    d = x.shape[-1]
    w = as_float_array(weight, "weight", ndim=2)
    check_dim(w, "weight", 0, d, "d, the channels (last axis) of x")
    K = w.shape[1]
    if K < 1:
        raise ValueError(f"weight: expected at least one tap, shape (d, K) with K >= 1, got shape {w.shape}")
    core = 1 if token else 2
    lead = x.shape[:x.ndim - core]
    if initial_state is None:
        state = np.zeros(lead + (K - 1, d), dtype=np.result_type(x, w))
    else:
        state = as_float_array(initial_state, "initial_state")
        if state.ndim < 2 or state.shape[-2:] != (K - 1, d):
            raise ValueError(f"initial_state: expected shape (..., K-1, d) = (..., {K - 1}, {d}) "
                             f"(the last K-1 inputs), got shape {state.shape}")
        lead = broadcast_leading(("x", x, core), ("initial_state", state, 2))
    b = None if bias is None else _weight_vector(bias, "bias", d, "d, the channels of x")
    x = np.broadcast_to(x, lead + x.shape[x.ndim - core:])
    state = np.broadcast_to(state, lead + state.shape[-2:])
    return x, w, state, b


def short_conv(x, weight, *, initial_state=None, bias=None, mask=None):
    """Depthwise causal convolution over the last ``K`` tokens, one filter per channel.

    ``y_t[c] = sum_{j=0}^{K-1} weight[c, j] x_{t-K+1+j}[c] (+ bias[c])``: the last
    tap ``weight[:, K-1]`` multiplies the current token, as in PyTorch's
    ``conv1d`` with ``K - 1`` zeros padded on the left (``causal_conv1d_fn``).
    Tokens before the sequence are the rows of ``initial_state`` (zeros when it
    is None). Real layers apply SiLU to the result; this part does not.

    Parameters
    ----------
    x : ``(..., T, d)``
    weight : ``(d, K)``, ``K >= 1`` (Mamba and Gated DeltaNet use ``K = 4``)
    initial_state : ``(..., K-1, d)`` or None: the ``K - 1`` inputs before ``x``,
        oldest first; leading axes broadcast with those of ``x``
    bias : ``(d,)`` or None (Mamba's convolution has one, Qwen3-Next's not)
    mask : ``(..., T)`` booleans or None: True at real tokens, False at padding.
        The padded inputs are zeroed before the convolution and the outputs there
        after it, as the libraries' padding masks do. With the padding on the left
        (batched generation), each real token sees zeros before its sequence, as
        if it ran alone from an empty cache, and the returned cache is its own.

    Returns
    -------
    (y, conv_state) : ``y`` ``(..., T, d)``; ``conv_state`` ``(..., K-1, d)``, the
        last ``K - 1`` inputs (of ``initial_state`` followed by ``x``), the
        decode cache that :func:`short_conv_step` continues from.
    """
    x, w, state, b = _conv_args(x, weight, initial_state, bias, token=False)
    K, T = w.shape[1], x.shape[-2]
    keep = None
    if mask is not None:
        keep = np.asarray(mask)
        if keep.dtype != bool or keep.shape[-1:] != (T,):
            raise ValueError(f"mask: expected booleans of shape (..., T) with T={T} (True at real tokens), "
                             f"got {keep.dtype} of shape {keep.shape}")
        try:
            keep = np.broadcast_to(keep[..., None], x.shape)
        except ValueError:
            raise ValueError(f"mask: expected leading axes that broadcast with x's {x.shape[:-2]}, "
                             f"got shape {np.shape(mask)}") from None
        x = np.where(keep, x, 0.0).astype(x.dtype, copy=False)
    padded = np.concatenate([state, x], axis=-2)  # (..., K-1+T, d)
    y = kn.conv_taps(w, padded, T)
    if b is not None:
        y = y + b
    if keep is not None:
        y = np.where(keep, y, 0.0).astype(y.dtype, copy=False)
    return y, padded[..., T:, :].copy()


def short_conv_backward(x, weight, d_y, *, initial_state=None, bias=None, d_final_state=None):
    """Gradients of :func:`short_conv` (``eq-tr-conv-grad``): ``(dx, dweight, dbias, d_initial_state)``.

    Tap ``j`` multiplied token ``t - K + 1 + j`` into output ``t``, so it sends
    ``weight[:, j] * d_y_t`` back to that token, and its weight gathers
    ``d_y_t * x_{t-K+1+j}`` over every token and sequence. ``d_final_state`` (the
    gradient with respect to the returned ``conv_state``, default zeros) flows
    back to the last ``K - 1`` inputs.

    Parameters
    ----------
    x : ``(..., T, d)``; weight : ``(d, K)``
    d_y : ``(..., T, d)``, the gradient with respect to ``y``
    initial_state : ``(..., K-1, d)`` or None; bias : ``(d,)`` or None
    d_final_state : ``(..., K-1, d)`` or None

    Returns
    -------
    dx with the shape of ``x``, dweight ``(d, K)``, dbias ``(d,)`` (None when ``bias``
    is None), d_initial_state with the shape of ``initial_state`` (when it is None: the
    leading axes of ``x``, ``(..., K-1, d)``)
    """
    x_shape = np.shape(x)
    state_shape = None if initial_state is None else np.shape(initial_state)
    x, w, state, _ = _conv_args(x, weight, initial_state, bias, token=False)
    K, T = w.shape[1], x.shape[-2]
    # d_y and d_final_state have the shapes of the forward's output and cache (the forward need not run)
    g = _grad(d_y, "d_y", x.shape)
    padded = np.concatenate([state, x], axis=-2)
    d_padded = np.zeros(padded.shape, dtype=np.result_type(padded, g))
    if d_final_state is not None:
        d_padded[..., T:, :] += _grad(d_final_state, "d_final_state", state.shape)
    d_padded, dweight = kn.conv_grad(w, padded, g, T, d_padded)
    dbias = None if bias is None else _rows(g).sum(axis=0)
    dx, d_state = d_padded[..., K - 1:, :], d_padded[..., :K - 1, :]
    # Each gradient has its input's shape: summed over the axes the forward broadcast it along.
    dx = sum_to(dx, x_shape)
    if state_shape is not None:
        d_state = sum_to(d_state, state_shape)
    return dx, dweight, dbias, d_state


def short_conv_step(x, weight, *, initial_state=None, bias=None):
    """One token of :func:`short_conv`: the decode step with its cache.

    Parameters
    ----------
    x : ``(..., d)``, one token
    weight : ``(d, K)``
    initial_state : ``(..., K-1, d)`` or None (zeros): the last ``K - 1`` inputs
    bias : ``(d,)`` or None

    Returns
    -------
    (y, conv_state) : ``y`` ``(..., d)``; ``conv_state`` ``(..., K-1, d)``, the
        cache shifted by one token with ``x`` as its newest row.
    """
    x, w, state, b = _conv_args(x, weight, initial_state, bias, token=True)
    window = np.concatenate([state, x[..., None, :]], axis=-2)  # (..., K, d)
    y = np.sum(w.T * window, axis=-2)
    if b is not None:
        y = y + b
    return y, window[..., 1:, :].copy()


# ---------------------------------------------------------------------------- the residual block

def residual_block(x, mixer, W_1=None, W_2=None, *, norm_mixer=None, norm_mlp=None, eps=1e-6):
    """The pre-norm residual block of every stack in the book, around any token mixer.

    ``x_mid = x + mixer(rms_norm(x, norm_mixer))``, then, when the block has an
    MLP (``W_1`` given), ``y = x_mid + mlp(rms_norm(x_mid, norm_mlp), W_1, W_2)``
    (``eq-tr-model``); without one, ``y = x_mid``. The residual stream is never
    normalised itself: each branch reads a normalised copy and adds back.

    Parameters
    ----------
    x : ``(..., d)``, one token or a sequence
    mixer : a function ``u -> (m, saved)``: the token mixer (its projections, core
        and output projection) applied to the normalised input ``u``, returning
        its output ``m`` ``(..., d)`` and whatever its backward pass needs
    W_1, W_2 : the MLP's matrices (:func:`mlp`), or None for a block without one
    norm_mixer, norm_mlp : RMSNorm weights ``(d,)`` or None (no scaling)

    Returns
    -------
    y ``(..., d)`` and ``saved``, the dict :func:`residual_block_backward` reads
    (the mixer's own under ``"mixer"``)
    """
    if not callable(mixer):
        raise ValueError(f"mixer: expected a function u -> (output, saved), got {type(mixer).__name__}")
    if (W_1 is None) != (W_2 is None):
        raise ValueError("W_1, W_2: expected both (a block with an MLP) or neither, got one of them")
    # rms_norm and mlp with the values their backward passes need kept in ``saved`` (the same arithmetic)
    x = _features(x, "x")
    eps = _eps(eps)
    u, u_parts = _kept_rms_norm(x, norm_mixer, eps)
    m, mixer_saved = mixer(u)
    x_mid = x + m
    saved = {"x": x, "u": u, "x_mid": x_mid, "mixer": mixer_saved, "u_parts": u_parts}
    if W_1 is None:
        return x_mid, saved
    x_mid = _features(x_mid, "x")
    saved["h"], saved["h_parts"] = _kept_rms_norm(x_mid, norm_mlp, eps)
    w1 = as_float_array(W_1, "W_1", ndim=2, allow_nonfinite=True)
    w2 = as_float_array(W_2, "W_2", ndim=2, allow_nonfinite=True)
    check_dim(w1, "W_1", 0, x_mid.shape[-1], "d, the last axis of x")
    check_dim(w2, "W_2", 0, w1.shape[1], "d_ff, the second axis of W_1")
    out, saved["mlp_inner"] = _mlp(saved["h"], w1, w2)
    return x_mid + out, saved


def _kept_rms_norm(x, weight, eps):
    """:func:`rms_norm` of a checked ``x``: ``(out, (normed, r))``, the parts its gradient reuses."""
    normed, r = kn.rms_norm_parts(x, eps)
    if weight is None:
        return normed, (normed, r)
    return normed * _weight_vector(weight, "weight", x.shape[-1], "d, the last axis of x"), (normed, r)


def _kept_rms_norm_backward(parts, d_out, weight, shape):
    """:func:`rms_norm_backward` from the parts :func:`_kept_rms_norm` kept."""
    w = None if weight is None else _weight_vector(weight, "weight", shape[-1], "d, the last axis of x")
    return kn.rms_norm_grad(*parts, _grad(d_out, "d_out", shape), w)


def residual_block_backward(saved, d_out, mixer_backward, W_1=None, W_2=None, *, norm_mixer=None,
                            norm_mlp=None, eps=1e-6):
    """Gradients of :func:`residual_block` (``eq-tr-model``): ``(dx, grads)``.

    Each residual connection passes ``d_out`` through unchanged and adds its
    branch's gradient: the MLP's (:func:`mlp_backward`, :func:`rms_norm_backward`, computed
    from the inner values the forward kept in ``saved`` rather than recomputed), then the mixer's, ``mixer_backward(saved["mixer"], d_m) -> du`` (the
    gradient with respect to the normalised input ``u``; it records the mixer's
    own weight gradients itself). ``grads`` holds ``W_1``, ``W_2``, ``norm_mixer``
    and ``norm_mlp`` (None where the block has no such weight).
    """
    if not isinstance(saved, dict) or "mixer" not in saved or "u_parts" not in saved:
        raise ValueError(f"saved: expected the dict residual_block returned, got {type(saved).__name__}"
                         f"{'' if not isinstance(saved, dict) else ' with keys ' + str(sorted(saved))}")
    _eps(eps)                                   # (the forward's eps: its parts are kept in saved)
    grads = {"W_1": None, "W_2": None, "norm_mlp": None}
    dx = _grad(d_out, "d_out", np.shape(saved["x_mid"]))
    if W_1 is not None:
        if "mlp_inner" not in saved:
            raise ValueError("W_1, W_2: expected none for a block that ran without an MLP, got them")
        h = saved["h"]
        w1 = as_float_array(W_1, "W_1", ndim=2)
        w2 = as_float_array(W_2, "W_2", ndim=2)
        check_dim(w1, "W_1", 0, h.shape[-1], "d, the last axis of x")
        check_dim(w2, "W_2", 0, w1.shape[1], "d_ff, the second axis of W_1")
        dh, grads["W_1"], grads["W_2"] = kn.mlp_grad(h, saved["mlp_inner"], w1, w2, dx)
        dx_mid, grads["norm_mlp"] = _kept_rms_norm_backward(saved["h_parts"], dh, norm_mlp, h.shape)
        dx = dx + dx_mid
    du = mixer_backward(saved["mixer"], dx)
    dx_in, grads["norm_mixer"] = _kept_rms_norm_backward(saved["u_parts"], du, norm_mixer, saved["x"].shape)
    return dx + dx_in, grads
