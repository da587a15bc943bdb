"""FLOP and memory accounting (chapters "The cost of softmax attention", "Linear attention", "The delta rule",
"State-space models").

Counting convention for every FLOP counter here:

- a multiply-add counts as **2 FLOPs**, so a product of an ``(m, n)`` and an
  ``(n, p)`` matrix costs ``2 m n p``;
- only the matrix products of the attention *core* are counted: the scores
  ``Q K^T`` and the weighted sum ``A V`` for softmax attention; the state write
  ``phi(K)^T V`` and the readout ``phi(Q) S`` for linear attention;
- **not counted**: the projections that make ``Q, K, V`` from the input, the
  output projection, the exponentials, maxima and divisions of the softmax, the
  feature map, and the division by the normalizer. They are lower order (at
  most proportional to ``T^2`` without a width factor, or to ``T`` times a width).

Memory counters return numbers of stored values (``*_numbers``) or bytes
(``*_bytes``, numbers times ``bytes_per_element``: 2 for fp16/bf16, 4 for fp32,
0.5 for 4-bit).

Every counter accepts Python ints, numpy integers or numpy integer arrays for
its size arguments (so a cost can be plotted against an array of context
lengths); results are Python ints for scalar input and int64 arrays otherwise
(floats when ``bytes_per_element`` is not an integer). The exceptions are the
counters of chapter 4's table (:func:`ssm_state_bytes`, :func:`selective_scan_flops`,
:func:`ssm_decode_flops`, :func:`s4_fft_conv_flops`) and
:func:`delta_rule_chunkwise_flops`, which take single positive integers.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ._validate import check_positive_int
from .layer_ids import DELTA, GATED_DELTA, HYBRID, KDA, LAYER_IDS, SOFTMAX, SWA, check_layer_id

__all__ = [
    "kv_cache_numbers",
    "kv_cache_bytes",
    "linear_state_numbers",
    "linear_state_bytes",
    "conv_state_numbers",
    "conv_state_bytes",
    "softmax_attention_flops",
    "linear_attention_flops",
    "softmax_decode_flops",
    "linear_decode_flops",
    "crossover_length",
    "decode_crossover_length",
    "delta_rule_chunkwise_flops",
    "dplr_chunkwise_flops",
    "chunkwise_profile",
    "ssm_state_bytes",
    "selective_scan_flops",
    "ssm_decode_flops",
    "s4_fft_conv_flops",
    "layer_state_bytes",
    "model_state_bytes",
]


def _count(x, name: str, *, minimum: int = 0):
    """An integer (or integer array) >= minimum, as a Python int or an int64 array."""
    if isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{name}: expected an integer >= {minimum}, got bool {x!r}")
    if isinstance(x, numbers.Integral):
        if x < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {int(x)}")
        return int(x)
    if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)):
        arr = np.asarray(x)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected an integer or an array of integers >= {minimum}, "
                             f"got an array of dtype {arr.dtype}")
        if arr.size and arr.min() < minimum:
            raise ValueError(f"{name}: expected integers >= {minimum}, got {int(arr.min())}")
        return arr.astype(np.int64)
    raise ValueError(f"{name}: expected an integer or an array of integers >= {minimum}, "
                     f"got {type(x).__name__} {x!r}")


def _bytes_per_element(x):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real) or not np.isfinite(x) or x <= 0:
        raise ValueError(f"bytes_per_element: expected a positive number (2 for fp16, 4 for fp32, "
                         f"0.5 for 4-bit), got {x!r}")
    if isinstance(x, numbers.Integral) or float(x).is_integer():
        return int(x)
    return float(x)


def kv_cache_numbers(context_len, *, n_layers=1, n_kv_heads=1, head_dim):
    """Numbers stored in a KV cache, equation ``eq-sm-kv-cache``: ``2 * T * L * H_kv * d_head``.

    One key and one value of width ``head_dim`` per token, per KV head, per layer.
    ``context_len`` (``T``) may be an int or an integer array; the result has its shape.
    """
    t = _count(context_len, "context_len")
    n_layers = _count(n_layers, "n_layers", minimum=1)
    n_kv_heads = _count(n_kv_heads, "n_kv_heads", minimum=1)
    head_dim = _count(head_dim, "head_dim", minimum=1)
    return 2 * t * n_layers * n_kv_heads * head_dim


def kv_cache_bytes(context_len, *, n_layers=1, n_kv_heads=1, head_dim, bytes_per_element=2):
    """Bytes of a KV cache, equation ``eq-sm-kv-cache``: ``2 * T * L * H_kv * d_head * bytes``.

    ``context_len``: int or integer array (tokens in the cache); ``bytes_per_element``:
    2 for fp16/bf16 (the default), 4 for fp32. The result has the shape of ``context_len``.
    """
    b = _bytes_per_element(bytes_per_element)
    return kv_cache_numbers(context_len, n_layers=n_layers, n_kv_heads=n_kv_heads,
                            head_dim=head_dim) * b


def linear_state_numbers(*, n_layers=1, n_heads=1, d_k, d_v, include_normalizer=False):
    """Numbers in the fixed state of a linear-attention model, equation ``eq-la-state-size``.

    ``L * H * d_k * d_v`` for the states ``S`` (``d_k`` is the feature width ``r``),
    plus ``L * H * d_k`` when ``include_normalizer`` (the vector ``z``). Independent of
    the context length.
    """
    n_layers = _count(n_layers, "n_layers", minimum=1)
    n_heads = _count(n_heads, "n_heads", minimum=1)
    d_k = _count(d_k, "d_k", minimum=1)
    d_v = _count(d_v, "d_v", minimum=1)
    if not isinstance(include_normalizer, (bool, np.bool_)):
        raise ValueError(f"include_normalizer: expected True or False, got {include_normalizer!r}")
    return n_layers * n_heads * d_k * (d_v + (1 if include_normalizer else 0))


def linear_state_bytes(*, n_layers=1, n_heads=1, d_k, d_v, bytes_per_element=2,
                       include_normalizer=False):
    """Bytes of the fixed state of a linear-attention model, equation ``eq-la-state-size``.

    :func:`linear_state_numbers` times ``bytes_per_element`` (2 for fp16/bf16).
    """
    b = _bytes_per_element(bytes_per_element)
    return linear_state_numbers(n_layers=n_layers, n_heads=n_heads, d_k=d_k, d_v=d_v,
                                include_normalizer=include_normalizer) * b


def conv_state_numbers(*, n_layers=1, kernel_size, conv_dim):
    """Numbers in the short-convolution buffers of fixed-state layers, equation ``eq-hy-state``.

    A causal depthwise convolution of kernel ``K`` over ``conv_dim`` channels
    (:func:`fixedstate.blocks.short_conv`) must remember the last ``K - 1`` inputs
    of every channel to make its next output: ``L * (K - 1) * conv_dim`` numbers.
    ``kernel_size = 1`` (no convolution over time) keeps none. Independent of the
    context length.
    """
    n_layers = _count(n_layers, "n_layers", minimum=1)
    kernel_size = _count(kernel_size, "kernel_size", minimum=1)
    conv_dim = _count(conv_dim, "conv_dim", minimum=1)
    return n_layers * (kernel_size - 1) * conv_dim


def conv_state_bytes(*, n_layers=1, kernel_size, conv_dim, bytes_per_element=2):
    """Bytes of the short-convolution buffers, equation ``eq-hy-state``.

    :func:`conv_state_numbers` times ``bytes_per_element`` (2 for fp16/bf16, 4 for fp32).
    """
    b = _bytes_per_element(bytes_per_element)
    return conv_state_numbers(n_layers=n_layers, kernel_size=kernel_size, conv_dim=conv_dim) * b


def softmax_attention_flops(seq_len, d_k, d_v, *, causal=False):
    """FLOPs of the softmax attention core over a sequence (prefill), equation ``eq-sm-flops``.

    ``Q K^T`` costs ``2 T^2 d_k`` and ``A V`` costs ``2 T^2 d_v``: ``2 T^2 (d_k + d_v)``,
    which is ``4 T^2 d`` when ``d_k = d_v = d``. This is what a masked matrix
    product computes (the masked half is computed and then zeroed). With
    ``causal=True`` only the ``T (T + 1) / 2`` visible pairs are counted:
    ``T (T + 1) (d_k + d_v)``. One head, one sequence; softmax arithmetic not counted.
    """
    t = _count(seq_len, "seq_len")
    d_k = _count(d_k, "d_k", minimum=1)
    d_v = _count(d_v, "d_v", minimum=1)
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal: expected True or False, got {causal!r}")
    pairs = t * (t + 1) // 2 if causal else t * t
    return 2 * pairs * (d_k + d_v)


def linear_attention_flops(seq_len, r, d_v, *, normalize=False):
    """FLOPs of the linear attention core over a sequence, equation ``eq-la-flops``.

    Writing ``phi(K)^T V`` costs ``2 T r d_v`` and reading ``phi(Q) S`` another
    ``2 T r d_v``: ``4 T r d_v`` (the recurrent form does one write and one read per
    token; the chunkwise form does the same count up to the lower-order
    intra-chunk products). ``normalize=True`` carries the normalizer as one more
    value column: ``4 T r (d_v + 1)``. The feature map and the division are not counted.
    """
    t = _count(seq_len, "seq_len")
    r = _count(r, "r", minimum=1)
    d_v = _count(d_v, "d_v", minimum=1)
    if not isinstance(normalize, (bool, np.bool_)):
        raise ValueError(f"normalize: expected True or False, got {normalize!r}")
    return 4 * t * r * (d_v + (1 if normalize else 0))


def softmax_decode_flops(context_len, d_k, d_v):
    """FLOPs to generate one token with a KV cache, equation ``eq-sm-decode-flops``.

    The new query against ``n = context_len`` cached keys (the new token's
    included): ``2 n d_k`` for the scores and ``2 n d_v`` for the weighted sum,
    ``2 n (d_k + d_v)``; it grows with the context.
    """
    n = _count(context_len, "context_len")
    d_k = _count(d_k, "d_k", minimum=1)
    d_v = _count(d_v, "d_v", minimum=1)
    return 2 * n * (d_k + d_v)


def linear_decode_flops(r, d_v, *, normalize=False):
    """FLOPs to generate one token with a fixed state, equation ``eq-la-decode-flops``.

    One write ``S + phi(k) v^T`` (``2 r d_v``: a multiply and an add per entry) and
    one readout ``S^T phi(q)`` (``2 r d_v``): ``4 r d_v``, or ``4 r (d_v + 1)`` with the
    normalizer. Independent of the context length.
    """
    r = _count(r, "r", minimum=1)
    d_v = _count(d_v, "d_v", minimum=1)
    if not isinstance(normalize, (bool, np.bool_)):
        raise ValueError(f"normalize: expected True or False, got {normalize!r}")
    return 4 * r * (d_v + (1 if normalize else 0))


def _first_true(predicate, what: str, limit: int = 1 << 62) -> int:
    """Smallest integer n >= 1 with predicate(n) True, for a predicate that stays True."""
    hi = 1
    while not predicate(hi):
        hi *= 2
        if hi > limit:
            raise ValueError(f"{what}: no crossover below {limit}")
    lo = hi // 2  # predicate(lo) is False (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid
    return hi


def crossover_length(r, d_k, d_v, *, causal=False, normalize=False) -> int:
    """Shortest sequence for which linear attention's core costs fewer FLOPs than softmax's.

    Found by searching the two counters :func:`softmax_attention_flops` and
    :func:`linear_attention_flops` (equation ``eq-la-crossover``), not from a
    formula: with ``d_k = d_v`` and the default full-square count it is ``r + 1``
    (linear attention is cheaper exactly when ``T > r``). Scalars only.
    """
    for name, x in (("r", r), ("d_k", d_k), ("d_v", d_v)):
        if not isinstance(_count(x, name, minimum=1), int):
            raise ValueError(f"{name}: expected a single integer, got an array")

    def cheaper(t: int) -> bool:
        return (linear_attention_flops(t, r, d_v, normalize=normalize)
                < softmax_attention_flops(t, d_k, d_v, causal=causal))

    return _first_true(cheaper, "crossover_length")


def decode_crossover_length(r, d_k, d_v, *, normalize=False) -> int:
    """Shortest context at which one decode step with a fixed state beats one with a KV cache.

    Searches :func:`softmax_decode_flops` against :func:`linear_decode_flops`; with
    ``d_k = d_v`` it is ``r + 1``. Scalars only.
    """
    for name, x in (("r", r), ("d_k", d_k), ("d_v", d_v)):
        if not isinstance(_count(x, name, minimum=1), int):
            raise ValueError(f"{name}: expected a single integer, got an array")

    def cheaper(n: int) -> bool:
        return linear_decode_flops(r, d_v, normalize=normalize) < softmax_decode_flops(n, d_k, d_v)

    return _first_true(cheaper, "decode_crossover_length")


def _scalar(x, name):
    """``x`` if it is a single integer; ``ValueError`` naming ``name`` for an array."""
    if not isinstance(x, int):
        raise ValueError(f"{name}: expected a single integer, got an array")
    return x


def _chunk_sizes(seq_len, d_k, d_v, chunk_size, batch, *, seq_minimum=0):
    """The sizes a chunkwise count takes, each checked and a single integer (the counters of the
    chunkwise forms share them)."""
    sizes = (_count(seq_len, "seq_len", minimum=seq_minimum), _count(d_k, "d_k", minimum=1),
             _count(d_v, "d_v", minimum=1), _count(chunk_size, "chunk_size", minimum=1),
             _count(batch, "batch", minimum=1))
    return tuple(_scalar(x, name) for x, name in zip(sizes, ("seq_len", "d_k", "d_v", "chunk_size", "batch")))


def delta_rule_chunkwise_flops(seq_len, d_k, d_v, *, chunk_size=64, layer=GATED_DELTA, batch=1) -> int:
    """FLOPs of the matrix products of the package's chunkwise delta-rule forms (``eq-dr-ut``,
    ``eq-dr-chunk-out``, ``eq-dr-chunk-state``), product by product as
    :func:`fixedstate.delta_rule.gated_delta_rule_chunkwise` (``layer="gated_delta"`` or
    ``"delta"``, ids of :mod:`fixedstate.layer_ids`) and :func:`fixedstate.delta_rule.kda_chunkwise`
    (``layer="kda"``) do them.

    Per chunk of ``C`` tokens (``chunk_size`` rounded up to a power of two, as the
    forms pad it), with ``n = ceil(T / chunk_size)`` chunks per sequence:

    - pair products: ``Q K^T`` and ``K K^T``, ``4 C^2 d_k`` (Gated DeltaNet, full
      squares, then masked); KDA's level-by-level products of the pairs below
      the diagonal, ``2 C (C - 1) d_k``;
    - the UT transform ``(I + A)^{-1}`` by doubling blocks from the diagonal blocks of 4 (written
      entry by entry), ``sum over h = 4, 8, ..., C/2 of 2 C h^2``;
    - ``U~ = T diag(beta) V`` and ``W = T diag(beta Gamma) K``: ``2 C^2 (d_k + d_v)``;
    - reading the state, ``[W; Gamma Q] S``: ``4 C d_k d_v``; writing it, ``K_out^T U``: ``2 C d_k d_v``;
    - the outputs inside the chunk, ``(Q K^T) U``: ``2 C^2 d_v``.

    With ``C = 64`` and ``d_k = d_v = 128`` that is about 11.7 million FLOPs per chunk,
    0.75 GFLOP at ``T = 4096``. Only the matrix products are counted (a test counts
    the products the forms actually call); the elementwise work (decays, masks) is not.
    ``batch`` multiplies the count (sequences or heads). Scalars only.
    """
    t, d_k, d_v, chunk, batch = _chunk_sizes(seq_len, d_k, d_v, chunk_size, batch)
    check_layer_id(layer, (DELTA, GATED_DELTA, KDA), "layer")
    c = 1 << (chunk - 1).bit_length()
    n_chunks = max(1, -(-t // chunk))
    pairs = 2 * c * (c - 1) * d_k if layer == KDA else 4 * c * c * d_k
    inverse = sum(2 * c * h * h for h in (1 << j for j in range(2, c.bit_length() - 1)))
    per_chunk = (pairs + inverse + 2 * c * c * (d_k + d_v)
                 + 4 * c * d_k * d_v + 2 * c * d_k * d_v + 2 * c * c * d_v)
    return batch * n_chunks * per_chunk


def dplr_chunkwise_flops(seq_len, d_k, d_v, *, chunk_size=64, tied=False, batch=1) -> dict:
    """FLOPs of the matrix products of a chunkwise diagonal-plus-low-rank form, by part (``eq-fam-dplr``).

    ``tied=False`` counts :func:`fixedstate.delta_family.rwkv7_chunkwise`, the general form
    ``S_t = (Diag(w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T`` with three separate vectors
    (``eq-fam-rwkv7-chunk-u``, ``eq-fam-rwkv7-chunk-out``, ``eq-fam-rwkv7-chunk-state``);
    ``tied=True`` counts :func:`fixedstate.delta_rule.kda_chunkwise`, where the rank-one term
    and the write share the key (its total is :func:`delta_rule_chunkwise_flops` with
    ``layer="kda"``). Per chunk of ``C`` tokens (``chunk_size`` rounded up to a power of
    two), with ``n = ceil(T / chunk_size)`` chunks per sequence:

    - ``"pairs"``, the decayed pair matrices, level by level: general, four (``q b``,
      ``q k``, ``a b``, ``a k``) in one product of ``2h x 2h`` blocks per level,
      ``4 C (C - 1) d_k``; tied, two (``q k``, ``k k``), ``2 C (C - 1) d_k``;
    - ``"inverse"``, the unit lower-triangular inverse, ``sum over h = 4, ..., C/2 of 2 C h^2``;
    - ``"intra"``, the other products of a chunk's ``C x C`` matrices with its ``C x d``
      blocks: general ``2 C^2 d_k + 8 C^2 d_v``, tied ``2 C^2 d_k + 4 C^2 d_v``;
    - ``"state"``, products of the state's size ``d_k x d_v``: general ``8 C d_k d_v``,
      tied ``6 C d_k d_v``.

    Returns a dict with those four parts and their ``"total"``, each times ``n`` and
    ``batch``. Only matrix products are counted (a test records the products the forms
    call); the elementwise decays are not.
    """
    t, d_k, d_v, chunk, batch = _chunk_sizes(seq_len, d_k, d_v, chunk_size, batch)
    if not isinstance(tied, (bool, np.bool_)):
        raise ValueError(f"tied: expected True (KDA's tied vectors) or False (RWKV-7's general form), got {tied!r}")
    c = 1 << (chunk - 1).bit_length()
    n = batch * max(1, -(-t // chunk))
    parts = {
        "pairs": (2 if tied else 4) * c * (c - 1) * d_k,
        "inverse": sum(2 * c * h * h for h in (1 << j for j in range(2, c.bit_length() - 1))),
        "intra": 2 * c * c * d_k + (4 if tied else 8) * c * c * d_v,
        "state": (6 if tied else 8) * c * d_k * d_v,
    }
    parts = {name: n * value for name, value in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def chunkwise_profile(seq_len, d_k, d_v, *, chunk_size=64, bytes_per_element=2, state_bytes_per_element=4,
                      batch=1) -> dict:
    """Where the work of Gated DeltaNet's chunkwise form goes, and how much data it needs (``eq-fam-intensity``).

    ``"matmul_flops"`` are the matrix products, :func:`delta_rule_chunkwise_flops`
    (``layer="gated_delta"``). ``"elementwise_flops"`` counts the rest from the formulas,
    one FLOP per elementwise operation (an exponential counts as one), per chunk of ``C``
    tokens (``chunk_size`` rounded up to a power of two): the cumulative log-decays and
    their exponentials, ``2 C``; the decay mask ``exp(b_r - b_i)`` on the lower triangle and
    its application with ``beta`` to ``Q K^T`` and ``K K^T``, ``5 C^2``; the scalings of
    keys, queries and values by ``beta`` and the decays, ``4 C d_k + C d_v``; the two
    additions of ``C x d_v`` blocks, ``2 C d_v``; decaying and adding the state,
    ``2 d_k d_v``. ``"bytes"`` is the least data the form must move per sequence: reading
    ``q, k, v, beta, log_gate`` and writing the outputs at ``bytes_per_element`` (2 for
    bfloat16), and reading and writing the state once at ``state_bytes_per_element`` (4,
    float32), the state staying on chip from chunk to chunk as the fused kernels keep it.

    Two parts are also given on their own, because hardware runs them at other rates:
    ``"exponentials"``, the exponentials among the elementwise FLOPs (``C`` for the
    cumulative decays and ``C^2`` for the mask, per chunk), and ``"chunk_state_bytes"``,
    what writing the state at every chunk boundary once at ``state_bytes_per_element``
    adds to ``"bytes"`` (``d_k d_v`` numbers per chunk), as kernels that store the
    per-chunk states for a later stage do; it is not included in ``"bytes"``.

    Returns a dict with those counts (times ``batch``), ``"matmul_fraction"``
    (matrix products over all FLOPs) and ``"intensity"`` (all FLOPs per byte).
    """
    t, d_k, d_v, chunk, batch = _chunk_sizes(seq_len, d_k, d_v, chunk_size, batch, seq_minimum=1)
    b_in = _scalar(_count(bytes_per_element, "bytes_per_element", minimum=1), "bytes_per_element")
    b_state = _scalar(_count(state_bytes_per_element, "state_bytes_per_element", minimum=1),
                      "state_bytes_per_element")
    c = 1 << (chunk - 1).bit_length()
    n = max(1, -(-t // chunk))
    matmul = delta_rule_chunkwise_flops(t, d_k, d_v, chunk_size=chunk, layer=GATED_DELTA, batch=batch)
    elementwise = batch * n * (2 * c + 5 * c * c + 4 * c * d_k + 3 * c * d_v + 2 * d_k * d_v)
    moved = batch * (t * (2 * d_k + d_v + 2) * b_in + t * d_v * b_in + 2 * d_k * d_v * b_state)
    exponentials = batch * n * (c + c * c)
    chunk_states = batch * n * d_k * d_v * b_state
    total = matmul + elementwise
    return {"matmul_flops": matmul, "elementwise_flops": elementwise, "bytes": moved,
            "matmul_fraction": matmul / total, "intensity": total / moved,
            "exponentials": exponentials, "chunk_state_bytes": chunk_states}


# ---------------------------------------------------------------------------- state-space models (chapter 4's table)

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


# ---------------------------------------------------------------- the state at the end of a sequence (chapter 9)

def layer_state_bytes(layer_id, *, seq_len, d_k, d_v, n_heads=1, window=None, bytes_per_element=4) -> int:
    """Bytes of the state one layer keeps at the end of a sequence of ``seq_len`` tokens (``eq-sm-kv-cache``,
    ``eq-la-state-size``): the x-axis of chapter 9's recall-against-state figure.

    - a fixed-state layer (``"linear"``, ``"delta"``, ``"gated_delta"``, ``"kda"``,
      ``"ssm"``, ``"ssd"``): ``H * d_k * d_v`` numbers, whatever ``seq_len``
      (for the state-space layers ``d_k`` is the state size ``N`` and ``d_v`` the
      channels of a head, Mamba-2's ``B`` and ``x``);
    - ``"softmax"``: its KV cache, ``H * seq_len * (d_k + d_v)``;
    - ``"swa"``: its window cache, the last ``min(window - 1, seq_len)`` keys and
      values (:func:`fixedstate.softmax_attention.sliding_window_attention`):
      ``H * min(window - 1, seq_len) * (d_k + d_v)``;

    times ``bytes_per_element`` (4, float32, the default: the book trains in float32).
    The short convolutions' few tokens of cache are not counted (every mixer of
    the book's models has the same ones). Returns an int.
    """
    layer_id = check_layer_id(layer_id, tuple(i for i in LAYER_IDS if i != HYBRID), "layer_id")
    t = _count(seq_len, "seq_len", minimum=1)
    d_k, d_v = _count(d_k, "d_k", minimum=1), _count(d_v, "d_v", minimum=1)
    n_heads = _count(n_heads, "n_heads", minimum=1)
    if not all(isinstance(x, int) for x in (t, d_k, d_v, n_heads)):
        raise ValueError("seq_len, d_k, d_v, n_heads: expected single integers, got an array")
    b = _bytes_per_element(bytes_per_element)
    if layer_id == SWA:
        if window is None:
            raise ValueError("window: expected the window (an integer >= 1) for the 'swa' layer, got None")
        kept = min(check_positive_int(window, "window") - 1, t)
        return n_heads * kept * (d_k + d_v) * b
    if window is not None:
        raise ValueError(f"window: expected None for the {layer_id!r} layer (only 'swa' has a window), "
                         f"got {window!r}")
    if layer_id == SOFTMAX:
        return n_heads * t * (d_k + d_v) * b
    return n_heads * d_k * d_v * b


def model_state_bytes(layers, *, seq_len, d_k, d_v, n_heads=1, window=None, bytes_per_element=4) -> int:
    """The state a stack keeps at the end of a sequence: :func:`layer_state_bytes` summed over ``layers``.

    ``layers``: the layer ids of the stack, in order (e.g. a hybrid's
    ``("gated_delta", "softmax")``: its fixed state plus its KV cache); ``window``
    is used by its ``"swa"`` layers only. Returns an int.
    """
    if isinstance(layers, str) or not hasattr(layers, "__iter__") or not len(layers):
        raise ValueError(f"layers: expected a non-empty sequence of layer ids, got {layers!r}")
    return sum(layer_state_bytes(i, seq_len=seq_len, d_k=d_k, d_v=d_v, n_heads=n_heads,
                                 window=window if i == SWA else None, bytes_per_element=bytes_per_element)
               for i in layers)
