"""Hybrid stacks of linear and full-attention layers (chapter "Hybrid models", chap-hybrids).

Two halves, one per question the chapter asks.

**What does a configuration cost?** A :class:`HybridConfig` describes a stack
(layers, widths, vocabulary, which layer indices use full softmax attention,
the head layout of both kinds of layer, bytes per stored number). From it:

- :func:`parameter_counts`: parameters by component (equation ``eq-hy-params``);
- :func:`prefill_flops_per_token` and :func:`flops_from_parameter_counts`: about
  two FLOPs per parameter, with or without the vocabulary projection
  (equation ``eq-hy-prefill-flops``);
- :func:`decode_flops_per_token`: the same plus the attention core, which grows
  with the context in the full-attention layers only (equation ``eq-hy-decode-flops``);
- :func:`stack_kv_cache_bytes` and :func:`stack_state_bytes`: the growing KV cache
  of the attention layers and the fixed states of the linear ones, their
  recurrent states (:func:`stack_recurrent_state_bytes`, at their own bytes per
  number) and short-convolution buffers (:func:`stack_conv_state_bytes`)
  (equations ``eq-hy-kv`` and ``eq-hy-state``);
- :func:`fit_time_model`, :func:`predicted_tokens_per_second`,
  :func:`attention_time_share`: the two-point model of time per token,
  ``t(L) = a + b L`` (equation ``eq-hy-time-model``), and
  :func:`all_attention_time_model`, its extrapolation to an all-attention twin.

The memory and attention-core counts reuse :mod:`fixedstate.costs`
(``kv_cache_bytes``, ``linear_state_bytes``, ``conv_state_bytes``,
``softmax_decode_flops``, ``linear_decode_flops``) rather than re-deriving them.

**What does it do, token by token?** A toy numpy stack with random weights:
:func:`init_stack` (any layout: hybrid, all-attention, all-linear),
:func:`stack_forward` (the whole sequence at once: causal softmax attention in
its matrix form, the gated delta rule in its chunkwise form),
:func:`stack_decode_step` (one token against a KV cache or a fixed state) and
:func:`stack_decode` (the decode step run over a sequence; a test proves it
equals :func:`stack_forward`). The stack is built from :mod:`fixedstate.blocks`
and calls each core once per layer with the heads as a leading axis.
:func:`synthetic_cache` gives :func:`fixedstate.timing.measure_decode_seconds`
a cache of a given context length to time one decode step against.

Shapes: a sequence is ``(T, d_model)``, one token per row; a token is
``(d_model,)``. Linear layers keep one state ``S`` of shape ``(d_k, d_v)`` per
head, read out as ``o = S^T q`` (the book's orientation).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import numpy as np

from . import costs
from ._validate import as_float_array, check_dim, check_positive_int
from .blocks import l2_normalize, linear, mlp, rms_norm, sigmoid, softplus
from .delta_rule import gated_delta_rule_chunkwise, gated_delta_rule_step
from .softmax_attention import KVCache, softmax_attention, softmax_attention_step

__all__ = [
    "HybridConfig",
    "every_nth_layer",
    "with_layout",
    "all_attention",
    "all_linear",
    "qwen35_9b_config",
    "parameters_per_layer",
    "parameter_counts",
    "flops_from_parameter_counts",
    "prefill_flops_per_token",
    "decode_flops_per_token",
    "stack_kv_cache_bytes",
    "stack_recurrent_state_bytes",
    "stack_conv_state_bytes",
    "stack_state_bytes",
    "fit_time_model",
    "predicted_tokens_per_second",
    "attention_time_share",
    "all_attention_time_model",
    "init_stack",
    "stack_forward",
    "init_decode_cache",
    "stack_decode_step",
    "stack_decode",
    "synthetic_cache",
]


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

def _layout(attention_layers, n_layers: int, name: str = "attention_layers") -> tuple[int, ...]:
    """Validate a list of full-attention layer indices; return it sorted as a tuple."""
    if isinstance(attention_layers, (str, bytes)) or not hasattr(attention_layers, "__iter__"):
        raise ValueError(f"{name}: expected a sequence of layer indices, got "
                         f"{type(attention_layers).__name__} {attention_layers!r}")
    out = []
    for i in attention_layers:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral):
            raise ValueError(f"{name}: expected integer layer indices, got {i!r}")
        if not 0 <= int(i) < n_layers:
            raise ValueError(f"{name}: layer index {int(i)} is outside the stack; expected "
                             f"indices 0 to {n_layers - 1} for n_layers={n_layers}")
        out.append(int(i))
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: expected each layer index at most once, got {sorted(out)}")
    return tuple(sorted(out))


def _bytes_per_element(x, name: str = "bytes_per_element") -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real) or not np.isfinite(x) or x <= 0:
        raise ValueError(f"{name}: expected a positive number (2 for bf16, 4 for fp32, "
                         f"0.5 for 4-bit), got {x!r}")
    return int(x) if float(x).is_integer() else float(x)


@dataclass(frozen=True)
class HybridConfig:
    """A stack of ``n_layers`` blocks, each a token mixer followed by an MLP.

    Layers whose index is in ``attention_layers`` use full softmax attention with
    ``n_heads`` query heads, ``n_kv_heads`` key/value heads (grouped-query
    attention) of width ``head_dim``; ``attention_output_gate`` adds a gate
    projection the size of the queries (as in Qwen3-Next). Every other layer is
    a gated-delta-rule (linear) layer with ``n_linear_key_heads`` query/key heads
    of width ``linear_key_dim`` and ``n_linear_heads`` value heads of width
    ``linear_value_dim``, one state ``(linear_key_dim, linear_value_dim)`` per
    value head, one scalar ``beta`` and one scalar gate per value head;
    ``linear_output_gate`` adds a gate projection the size of the values.
    The MLP has ``mlp_matrices`` matrices of ``d_model x d_ff`` (3 for SwiGLU).

    Memory while generating (equations ``eq-hy-kv`` and ``eq-hy-state``):
    ``bytes_per_element`` is the width of a stored KV-cache number (2 for bf16)
    and of a short-convolution buffer number; ``state_bytes_per_element`` that of
    a number of the recurrent states (``None``: the same as ``bytes_per_element``;
    serving stacks often keep the states in float32, 4). ``conv_kernel_size`` is
    the kernel ``K`` of the causal short convolution that a linear layer runs over
    ``conv_dim`` channels before its core; each linear layer then carries the last
    ``K - 1`` inputs of every channel, ``(K - 1) conv_dim`` numbers (``K = 1``, the
    default, means no convolution and no buffer). ``conv_dim=None`` means the
    query, key and value channels of a Gated DeltaNet layer,
    ``2 H_k d_k + H_v d_v``. Invalid input raises ``ValueError`` naming the field.
    """

    n_layers: int
    d_model: int
    d_ff: int
    vocab_size: int
    attention_layers: tuple
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_linear_heads: int
    n_linear_key_heads: int
    linear_key_dim: int
    linear_value_dim: int
    attention_output_gate: bool = False
    linear_output_gate: bool = False
    mlp_matrices: int = 3
    bytes_per_element: float = 2
    state_bytes_per_element: float | None = None
    conv_kernel_size: int = 1
    conv_dim: int | None = None
    name: str = ""

    def __post_init__(self):
        for field in ("n_layers", "d_model", "d_ff", "vocab_size", "n_heads", "n_kv_heads",
                      "head_dim", "n_linear_heads", "n_linear_key_heads", "linear_key_dim",
                      "linear_value_dim", "mlp_matrices"):
            check_positive_int(getattr(self, field), field)
        object.__setattr__(self, "attention_layers", _layout(self.attention_layers, self.n_layers))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: expected a divisor of n_heads={self.n_heads} "
                             f"(each KV head serves a whole group of query heads), got {self.n_kv_heads}")
        if self.n_linear_heads % self.n_linear_key_heads:
            raise ValueError(f"n_linear_key_heads: expected a divisor of n_linear_heads="
                             f"{self.n_linear_heads}, got {self.n_linear_key_heads}")
        for field in ("attention_output_gate", "linear_output_gate"):
            if not isinstance(getattr(self, field), (bool, np.bool_)):
                raise ValueError(f"{field}: expected True or False, got {getattr(self, field)!r}")
        object.__setattr__(self, "bytes_per_element", _bytes_per_element(self.bytes_per_element))
        state_bytes = self.bytes_per_element if self.state_bytes_per_element is None \
            else _bytes_per_element(self.state_bytes_per_element, "state_bytes_per_element")
        object.__setattr__(self, "state_bytes_per_element", state_bytes)
        check_positive_int(self.conv_kernel_size, "conv_kernel_size")
        if self.conv_dim is None:
            object.__setattr__(self, "conv_dim", 2 * self.n_linear_key_heads * self.linear_key_dim
                               + self.n_linear_heads * self.linear_value_dim)
        check_positive_int(self.conv_dim, "conv_dim")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the linear (gated delta rule) layers."""
        full = set(self.attention_layers)
        return tuple(i for i in range(self.n_layers) if i not in full)

    @property
    def n_attention_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def n_linear_layers(self) -> int:
        return self.n_layers - len(self.attention_layers)


def every_nth_layer(n_layers: int, n: int) -> tuple[int, ...]:
    """Indices ``n-1, 2n-1, ...`` below ``n_layers``: full attention in every ``n``-th layer.

    ``every_nth_layer(32, 4)`` is ``(3, 7, ..., 31)``, eight layers.
    """
    n_layers = check_positive_int(n_layers, "n_layers")
    n = check_positive_int(n, "n")
    return tuple(range(n - 1, n_layers, n))


def with_layout(config: HybridConfig, attention_layers, name: str | None = None) -> HybridConfig:
    """The same configuration with another set of full-attention layers."""
    if not isinstance(config, HybridConfig):
        raise ValueError(f"config: expected a HybridConfig, got {type(config).__name__}")
    return dataclasses.replace(config, attention_layers=tuple(attention_layers),
                               name=config.name if name is None else name)


def all_attention(config: HybridConfig) -> HybridConfig:
    """The same shape with full attention in every layer."""
    return with_layout(config, range(config.n_layers), name=f"{config.name} (all attention)".strip())


def all_linear(config: HybridConfig) -> HybridConfig:
    """The same shape with a linear layer everywhere."""
    return with_layout(config, (), name=f"{config.name} (all linear)".strip())


def qwen35_9b_config(*, state_bytes_per_element: float = 4, conv_kernel_size: int = 4) -> HybridConfig:
    """The Qwen3.5 text configuration: 32 layers, full attention in every 4th.

    Every size is the default text configuration of Qwen3.5 in Hugging Face
    ``transformers`` (``Qwen3_5Config().text_config``, which its docstring calls
    the Qwen3.5-9B style): hidden size 4096, intermediate size 12288, vocabulary
    248,320, ``full_attention_interval`` 4; attention layers with 16 query heads
    and 4 KV heads of width 256 and an output gate; Gated DeltaNet layers with
    16 key heads and 32 value heads of width 128, an output gate, and a short
    convolution of kernel ``linear_conv_kernel_dim = 4`` over their
    ``2 * 16 * 128 + 32 * 128 = 8192`` query, key and value channels. It
    reproduces the per-component parameter counts published by Chumba (2026,
    ``chumba2026beyond`` in the book's bibliography)
    (0.470B full attention, 1.617B linear attention); a test checks that it does.

    The KV cache and convolution buffers are counted in bf16 (2 bytes). The
    recurrent states default to float32 (``state_bytes_per_element=4``), as a
    serving stack may keep them to limit rounding over long sequences;
    ``state_bytes_per_element=2,
    conv_kernel_size=1`` gives the simpler count, bf16 states without buffers.
    """
    return HybridConfig(
        n_layers=32, d_model=4096, d_ff=12288, vocab_size=248_320,
        attention_layers=every_nth_layer(32, 4),
        n_heads=16, n_kv_heads=4, head_dim=256, attention_output_gate=True,
        n_linear_heads=32, n_linear_key_heads=16, linear_key_dim=128, linear_value_dim=128,
        linear_output_gate=True, mlp_matrices=3, bytes_per_element=2,
        state_bytes_per_element=state_bytes_per_element, conv_kernel_size=conv_kernel_size,
        name="Qwen3.5-9B-style",
    )


# ---------------------------------------------------------------------------
# Parameters and FLOPs
# ---------------------------------------------------------------------------

def _check_config(config) -> HybridConfig:
    if not isinstance(config, HybridConfig):
        raise ValueError(f"config: expected a HybridConfig, got {type(config).__name__}")
    return config


def parameters_per_layer(config: HybridConfig) -> dict[str, int]:
    """Weight-matrix parameters of one layer of each kind, equation ``eq-hy-params``.

    ``full_attention``: ``d (H d_h) (2 if gated else 1) + 2 d H_kv d_h + H d_h d``
    (queries [and their gate], keys and values, output);
    ``linear_attention``: ``2 d H_k d_k + d H_v d_v (2 if gated else 1) + 2 d H_v + H_v d_v d``
    (queries and keys, values [and their gate], the scalar ``beta`` and gate per
    value head, output); ``mlp``: ``m d d_ff``. Norm weights, biases and the short
    convolutions of real layers are left out (each under 0.1 % of a layer).
    Returns a dict of Python ints.
    """
    c = _check_config(config)
    d = c.d_model
    q_width = c.n_heads * c.head_dim
    full = d * q_width * (2 if c.attention_output_gate else 1) + 2 * d * c.n_kv_heads * c.head_dim \
        + q_width * d
    k_width = c.n_linear_key_heads * c.linear_key_dim
    v_width = c.n_linear_heads * c.linear_value_dim
    linear = 2 * d * k_width + d * v_width * (2 if c.linear_output_gate else 1) \
        + 2 * d * c.n_linear_heads + v_width * d
    mlp = c.mlp_matrices * d * c.d_ff
    return {"full_attention": int(full), "linear_attention": int(linear), "mlp": int(mlp)}


def parameter_counts(config: HybridConfig) -> dict[str, int]:
    """Parameters of the whole stack by component, equation ``eq-hy-params``.

    Keys: ``mlp``, ``linear_attention``, ``full_attention`` (summed over the
    layers of each kind), ``embedding`` and ``output_projection`` (each
    ``vocab_size x d_model``; the input embedding is a lookup and costs no
    FLOPs), and ``total``. Python ints.
    """
    c = _check_config(config)
    per = parameters_per_layer(c)
    counts = {
        "mlp": per["mlp"] * c.n_layers,
        "linear_attention": per["linear_attention"] * c.n_linear_layers,
        "full_attention": per["full_attention"] * c.n_attention_layers,
        "embedding": c.vocab_size * c.d_model,
        "output_projection": c.vocab_size * c.d_model,
    }
    counts["total"] = sum(counts.values())
    return counts


def flops_from_parameter_counts(mlp, linear_attention, full_attention, *, vocab_projection=0):
    """Prefill FLOPs per token from parameter counts alone, equation ``eq-hy-prefill-flops``.

    Each weight is used in one multiply-add per token, 2 FLOPs:
    ``2 (P_mlp + P_linear + P_full) + 2 P_vocab``, where ``vocab_projection`` is the
    number of parameters of the output projection over the vocabulary (0 to leave
    it out). The context-dependent attention core is not included (see
    :func:`decode_flops_per_token`). Arguments are non-negative numbers; returns a float.
    """
    total = 0.0
    for name, x in (("mlp", mlp), ("linear_attention", linear_attention),
                    ("full_attention", full_attention), ("vocab_projection", vocab_projection)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real) or not np.isfinite(x) or x < 0:
            raise ValueError(f"{name}: expected a non-negative number of parameters, got {x!r}")
        total += float(x)
    return 2.0 * total


def prefill_flops_per_token(config: HybridConfig, *, include_output_projection: bool = True) -> float:
    """Prefill FLOPs per token of a configuration, equation ``eq-hy-prefill-flops``.

    :func:`flops_from_parameter_counts` applied to :func:`parameter_counts`; the
    vocabulary projection is counted when ``include_output_projection``.
    """
    if not isinstance(include_output_projection, (bool, np.bool_)):
        raise ValueError(f"include_output_projection: expected True or False, got "
                         f"{include_output_projection!r}")
    p = parameter_counts(config)
    return flops_from_parameter_counts(
        p["mlp"], p["linear_attention"], p["full_attention"],
        vocab_projection=p["output_projection"] if include_output_projection else 0)


def decode_flops_per_token(config: HybridConfig, context_len, *,
                           include_output_projection: bool = True):
    """FLOPs to generate one token at context length ``L``, equation ``eq-hy-decode-flops``.

    :func:`prefill_flops_per_token` (the weights) plus the attention cores:
    ``n_full * H * costs.softmax_decode_flops(L, d_h, d_h)`` for the full-attention
    layers (every query head reads the cache), and for the linear layers
    ``n_lin * H_v * (costs.linear_decode_flops(d_k, d_v) + 2 d_k d_v)``: the write
    and the readout of :mod:`fixedstate.costs` plus the recall ``S^T k`` that the
    delta correction needs. Element-wise work (gates, softmax) is not counted.
    ``context_len``: int or integer array; the result (float) has its shape.
    """
    c = _check_config(config)
    base = prefill_flops_per_token(c, include_output_projection=include_output_projection)
    attn = c.n_attention_layers * c.n_heads * costs.softmax_decode_flops(context_len, c.head_dim, c.head_dim)
    lin = c.n_linear_layers * c.n_linear_heads * (
        costs.linear_decode_flops(c.linear_key_dim, c.linear_value_dim)
        + 2 * c.linear_key_dim * c.linear_value_dim)
    out = base + np.asarray(attn, dtype=float) + float(lin)
    return float(out) if np.ndim(out) == 0 else out


def stack_kv_cache_bytes(config: HybridConfig, context_len):
    """KV-cache bytes of a stack at context length ``L``, equation ``eq-hy-kv``.

    Only the full-attention layers keep a cache:
    ``costs.kv_cache_bytes(L, n_layers=n_full, n_kv_heads=H_kv, head_dim=d_h)``
    with the configuration's ``bytes_per_element``; 0 for an all-linear stack.
    ``context_len``: int or integer array; the result has its shape.
    """
    c = _check_config(config)
    if c.n_attention_layers == 0:
        zero = costs.kv_cache_bytes(context_len, n_layers=1, n_kv_heads=1, head_dim=1) * 0
        return zero
    return costs.kv_cache_bytes(context_len, n_layers=c.n_attention_layers, n_kv_heads=c.n_kv_heads,
                                head_dim=c.head_dim, bytes_per_element=c.bytes_per_element)


def stack_recurrent_state_bytes(config: HybridConfig):
    """Bytes of the recurrent states of a stack, the first term of equation ``eq-hy-state``.

    One ``(d_k, d_v)`` state per value head per linear layer, at
    ``state_bytes_per_element``:
    ``costs.linear_state_bytes(n_layers=n_lin, n_heads=H_v, d_k=d_k, d_v=d_v)``;
    0 for an all-attention stack.
    """
    c = _check_config(config)
    if c.n_linear_layers == 0:
        return 0
    return costs.linear_state_bytes(n_layers=c.n_linear_layers, n_heads=c.n_linear_heads,
                                    d_k=c.linear_key_dim, d_v=c.linear_value_dim,
                                    bytes_per_element=c.state_bytes_per_element)


def stack_conv_state_bytes(config: HybridConfig):
    """Bytes of the short-convolution buffers of a stack, the second term of ``eq-hy-state``.

    ``(K - 1) conv_dim`` numbers per linear layer at ``bytes_per_element``:
    ``costs.conv_state_bytes(n_layers=n_lin, kernel_size=K, conv_dim=conv_dim)``;
    0 for an all-attention stack or ``conv_kernel_size = 1``.
    """
    c = _check_config(config)
    if c.n_linear_layers == 0:
        return 0
    return costs.conv_state_bytes(n_layers=c.n_linear_layers, kernel_size=c.conv_kernel_size,
                                  conv_dim=c.conv_dim, bytes_per_element=c.bytes_per_element)


def stack_state_bytes(config: HybridConfig):
    """Fixed-state bytes of a stack, equation ``eq-hy-state``: independent of the context.

    :func:`stack_recurrent_state_bytes` plus :func:`stack_conv_state_bytes`;
    0 for an all-attention stack.
    """
    return stack_recurrent_state_bytes(config) + stack_conv_state_bytes(config)


# ---------------------------------------------------------------------------
# The two-point model of time per token
# ---------------------------------------------------------------------------

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
    c = _check_config(config)
    if c.n_attention_layers == 0:
        raise ValueError("config: expected at least one attention layer (an all-linear stack "
                         "has no context term to scale)")
    _time_args(a, b, 0)
    full = all_attention(c)
    kv_ratio = stack_kv_cache_bytes(full, 1) / stack_kv_cache_bytes(c, 1)
    weight_ratio = prefill_flops_per_token(full) / prefill_flops_per_token(c)
    return float(a * weight_ratio), float(b * kv_ratio)


# ---------------------------------------------------------------------------
# A toy numpy stack
# ---------------------------------------------------------------------------

def init_stack(n_layers: int, d_model: int, n_heads: int, attention_layers, *, d_ff: int = 0,
               seed: int = 0, dtype=np.float64, gate_bias: float = 3.0) -> dict:
    """Random weights for a toy stack of ``n_layers`` pre-norm residual blocks.

    Each block is ``x + W_o mix(norm(x))`` followed, when ``d_ff > 0``, by
    ``x + mlp(norm(x))`` (:func:`fixedstate.blocks.mlp`, ``silu(x W_1) W_2``).
    Layers in ``attention_layers`` mix with causal softmax attention
    (``n_heads`` heads of width ``d_model / n_heads``); the others with the
    gated delta rule (same heads; keys and queries L2-normalised,
    ``beta = sigmoid(x W_beta)`` and the decay ``g = sigmoid(x W_gate + gate_bias)``,
    passed as ``log_gate = log g``, one each per head). Weights are Gaussian with
    variance ``1 / fan_in``.

    Returns a dict with ``n_heads``, ``attention_layers`` (sorted tuple) and
    ``layers`` (a list of dicts of arrays). ``ValueError`` if a size is not a
    positive integer, ``n_heads`` does not divide ``d_model`` or a layer index is
    outside the stack.
    """
    n_layers = check_positive_int(n_layers, "n_layers")
    d_model = check_positive_int(d_model, "d_model")
    n_heads = check_positive_int(n_heads, "n_heads")
    d_ff = check_positive_int(d_ff, "d_ff", minimum=0)
    if d_model % n_heads:
        raise ValueError(f"n_heads: expected a divisor of d_model={d_model} (heads split the "
                         f"width evenly), got {n_heads}")
    layout = _layout(attention_layers, n_layers)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
    rng = np.random.default_rng(seed)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(dtype)

    layers = []
    for i in range(n_layers):
        layer = {"kind": "attention" if i in layout else "linear",
                 "W_q": mat(d_model, d_model), "W_k": mat(d_model, d_model),
                 "W_v": mat(d_model, d_model), "W_o": mat(d_model, d_model)}
        if layer["kind"] == "linear":
            layer["W_beta"] = mat(d_model, n_heads)
            layer["W_gate"] = mat(d_model, n_heads)
            layer["b_gate"] = np.full(n_heads, gate_bias, dtype=dtype)
        if d_ff:
            layer["W_1"] = mat(d_model, d_ff)
            layer["W_2"] = mat(d_ff, d_model)
        layers.append(layer)
    return {"n_heads": n_heads, "d_model": d_model, "attention_layers": layout, "layers": layers}


def _check_params(params) -> dict:
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


def _mixer_inputs(layer, h, n_heads):
    """Queries, keys, values with the heads first (``(H, T, d_h)`` or ``(H, d_h)``) and, for a
    linear layer, ``beta`` and ``log_gate`` (``(H, T)`` or ``(H,)``); built from :mod:`fixedstate.blocks`."""
    q, k, v = (_split_heads(linear(h, layer[name]), n_heads) for name in ("W_q", "W_k", "W_v"))
    if layer["kind"] == "attention":
        return q, k, v, None
    gates = {"beta": sigmoid(linear(h, layer["W_beta"])).T,           # (T, H) -> (H, T); (H,) stays
             # log sigmoid(z) = -softplus(-z): the log-decay, <= 0, with no overflow
             "log_gate": -softplus(-linear(h, layer["W_gate"], layer["b_gate"])).T}
    return l2_normalize(q), l2_normalize(k), v, gates


def _block(layer, x, mixed):
    """The residual around the mixer, then the MLP block (if the layer has one)."""
    x = x + linear(_merge_heads(mixed), layer["W_o"])
    if "W_1" in layer:
        x = x + mlp(rms_norm(x), layer["W_1"], layer["W_2"])
    return x


def stack_forward(params: dict, inputs, *, chunk_size: int = 64) -> np.ndarray:
    """Run the stack over a whole sequence at once (the parallel form).

    Every head of a layer in one call, the heads as the leading axis: attention
    layers use :func:`fixedstate.softmax_attention.softmax_attention` (causal,
    scale ``1/sqrt(d_h)``); linear layers use
    :func:`fixedstate.delta_rule.gated_delta_rule_chunkwise` (scale ``1/sqrt(d_h)``,
    zero initial state). ``inputs``: ``(T, d_model)``; returns ``(T, d_model)``.
    """
    params = _check_params(params)
    x = as_float_array(inputs, "inputs", ndim=2)
    check_dim(x, "inputs", 1, params["d_model"], "d_model of the stack")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    n_heads = params["n_heads"]
    scale = 1.0 / np.sqrt(params["d_model"] // n_heads)
    for layer in params["layers"]:
        q, k, v, gates = _mixer_inputs(layer, rms_norm(x), n_heads)
        if gates is None:
            mixed, _ = softmax_attention(q, k, v, causal=True, scale=scale)
        else:
            mixed, _ = gated_delta_rule_chunkwise(q, k, v, **gates, scale=scale, chunk_size=chunk_size)
        x = _block(layer, x, mixed)
    return x


def init_decode_cache(params: dict) -> list:
    """An empty decode cache, one entry per layer.

    Attention layers: an empty :class:`fixedstate.softmax_attention.KVCache` of
    all ``H`` heads (keys and values ``(H, 0, d_h)``; its buffers grow by doubling,
    so an append is amortised O(1)). Linear layers: zero states ``(H, d_h, d_h)``.
    """
    return _decode_cache(_check_params(params), 0, rng=None)


def _decode_cache(params, context_len, rng):
    """One cache entry per layer for ``context_len`` earlier tokens: zeros, or random with ``rng``."""
    n_heads = params["n_heads"]
    d_h = params["d_model"] // n_heads
    cache = []
    for layer in params["layers"]:
        dtype = layer["W_q"].dtype
        if layer["kind"] == "attention":
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

    Every head of a layer in one call, the heads as the leading axis: attention
    layers call :func:`fixedstate.softmax_attention.softmax_attention_step`
    (append the token's keys and values to the KV cache, amortised O(1), and
    attend over it); linear layers call
    :func:`fixedstate.delta_rule.gated_delta_rule_step` on their ``(H, d_h, d_h)``
    states. ``token``: ``(d_model,)``; ``cache``: from :func:`init_decode_cache`
    or a previous step. Returns ``(output (d_model,), cache)``: the list
    ``cache`` is updated in place (each entry replaced by the layer's new
    cache or state), as a serving system does.
    """
    params = _check_params(params)
    x = as_float_array(token, "token", ndim=1, shape=(params["d_model"],))
    if not isinstance(cache, list) or len(cache) != len(params["layers"]):
        raise ValueError(f"cache: expected a list with one entry per layer "
                         f"({len(params['layers'])}), got {type(cache).__name__}")
    n_heads = params["n_heads"]
    scale = 1.0 / np.sqrt(params["d_model"] // n_heads)
    for i, layer in enumerate(params["layers"]):
        q, k, v, gates = _mixer_inputs(layer, rms_norm(x), n_heads)
        if gates is None:
            mixed, cache[i] = softmax_attention_step(q, k, v, scale=scale, initial_state=cache[i])
        else:
            mixed, cache[i] = gated_delta_rule_step(q, k, v, **gates, scale=scale, initial_state=cache[i])
        x = _block(layer, x, mixed)
    return x, cache


def stack_decode(params: dict, inputs, cache: list | None = None):
    """Run :func:`stack_decode_step` over every row of ``inputs`` ``(T, d_model)``.

    Returns ``(outputs (T, d_model), cache)``. Equal to :func:`stack_forward` on
    the same inputs (tested).
    """
    params = _check_params(params)
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
    params = _check_params(params)
    context_len = check_positive_int(context_len, "context_len", minimum=0)
    return _decode_cache(params, context_len, rng=np.random.default_rng(seed))
