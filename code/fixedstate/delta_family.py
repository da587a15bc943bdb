"""The delta rule's relatives: DeltaProduct, RWKV-7, Longhorn, and parity with negative eigenvalues.

Chapter "One family, one algorithm" (``chap-one-family``). Every layer keeps a state
``S`` of shape ``(d_k, d_v)`` (the book's orientation: a write is ``k v^T``, a
read is ``S^T q``), and each update is ``S_t = M_t S_{t-1} + (write)`` with a
``(d_k, d_k)`` transition ``M_t`` acting on the key side:

- **DeltaProduct** (Siems et al. 2025): ``n_h`` delta-rule steps per token,
  each a generalised Householder factor ``I - beta_j k_j k_j^T``: the
  transition is their product, identity plus rank ``n_h``
  (:func:`deltaproduct_step`, :func:`deltaproduct_recurrent`,
  :func:`deltaproduct_chunkwise`). With ``n_h = 1`` it is DeltaNet, or Gated
  DeltaNet with a gate.
- **RWKV-7** (Peng et al. 2025): a diagonal decay plus a rank-one term,
  ``M_t = Diag(w_t) + b_t a_t^T`` (:func:`rwkv7_step`, :func:`rwkv7_recurrent`,
  :func:`rwkv7_chunkwise`).
- **Longhorn** (Liu et al. 2025): an elementwise (diagonal in the vectorised
  state) approximation of the delta rule's implicit update
  (:func:`longhorn_recurrent`).

The objective behind each update (``eq-fam-regression`` to ``eq-fam-implicit``): every
layer's update is one step of an online learner on a loss of the state.
:func:`regression_objective` is the delta rule's ``1/2 |S^T k - v|^2``,
:func:`score_objective` linear attention's ``-<S^T k, v>``, :func:`decay_objective` the
weight-decay penalty a decay shrinks by, and :func:`implicit_regression_step` the exact
(proximal) step on the regression that Longhorn approximates.

Negative eigenvalues. The erase factor ``I - beta k k^T`` has eigenvalue
``1 - beta |k|^2`` along ``k``. With unit keys and ``beta`` in [0, 1] it lies in
[0, 1]; with ``beta`` in [0, 2] it reaches -1, a reflection. The functions here
accept ``beta`` in [0, 2] (those of :mod:`fixedstate.delta_rule` keep [0, 1]):
:func:`deltaproduct_recurrent` with ``n_h = 1`` is DeltaNet with the extended
range. :func:`parity_delta_rule` uses it to track the parity of a bit string
exactly, at any length; :func:`diagonal_parity_layer` is the diagonal,
positive-decay layer that cannot (:func:`sign_changes` counts what its readout
can do on a string of ones, the heart of the argument).

Arguments follow the package: ``q, k, v`` positionally, the rest by keyword;
every function returns ``(outputs, final_state)``; leading axes broadcast;
float32 in, float32 out; ``ValueError`` naming the argument on bad input.
"""

from __future__ import annotations

import math

import numpy as np

from ._threads import one_blas_thread
from ._validate import (Arg, as_float_array, as_float_batch, broadcast_leading, check_interval, check_log_gate,
                        check_positive_int, check_real_number, float_dtype, prepare_layer_args)
from .gated_linear_attention import gla_recurrent
from .kernels import (block_view, chunk_grid, chunks_per_group, delta_chunks, flat, levels, matmul, split_chunks,
                      unit_lower_inverse)

__all__ = [
    "deltaproduct_step", "deltaproduct_recurrent", "deltaproduct_chunkwise",
    "rwkv7_step", "rwkv7_recurrent", "rwkv7_chunkwise", "longhorn_recurrent",
    "parity_delta_rule", "diagonal_parity_layer", "fit_diagonal_parity", "sign_changes", "parity",
    "regression_objective", "score_objective", "decay_objective", "implicit_regression_step",
]


# --------------------------------------------------------------------------- DeltaProduct

def _at_least_one_step(k):
    if k.shape[-2] < 1:
        raise ValueError(f"k: expected at least one Householder step per token (n_h >= 1), got shape {k.shape}")
    return k


def _prepare_product(q, k, v, beta, log_gate, scale, initial_state, *, tokens=True):
    """Validate DeltaProduct's arguments; return lead, q, k, v, beta, log_gate, initial_state, scale."""
    lead, (q, k, v, beta, log_gate), initial_state, scale = prepare_layer_args(
        [Arg("q", q, ("T", "d_k")), Arg("k", k, ("T", "n_h", "d_k"), _at_least_one_step),
         Arg("v", v, ("T", "n_h", "d_v")),
         Arg("beta", beta, ("T", "n_h"), lambda x: check_interval(x, "beta", 0.0, 2.0)),
         Arg("log_gate", log_gate, ("T",), check_log_gate, allow_nonfinite=True)],
        initial_state=initial_state, scale=scale, tokens=tokens)
    return lead, q, k, v, beta, log_gate, initial_state, scale


def deltaproduct_step(q, k, v, *, beta, log_gate=None, scale=1.0, initial_state=None):
    """One DeltaProduct token, ``eq-fam-deltaproduct``: ``n_h`` delta-rule steps, then the readout.

    ``S <- g S`` with ``g = exp(log_gate)`` (once, if a gate is given), then for
    ``j = 1, ..., n_h`` in order ``S <- S + beta_j k_j (v_j - S^T k_j)^T``, i.e.
    ``S <- (I - beta_j k_j k_j^T) S + beta_j k_j v_j^T``, each step against the
    state the previous one left; ``o = scale * S^T q``.

    Parameters
    ----------
    q : (..., d_k). k : (..., n_h, d_k). v : (..., n_h, d_v).
    beta : (..., n_h) in [0, 2] (above 1 the erase factor's eigenvalue ``1 - beta |k|^2`` is negative for unit keys).
    log_gate : (...) log-decay <= 0, or None (no decay: DeltaProduct without gate).
    scale : readout scale. initial_state : (..., d_k, d_v) or None (zeros).

    Returns
    -------
    o : (..., d_v) array. state : (..., d_k, d_v) array (the one passed in is not modified).
    """
    lead, q, k, v, beta, g, S, scale = _prepare_product(q, k, v, beta, log_gate, scale, initial_state,
                                                        tokens=False)
    S = np.zeros(lead + (q.shape[-1], v.shape[-1]), dtype=q.dtype) if S is None else S.copy()
    if g is not None:
        S *= np.exp(g)[..., None, None]
    for j in range(k.shape[-2]):
        kj = k[..., j, :]
        error = v[..., j, :] - np.matmul(kj[..., None, :], S)[..., 0, :]       # v_j - S^T k_j
        S += (beta[..., j, None] * kj)[..., :, None] * error[..., None, :]    # + beta_j k_j error^T
    o = np.matmul(q[..., None, :], S)[..., 0, :]
    return (o * o.dtype.type(scale) if scale != 1.0 else o), S


@one_blas_thread
def _product_recurrent(q, k, v, beta, log_gate, S, scale):
    """q: (B, T, d_k); k: (B, T, n_h, d_k); v: (B, T, n_h, d_v); beta: (B, T, n_h); log_gate: (B, T) or None."""
    B, T, n_h, d_k = k.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    decays = None if log_gate is None else np.exp(log_gate)[..., None, None]
    beta_keys = beta[..., None] * k
    outputs = np.empty((B, T, d_v), dtype=dtype)
    for t in range(T):
        if decays is not None:
            S *= decays[:, t]                                                   # g_t S_{t-1}
        for j in range(n_h):                                                    # the n_h Householder steps
            error = v[:, t, j] - np.matmul(k[:, t, j, None, :], S)[:, 0]
            S += beta_keys[:, t, j, :, None] * error[:, None, :]
        outputs[:, t] = np.matmul(q[:, t, None, :], S)[:, 0]
    if scale != 1.0:
        outputs *= dtype.type(scale)
    return outputs, S


def deltaproduct_recurrent(q, k, v, *, beta, log_gate=None, scale=1.0, initial_state=None):
    """DeltaProduct over a sequence (``eq-fam-deltaproduct``), one token (and one Householder step) at a time.

    ``S_t = (prod_{j = n_h .. 1} (I - beta_tj k_tj k_tj^T)) g_t S_{t-1} + (the n_h writes)``:
    token ``t`` decays the state once (``g_t = exp(log_gate_t)``, or no decay
    when ``log_gate`` is None) and applies its ``n_h`` delta-rule steps in
    order; ``o_t = scale * S_t^T q_t`` reads the state after all of them.

    Parameters
    ----------
    q : (..., T, d_k). k : (..., T, n_h, d_k). v : (..., T, n_h, d_v).
    beta : (..., T, n_h) in [0, 2]. log_gate : (..., T) log-decays <= 0, or None.
    scale : readout scale. initial_state : (..., d_k, d_v) or None (zeros).

    Returns
    -------
    outputs : (..., T, d_v) array. final_state : (..., d_k, d_v) array.

    With ``n_h = 1`` this is :func:`fixedstate.delta_rule.delta_rule_recurrent`
    (no gate) or :func:`~fixedstate.delta_rule.gated_delta_rule_recurrent`,
    with ``beta`` allowed up to 2.
    """
    lead, q, k, v, beta, g, S, scale = _prepare_product(q, k, v, beta, log_gate, scale, initial_state)
    T, d_v = q.shape[-2], v.shape[-1]
    out, S = _product_recurrent(flat(q, lead, 2), flat(k, lead, 3), flat(v, lead, 3), flat(beta, lead, 2),
                                flat(g, lead, 1), flat(S, lead, 2), scale)
    return out.reshape(lead + (T, d_v)), S.reshape(lead + S.shape[1:])


def deltaproduct_chunkwise(q, k, v, *, beta, log_gate=None, scale=1.0, initial_state=None, chunk_size=64):
    """DeltaProduct in chunkwise form: Gated DeltaNet's chunkwise form on the sequence of Householder steps.

    The ``T`` tokens of ``n_h`` steps each are laid out as ``T n_h`` delta-rule
    steps; step ``j`` of token ``t`` carries ``k_tj, v_tj, beta_tj``, the gate
    ``log_gate_t`` on ``j = 1`` only (0 on the others) and the query ``q_t`` on
    ``j = n_h`` only (0 on the others, whose outputs are dropped). That
    sequence goes through :func:`fixedstate.delta_rule.gated_delta_rule_chunkwise`'s
    machinery (``eq-dr-ut``, ``eq-dr-chunk-out``, ``eq-dr-chunk-state``), so
    ``chunk_size`` counts Householder steps, not tokens. Arguments and results
    as :func:`deltaproduct_recurrent`.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    lead, q, k, v, beta, g, S, scale = _prepare_product(q, k, v, beta, log_gate, scale, initial_state)
    T, n_h, d_k = k.shape[-3:]
    d_v = v.shape[-1]
    B = math.prod(lead)
    qs = np.zeros((B, T, n_h, d_k), dtype=q.dtype)
    qs[:, :, -1] = flat(q, lead, 2)                                   # the query reads after the last step
    gs = np.zeros((B, T, n_h), dtype=q.dtype)
    if g is not None:
        gs[:, :, 0] = flat(g, lead, 1)                                # the decay comes before the first step
    out, S = delta_chunks(qs.reshape(B, T * n_h, d_k), flat(k, lead, 3).reshape(B, T * n_h, d_k),
                          flat(v, lead, 3).reshape(B, T * n_h, d_v), flat(beta, lead, 2).reshape(B, T * n_h),
                          gs.reshape(B, T * n_h), flat(S, lead, 2), scale, chunk_size, False)
    out = out.reshape(B, T, n_h, d_v)[:, :, -1]
    return np.ascontiguousarray(out).reshape(lead + (T, d_v)), S.reshape(lead + (d_k, d_v))


# --------------------------------------------------------------------------- RWKV-7

def _prepare_rwkv7(q, k, v, log_gate, a, b, scale, initial_state, *, tokens=True):
    lead, arrays, initial_state, scale = prepare_layer_args(
        [Arg("q", q, ("T", "d_k")), Arg("k", k, ("T", "d_k")), Arg("v", v, ("T", "d_v")),
         Arg("log_gate", log_gate, ("T", "d_k"), lambda x: check_log_gate(x, "log_gate"), allow_nonfinite=True),
         Arg("a", a, ("T", "d_k")), Arg("b", b, ("T", "d_k"))],
        initial_state=initial_state, scale=scale, tokens=tokens)
    return (lead, *arrays, initial_state, scale)


def rwkv7_step(q, k, v, *, log_gate, a, b, scale=1.0, initial_state=None):
    """One RWKV-7 token, ``eq-fam-rwkv7``: ``S_t = Diag(w_t) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T``.

    The transition ``M_t = Diag(w_t) + b_t a_t^T`` is diagonal plus rank one;
    ``w_t = exp(log_gate_t)`` (log-decays <= 0, one per key channel); the readout
    is ``o_t = scale * S_t^T q_t`` (``q`` is RWKV's receptance ``r``). The
    paper (RWKV-7 "Goose", Peng et al. 2025, its generalised delta rule) writes
    the state as ``(d_v, d_k)``, ``S_t = S_{t-1} (diag(w_t) - kappa_t^T (a_t o kappa_t)) + v_t^T k~_t``
    with ``kappa_t`` the L2-normalised removal key, ``a_t`` the in-context learning
    rate and ``k~_t`` the replacement key; transposed into the book's
    orientation that is this function with ``a = -kappa_t``,
    ``b = kappa_t o a_t`` (paper's ``a``) and ``k = k~_t``. Both ``a``, ``b``
    and the transition act on the *undecayed* ``S_{t-1}``, as in the paper's
    reference kernel (whose arguments are also called ``a``, ``b``).
    The gated delta rule is the choice ``log_gate = log g`` on every channel,
    ``a = -k``, ``b = g beta k`` and key ``beta k``.

    Parameters
    ----------
    q, k, log_gate, a, b : (..., d_k). v : (..., d_v).
    scale : readout scale. initial_state : (..., d_k, d_v) or None (zeros).

    Returns
    -------
    o : (..., d_v). state : (..., d_k, d_v).
    """
    lead, q, k, v, lw, a, b, S, scale = _prepare_rwkv7(q, k, v, log_gate, a, b, scale, initial_state, tokens=False)
    if S is None:
        S = np.zeros(lead + (q.shape[-1], v.shape[-1]), dtype=q.dtype)
    read = np.matmul(a[..., None, :], S)[..., 0, :]                          # a^T S_{t-1}, (..., d_v)
    S = np.exp(lw)[..., :, None] * S + b[..., :, None] * read[..., None, :] + k[..., :, None] * v[..., None, :]
    o = np.matmul(q[..., None, :], S)[..., 0, :]
    return (o * o.dtype.type(scale) if scale != 1.0 else o), S


@one_blas_thread
def _rwkv7_scan(q, k, v, log_gate, a, b, S, scale):
    B, T, d_k = q.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    w = np.exp(log_gate)[..., None]
    out = np.empty((B, T, d_v), dtype=dtype)
    for t in range(T):
        read = np.matmul(a[:, t, None, :], S)[:, 0]                           # a_t^T S_{t-1}
        S *= w[:, t]                                                          # Diag(w_t) S_{t-1}
        S += b[:, t, :, None] * read[:, None, :]                             # + b_t (a_t^T S_{t-1})
        S += k[:, t, :, None] * v[:, t, None, :]                             # + k_t v_t^T
        out[:, t] = np.matmul(q[:, t, None, :], S)[:, 0]
    if scale != 1.0:
        out *= dtype.type(scale)
    return out, S


def rwkv7_recurrent(q, k, v, *, log_gate, a, b, scale=1.0, initial_state=None):
    """RWKV-7's generalised delta rule over a sequence (``eq-fam-rwkv7``), token by token.

    As :func:`rwkv7_step` for every token: ``q, k, log_gate, a, b`` (..., T, d_k),
    ``v`` (..., T, d_v), ``initial_state`` (..., d_k, d_v) or None. Returns the
    outputs (..., T, d_v) and the final state.
    """
    lead, q, k, v, lw, a, b, S, scale = _prepare_rwkv7(q, k, v, log_gate, a, b, scale, initial_state)
    T, d_v = q.shape[-2], v.shape[-1]
    out, S = _rwkv7_scan(*(flat(x, lead, 2) for x in (q, k, v, lw, a, b, S)), scale)
    return out.reshape(lead + (T, d_v)), S.reshape(lead + S.shape[1:])


def _rwkv7_pairs(w, q, k, a, b):
    """Decays inside each chunk and the four decayed pair products of RWKV-7's chunkwise form.

    ``w``: (N, C, d_k) per-token decays (each in [0, 1]); ``q, k, a, b``: (N, C, d_k), C a
    power of two. Level by level over halves of the chunk, as
    :func:`fixedstate.kernels.chunk_decays`: a pair i < r in the halves F, G of a block
    factors through F's last token p. The output pairs (``eq-fam-rwkv7-chunk-out``) decay
    from i + 1 through r, ``fwd[r] bwd[i]`` with ``fwd`` inclusive (G's start through r); the
    removal reads (``eq-fam-rwkv7-chunk-u``) see the state *before* token r, so their pairs
    decay from i + 1 through r - 1, ``fwd_excl[r] bwd[i]`` with ``fwd_excl`` exclusive (G's
    start through r - 1). Both are products of decays <= 1; nothing is divided.

    Returns ``qb, qk`` (N, C, C; lower triangles *with* the diagonal q_r^T b_r, q_r^T k_r),
    ``ab, ak`` (strictly lower), and ``gamma`` (Gamma_r, through r), ``gamma_excl``
    (Gamma_{r-1}, through r - 1), ``to_end`` (from i + 1 through C), each (N, C, d_k).
    """
    N, C, d_k = w.shape
    dtype = w.dtype
    qb, qk, ab, ak = (np.zeros((N, C, C), dtype=dtype) for _ in range(4))
    fwd = w.copy()
    fwd_excl = np.ones_like(w)
    bwd = np.ones_like(w)
    for h in levels(C):
        shape = (N, C // (2 * h), 2, h, d_k)
        f, fe, bw = fwd.reshape(shape), fwd_excl.reshape(shape), bwd.reshape(shape)
        qs, ks, as_, bs = (x.reshape(shape) for x in (q, k, a, b))
        left = np.empty((N, C // (2 * h), 2 * h, d_k), dtype=dtype)
        np.multiply(qs[:, :, 1], f[:, :, 1], out=left[:, :, :h])              # q_r fwd[r], r in G
        np.multiply(as_[:, :, 1], fe[:, :, 1], out=left[:, :, h:])            # a_r fwd_excl[r]
        right = np.empty((N, C // (2 * h), 2 * h, d_k), dtype=dtype)
        np.multiply(bs[:, :, 0], bw[:, :, 0], out=right[:, :, :h])            # b_i bwd[i], i in F
        np.multiply(ks[:, :, 0], bw[:, :, 0], out=right[:, :, h:])            # k_i bwd[i]
        both = matmul(left, right.swapaxes(-1, -2))                            # (N, C/2h, 2h, 2h)
        block_view(qb, h, h, 0)[...] = both[:, :, :h, :h]
        block_view(qk, h, h, 0)[...] = both[:, :, :h, h:]
        block_view(ab, h, h, 0)[...] = both[:, :, h:, :h]
        block_view(ak, h, h, 0)[...] = both[:, :, h:, h:]
        bw[:, :, 0] *= f[:, :, 1, -1:]                                         # bwd over F: times G's product
        fe[:, :, 1] *= f[:, :, 0, -1:]                                         # both fwd over G: times F's
        f[:, :, 1] *= f[:, :, 0, -1:]
    diag = slice(None, None, C + 1)
    qb.reshape(N, C * C)[:, diag] = np.einsum("nrc,nrc->nr", q, b)           # i = r: no decay
    qk.reshape(N, C * C)[:, diag] = np.einsum("nrc,nrc->nr", q, k)
    return qb, qk, ab, ak, fwd, fwd_excl, bwd


def _rwkv7_group(qc, kc, vc, ac, bc, w, S):
    """One group of consecutive chunks of B sequences: ``qc, kc, ac, bc, w`` (B, g, C, d_k), ``vc``
    (B, g, C, d_v), C a power of two; ``S`` the (B, d_k, d_v) states entering the group, updated in
    place. Returns the (B, g, C, d_v) outputs (unscaled)."""
    B, g, C, d_k = kc.shape
    d_v = vc.shape[-1]
    dtype = kc.dtype
    flat = lambda x: x.reshape((B * g,) + x.shape[2:])
    qc, kc, vc, ac, bc = (flat(x) for x in (qc, kc, vc, ac, bc))
    qb, qk, ab, ak, gamma, gamma_excl, to_end = _rwkv7_pairs(flat(w), qc, kc, ac, bc)
    # eq-fam-rwkv7-chunk-u: (I - L_ab) U = L_ak V + (A o Gamma^-) S_0, so U = U~ + W S_0
    ut = unit_lower_inverse(-ab)                                              # (I - L_ab)^{-1}
    u_free = matmul(ut, matmul(ak, vc))                                       # U~ = T L_ak V
    reads = np.empty((B * g, 2 * C, d_k), dtype=dtype)                        # [W; Gamma o Q]
    matmul(ut, ac * gamma_excl, out=reads[:, :C])
    np.multiply(qc, gamma, out=reads[:, C:])
    b_end_t = (bc * to_end).swapaxes(-1, -2)                                  # (Gamma^-> o B)^T, (d_k, C)
    kv_end = matmul((kc * to_end).swapaxes(-1, -2), vc)                       # (Gamma^-> o K)^T V
    decay_last = gamma[:, -1, :, None]                                        # Gamma_C, (d_k, 1)

    # The only sequential part: carry the state from chunk to chunk (eq-fam-rwkv7-chunk-state).
    reads, u_free, b_end_t, kv_end, decay_last = (x.reshape((B, g) + x.shape[1:])
                                                  for x in (reads, u_free, b_end_t, kv_end, decay_last))
    read = np.empty((B, g, 2 * C, d_v), dtype=dtype)                          # [W S_0; (Gamma o Q) S_0]
    u = np.empty((B, g, C, d_v), dtype=dtype)
    for j in range(g):
        matmul(reads[:, j], S, out=read[:, j])
        np.add(u_free[:, j], read[:, j, :C], out=u[:, j])                     # U = U~ + W S_0
        S *= decay_last[:, j]
        S += matmul(b_end_t[:, j], u[:, j])
        S += kv_end[:, j]
    # eq-fam-rwkv7-chunk-out: O = (Gamma o Q) S_0 + P_qb U + P_qk V, for the group's chunks at once
    out = matmul(qb, u.reshape(B * g, C, d_v))
    out += matmul(qk, vc)
    out += read.reshape(B * g, 2 * C, d_v)[:, C:]
    return out.reshape(B, g, C, d_v)


@one_blas_thread
def rwkv7_chunks(q, k, v, log_gate, a, b, S, scale, chunk_size, *, group_bytes=None):
    """The kernel of :func:`rwkv7_chunkwise` on flattened arrays (``eq-fam-rwkv7-chunk-u``,
    ``eq-fam-rwkv7-chunk-out``, ``eq-fam-rwkv7-chunk-state``), one BLAS thread.

    ``q, k, log_gate, a, b``: (B, T, d_k); ``v``: (B, T, d_v); ``S``: (B, d_k, d_v) or None
    (zeros); ``chunk_size`` an integer >= 1. No validation: :func:`rwkv7_chunkwise`
    validates, flattens the leading axes and calls it (it is not in ``__all__``).
    Returns the outputs (B, T, d_v), times ``scale``, and the final state.

    The chunks go through :func:`_rwkv7_group` in groups of consecutive chunks whose
    (tokens x d) arrays take about ``group_bytes`` (default
    :data:`fixedstate.kernels.GROUP_BYTES`), so that a group's intermediate arrays
    stay in the processor's cache; the result does not depend on the group size
    (the tests pass small ones).
    """
    B, T, d_k = q.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    C = chunk_size
    C2, n = chunk_grid(T, C)                        # n chunks, C rounded up to a power of two

    def chunks(x, fill=0.0):
        return split_chunks(x, fill, chunk_size=C)

    # Padding tokens have q = k = v = a = b = 0 and decay 1: they leave the state unchanged.
    qc, kc, vc, ac, bc = (chunks(x) for x in (q, k, v, a, b))
    w = chunks(np.exp(log_gate), fill=1.0)              # per-token decays, exponents <= 0
    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    out = np.empty((B, n, C2, d_v), dtype=dtype)
    group = chunks_per_group(C2, max(d_k, d_v), dtype.itemsize, sequences=B, group_bytes=group_bytes)
    for g0 in range(0, n, group):
        sl = slice(g0, min(n, g0 + group))
        out[:, sl] = _rwkv7_group(qc[:, sl], kc[:, sl], vc[:, sl], ac[:, sl], bc[:, sl], w[:, sl], S)
    outputs = out[:, :, :C].reshape(B, n * C, d_v)[:, :T]
    if scale != 1.0:
        outputs = outputs * dtype.type(scale)
    return np.ascontiguousarray(outputs), S


def rwkv7_chunkwise(q, k, v, *, log_gate, a, b, scale=1.0, initial_state=None, chunk_size=64):
    """RWKV-7's generalised delta rule in chunkwise-parallel form (``eq-fam-rwkv7-chunk-u``,
    ``eq-fam-rwkv7-chunk-out``, ``eq-fam-rwkv7-chunk-state``).

    Same arguments and results as :func:`rwkv7_recurrent`, plus ``chunk_size`` (an
    integer >= 1; the length need not be a multiple of it; one that is not a power
    of two is padded up to one inside each chunk). Inside a chunk the removal reads
    ``u_r = S_{r-1}^T a_r`` solve a unit lower-triangular system (a UT transform, as
    the delta rule's ``eq-dr-ut``); outputs and the chunk-end state follow by matrix
    products. Decays between positions of a chunk are products of the per-token
    decays ``exp(log_gate) <= 1`` built level by level over halves of the chunk, so no
    exponent is ever positive and no decay is divided. The leading axes are
    processed inside the same matrix products; the products run with one BLAS thread.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    lead, q, k, v, lw, a, b, S, scale = _prepare_rwkv7(q, k, v, log_gate, a, b, scale, initial_state)
    T, d_v = q.shape[-2], v.shape[-1]
    out, S = rwkv7_chunks(*(flat(x, lead, 2) for x in (q, k, v, lw, a, b, S)), scale, chunk_size)
    return out.reshape(lead + (T, d_v)), S.reshape(lead + S.shape[1:])


# --------------------------------------------------------------------------- Longhorn

def _non_negative_steps(beta):
    if np.any(beta < 0):
        raise ValueError(f"beta: expected non-negative step sizes, got {float(beta.min())!r}")
    return beta


def longhorn_recurrent(q, k, v, *, beta, scale=1.0, initial_state=None):
    """Longhorn's recurrence (``eq-fam-longhorn``), in the book's orientation.

    ``eps_t = beta_t / (1 + beta_t |k_t|^2)`` (one step size per value channel),
    ``S_t = (1 - k_t^2 eps_t^T) o S_{t-1} + k_t (eps_t o v_t)^T`` (``k_t^2`` the
    entrywise square; ``o`` the entrywise product) and ``o_t = scale * S_t^T q_t``.
    It is the closed-form solution of the online regression
    ``min_S |S - S_{t-1}|^2 + beta |S^T k - v|^2`` for each value channel, with
    the rank-one erase ``k k^T`` kept only on its diagonal (Liu et al. 2025):
    a diagonal transition on the vectorised state, every factor in (0, 1].

    Parameters
    ----------
    q, k : (..., T, d_k). v : (..., T, d_v). beta : (..., T, d_v) non-negative.
    scale : readout scale. initial_state : (..., d_k, d_v) or None.

    Returns
    -------
    outputs : (..., T, d_v). final_state : (..., d_k, d_v).
    """
    lead, (q, k, v, beta), S, scale = prepare_layer_args(
        [Arg("q", q, ("T", "d_k")), Arg("k", k, ("T", "d_k")), Arg("v", v, ("T", "d_v")),
         Arg("beta", beta, ("T", "d_v"), _non_negative_steps)], initial_state=initial_state, scale=scale)
    T, d_k, d_v, dtype = q.shape[-2], q.shape[-1], v.shape[-1], q.dtype
    S = np.zeros(lead + (d_k, d_v), dtype=dtype) if S is None else S.copy()
    eps = beta / (1.0 + beta * np.sum(k * k, axis=-1, keepdims=True))       # (..., T, d_v)
    out = np.empty(lead + (T, d_v), dtype=dtype)
    for t in range(T):
        kt = k[..., t, :, None]
        S *= 1.0 - (kt * kt) * eps[..., t, None, :]
        S += kt * (eps[..., t, :] * v[..., t, :])[..., None, :]
        out[..., t, :] = np.matmul(q[..., t, None, :], S)[..., 0, :]
    if scale != 1.0:
        out *= dtype.type(scale)
    return out, S


# --------------------------------------------------------------------------- parity

def _bits(bits):
    arr = np.asarray(bits)
    if arr.ndim != 1 or arr.size < 1 or arr.dtype.kind not in "biu":
        raise ValueError(f"bits: expected a non-empty 1-d array of 0s and 1s (integer or bool), got shape "
                         f"{arr.shape} and dtype {arr.dtype}")
    if np.any((arr != 0) & (arr != 1)):
        raise ValueError(f"bits: expected only 0s and 1s, got the values {np.unique(arr)[:4].tolist()}")
    return arr.astype(np.int64)


def parity(bits):
    """The running parity of a bit string, ``p_t = (x_1 + ... + x_t) mod 2`` (``eq-fam-parity``), an int array like ``bits``."""
    return np.cumsum(_bits(bits)) % 2


def parity_delta_rule(bits, *, dtype=np.float64):
    """A constructed delta-rule layer that tracks parity, ``eq-fam-parity``: ``(predicted parity, outputs)``.

    One key channel and one value channel (``d_k = d_v = 1``), unit key
    ``k = 1``, and an extra first token with ``beta = 1``, ``v = 1`` that
    writes ``S_0 = 1``. Then bit ``x_t`` is the token ``k = 1, v = 0,
    beta = 2 x_t``: the erase factor ``1 - beta |k|^2`` is ``-1`` on a 1 bit (a
    reflection, the eigenvalue only ``beta`` in (1, 2] reaches) and ``1`` on a 0
    bit, and the write is zero, so ``S_t = (-1)^(x_1 + ... + x_t)``. The query
    ``q = 1`` reads it; the prediction is ``(1 - o_t) / 2``. Every operation
    multiplies by exactly ``+1`` or ``-1``, so the layer is exact at any length
    and in any precision. Runs :func:`deltaproduct_recurrent` with ``n_h = 1``
    (DeltaNet with ``beta`` in [0, 2]).

    Parameters
    ----------
    bits : 1-d array of 0s and 1s (any length >= 1, e.g. 10^4).
    dtype : float32 or float64, the precision the layer runs in.

    Returns
    -------
    predicted : int array like ``bits``, the predicted running parity.
    outputs : the layer's outputs ``o_t`` (``+1`` for even, ``-1`` for odd), in ``dtype``.
    """
    x = _bits(bits)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
    T = x.size + 1
    ones = np.ones((T, 1), dtype=dtype)
    v = np.zeros((T, 1, 1), dtype=dtype)
    v[0] = 1.0                                                                # the start token writes 1
    beta = np.concatenate([[1.0], 2.0 * x]).astype(dtype)[:, None]            # 2 on a 1 bit: eigenvalue -1
    out, _ = deltaproduct_recurrent(ones, ones[:, None, :], v, beta=beta)
    o = out[1:, 0]
    return np.rint((1.0 - o) / 2.0).astype(np.int64), o


def diagonal_parity_layer(bits, *, log_gates, keys, values, query, initial_state=None):
    """A diagonal positive-decay layer reading a bit string (GLA, ``eq-fam-gla``): its outputs ``(T, d_v)``.

    Bit ``x_t`` selects its token: log-decays ``log_gates[x_t]`` (per key
    channel, <= 0, so every decay lies in (0, 1]), key ``keys[x_t]`` and value
    ``values[x_t]``; the query is the same at every step. So
    ``S_t = Diag(alpha(x_t)) S_{t-1} + k(x_t) v(x_t)^T`` and ``o_t = S_t^T q``:
    any parameters a trained diagonal layer with positive decays could have.

    Why it cannot track parity: on the string ``1 1 1 ...`` every channel ``c``
    follows ``s_t = alpha_c s_{t-1} + w_c``, so ``s_t = u_c + e_c alpha_c^t``
    (or ``u_c + w_c t`` when ``alpha_c = 1``), and any linear readout is
    ``f(t) = c_0 + c_1 t + sum_c f_c alpha_c^t``: an exponential polynomial
    with at most ``d_k + 1`` terms, whose sign (after subtracting any threshold)
    changes at most ``d_k`` times in ``t`` (Descartes' rule of signs for
    exponential sums, all bases positive). The parity of ``1^t`` changes sign at
    every step. So on ``1^T`` the layer is wrong on at least about ``(T - d_k) / 2``
    positions, whatever its parameters; :func:`sign_changes` counts the changes.

    Parameters
    ----------
    bits : 1-d array of 0s and 1s.
    log_gates, keys : (2, d_k) arrays, row ``x`` for bit ``x``; ``log_gates <= 0``.
    values : (2, d_v). query : (d_k,). initial_state : (d_k, d_v) or None.

    Returns
    -------
    outputs : (T, d_v) array.
    """
    x = _bits(bits)
    log_gates = as_float_array(log_gates, "log_gates", ndim=2)
    if log_gates.shape[0] != 2:
        raise ValueError(f"log_gates: expected shape (2, d_k), one row per bit value, got {log_gates.shape}")
    d_k = log_gates.shape[1]
    keys = as_float_array(keys, "keys", shape=(2, d_k))
    values = as_float_array(values, "values", ndim=2)
    if values.shape[0] != 2:
        raise ValueError(f"values: expected shape (2, d_v), one row per bit value, got {values.shape}")
    query = as_float_array(query, "query", shape=(d_k,))
    check_log_gate(log_gates, "log_gates")
    q = np.broadcast_to(query, (x.size, d_k))
    out, _ = gla_recurrent(q, keys[x], values[x], log_gate=log_gates[x], initial_state=initial_state)
    return out


def fit_diagonal_parity(bits, log_gates, *, bias=True):
    """The best a diagonal positive-decay layer (``eq-fam-gla``) with these gates does on parity: ``(accuracy, outputs)``.

    With the decays fixed (``log_gates`` (2, d_k), row ``x`` for bit ``x``), the
    output of :func:`diagonal_parity_layer` with ``d_v = 1`` is linear in the
    per-bit writes ``w(x)_c = q_c k(x)_c v(x)``: channel ``c`` holds
    ``sum_{i<=t} (prod_{i<j<=t} alpha_c(x_j)) w(x_i)_c``. So the writes that
    best fit the target ``+1`` (even) / ``-1`` (odd) in least squares are one
    linear solve (plus a constant if ``bias``). Returns the fraction of
    positions where the sign of the fitted output matches the parity, and the
    fitted outputs. The fit is on the same string it is scored on, which
    favours the layer.
    """
    x = _bits(bits)
    log_gates = check_log_gate(as_float_array(log_gates, "log_gates", ndim=2), "log_gates")
    if log_gates.shape[0] != 2:
        raise ValueError(f"log_gates: expected shape (2, d_k), one row per bit value, got {log_gates.shape}")
    d_k = log_gates.shape[1]
    T = x.size
    alpha = np.exp(log_gates[x])                                   # (T, d_k)
    features = np.zeros((T, 2 * d_k + bool(bias)))                 # channel c's state for a unit write of each bit
    state = np.zeros((2, d_k))
    for t in range(T):
        state *= alpha[t]
        state[x[t]] += 1.0
        features[t, :2 * d_k] = state.ravel()
    if bias:
        features[:, -1] = 1.0
    target = 1.0 - 2.0 * (np.cumsum(x) % 2)
    coef, *_ = np.linalg.lstsq(features, target, rcond=None)
    fitted = features @ coef
    return float(np.mean(np.sign(fitted) == target)), fitted


def sign_changes(values, threshold=0.0):
    """How many times ``values - threshold`` changes sign along its (1-d) axis; exact zeros are skipped.

    On a string of ones every entry of a diagonal positive-decay layer's state
    is monotone (``eq-fam-monotone``), of the form ``u + e alpha^t`` (or
    ``u + w t``), so a linear readout of ``d_k`` channels changes sign at most
    ``d_k`` times (:func:`diagonal_parity_layer`), while the parity changes at
    every step.
    """
    arr = as_float_array(values, "values", ndim=1)
    threshold = check_real_number(threshold, "threshold")
    s = np.sign(arr - threshold)
    s = s[s != 0]
    return int(np.count_nonzero(s[1:] != s[:-1]))


# --------------------------------------------------------------------------- the objective behind each update

def _prepare_objective(state, k, v):
    """Validate ``state`` (..., d_k, d_v), ``k`` (..., d_k), ``v`` (..., d_v); cast to one dtype."""
    dtype = float_dtype(state, k, v)
    S = as_float_batch(state, "state", (None, None), ("d_k", "d_v"))
    d_k, d_v = S.shape[-2:]
    k = as_float_batch(k, "k", (d_k,), ("d_k",))
    v = as_float_batch(v, "v", (d_v,), ("d_v",))
    broadcast_leading(("state", S, 2), ("k", k, 1), ("v", v, 1))
    return (x.astype(dtype, copy=False) for x in (S, k, v))


def regression_objective(state, k, v):
    """The delta rule's loss and its gradient in the state, ``eq-fam-regression``.

    ``L(S) = 1/2 |S^T k - v|^2``, the squared error of the state read as a linear
    map from keys to values, and ``grad L(S) = k (S^T k - v)^T``. One gradient
    step of size ``beta`` from ``S`` is DeltaNet's update, ``S - beta grad L(S)
    = (I - beta k k^T) S + beta k v^T``; taken from the decayed state it is
    Gated DeltaNet's (scalar decay) or KDA's (a decay per key channel).

    Parameters
    ----------
    state : (..., d_k, d_v). k : (..., d_k). v : (..., d_v). Leading axes broadcast.

    Returns
    -------
    loss : (...) array. gradient : (..., d_k, d_v) array, the shape of the state.
    """
    S, k, v = _prepare_objective(state, k, v)
    error = np.matmul(k[..., None, :], S)[..., 0, :] - v                    # S^T k - v, (..., d_v)
    return 0.5 * np.sum(error * error, axis=-1), k[..., :, None] * error[..., None, :]


def score_objective(state, k, v):
    """Linear attention's loss and its gradient, ``eq-fam-score``: ``L(S) = -<S^T k, v> = -k^T S v``, ``grad = -k v^T``.

    The loss rewards the state for reading ``v`` from ``k`` in proportion, without
    bound: it is linear in ``S``, so a step never stops writing. One gradient step
    of size 1 is linear attention's update ``S + k v^T``; from the decayed state
    it is GLA's (a decay per channel), RetNet's, Mamba-2's, or with step ``i_t``
    the mLSTM's.

    Parameters
    ----------
    state : (..., d_k, d_v). k : (..., d_k). v : (..., d_v). Leading axes broadcast.

    Returns
    -------
    loss : (...) array. gradient : (..., d_k, d_v) array.
    """
    S, k, v = _prepare_objective(state, k, v)
    read = np.matmul(k[..., None, :], S)[..., 0, :]                          # S^T k
    gradient = -(k[..., :, None] * v[..., None, :])
    return -np.sum(read * v, axis=-1), np.broadcast_to(gradient, np.broadcast_shapes(gradient.shape, S.shape)).copy()


def decay_objective(state, *, log_gate):
    """The weight-decay penalty behind a decay, ``eq-fam-decay``, and its gradient.

    ``R(S) = 1/2 sum_c (1 - alpha_c) |S_c|^2`` over the rows ``S_c`` of the state
    (one per key channel), ``alpha = exp(log_gate)``; ``grad R(S) = Diag(1 - alpha) S``.
    One gradient step of size 1 on ``R`` is the decay itself,
    ``S - grad R(S) = Diag(alpha) S``: a shrinkage of each row towards zero.

    Parameters
    ----------
    state : (..., d_k, d_v). log_gate : (..., d_k) log-decays <= 0 (a scalar decay
    is the same entry in every channel).

    Returns
    -------
    loss : (...) array. gradient : (..., d_k, d_v) array.
    """
    dtype = float_dtype(state, log_gate)
    S = as_float_batch(state, "state", (None, None), ("d_k", "d_v")).astype(dtype, copy=False)
    lg = check_log_gate(as_float_batch(log_gate, "log_gate", (S.shape[-2],), ("d_k",)), "log_gate")
    broadcast_leading(("state", S, 2), ("log_gate", lg, 1))
    shrink = -np.expm1(lg.astype(dtype, copy=False))[..., :, None]          # 1 - alpha_c, (..., d_k, 1)
    return 0.5 * np.sum(shrink * S * S, axis=(-2, -1)), shrink * S


def implicit_regression_step(state, k, v, *, beta):
    """The implicit (proximal) step on the regression loss, ``eq-fam-implicit``: the exact minimiser.

    ``S_new = argmin_S 1/2 |S - S_0|^2 + 1/2 sum_j beta_j (s_j^T k - v_j)^2`` over
    the columns ``s_j`` of ``S`` (one per value channel, each with its own step
    ``beta_j >= 0``, or one ``beta`` for all). Each column solves
    ``(I + beta_j k k^T) s_j = s_0j + beta_j v_j k``, whose solution (Sherman and
    Morrison) is the delta rule with the step ``eps_j = beta_j / (1 + beta_j |k|^2)``:
    ``s_j = s_0j - eps_j k (k^T s_0j - v_j)``. It is also the implicit gradient
    step ``S_new = S_0 - grad L(S_new) Diag(beta)``, the gradient taken at the new
    state. Longhorn's layer (:func:`longhorn_recurrent`) is this step with ``k k^T``
    replaced by its diagonal.

    Parameters
    ----------
    state : (..., d_k, d_v). k : (..., d_k). v : (..., d_v).
    beta : a number, or (..., d_v) steps, non-negative.

    Returns
    -------
    new_state : (..., d_k, d_v) array.
    """
    S, k, v = _prepare_objective(state, k, v)
    beta = _non_negative_steps(as_float_array(beta, "beta"))
    if beta.ndim and beta.shape[-1] not in (1, S.shape[-1]):
        raise ValueError(f"beta: expected a number or shape (..., d_v={S.shape[-1]}), got shape {beta.shape}")
    beta = beta.astype(S.dtype, copy=False)
    eps = beta / (1.0 + beta * np.sum(k * k, axis=-1, keepdims=True))     # (..., d_v) or (..., 1)
    error = np.matmul(k[..., None, :], S)[..., 0, :] - v                    # k^T S_0 - v
    return S - k[..., :, None] * (eps * error)[..., None, :]
