"""The cost model of hybrid stacks of linear and full-attention layers (chapter "Hybrid models", chap-hybrids).

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
  (equations ``eq-hy-kv`` and ``eq-hy-state``).

The memory and attention-core counts reuse :mod:`fixedstate.costs`
(``kv_cache_bytes``, ``linear_state_bytes``, ``conv_state_bytes``,
``softmax_decode_flops``, ``linear_decode_flops``) rather than re-deriving them.

The chapter's other two questions live in modules of their own: the two-point
model of time per token in :mod:`fixedstate.time_model`, and what a stack does,
token by token, in the toy numpy stack of :mod:`fixedstate.toy_stack`.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import numpy as np

from . import costs
from ._validate import check_positive_int

__all__ = [
    "HybridConfig",
    "check_layout",
    "check_config",
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
]


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

def check_layout(attention_layers, n_layers: int, name: str = "attention_layers") -> tuple[int, ...]:
    """Validate a list of full-attention layer indices below ``n_layers``; return it sorted as a tuple.

    ``ValueError`` naming ``name`` for a non-sequence, a non-integer, an index outside the
    stack or a repeated index. :mod:`fixedstate.toy_stack` checks its layouts with it too.
    """
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
        object.__setattr__(self, "attention_layers", check_layout(self.attention_layers, self.n_layers))
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

def check_config(config) -> HybridConfig:
    """``config`` if it is a :class:`HybridConfig`, else a ``ValueError`` naming it."""
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
    c = check_config(config)
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
    c = check_config(config)
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
    c = check_config(config)
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
    c = check_config(config)
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
    c = check_config(config)
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
    c = check_config(config)
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
