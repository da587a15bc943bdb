"""Small helpers shared by the backward passes of the cores (chapter 9, "Backward passes").

A forward pass broadcasts its inputs' leading axes together; the gradient with
respect to an input that was broadcast is the sum over the axes it was broadcast
along. :func:`sum_to` performs that sum, so that every gradient has the shape of
its input; :func:`time_major` lays a sequence out token by token for the reverse-time
scans.
"""

from __future__ import annotations

import numpy as np

__all__ = ["sum_to", "time_major"]


def sum_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``grad`` over the axes along which an array of ``shape`` was broadcast to ``grad.shape``."""
    shape = tuple(shape)
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, (n, g) in enumerate(zip(shape, grad.shape)) if n == 1 and g != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return np.ascontiguousarray(grad).reshape(shape)


def time_major(x: np.ndarray, axis: int) -> np.ndarray:
    """A contiguous copy of ``x`` with its time axis ``axis`` (negative, from the end) moved to the front.

    The backward scans read one token's slice per step; from a time-major array that slice is
    contiguous, which makes the small per-step products several times faster.
    """
    return np.ascontiguousarray(np.moveaxis(x, axis, 0))
