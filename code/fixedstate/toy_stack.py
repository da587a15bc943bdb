"""A toy numpy stack of linear and full-attention layers, token by token (chapter "Hybrid models").

What does a hybrid stack do, token by token? A stack with random weights, built
from :mod:`fixedstate.blocks` (each layer a :func:`fixedstate.blocks.residual_block`)
and the mixer table :data:`fixedstate.mixers.MIXERS` (causal softmax attention and
the gated delta rule, by the ids of :mod:`fixedstate.layer_ids`), in any layout:
hybrid, all-attention, all-linear.

- :func:`init_stack`: the weights, named as in :mod:`fixedstate.training`;
- :func:`stack_forward`: the whole sequence at once (softmax attention in its matrix
  form, the gated delta rule in its chunkwise form);
- :func:`stack_decode_step`: one token against a KV cache or a fixed state, and
  :func:`stack_decode`, the step run over a sequence (a test proves it equals
  :func:`stack_forward`); :func:`init_decode_cache`;
- :func:`synthetic_cache`: a cache of a given context length, for
  :func:`fixedstate.timing.measure_decode_seconds` to time one decode step against.

Each core is called once per layer with the heads as a leading axis. Shapes: a
sequence is ``(T, d_model)``, one token per row; a token is ``(d_model,)``. Linear
layers keep one state ``S`` of shape ``(d_k, d_v)`` per head, read out as
``o = S^T q`` (the book's orientation).
"""

from __future__ import annotations

import numpy as np

from . import mixers
from ._validate import as_float_array, check_dim, check_positive_int
from .blocks import l2_normalize, linear, residual_block, sigmoid, sigmoid_log_gate
from .hybrid import check_layout
from .layer_ids import GATED_DELTA, SOFTMAX
from .softmax_attention import KVCache

__all__ = ["init_stack", "stack_forward", "init_decode_cache", "stack_decode_step", "stack_decode",
           "synthetic_cache"]


def init_stack(n_layers: int, d_model: int, n_heads: int, attention_layers, *, d_ff: int = 0,
               seed: int = 0, dtype=np.float64, gate_bias: float = 3.0) -> dict:
    """Random weights for a toy stack of ``n_layers`` pre-norm residual blocks.

    Each block is :func:`fixedstate.blocks.residual_block`: ``x + W_o mix(norm(x))``
    followed, when ``d_ff > 0``, by ``x + mlp(norm(x))`` (:func:`fixedstate.blocks.mlp`,
    ``silu(x W_1) W_2``). Layers in ``attention_layers`` mix with causal softmax
    attention (``n_heads`` heads of width ``d_model / n_heads``); the others with the
    gated delta rule (same heads; keys and queries L2-normalised,
    ``beta = sigmoid(x W_b)`` and the decay ``g = sigmoid(x W_a + b_a)`` with
    ``b_a = gate_bias``, passed as ``log_gate = log g``
    (:func:`fixedstate.blocks.sigmoid_log_gate`), one each per head). Weights are
    Gaussian with variance ``1 / fan_in``.

    Returns a dict with ``n_heads``, ``attention_layers`` (sorted tuple) and
    ``layers``, a list of dicts: ``"layer_id"`` (``"softmax"`` or ``"gated_delta"``,
    from :mod:`fixedstate.layer_ids`) and the arrays, named as in
    :mod:`fixedstate.training` (``W_q``, ``W_k``, ``W_v``, ``W_o``, ``W_b``, ``W_a``,
    ``b_a``, ``W_1``, ``W_2``). ``ValueError`` if a size is not a positive integer,
    ``n_heads`` does not divide ``d_model`` or a layer index is outside the stack.
    """
    n_layers = check_positive_int(n_layers, "n_layers")
    d_model = check_positive_int(d_model, "d_model")
    n_heads = check_positive_int(n_heads, "n_heads")
    d_ff = check_positive_int(d_ff, "d_ff", minimum=0)
    if d_model % n_heads:
        raise ValueError(f"n_heads: expected a divisor of d_model={d_model} (heads split the "
                         f"width evenly), got {n_heads}")
    layout = check_layout(attention_layers, n_layers)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
    rng = np.random.default_rng(seed)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(dtype)

    layers = []
    for i in range(n_layers):
        layer = {"layer_id": SOFTMAX if i in layout else GATED_DELTA,
                 "W_q": mat(d_model, d_model), "W_k": mat(d_model, d_model),
                 "W_v": mat(d_model, d_model), "W_o": mat(d_model, d_model)}
        if layer["layer_id"] == GATED_DELTA:
            layer["W_b"] = mat(d_model, n_heads)
            layer["W_a"] = mat(d_model, n_heads)
            layer["b_a"] = np.full(n_heads, gate_bias, dtype=dtype)
        if d_ff:
            layer["W_1"] = mat(d_model, d_ff)
            layer["W_2"] = mat(d_ff, d_model)
        layers.append(layer)
    return {"n_heads": n_heads, "d_model": d_model, "attention_layers": layout, "layers": layers}


def _check_stack_params(params) -> dict:
    if not isinstance(params, dict) or "layers" not in params or "n_heads" not in params:
        raise ValueError("params: expected the dict returned by init_stack, got "
                         f"{type(params).__name__}")
    return params


def _split_heads(x, n_heads: int):
    """``(..., H * d_h)`` -> heads first: ``(T, H d_h)`` -> ``(H, T, d_h)``, ``(H d_h,)`` -> ``(H, d_h)``."""
    heads = x.reshape(x.shape[:-1] + (n_heads, -1))
    return heads if x.ndim == 1 else heads.swapaxes(0, 1)


def _merge_heads(o):
    """The inverse of :func:`_split_heads`: ``(H, T, d_h)`` -> ``(T, H d_h)``, ``(H, d_h)`` -> ``(H d_h,)``."""
    return o.reshape(-1) if o.ndim == 2 else o.swapaxes(0, 1).reshape(o.shape[1], -1)


# The gates of the table's mixers, as this stack computes them from the normalised input h: (H, T) or (H,).
_GATES = {
    "beta": lambda layer, h: sigmoid(linear(h, layer["W_b"])).T,
    "log_gate": lambda layer, h: sigmoid_log_gate(linear(h, layer["W_a"], layer["b_a"])).T,
}


def _mixer_inputs(layer, h, n_heads):
    """The layer's mixer (from :data:`fixedstate.mixers.MIXERS`), its queries, keys and values with
    the heads first (``(H, T, d_h)`` or ``(H, d_h)``) and its gates, built from :mod:`fixedstate.blocks`."""
    entry = mixers.mixer(layer["layer_id"])
    q, k, v = (_split_heads(linear(h, layer[name]), n_heads) for name in ("W_q", "W_k", "W_v"))
    if entry.normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    return entry, q, k, v, {gate: _GATES[gate](layer, h) for gate in entry.gates}


def _block(layer, x, mix):
    """:func:`fixedstate.blocks.residual_block` around ``mix`` (heads first), projected by ``W_o``."""
    y, _ = residual_block(x, lambda h: (linear(_merge_heads(mix(h)), layer["W_o"]), None),
                          layer.get("W_1"), layer.get("W_2"))
    return y


def stack_forward(params: dict, inputs, *, chunk_size: int = 64) -> np.ndarray:
    """Run the stack over a whole sequence at once (the parallel form).

    Every head of a layer in one call, the heads as the leading axis, through the
    mixer table's forward (:data:`fixedstate.mixers.MIXERS`): attention layers use
    :func:`fixedstate.softmax_attention.softmax_attention` (causal, scale
    ``1/sqrt(d_h)``); linear layers use
    :func:`fixedstate.delta_rule.gated_delta_rule_chunkwise` (scale ``1/sqrt(d_h)``,
    zero initial state). ``inputs``: ``(T, d_model)``; returns ``(T, d_model)``.
    """
    params = _check_stack_params(params)
    x = as_float_array(inputs, "inputs", ndim=2)
    check_dim(x, "inputs", 1, params["d_model"], "d_model of the stack")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    n_heads = params["n_heads"]
    scale = 1.0 / np.sqrt(params["d_model"] // n_heads)

    def mix(layer, h):
        entry, q, k, v, gates = _mixer_inputs(layer, h, n_heads)
        return entry.forward(q, k, v, gates, scale=scale, chunk_size=chunk_size)[0]

    for layer in params["layers"]:
        x = _block(layer, x, lambda h, layer=layer: mix(layer, h))
    return x


def init_decode_cache(params: dict) -> list:
    """An empty decode cache, one entry per layer.

    Attention layers: an empty :class:`fixedstate.softmax_attention.KVCache` of
    all ``H`` heads (keys and values ``(H, 0, d_h)``; its buffers grow by doubling,
    so an append is amortised O(1)). Linear layers: zero states ``(H, d_h, d_h)``.
    """
    return _decode_cache(_check_stack_params(params), 0, rng=None)


def _decode_cache(params, context_len, rng):
    """One cache entry per layer for ``context_len`` earlier tokens: zeros, or random with ``rng``."""
    n_heads = params["n_heads"]
    d_h = params["d_model"] // n_heads
    cache = []
    for layer in params["layers"]:
        dtype = layer["W_q"].dtype
        if layer["layer_id"] == SOFTMAX:
            shape = (n_heads, context_len, d_h)
            if rng is None:
                keys, values = np.zeros(shape, dtype=dtype), np.zeros(shape, dtype=dtype)
            else:
                keys, values = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
            cache.append(KVCache(keys, values))
        elif rng is None:
            cache.append(np.zeros((n_heads, d_h, d_h), dtype=dtype))
        else:
            cache.append((rng.standard_normal((n_heads, d_h, d_h)) / d_h).astype(dtype))
    return cache


def stack_decode_step(params: dict, token, cache: list):
    """One token through the stack, the sequential form of :func:`stack_forward`.

    Every head of a layer in one call, the heads as the leading axis, through the
    mixer table's one-token form: attention layers call
    :func:`fixedstate.softmax_attention.softmax_attention_step` (append the token's
    keys and values to the KV cache, amortised O(1), and attend over it); linear
    layers call :func:`fixedstate.delta_rule.gated_delta_rule_step` on their
    ``(H, d_h, d_h)`` states. ``token``: ``(d_model,)``; ``cache``: from
    :func:`init_decode_cache` or a previous step. Returns ``(output (d_model,), cache)``:
    the list ``cache`` is updated in place (each entry replaced by the layer's new
    cache or state), as a serving system does.
    """
    params = _check_stack_params(params)
    x = as_float_array(token, "token", ndim=1, shape=(params["d_model"],))
    if not isinstance(cache, list) or len(cache) != len(params["layers"]):
        raise ValueError(f"cache: expected a list with one entry per layer "
                         f"({len(params['layers'])}), got {type(cache).__name__}")
    n_heads = params["n_heads"]
    scale = 1.0 / np.sqrt(params["d_model"] // n_heads)

    def mix(i, layer, h):
        entry, q, k, v, gates = _mixer_inputs(layer, h, n_heads)
        out, cache[i] = entry.step(q, k, v, gates, cache[i], scale=scale)
        return out

    for i, layer in enumerate(params["layers"]):
        x = _block(layer, x, lambda h, i=i, layer=layer: mix(i, layer, h))
    return x, cache


def stack_decode(params: dict, inputs, cache: list | None = None):
    """Run :func:`stack_decode_step` over every row of ``inputs`` ``(T, d_model)``.

    Returns ``(outputs (T, d_model), cache)``. Equal to :func:`stack_forward` on
    the same inputs (tested).
    """
    params = _check_stack_params(params)
    x = as_float_array(inputs, "inputs", ndim=2)
    check_dim(x, "inputs", 1, params["d_model"], "d_model of the stack")
    if cache is None:
        cache = init_decode_cache(params)
    outs = []
    for row in x:
        y, cache = stack_decode_step(params, row, cache)
        outs.append(y)
    return np.stack(outs) if outs else np.zeros_like(x), cache


def synthetic_cache(params: dict, context_len: int, *, seed: int = 0) -> list:
    """A decode cache of the right sizes for ``context_len`` earlier tokens, random contents.

    For timing only (:func:`fixedstate.timing.measure_decode_seconds`): the work
    of a decode step depends on the sizes of the KV caches (``context_len`` rows
    per head) and states (fixed), not on their contents, and a real prefill of
    an all-attention stack at 16k tokens would take far longer than the
    measurement. Keys are random Gaussian rows, values too; states are random
    with entries of size ``1/d_h``. The KV caches are full: the first step
    after this one reallocates them with twice the rows (once; the steps after
    it append in place).
    """
    params = _check_stack_params(params)
    context_len = check_positive_int(context_len, "context_len", minimum=0)
    return _decode_cache(params, context_len, rng=np.random.default_rng(seed))
