"""The internal layer of the chunked kernels: the array-level parts several modules share.

The public modules (:mod:`fixedstate.delta_rule`, :mod:`fixedstate.delta_family`,
:mod:`fixedstate.gated_linear_attention`, :mod:`fixedstate.ssm`,
:mod:`fixedstate.softmax_attention`, :mod:`fixedstate.recall`, ...) validate their
arguments, broadcast and flatten the leading axes, and call the functions here on
plain arrays. Nothing here validates its input: every function takes arrays of the
shapes its docstring states (a leading axis ``B`` for the flattened batch and heads)
and trusts them. What lives here is what more than one module needs:

- the chunk machinery of the delta rule family: splitting a sequence into chunks
  (:func:`chunk_grid`, :func:`split_chunks`), the overflow-safe per-channel pair
  decays built level by level over halves of a chunk (:func:`chunk_decays`, shared by
  KDA and GLA, on :func:`levels` and :func:`block_view`, which RWKV-7's pairs use too),
  the unit-lower-triangular inverse of the UT transform (:func:`unit_lower_inverse`,
  also RWKV-7's), the chunk-to-chunk state pass (:func:`state_pass`) and
  the chunkwise driver (:func:`delta_chunks`, which DeltaProduct reuses), with the
  one-token and token-scan forms beside it (:func:`delta_step`, :func:`delta_scan`);
- the unchecked scans that a layer and the recall lab's memories share: :func:`delta_scan`,
  linear attention's :func:`additive_scan`, and :func:`ssd_state`, the state a scalar-decay
  state-space head leaves, in matrix form (each can return the states at several prefixes);
- every matrix product of the chunkwise delta rule (:func:`matmul`,
  :func:`matmul_add`), which :func:`recording_products` can record (the product
  counts and the replay of :mod:`fixedstate.timing`);
- the group size of the chunked forms (:data:`GROUP_BYTES`, :data:`RANGE_BYTES`) and the one
  formula that turns it into chunks (:func:`chunks_per_group`);
- the pieces of the chunkwise backward passes (chapter 9, ``eq-bw-chunk-ut``,
  ``eq-bw-chunk-state``): the chunked tokens (:func:`chunk_tokens`), the scalar decays of
  each chunk (:func:`scalar_chunk_decays`), the gradient of the log-decays from the
  gradients of those decays (:func:`chunk_gate_gradient`, which the delta rule's and the
  additive backward share), and the chunked backward of gated linear attention
  (:func:`additive_chunks_backward`, which linear attention's and the SSD's call);
- the arithmetic of the blocks (:mod:`fixedstate.blocks`) with the forward's values kept
  for the backward: RMSNorm and L2 normalisation (:func:`rms_norm_parts`,
  :func:`l2_normalize_parts` and their gradients), a projection's gradient
  (:func:`linear_grad`), SiLU and the MLP (:func:`silu_parts`, :func:`mlp_parts` and their
  gradients), the short convolution's taps (:func:`conv_taps`, :func:`conv_grad`), which the
  blocks' public functions and chapter 9's training step (:mod:`fixedstate.training`, which
  validates its parameters once per step) share;
- :func:`flat`, which merges leading axes; the softmax attention's
  :func:`row_softmax` and :func:`softmax_scale`; the SSM's :func:`segment_sums` and
  the pair scan :func:`scan_pairs` behind :func:`fixedstate.ssm.associative_scan`.

A module never reaches into another module's private names
(``tests/test_package_layout.py``): what two modules share comes from here, under a
public name. The results are bit for bit those of the public forms that call them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import numpy as np
from scipy.linalg import blas as scipy_blas
from scipy.special import expit

from ._threads import one_blas_thread
from ._validate import as_float_array

__all__ = [
    "flat", "chunk_grid", "split_chunks", "levels", "block_view", "chunk_decays", "unit_lower_inverse",
    "matmul", "matmul_add", "recording_products",
    "GROUP_BYTES", "RANGE_BYTES", "chunks_per_group",
    "scalar_prep", "kda_prep", "state_pass", "delta_chunks", "delta_step", "delta_scan", "additive_scan",
    "chunk_tokens", "unchunk", "scalar_chunk_decays", "chunk_gate_gradient", "additive_chunks_backward",
    "ssd_decay_mask", "ssd_state",
    "row_softmax", "softmax_scale", "segment_sums", "scan_pairs",
    "rms_norm_parts", "rms_norm_grad", "l2_normalize_parts", "l2_normalize_grad", "linear_grad",
    "silu_parts", "silu_grad", "mlp_parts", "mlp_grad", "conv_taps", "conv_grad",
]


# --------------------------------------------------------------------------- leading axes

def flat(x, lead, n_core):
    """``x`` with its leading axes ``lead`` merged into one: ``(*lead, *core) -> (prod(lead), *core)``.

    ``n_core`` is the number of trailing axes kept (2 for ``(T, d)``, 1 for ``(T,)``);
    a view when possible; None stays None (an argument left out).
    """
    return None if x is None else x.reshape((math.prod(lead),) + x.shape[x.ndim - n_core:])



# --------------------------------------------------------------------------- the delta rule, token by token

def delta_step(q, k, v, beta, log_gate, S, scale, channelwise):
    """One token of the delta rule, ``eq-dr-gated`` (``eq-dr-kda`` if ``channelwise``) then ``eq-dr-readout``.

    ``q, k``: (..., d_k); ``v``: (..., d_v); ``beta``: (...); ``log_gate``: (...) (a
    scalar gate), (..., d_k) (``channelwise``, KDA's) or None (DeltaNet); ``S``: the
    (..., d_k, d_v) state before the token, or None (zeros). Returns the output
    (..., d_v) and the new state (the one passed in is not modified).
    """
    if S is None:
        S = np.zeros(q.shape[:-1] + (q.shape[-1], v.shape[-1]), dtype=q.dtype)
    if log_gate is not None:
        decay = np.exp(log_gate)                                       # exponent <= 0
        S = S * (decay[..., :, None] if channelwise else decay[..., None, None])
    error = v - np.matmul(k[..., None, :], S)[..., 0, :]              # v - (G S)^T k
    S = S + (beta[..., None] * k)[..., :, None] * error[..., None, :]  # + beta k error^T
    o = np.matmul(q[..., None, :], S)[..., 0, :]                       # S_t^T q
    return (o * o.dtype.type(scale) if scale != 1.0 else o), S



@one_blas_thread
def delta_scan(q, k, v, beta, log_gate, S, scale, channelwise, *, marks=None):
    """The delta rule's scan over tokens (``eq-dr-gated``, ``eq-dr-kda``, ``eq-dr-readout``), one BLAS thread.

    ``q, k``: (B, T, d_k); ``v``: (B, T, d_v); ``beta``: (B, T); ``log_gate``: (B, T),
    (B, T, d_k) if ``channelwise``, or None; ``S``: (B, d_k, d_v) or None (zeros).
    Returns the outputs (B, T, d_v), times ``scale``, and the final state.

    ``q`` None makes no readouts (the outputs are None): a memory written and not
    read, as the recall lab's capacity curves write it. ``marks``, sorted token counts
    in ``[0, T]`` (repeats allowed), returns instead of the final state the list of
    the states after that many tokens (copies): one scan gives every prefix.
    The public forms of :mod:`fixedstate.delta_rule` and :mod:`fixedstate.recall`
    both call it, so their states are the same numbers.
    """
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = k.dtype
    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    beta_keys = beta[..., None] * k
    if log_gate is not None:
        decays = np.exp(log_gate)                                      # exponents <= 0
        decays = decays[..., None] if channelwise else decays[..., None, None]
    outputs = None if q is None else np.empty((B, T, d_v), dtype=dtype)
    taken, states = _mark_taker(marks, S)
    taken(0)
    if B == 1:  # one sequence: plain vector-matrix products are the fastest
        S2, k2, v2, bk2 = S[0], k[0], v[0], beta_keys[0]
        q2, out2 = (None, None) if q is None else (q[0], outputs[0])
        d2 = None if log_gate is None else decays[0]
        for t in range(T):
            if d2 is not None:
                S2 *= d2[t]
            error = v2[t] - k2[t] @ S2
            S2 += np.multiply.outer(bk2[t], error)
            if q2 is not None:
                out2[t] = q2[t] @ S2
            taken(t + 1)
    else:
        for t in range(T):
            if log_gate is not None:
                S *= decays[:, t]
            error = v[:, t] - np.matmul(k[:, t, None, :], S)[:, 0]
            S += beta_keys[:, t, :, None] * error[:, None, :]
            if q is not None:
                outputs[:, t] = np.matmul(q[:, t, None, :], S)[:, 0]
            taken(t + 1)
    if outputs is not None and scale != 1.0:
        outputs *= dtype.type(scale)
    return outputs, (S if marks is None else states)


def additive_scan(q, k, v, S, *, marks=None):
    """Linear attention's scan, ``S_t = S_{t-1} + k_t v_t^T`` and the read ``S_t^T q_t`` (``eq-la-recurrent``).

    ``q, k``: (..., T, r), the feature maps already applied (``q`` None: no reads);
    ``v``: (..., T, w); ``S``: (..., r, w) or None (zeros); the leading axes broadcast
    together. Returns the reads
    (..., T, w) (None without ``q``) and the final state, or with ``marks`` (sorted
    token counts in ``[0, T]``) the list of the states after that many tokens.
    :func:`fixedstate.linear_attention.linear_attention_recurrent` and the recall
    lab's additive memory both call it.
    """
    T, width = v.shape[-2], v.shape[-1]
    lead = np.broadcast_shapes(*(x.shape[:-2] for x in (q, k, v, S) if x is not None))
    state = np.zeros(lead + (k.shape[-1], width), dtype=v.dtype) if S is None else S.copy()
    reads = None if q is None else np.empty(lead + (T, width), dtype=v.dtype)
    taken, states = _mark_taker(marks, state)
    taken(0)
    for t in range(T):
        state += k[..., t, :, None] * v[..., t, None, :]                  # S_t = S_{t-1} + k_t v_t^T
        if q is not None:
            reads[..., t, :] = (q[..., t, None, :] @ state)[..., 0, :]    # S_t^T q_t
        taken(t + 1)
    return reads, (state if marks is None else states)


def _mark_taker(marks, state):
    """``(take, states)``: ``take(n)`` appends a copy of ``state`` to ``states`` once for each mark equal to n."""
    states = []
    if marks is None:
        return (lambda n: None), states
    pending = list(marks)[::-1]

    def take(n):
        while pending and pending[-1] == n:
            states.append(state.copy())
            pending.pop()
    return take, states


def ssd_decay_mask(log_gate):
    """The decay mask of a scalar-decay state-space head, ``eq-ssm-ssd-matrix``: ``(..., T, T)``.

    ``L[..., t, s] = exp(sum_{r=s+1}^{t} log_gate_r)`` for ``s <= t`` (:func:`segment_sums`),
    else 0; ``log_gate``: (..., T) (``a * delta`` in the chapter's notation).
    :func:`fixedstate.ssm.ssd_mask` checks its arguments and returns this;
    :func:`fixedstate.ssm.ssd_quadratic` and :func:`fixedstate.ssm.ssd_chunkwise` form
    their masks with it.
    """
    T = log_gate.shape[-1]
    return np.where(np.tri(T, dtype=bool), np.exp(segment_sums(log_gate)), 0.0)


def ssd_state(log_gate, B, V, S, *, mask=None):
    """The state a scalar-decay state-space head leaves after ``T`` tokens, in matrix form (``eq-ssm-ssd-matrix``).

    ``S_T = Gamma_T S_0 + sum_s L[T-1, s] B_s V_s^T`` with ``L`` the decay mask
    (:func:`ssd_decay_mask`, whose last row is used) and ``Gamma_T = exp(sum_r log_gate_r)``.
    ``log_gate``: (..., T) (``a * delta`` in the chapter's notation); ``B``: (..., T, N);
    ``V``: (..., T, P) (``delta * x``); ``S``: (..., N, P), or None for a zero state (the
    ``Gamma_T S_0`` term is then left out). ``mask``: the mask when the caller has formed it
    already (:func:`fixedstate.ssm.ssd_quadratic` and :func:`fixedstate.ssm.ssd_chunkwise`
    have, for their outputs); otherwise it is formed here. Returns (..., N, P).

    The SSD forms of :mod:`fixedstate.ssm` and the recall lab's SSM memory both take
    their states from this function, so they agree bit for bit.
    """
    if mask is None:
        mask = ssd_decay_mask(log_gate)
    written = np.swapaxes(B, -1, -2) @ (mask[..., -1, :, None] * V)
    if S is None:
        return written
    decay = np.exp(np.cumsum(log_gate, axis=-1))[..., -1]
    return decay[..., None, None] * S + written


# --------------------------------------------------------------------------- the chunk machinery
#
# How the fast form computes the decays inside a chunk. The decay between tokens i <= r
# of one chunk is e^{b_r - b_i} = alpha_{i+1} ... alpha_r, a product of per-token decays
# alpha_t = e^{log_gate_t} <= 1 (one per key channel for KDA). The products are built
# level by level. At level h the chunk is cut into aligned blocks of 2h tokens, each a
# first half F and a second half G of h tokens, and two running products are kept:
#
#   fwd[r]  = alpha_s ... alpha_r         (s the first token of r's block of h)
#   bwd[i]  = alpha_{i+1} ... alpha_e     (e the last token of i's block of h)
#
# For r in G and i in F the decay factors through the boundary between the halves:
# e^{b_r - b_i} = bwd[i] * fwd[r], two factors <= 1. Then the halves merge (fwd on G is
# multiplied by F's product, bwd on F by G's product) and h doubles. Every pair i < r
# meets at exactly one level. For Gated DeltaNet the factors are numbers: they fill the
# C x C decay matrix, which scales the products q_r^T k_i. For KDA they are vectors over
# the key channels and scale the rows of Q, K before the products, so each level's
# pairs are one batched matrix product (secondary chunking, down to single tokens).
# The only exponentials are alpha_t = e^{log_gate_t}: no exponent is ever positive, and
# no 1/Gamma is formed. At the top level fwd is Gamma_r = e^{b_r} and bwd is
# e^{b_C - b_i}, the two decays of eq-dr-chunk-out and eq-dr-chunk-state.
#
# The same levels invert the unit lower-triangular I + A of the UT transform: the inverse
# of a block of 2h tokens is [[T_F, 0], [-T_G A_GF T_F, T_G]] with T_F, T_G the inverses
# of its halves. Chunks that are not a power of two long get padding tokens (key 0,
# beta 0, log-decay 0) at their end, which change nothing.

# Every matrix product of the chunkwise delta rule goes through matmul or matmul_add, so that
# recording_products sees all of them (tests/test_costs.py counts them; timing replays them).
_RECORDER = contextvars.ContextVar("fixedstate_kernels_recorder", default=None)


@contextlib.contextmanager
def recording_products(on_product=None):
    """Record every product :func:`matmul` and :func:`matmul_add` make inside the ``with`` block.

    Yields a list that receives one step per product, in order, as
    ``(kind, a, b, out, keep, sign)``: kind ``"matmul"`` (``out = a @ b``, keep and sign 1)
    or ``"add"`` (``out <- keep * out + sign * a @ b``), with the arrays themselves (not
    copies). ``on_product(step)``, if given, is called with each step as it is recorded.
    The recording belongs to the running context (thread): products made in other
    threads are not recorded. An inner recording replaces an outer one until it ends;
    the outer one is back afterwards, also after an error. :func:`fixedstate.timing.products_replay`
    records a chunkwise form's products this way.
    """
    steps = []

    def record(step):
        steps.append(step)
        if on_product is not None:
            on_product(step)

    token = _RECORDER.set(record)
    try:
        yield steps
    finally:
        _RECORDER.reset(token)


def matmul(a, b, out=None):
    """``a @ b`` (``np.matmul``, into ``out`` if given): every plain product of the chunkwise forms.

    Any shapes ``np.matmul`` takes, ``(..., n, m) @ (..., m, p) -> (..., n, p)``. The same
    call as ``np.matmul``, recorded as ``("matmul", a, b, result, 1.0, 1.0)`` inside
    :func:`recording_products`.
    """
    res = np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
    record = _RECORDER.get()
    if record is not None:
        record(("matmul", a, b, res, 1.0, 1.0))
    return res


# The products that matmul_add does in one gemm call. scipy's BLAS (its own OpenBLAS build) is
# used for float64 only: in float32 its gemm ran about a fifth slower than numpy's on these shapes
# (64 to 128 rows and columns), more than the passes over the result that it saves.
_GEMM = {np.dtype(np.float64): scipy_blas.dgemm}


def _fortran(x):
    """``(y, trans)`` with ``y`` F-contiguous and ``op(y) = x^T`` for BLAS, or None if x is neither layout."""
    if x.flags.c_contiguous:
        return x.T, 0
    if x.flags.f_contiguous:
        return x, 1
    return None


def _product_add(a, b, out, keep, sign):
    """:func:`matmul_add` without the recording."""
    gemm = _GEMM.get(out.dtype)
    fa, fb = _fortran(a), _fortran(b)
    if gemm is None or fa is None or fb is None or not out.flags.c_contiguous or a.dtype != out.dtype \
            or b.dtype != out.dtype:
        product = np.matmul(a, b)
        if keep != 1.0:
            out *= keep
        if sign != 1.0:
            product *= sign
        out += product
        return out
    # in Fortran's column-major view out is out^T: out^T <- keep out^T + sign b^T a^T
    (y_b, trans_b), (y_a, trans_a) = fb, fa
    res = gemm(float(sign), y_b, y_a, beta=float(keep), c=out.T, trans_a=trans_b, trans_b=trans_a, overwrite_c=1)
    if not np.shares_memory(res, out):
        out[...] = res.T
    return out


def matmul_add(a, b, out, keep, sign=1.0):
    """``out <- keep * out + sign * (a @ b)`` for 2-D arrays in one BLAS call (gemm's alpha and beta).

    ``a`` (n, m), ``b`` (m, p), ``out`` (n, p) C-contiguous, updated in place and
    returned. A state update ``S <- g S + K^T U`` or ``U <- U~ - W S`` without the
    passes over the result that scaling, adding or subtracting would take (in float64;
    in float32 a product followed by the scaling and the addition). Counted like a
    product of ``a`` and ``b``; recorded as ``("add", a, b, out, keep, sign)`` inside
    :func:`recording_products`.
    """
    res = _product_add(a, b, out, keep, sign)
    record = _RECORDER.get()
    if record is not None:
        record(("add", a, b, out, float(keep), float(sign)))
    return res


def levels(C):
    """The half-block sizes h = 1, 2, 4, ..., C/2 of a chunk of C (a power of two) tokens, a generator.

    At level h the chunk is cut into aligned blocks of 2h tokens, each two halves of h
    (see the comment above :func:`matmul`).
    """
    h = 1
    while h < C:
        yield h
        h *= 2


def block_view(x, h, row0, col0):
    """A writable view (N, C/(2h), h, h) of blocks of x (N, R, C), a C-contiguous array.

    Block j is x[:, row0 + 2hj : row0 + 2hj + h, col0 + 2hj : col0 + 2hj + h]: with
    (row0, col0) = (h, 0) the lower-left quarters of the diagonal blocks of 2h, with
    (0, 0) and (h, h) their two diagonal halves.
    """
    N, R, C = x.shape
    item = x.itemsize
    return np.ndarray((N, C // (2 * h), h, h), x.dtype, x, offset=(row0 * C + col0) * item,
                      strides=(R * C * item, 2 * h * (C + 1) * item, C * item, item))


def chunk_decays(alpha, decay=None, q=None, k=None, qk=None, kk=None):
    """Decays inside each chunk, level by level; for KDA (and GLA) also the decayed pair products.

    The decays of ``eq-dr-chunk-out`` and ``eq-dr-chunk-state`` (``eq-fam-gla-chunk-out``
    for GLA), built as products of per-token decays <= 1, never from ``1/Gamma``.

    ``alpha``: (N, C) per-token decays (Gated DeltaNet) or (N, C, d_k) (KDA), C a
    power of two. Returns ``gamma`` (e^{b_r}, shaped like alpha) and ``to_end``
    (e^{b_C - b_i}). Scalar gates: writes e^{b_r - b_i} (i < r) into ``decay``
    (N, C, C). Per-channel gates: writes the decayed products sum_c q_rc k_ic
    e^{b_rc - b_ic} (i < r) into ``qk`` and the same with k_r into ``kk``.
    """
    N, C = alpha.shape[:2]
    channels = alpha.shape[2:]
    fwd = alpha.copy()
    bwd = np.ones_like(alpha)
    for h in levels(C):
        shape = (N, C // (2 * h), 2, h) + channels
        f, b = fwd.reshape(shape), bwd.reshape(shape)
        if not channels:
            np.multiply(f[:, :, 1, :, None], b[:, :, 0, None, :], out=block_view(decay, h, h, 0))
        else:
            qb, kb = q.reshape(shape), k.reshape(shape)
            left = np.empty((N, C // (2 * h), 2 * h) + channels, dtype=alpha.dtype)
            np.multiply(qb[:, :, 1], f[:, :, 1], out=left[:, :, :h])       # q_r fwd[r], r in G
            np.multiply(kb[:, :, 1], f[:, :, 1], out=left[:, :, h:])       # k_r fwd[r]
            right = kb[:, :, 0] * b[:, :, 0]                                 # k_i bwd[i], i in F
            both = matmul(left, right.swapaxes(-1, -2))                     # (N, C/2h, 2h, h)
            block_view(qk, h, h, 0)[...] = both[:, :, :h]
            block_view(kk, h, h, 0)[...] = both[:, :, h:]
        b[:, :, 0] *= f[:, :, 1, -1:]                                        # bwd over F: times G's product
        f[:, :, 1] *= f[:, :, 0, -1:]                                        # fwd over G: times F's product
    return fwd, bwd


def unit_lower_inverse(a):
    """(I + A)^{-1} for A the strictly lower part of ``a`` (N, C, C), by doubling blocks.

    The UT transform of ``eq-dr-ut``. C is a power of two; returns the (N, C, C)
    inverse, unit lower triangular.

    The blocks of 4 on the diagonal are written entry by entry (forward
    substitution, each entry one array over all blocks); from there the blocks
    double by products.
    """
    N, C, _ = a.shape
    inv = np.zeros((N, C, C), dtype=a.dtype)
    inv.reshape(N, C * C)[:, ::C + 1] = 1.0
    first = 1
    if C >= 4:
        item = a.itemsize
        strides = (C * C * item, 4 * (C + 1) * item, C * item, item)     # the (N, C/4, 4, 4) diagonal blocks
        d = np.ndarray((N, C // 4, 4, 4), a.dtype, a, strides=strides)
        t = np.ndarray((N, C // 4, 4, 4), a.dtype, inv, strides=strides)
        for r in range(1, 4):                                             # t_rc = -(a_rc + sum_{c<j<r} a_rj t_jc)
            for c in range(r - 1, -1, -1):
                acc = t[..., r, c]
                np.multiply(d[..., r, c], -1.0, out=acc)
                for j in range(c + 1, r):
                    acc -= d[..., r, j] * t[..., j, c]
        first = 4
    for h in levels(C):
        if h < first:
            continue
        a_gf = block_view(a, h, h, 0)
        t_gf = block_view(inv, h, h, 0)
        # (np.multiply by -1, not np.negative: numpy 2.4's negative misreads some strided views)
        if h == 1:
            np.multiply(a_gf, -1.0, out=t_gf)
        else:
            a_t = matmul(a_gf, block_view(inv, h, 0, 0))
            a_t *= -1.0
            matmul(block_view(inv, h, h, h), a_t, out=t_gf)
    return inv


def scalar_prep(k, beta, alpha):
    """Gated DeltaNet (and DeltaNet): the chunkwise form's C x C work that does not involve Q.

    ``k``: (n, C, d_k) with C a power of two; ``beta``: (n, C, 1); ``alpha``: the
    per-token decays e^{log_gate}, (n, C). Returns the decay matrices
    e^{b_r - b_i} (n, C, C; one on the diagonal, zero above it); the UT transform
    T = (I + A)^{-1} with A_ri = beta_r e^{b_r - b_i} k_r^T k_i for i < r (eq-dr-ut),
    its columns scaled by beta and by beta Gamma (T diag(beta) V is U~, T diag(beta
    Gamma) K is W); and ``gamma`` = e^{b_r}, ``to_end`` = e^{b_C - b_r}, (n, C, 1).
    """
    n, C = alpha.shape
    decay = np.zeros((n, C, C), dtype=alpha.dtype)
    decay.reshape(n, C * C)[:, ::C + 1] = 1.0
    gamma, to_end = chunk_decays(alpha, decay=decay)
    a = matmul(k, k.swapaxes(-1, -2))
    a *= decay
    a *= beta
    ut_beta = unit_lower_inverse(a)
    ut_beta *= beta.swapaxes(-1, -2)
    ut_beta_gamma = ut_beta * gamma[:, None, :]
    return decay, (ut_beta, ut_beta_gamma), gamma[..., None], to_end[..., None]


def kda_prep(q, k, beta, alpha):
    """KDA: the chunkwise form's C x C work, the pair products with per-channel decays.

    ``q, k``: (n, C, d_k) with C a power of two; ``beta``: (n, C, 1); ``alpha``:
    (n, C, d_k). Returns ``qk`` (the decayed q_r^T k_i for i <= r, zero above the
    diagonal), the UT transform (eq-dr-ut), and ``gamma``, ``to_end`` (n, C, d_k).
    """
    n, C, d_k = k.shape
    qk = np.zeros((n, C, C), dtype=k.dtype)
    a = np.zeros((n, C, C), dtype=k.dtype)
    gamma, to_end = chunk_decays(alpha, q=q, k=k, qk=qk, kk=a)
    qk.reshape(n, C * C)[:, ::C + 1] = np.einsum("nrc,nrc->nr", q, k)
    a *= beta
    return qk, unit_lower_inverse(a), gamma, to_end


def state_pass(q, k, v, beta, qk, ut, gamma, to_end, S, channelwise):
    """The rest of the chunkwise form for a group of consecutive chunks of B sequences (``eq-dr-ut``,
    ``eq-dr-chunk-out``, ``eq-dr-chunk-state``): the state carried from chunk to chunk.

    ``q, k, v``: (B, g, C, d); ``beta``: (B, g, C, 1); ``qk``, ``ut``, ``gamma``,
    ``to_end``: as :func:`kda_prep` returns them, for the B * g chunks (for
    scalar gates ``ut`` is the pair T diag(beta), T diag(beta Gamma) of
    :func:`scalar_prep`); ``S``: the
    (B, d_k, d_v) states entering the group, updated in place. Returns the
    (B, g, C, d_v) outputs (unscaled). Every product that does not involve the
    carried state is done for all B * g chunks at once.
    """
    B, g, C, d_k = k.shape
    d_v = v.shape[-1]
    dtype = k.dtype
    n = B * g
    q, k, v, beta = (x.reshape((n,) + x.shape[2:]) for x in (q, k, v, beta))
    # eq-dr-ut: U~ = T diag(beta) V and W = T diag(beta Gamma) K; W and Gamma Q both read the state
    reads = np.empty((n, 2 * C, d_k), dtype=dtype)                                # [W; Gamma Q]
    np.multiply(q, gamma, out=reads[:, C:])
    if not channelwise:                                                           # T's columns scaled, not V and K
        u_free = matmul(ut[0], v)
        matmul(ut[1], k, out=reads[:, :C])
    else:
        u_free = matmul(ut, v * beta)
        matmul(ut, k * (gamma * beta), out=reads[:, :C])
    k_out_t = (k * to_end).swapaxes(-1, -2)                                      # (e^{b_C - b_i} k_i)^T
    decay_last = gamma[:, -1, :, None]                                            # (n, 1 or d_k, 1)

    # The only sequential part: carry the state from chunk to chunk.
    reads, u_free, k_out_t, decay_last = (x.reshape((B, g) + x.shape[1:])
                                          for x in (reads, u_free, k_out_t, decay_last))
    read = np.empty((B, g, 2 * C, d_v), dtype=dtype)                             # [W S; Gamma Q S]
    u = np.empty((B, g, C, d_v), dtype=dtype)
    write = np.empty((B, d_k, d_v), dtype=dtype)
    if B == 1:  # one sequence: plain matrix products
        S2, write2 = S[0], write[0]
        for j in range(g):
            matmul(reads[0, j], S2, out=read[0, j])
            np.subtract(u_free[0, j], read[0, j, :C], out=u[0, j])               # U = U~ - W S
            if channelwise:                                                       # eq-dr-chunk-state
                S2 *= decay_last[0, j]
                S2 += matmul(k_out_t[0, j], u[0, j], out=write2)
            else:                                                                 # S <- g S + K_out^T U
                matmul_add(k_out_t[0, j], u[0, j], S2, decay_last[0, j, 0, 0])
    else:
        for j in range(g):
            matmul(reads[:, j], S, out=read[:, j])
            np.subtract(u_free[:, j], read[:, j, :C], out=u[:, j])
            S *= decay_last[:, j]
            S += matmul(k_out_t[:, j], u[:, j], out=write)
    out = matmul(qk, u.reshape(n, C, d_v))                                       # eq-dr-chunk-out
    out += read.reshape(n, 2 * C, d_v)[:, C:]
    return out.reshape(B, g, C, d_v)


# The chunks of a call are processed in groups: a block of sequences times consecutive
# chunks whose (tokens x d) arrays take about GROUP_BYTES (256 tokens of d = 128 in
# float64, 512 in float32), so that a group's intermediate arrays stay in the processor's
# cache while numpy's per-call overhead is spread over several chunks. For Gated DeltaNet
# the C x C work that does not involve the queries (decays, UT transform: many small
# calls) is done for ranges of chunks whose C x C arrays take up to RANGE_BYTES. The
# result depends on neither size.
#
# GROUP_BYTES is the one group size of every chunked form (the delta rule's, RWKV-7's in
# delta_family, GLA's), and chunks_per_group the one formula that turns it into a number of
# chunks: group_tokens = max(C, GROUP_BYTES // (d * itemsize)) tokens (d = max(d_k, d_v), C
# the padded chunk size), shared by the sequences placed side by side in a group.
GROUP_BYTES = 256 * 1024
RANGE_BYTES = 8 * 1024 * 1024


def chunks_per_group(chunk, width, itemsize, *, sequences=1, group_bytes=None):
    """How many consecutive chunks go into one group: at least one, and about ``group_bytes`` in all.

    A group holds ``sequences`` sequences side by side, each with the same consecutive
    chunks of ``chunk`` tokens whose rows are ``width`` numbers of ``itemsize`` bytes
    (``width = max(d_k, d_v)``). Its tokens number ``max(chunk, group_bytes // (width *
    itemsize))`` (at least one chunk; ``group_bytes`` defaults to :data:`GROUP_BYTES`),
    split among the sequences: ``max(1, tokens // (chunk * sequences))`` chunks each. With
    ``sequences=1`` it is also how many sequences of one chunk fit side by side. Every
    chunked form (:func:`delta_chunks`, GLA's, RWKV-7's) sizes its groups with it.
    """
    group_bytes = GROUP_BYTES if group_bytes is None else group_bytes
    tokens = max(chunk, group_bytes // (width * itemsize))
    return max(1, tokens // (chunk * sequences))


def chunk_grid(T, chunk_size):
    """``(C2, n)``: how a sequence of ``T`` tokens is cut into chunks of ``C = chunk_size`` tokens.

    ``n = ceil(T / C)`` chunks (at least one), each padded to ``C2``, C rounded up
    to a power of two (the levels of :func:`chunk_decays` halve a chunk down to
    single tokens).
    """
    return 1 << (chunk_size - 1).bit_length(), max(1, -(-T // chunk_size))


def split_chunks(x, fill=0.0, *, chunk_size):
    """``x`` (B, T, ...) as (B, n, C2, ...): n = ceil(T / C) chunks of C = ``chunk_size`` tokens, each padded
    with ``fill`` to C2, C rounded up to a power of two (a view when no padding is needed).

    The chunkwise forms pad with tokens that change nothing (key 0, decay 1).
    """
    B, T = x.shape[:2]
    C = chunk_size
    C2, n = chunk_grid(T, C)
    if n * C == T and C2 == C:
        return x.reshape((B, n, C) + x.shape[2:])
    out = np.full((B, n, C2) + x.shape[2:], fill, dtype=x.dtype)
    full = (T // C) * C
    out[:, :T // C, :C] = x[:, :full].reshape((B, T // C, C) + x.shape[2:])
    if full < T:
        out[:, -1, :T - full] = x[:, full:]
    return out


@one_blas_thread
def delta_chunks(q, k, v, beta, log_gate, S, scale, chunk_size, channelwise, *, group_bytes=None,
                 range_bytes=None):
    """The delta rule's chunkwise form (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``), one BLAS thread.

    ``q, k``: (B, T, d_k); ``v``: (B, T, d_v); ``beta``: (B, T); ``log_gate``: (B, T)
    (scalar gates), (B, T, d_k) (``channelwise``, KDA's) or None (DeltaNet); ``S``:
    (B, d_k, d_v) or None (zeros); ``chunk_size`` an integer >= 1. Returns the outputs
    (B, T, d_v), times ``scale``, and the final state (B, d_k, d_v). The public
    ``*_chunkwise`` forms of :mod:`fixedstate.delta_rule` and
    :func:`fixedstate.delta_family.deltaproduct_chunkwise` call it.

    ``group_bytes`` and ``range_bytes`` (default :data:`GROUP_BYTES`,
    :data:`RANGE_BYTES`) size the groups of chunks processed together; the result
    does not depend on them (the tests pass small ones to cross many groups).
    """
    range_bytes = RANGE_BYTES if range_bytes is None else range_bytes
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    C = chunk_size
    C2, n = chunk_grid(T, C)                        # n chunks, C rounded up to a power of two

    chunks = functools.partial(split_chunks, chunk_size=C)

    # Padding tokens have key 0, beta 0 and decay 1: they leave the state unchanged.
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    betac = chunks(beta)[..., None]
    if log_gate is None:
        alpha = np.ones((B, n, C2) + ((d_k,) if channelwise else ()), dtype=dtype)
    else:
        alpha = chunks(np.exp(log_gate), fill=1.0)   # the per-token decays, exponents <= 0

    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    out = np.empty((B, n, C2, d_v), dtype=dtype)
    width, item = max(d_k, d_v), dtype.itemsize
    per_block = chunks_per_group(C2, width, item, group_bytes=group_bytes)   # sequences side by side
    for i0 in range(0, B, per_block):
        items = slice(i0, min(B, i0 + per_block))
        m = items.stop - i0
        group = chunks_per_group(C2, width, item, sequences=m, group_bytes=group_bytes)   # consecutive chunks
        span = group * max(1, range_bytes // (group * m * C2 * C2 * dtype.itemsize))
        S_items = S[items]
        for r0 in range(0, n, span):
            r = slice(r0, min(n, r0 + span))
            merge = lambda x: x.reshape((-1,) + x.shape[2:])     # (m, chunks, ...) -> (m * chunks, ...)
            if not channelwise:
                decay, (ut_beta, ut_beta_gamma), gamma, to_end = scalar_prep(
                    merge(kc[items, r]), merge(betac[items, r]), merge(alpha[items, r]))
                prep = [x.reshape((m, r.stop - r0) + x.shape[1:])
                        for x in (decay, ut_beta, ut_beta_gamma, gamma, to_end)]
            for g0 in range(r0, r.stop, group):
                sl = slice(g0, min(r.stop, g0 + group))
                q_g, k_g, v_g, beta_g = (x[items, sl] for x in (qc, kc, vc, betac))
                if channelwise:
                    qk, ut, gamma, to_end = kda_prep(merge(q_g), merge(k_g), merge(beta_g), merge(alpha[items, sl]))
                else:
                    decay, ut_beta, ut_beta_gamma, gamma, to_end = (merge(x[:, g0 - r0:sl.stop - r0]) for x in prep)
                    ut = (ut_beta, ut_beta_gamma)
                    qk = matmul(merge(q_g), merge(k_g).swapaxes(-1, -2))
                    qk *= decay
                out[items, sl] = state_pass(q_g, k_g, v_g, beta_g, qk, ut, gamma, to_end, S_items, channelwise)
        S[items] = S_items
    outputs = out[:, :, :C].reshape(B, n * C, d_v)[:, :T]
    if scale != 1.0:
        outputs = outputs * dtype.type(scale)
    return outputs, S


# --------------------------------------------------------------------------- chunkwise backward passes
#
# The backward passes of the chunked forms (chapter 9, "How a chunkwise backward follows"). Both run the
# same three passes, and neither takes states stored by the forward: the chunk states again (forwards over
# the chunks, S_0 of every chunk; no state inside a chunk is formed), the state's
# gradient (backwards over the chunks, dS_C of every chunk: eq-bw-chunk-state), then every chunk's
# gradients at once, as products of (C, C) and (C, d) blocks. The decays inside a chunk are products of
# per-token decays <= 1 (chunk_decays), and the gradients of the log-decays are read off the gradients of
# those products (chunk_gate_gradient).

def chunk_tokens(x, chunk_size, fill=0.0):
    """``x`` (B, T, ...) cut into chunks and merged: (B * n, C2, ...), C2 the padded chunk (:func:`split_chunks`)."""
    c = split_chunks(x, fill, chunk_size=chunk_size)
    return c.reshape((-1,) + c.shape[2:])


def scalar_chunk_decays(log_gate, chunk_size, dtype):
    """The decays of every chunk for scalar gates (``eq-dr-chunk-out``, ``eq-dr-chunk-state``).

    ``log_gate``: (B, T) log-decays <= 0. Returns ``decay``
    (N, C2, C2) with ``e^{b_r - b_i}`` for ``i <= r`` and 0 above the diagonal, ``gamma``
    ``e^{b_r}`` and ``to_end`` ``e^{b_C - b_r}`` (N, C2), N = B n the chunks of
    :func:`chunk_tokens`; padding tokens have decay 1.
    """
    B, T = log_gate.shape
    C2, n = chunk_grid(T, chunk_size)
    N = B * n
    alpha = chunk_tokens(np.exp(log_gate), chunk_size, fill=1.0).astype(dtype, copy=False)
    decay = np.zeros((N, C2, C2), dtype=dtype)
    decay.reshape(N, C2 * C2)[:, ::C2 + 1] = 1.0
    gamma, to_end = chunk_decays(alpha, decay=decay)
    return decay, gamma, to_end


def chunk_gate_gradient(z, d_gamma, d_to_end, gamma, to_end):
    """The gradient of each token's log-decay from the gradients of its chunk's decays (chapter 9).

    Inside a chunk the forms read the log-decays ``gamma_t`` only through the partial sums
    ``b_r = gamma_1 + ... + gamma_r``, in three kinds of decay: ``D_ri = e^{b_r - b_i}``
    (``i <= r``), ``Gamma_r = e^{b_r}`` and ``e^{b_C - b_r}``. ``z``: (N, C, C), the gradient of
    ``D`` times ``D`` entry by entry; ``d_gamma``, ``d_to_end``: (N, C), the gradients of the
    other two; ``gamma``, ``to_end``: (N, C), their values. With ``db_r`` the gradient of
    ``b_r`` (row sum minus column sum of ``z``, plus ``Gamma_r dGamma_r``, minus
    ``e^{b_C - b_r} d(e^{b_C - b_r})``, and their sum at ``r = C``), the gradient of
    ``gamma_t`` is ``sum_{r >= t} db_r``. Returns (N, C).
    """
    ends = to_end * d_to_end
    db = z.sum(axis=-1) - z.sum(axis=-2) + gamma * d_gamma - ends
    db[:, -1] += ends.sum(axis=-1)
    return np.cumsum(db[:, ::-1], axis=-1)[:, ::-1]


@one_blas_thread
def additive_chunks_backward(q, k, v, log_gate, S, d_out, d_final, scale, chunk_size):
    """The chunked backward of (gated) linear attention, ``eq-bw-la-state`` chunk by chunk; one BLAS thread.

    The forward is ``S_t = g_t S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t`` with
    ``g_t = e^{log_gate_t}``; per chunk (``eq-la-chunkwise`` with decays) ``O = c (diag(Gamma) Q S_0
    + M V)`` and ``S_C = Gamma_C S_0 + Kbar^T V``, ``M = Q K^T o D``, ``Kbar = diag(e^{b_C - b}) K``.
    Backwards, ``dS_0 = Gamma_C dS_C + c Q^T diag(Gamma) dO`` carries the state's gradient over the
    chunks, and inside a chunk ``dV = c M^T dO + Kbar dS_C``, ``dM = c dO V^T``,
    ``dQ = (dM o D) K + c diag(Gamma) dO S_0^T``, ``dK = (dM o D)^T Q + diag(e^{b_C - b}) V dS_C^T``.

    ``q, k``: (B, T, d_k); ``v``, ``d_out``: (B, T, d_v); ``log_gate``: (B, T) or None;
    ``S``, ``d_final``: (B, d_k, d_v) or None (zeros). Returns ``dq, dk, dv`` (B, T, d), ``dlog_gate``
    (B, T) or None, and the gradient of the initial state (B, d_k, d_v).
    :func:`fixedstate.linear_attention.linear_attention_chunkwise_backward` and
    :func:`fixedstate.ssm.ssd_chunkwise_backward` call it.
    """
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = v.dtype
    C2, n = chunk_grid(T, chunk_size)
    N = B * n
    Q, K, V = (chunk_tokens(x, chunk_size) for x in (q, k, v))
    G = chunk_tokens(d_out, chunk_size)
    if scale != 1.0:
        G = G * dtype.type(scale)
    if log_gate is None:
        decay = np.broadcast_to(np.tri(C2, dtype=dtype), (N, C2, C2))
        gamma = to_end = None
    else:
        decay, gamma, to_end = scalar_chunk_decays(log_gate, chunk_size, dtype)
    Kbar = K if to_end is None else K * to_end[..., None]
    # the chunk states S_0 of every chunk, forwards over the chunks
    written = matmul(Kbar.swapaxes(-1, -2), V).reshape(B, n, d_k, d_v)
    last = None if gamma is None else gamma[:, -1].reshape(B, n)
    starts = np.empty((B, n, d_k, d_v), dtype=dtype)
    state = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.astype(dtype, copy=True)
    for j in range(n):
        starts[:, j] = state
        if last is not None:
            state *= last[:, j, None, None]
        state += written[:, j]
    # the state's gradient dS_C of every chunk, backwards over the chunks (eq-bw-chunk-state without the erase)
    QG = Q if gamma is None else Q * gamma[..., None]
    read = matmul(QG.swapaxes(-1, -2), G).reshape(B, n, d_k, d_v)
    d_ends = np.empty((B, n, d_k, d_v), dtype=dtype)
    dS = np.zeros((B, d_k, d_v), dtype=dtype) if d_final is None else d_final.astype(dtype, copy=True)
    for j in range(n - 1, -1, -1):
        d_ends[:, j] = dS
        if last is not None:
            dS *= last[:, j, None, None]
        dS += read[:, j]
    starts, d_ends = starts.reshape(N, d_k, d_v), d_ends.reshape(N, d_k, d_v)
    # every chunk's gradients at once
    M = matmul(Q, K.swapaxes(-1, -2))
    M *= decay
    dM = matmul(G, V.swapaxes(-1, -2))                                # c dO V^T (only i <= r is read)
    dP = dM * decay
    dv = matmul(M.swapaxes(-1, -2), G)
    dv += matmul(Kbar, d_ends)
    dq = matmul(dP, K)
    dq += matmul(G, starts.swapaxes(-1, -2)) * (1.0 if gamma is None else gamma[..., None])
    V_dS = matmul(V, d_ends.swapaxes(-1, -2))                         # V dS_C^T, the gradient of Kbar
    dk = matmul(dP.swapaxes(-1, -2), Q)
    dk += V_dS if to_end is None else V_dS * to_end[..., None]
    dlog = None
    if gamma is not None:
        z = dM * M                                                    # dD o D
        d_gamma = np.einsum("ncp,ncp->nc", matmul(Q, starts), G)
        d_gamma[:, -1] += np.einsum("nkp,nkp->n", starts, d_ends)     # Gamma_C S_0 in S_C
        d_to_end = np.einsum("nck,nck->nc", V_dS, K)
        dlog = chunk_gate_gradient(z, d_gamma, d_to_end, gamma, to_end)
        dlog = unchunk(dlog[..., None], B, T, chunk_size)[..., 0]
    return (unchunk(dq, B, T, chunk_size), unchunk(dk, B, T, chunk_size), unchunk(dv, B, T, chunk_size),
            dlog, dS)


def unchunk(x, B, T, chunk_size):
    """The inverse of :func:`chunk_tokens`: (B * n, C2, d) back to (B, T, d), the padding dropped."""
    C2, n = chunk_grid(T, chunk_size)
    x = x.reshape(B, n, C2, x.shape[-1])[:, :, :chunk_size]
    return x.reshape(B, n * chunk_size, x.shape[-1])[:, :T]


# --------------------------------------------------------------------------- softmax attention's rows

def softmax_scale(scale, d_k: int) -> float:
    """The score scale of softmax attention (``eq-sm-scores``): ``scale``, or ``1/sqrt(d_k)`` when it is None.

    ``scale`` a positive number (a 0-d array is fine) or None; ``d_k`` the key width.
    Returns a Python float; ``ValueError`` naming ``scale`` if it is not positive.
    """
    if scale is None:
        return 1.0 / float(np.sqrt(d_k))
    arr = as_float_array(scale, "scale", ndim=0)
    value = float(arr)
    if not value > 0:
        raise ValueError(f"scale: expected a positive number (or None for 1/sqrt(d_k)), got {value!r}")
    return value


def row_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax along the last axis (``eq-sm-causal``), with -inf entries (masked) getting weight 0.

    ``scores`` (..., n); returns weights of the same shape, each row summing to 1. The
    row's maximum is subtracted first, so no exponent is positive.
    """
    shifted = scores - np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(shifted)
    return weights / np.sum(weights, axis=-1, keepdims=True)


# --------------------------------------------------------------------------- the state space models' sums and scan

def segment_sums(log_gate: np.ndarray) -> np.ndarray:
    """``seg[..., t, s] = sum_{r=s+1}^{t} log_gate[..., r]`` for ``s <= t``, else 0.

    The exponents of the decay mask of ``eq-ssm-ssd-matrix``. ``log_gate`` (..., T);
    returns (..., T, T).

    Formed segment by segment (cumulative sums down each column below the
    diagonal), not as differences of one cumulative sum: no cancellation on long
    sequences, and never a positive exponent when the gates are ``<= 0``.
    """
    T = log_gate.shape[-1]
    rep = np.where(np.tri(T, k=-1, dtype=bool), log_gate[..., :, None], 0.0)
    return np.cumsum(rep, axis=-2)


def scan_pairs(a: np.ndarray, b: np.ndarray):
    """Inclusive scan of the pairs (a_t, b_t) under ``eq-ssm-scan-op``; returns the cumulative (a, b).

    ``a``, ``b``: (T, ...) of one shape, T >= 1, time first. Entry t of the result is
    the composition of steps 1..t, so the cumulative ``b`` is ``h_t`` of
    ``h_t = a_t h_{t-1} + b_t`` from ``h_0 = 0``. Recursive: each call that recurses
    does one pairing level (and a fill-in level when T > 2);
    :func:`fixedstate.ssm.associative_scan` validates and calls it.
    """
    T = a.shape[0]
    if T == 1:
        return a, b
    m = T // 2
    a_l, a_r = a[0:2 * m:2], a[1:2 * m:2]
    b_l, b_r = b[0:2 * m:2], b[1:2 * m:2]
    # combine each even element with its right neighbour: one level
    a_half, b_half = scan_pairs(a_l * a_r, a_r * b_l + b_r)
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


# --------------------------------------------------------------------------- the blocks' arithmetic

def rms_norm_parts(x, eps):
    """RMSNorm without its weight: ``(normed, r)`` with ``r = 1 / sqrt(mean(x^2) + eps)`` over the last axis.

    ``x`` ``(..., d)``; ``normed = x / sqrt(mean(x^2) + eps)`` ``(..., d)`` and ``r`` ``(..., 1)``,
    which :func:`rms_norm_grad` reuses (``eq-tr-rms-grad``).
    """
    root = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x / root, 1 / root


def rms_norm_grad(normed, r, d_out, weight):
    """The gradients of RMSNorm (``eq-tr-rms-grad``) from :func:`rms_norm_parts`: ``(dx, dweight)``.

    With ``g = d_out * weight``: ``dx = r g - r normed mean(g normed)``; ``dweight`` sums
    ``d_out * normed`` over the leading axes (None when ``weight`` is None). ``normed``,
    ``d_out`` ``(..., d)``, ``r`` ``(..., 1)``, ``weight`` ``(d,)`` or None.
    """
    dweight = None
    if weight is not None:
        dweight = (d_out * normed).reshape(-1, normed.shape[-1]).sum(axis=0)
        d_out = d_out * weight
    return r * d_out - r * normed * np.mean(d_out * normed, axis=-1, keepdims=True), dweight


def l2_normalize_parts(x, eps):
    """``(y, r)``: ``y = x / sqrt(sum(x^2) + eps)`` over the last axis and ``r = 1 / sqrt(sum(x^2) + eps)``.

    ``x`` ``(..., d)``; ``y`` ``(..., d)``, ``r`` ``(..., 1)``, which :func:`l2_normalize_grad` reuses.
    """
    root = np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)
    return x / root, 1 / root


def l2_normalize_grad(y, r, d_out):
    """The gradient of L2 normalisation (``eq-tr-l2-grad``): ``r (d_out - y (y . d_out))``, ``(..., d)``."""
    return r * (d_out - y * np.sum(y * d_out, axis=-1, keepdims=True))


def linear_grad(x, weight, d_out):
    """The gradients of ``x @ weight`` (``eq-tr-linear-grad``): ``(dx, dweight)``.

    ``x`` ``(..., d_in)``, ``weight`` ``(d_in, d_out)``, ``d_out`` ``(..., d_out)``;
    ``dx = d_out W^T`` and ``dweight = X^T d_out`` over the rows of every leading axis.
    """
    return d_out @ weight.T, x.reshape(-1, x.shape[-1]).T @ d_out.reshape(-1, d_out.shape[-1])


def silu_parts(u):
    """``(h, s)``: SiLU ``h = u s`` with ``s = sigmoid(u)``, kept for :func:`silu_grad`. Any shape."""
    s = expit(u)
    return u * s, s


def silu_grad(u, s, d_out):
    """The gradient through SiLU (``eq-tr-act-grads``): ``d_out s (1 + u (1 - s))``, ``s = sigmoid(u)``."""
    return d_out * s * (1 + u * (1 - s))


def mlp_parts(x, W_1, W_2):
    """The SiLU MLP ``silu(x W_1) W_2`` (``eq-tr-mlp-grad``): ``(out, (u, s, h))``, the inner values kept.

    ``x`` ``(..., d)``, ``W_1`` ``(d, d_ff)``, ``W_2`` ``(d_ff, d_out)``; ``u = x W_1``,
    ``s = sigmoid(u)``, ``h = u s``.
    """
    u = x @ W_1
    h, s = silu_parts(u)
    return h @ W_2, (u, s, h)


def mlp_grad(x, inner, W_1, W_2, d_out):
    """The gradients of :func:`mlp_parts` from its kept ``inner = (u, s, h)``: ``(dx, dW_1, dW_2)``."""
    u, s, h = inner
    dh, dW_2 = linear_grad(h, W_2, d_out)
    dx, dW_1 = linear_grad(x, W_1, silu_grad(u, s, dh))
    return dx, dW_1, dW_2


def conv_taps(weight, padded, T):
    """The short causal convolution (``eq-tr-model``, whose gradient is ``eq-tr-conv-grad``) of ``padded`` ``(..., K-1+T, d)``, the ``K - 1`` inputs
    before the sequence then its ``T`` tokens, with ``weight`` ``(d, K)``: ``(..., T, d)``,
    ``sum_j weight[:, j] * padded[..., j:j+T, :]`` accumulated in the order ``j = 0, ..., K-1``."""
    y = weight[:, 0] * padded[..., 0:T, :]
    for j in range(1, weight.shape[1]):
        y += weight[:, j] * padded[..., j:j + T, :]
    return y


def conv_grad(weight, padded, d_y, T, d_padded=None):
    """The gradients of :func:`conv_taps` (``eq-tr-conv-grad``): ``(d_padded, dweight)``.

    ``d_y`` ``(..., T, d)``; tap ``j`` sends ``weight[:, j] * d_y`` back to ``padded[..., j:j+T, :]``
    and its weight gathers ``d_y * padded[..., j:j+T, :]`` over every row. ``d_padded`` (the
    shape of ``padded``), if given, already holds a gradient and is added to in place.
    """
    if d_padded is None:
        d_padded = np.zeros(padded.shape, dtype=np.result_type(padded, d_y))
    dweight = np.empty(weight.shape, dtype=d_padded.dtype)
    for j in range(weight.shape[1]):
        d_padded[..., j:j + T, :] += weight[:, j] * d_y
        dweight[:, j] = (d_y * padded[..., j:j + T, :]).reshape(-1, padded.shape[-1]).sum(axis=0)
    return d_padded, dweight
