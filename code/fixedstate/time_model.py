"""The two-point model of time per token of a hybrid stack (chapter "Hybrid models", chap-hybrids).

Decoding one token costs a fixed part (reading the weights) and a part that grows
with the context (reading the KV cache of the attention layers):
``t(L) = a + b L`` (equation ``eq-hy-time-model``).

- :func:`fit_time_model`: the line through two measured throughputs;
- :func:`predicted_tokens_per_second`, :func:`attention_time_share`: what the line
  predicts at other lengths;
- :func:`all_attention_time_model`: its extrapolation to an all-attention twin of the
  same shape, scaled by the cost model of :mod:`fixedstate.hybrid`.
"""

from __future__ import annotations

import numbers

import numpy as np

from ._validate import as_float_array
from .hybrid import HybridConfig, all_attention, check_config, prefill_flops_per_token, stack_kv_cache_bytes

__all__ = ["fit_time_model", "predicted_tokens_per_second", "attention_time_share", "all_attention_time_model"]


def fit_time_model(context_lengths, tokens_per_second) -> tuple[float, float]:
    """Fit ``t(L) = a + b L`` through two measurements, equation ``eq-hy-time-model``.

    ``context_lengths``: two distinct positive lengths ``(L_1, L_2)``;
    ``tokens_per_second``: the two measured throughputs. The time per token is
    the reciprocal of the throughput, ``t_i = 1 / r_i``; the line through the two
    points has slope ``b = (t_2 - t_1) / (L_2 - L_1)`` (seconds per token of
    context) and intercept ``a = t_1 - b L_1`` (seconds). Returns ``(a, b)``.
    """
    lengths = as_float_array(context_lengths, "context_lengths", ndim=1, shape=(2,))
    rates = as_float_array(tokens_per_second, "tokens_per_second", ndim=1, shape=(2,))
    if np.any(lengths <= 0):
        raise ValueError(f"context_lengths: expected positive lengths, got {lengths.tolist()}")
    if lengths[0] == lengths[1]:
        raise ValueError(f"context_lengths: expected two different lengths, got {lengths.tolist()}")
    if np.any(rates <= 0):
        raise ValueError(f"tokens_per_second: expected positive throughputs, got {rates.tolist()}")
    t = 1.0 / rates
    b = (t[1] - t[0]) / (lengths[1] - lengths[0])
    a = t[0] - b * lengths[0]
    return float(a), float(b)


def _time_args(a, b, context_len):
    for name, x in (("a", a), ("b", b)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real) or not np.isfinite(x):
            raise ValueError(f"{name}: expected a finite number, got {x!r}")
    length = as_float_array(context_len, "context_len")
    if np.any(length < 0):
        raise ValueError("context_len: expected non-negative lengths")
    t = a + b * length
    if np.any(t <= 0):
        raise ValueError(f"a, b: the model a + b L is not positive at every context_len (a={a}, b={b})")
    return length, t


def predicted_tokens_per_second(a: float, b: float, context_len):
    """Throughput ``1 / (a + b L)`` predicted by the time model ``eq-hy-time-model``.

    ``context_len``: number or array; the result has its shape (float or array).
    """
    _, t = _time_args(a, b, context_len)
    out = 1.0 / t
    return float(out) if np.ndim(out) == 0 else out


def attention_time_share(a: float, b: float, context_len):
    """Share of the time per token that grows with the context, ``b L / (a + b L)``.

    Under the model ``eq-hy-time-model`` this is the time spent reading the KV
    cache in the attention layers. Number or array, like ``context_len``.
    """
    length, t = _time_args(a, b, context_len)
    out = b * length / t
    return float(out) if np.ndim(out) == 0 else out


def all_attention_time_model(config: HybridConfig, a: float, b: float) -> tuple[float, float]:
    """The time model ``eq-hy-time-model`` of an all-attention stack of the same shape.

    From the hybrid's fitted ``(a, b)``, under two stated assumptions: the context
    part is the time to read the KV cache, so ``b`` scales with the KV cache
    (:func:`stack_kv_cache_bytes` of :func:`all_attention` over the hybrid's);
    the fixed part is the time to read the weights used per token, so ``a``
    scales with :func:`prefill_flops_per_token` (two FLOPs per weight).
    Returns ``(a_full, b_full)``. ``ValueError`` if ``config`` has no attention layer.
    """
    c = check_config(config)
    if c.n_attention_layers == 0:
        raise ValueError("config: expected at least one attention layer (an all-linear stack "
                         "has no context term to scale)")
    _time_args(a, b, 0)
    full = all_attention(c)
    kv_ratio = stack_kv_cache_bytes(full, 1) / stack_kv_cache_bytes(c, 1)
    weight_ratio = prefill_flops_per_token(full) / prefill_flops_per_token(c)
    return float(a * weight_ratio), float(b * kv_ratio)
