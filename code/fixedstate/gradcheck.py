"""Checking a backward pass against central finite differences (chapter 9, "Backward passes").

A backward pass is checked on the scalar loss ``L = sum_i <W_i, out_i>``, a fixed
random weighting ``W_i`` of each output ``out_i`` of the forward pass: its
gradient with respect to the outputs is ``W_i`` itself, which is what the
backward pass is given as ``d_out`` (and ``d_final_state``). For each input
``x`` the numerical gradient is the central difference

    dL/dx[j] ~ (L(x + h e_j) - L(x - h e_j)) / (2 h),

one entry at a time, and the error is reported relative to the size of the
gradient, ``max_j |g[j] - g_fd[j]| / max_j |g_fd[j]|`` (a norm-wise relative
error, which does not blow up at entries that happen to be near zero). In
float64 with ``h = 1e-6`` the difference quotient itself is accurate to about
``1e-9`` relative for the smooth cores of this book, so a correct backward pass
shows errors far below the chapter's bound of ``1e-6`` and a wrong one shows
errors of order one.

- :func:`random_weights`: seeded ``W`` with the shapes of a forward's outputs;
- :func:`loss`: ``L = sum <W, out>``;
- :func:`numerical_gradient`: the central differences for one input;
- :func:`relative_errors`: one relative error per input;
- :func:`max_relative_error`: the largest of them.
"""

from __future__ import annotations

import numbers

import numpy as np

from ._validate import as_float_array

__all__ = ["random_weights", "loss", "numerical_gradient", "relative_errors", "max_relative_error"]


def _as_outputs(out) -> tuple:
    """The forward's result as a tuple of arrays (a single array becomes a 1-tuple)."""
    if isinstance(out, (tuple, list)):
        return tuple(np.asarray(o) for o in out)
    return (np.asarray(out),)


def _check_inputs(inputs) -> dict:
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError(f"inputs: expected a non-empty dict from argument names to arrays, got "
                         f"{type(inputs).__name__}")
    return {name: as_float_array(x, f"inputs[{name!r}]") for name, x in inputs.items()}


def _check_step(step) -> float:
    if isinstance(step, bool) or not isinstance(step, numbers.Real) or not 0 < step < 1:
        raise ValueError(f"step: expected a number in (0, 1), got {step!r}")
    return float(step)


def random_weights(outputs, seed=0) -> tuple:
    """Seeded standard-normal weights ``W``, one float64 array per output, with the outputs' shapes."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(o.shape) for o in _as_outputs(outputs))


def loss(outputs, weights) -> float:
    """``L = sum_i <W_i, out_i>`` in float64: the scalar whose gradient the checks compare."""
    outs = _as_outputs(outputs)
    weights = _as_outputs(weights)
    if len(outs) != len(weights):
        raise ValueError(f"weights: expected one array per output ({len(outs)}), got {len(weights)}")
    total = 0.0
    for i, (o, w) in enumerate(zip(outs, weights)):
        if o.shape != w.shape:
            raise ValueError(f"weights: expected weights[{i}] of the output's shape {o.shape}, got {w.shape}")
        total += float(np.sum(w.astype(np.float64) * o.astype(np.float64)))
    return total


def numerical_gradient(f, inputs, name, weights, *, step=1e-6) -> np.ndarray:
    """The central-difference gradient of ``L = loss(f(**inputs), weights)`` with respect to ``inputs[name]``.

    ``f`` is called as ``f(**inputs)`` with one entry of ``inputs[name]`` moved by
    ``+step`` and ``-step`` at a time (``2 n`` calls for an input of ``n`` entries);
    the inputs passed in are not modified.
    """
    if not callable(f):
        raise ValueError(f"f: expected a callable returning the forward's outputs, got {f!r}")
    inputs = _check_inputs(inputs)
    if name not in inputs:
        raise ValueError(f"name: expected one of {sorted(inputs)}, got {name!r}")
    step = _check_step(step)
    x = inputs[name].astype(np.float64)
    grad = np.empty_like(x)
    for j in np.ndindex(*x.shape):
        values = []
        for sign in (1.0, -1.0):
            moved = x.copy()
            moved[j] += sign * step
            values.append(loss(f(**{**inputs, name: moved}), weights))
        grad[j] = (values[0] - values[1]) / (2 * step)
    return grad


def relative_errors(f, inputs, grads, weights, *, step=1e-6) -> dict:
    """For each input named in ``grads``: ``max |g - g_fd| / max |g_fd|``, the relative error of a backward pass.

    Parameters
    ----------
    f : callable, ``f(**inputs)`` returns the forward's output or a tuple of outputs
    inputs : dict, argument name -> array (float64 for a meaningful check)
    grads : dict, argument name -> the backward pass's gradient of
        ``L = sum <W, out>`` with respect to that argument (same shape)
    weights : the ``W``, one array per output (see :func:`random_weights`)
    step : the finite-difference step ``h``

    Returns
    -------
    dict name -> relative error (``0.0`` when both gradients are exactly zero).
    """
    inputs = _check_inputs(inputs)
    if not isinstance(grads, dict) or not grads:
        raise ValueError(f"grads: expected a non-empty dict from argument names to gradients, got "
                         f"{type(grads).__name__}")
    errors = {}
    for name, g in grads.items():
        if name not in inputs:
            raise ValueError(f"grads: gradient for {name!r}, which is not one of the inputs {sorted(inputs)}")
        g = as_float_array(g, f"grads[{name!r}]").astype(np.float64)
        if g.shape != inputs[name].shape:
            raise ValueError(f"grads: expected grads[{name!r}] of the input's shape {inputs[name].shape}, "
                             f"got {g.shape}")
        fd = numerical_gradient(f, inputs, name, weights, step=step)
        size = float(np.max(np.abs(fd), initial=0.0))
        diff = float(np.max(np.abs(g - fd), initial=0.0))
        errors[name] = 0.0 if diff == 0.0 else diff / max(size, np.finfo(np.float64).tiny)
    return errors


def max_relative_error(f, inputs, grads, weights, *, step=1e-6) -> float:
    """The largest of :func:`relative_errors`: one number per backward pass, for a test or a cell."""
    return max(relative_errors(f, inputs, grads, weights, step=step).values())
