"""Gated linear attention: linear attention with a decay, scalar or per key channel.

Chapter "One family, one algorithm" (``chap-one-family``). The layers here keep a
state ``S`` of shape ``(d_k, d_v)`` (the book's orientation: a write is
``k v^T``, a read is ``S^T q``) and update it once per token with

    S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T,    alpha_t = exp(log_gate_t)      (GLA)
    o_t = scale * S_t^T q_t

where ``log_gate_t <= 0`` has one entry per key channel (GLA, Yang et al. 2024):
the decay scales the *rows* of ``S``, the same per-channel decay as Kimi Delta
Attention (:mod:`fixedstate.delta_rule`) but without the delta correction. Its
special cases and relatives, in the book's orientation:

- **RetNet** (Sun et al. 2023): one decay ``gamma = exp(log_gate)`` per head,
  constant in time: ``S_t = gamma S_{t-1} + k_t v_t^T``. It is GLA with the gate
  broadcast over the channels and the tokens (:func:`retnet_recurrent`,
  :func:`retnet_chunkwise` are thin wrappers that do exactly that).
- **Mamba-2** (Dao and Gu 2024): one decay per head and per token, GLA with the
  gate broadcast over the channels (:func:`fixedstate.ssm.ssd_recurrent`,
  ``q = C``, ``k = B``, ``v = delta x``, ``log_gate = delta a``).
- **HGRN2** (Qin et al. 2024): per-channel forget gate ``f_t`` and the key tied
  to it, ``k_t = 1 - f_t``: GLA with ``log_gate = log f_t`` and
  ``k_t = 1 - exp(log_gate_t)`` (:func:`hgrn2_recurrent`, :func:`hgrn2_chunkwise`).
- **mLSTM** (Beck et al. 2024), without its max-stabiliser: a scalar forget gate
  ``f_t`` and an exponential input gate ``i_t``: GLA with ``log_gate = log f_t``
  broadcast over the channels and the key ``i_t k_t``; its normaliser
  ``n_t = f_t n_{t-1} + i_t k_t`` is the state of a value column of ones, and
  the output divides by ``max(|n_t^T q_t|, 1)`` (:func:`mlstm_recurrent`); with the
  stabiliser, in chunkwise form (:func:`mlstm_chunkwise`), no input gate's exponential
  is ever formed.

Every function takes ``q, k, v`` positionally and the rest by keyword and
returns ``(outputs, final_state)``. Shapes carry any leading axes (batch,
heads, ...), which broadcast together: ``q, k`` ``(..., T, d_k)``, ``v``
``(..., T, d_v)``, ``log_gate`` ``(..., T, d_k)``, ``initial_state``
``(..., d_k, d_v)``; the one-token forms drop the ``T`` axis. float32 in,
float32 out.

Forms (they agree to float64 precision; the tests prove it):

- :func:`gla_step`: one token, the equation as written;
- :func:`gla_recurrent`: the scan over tokens;
- :func:`gla_loop`: the token loop for one sequence, line by line the equation;
- :func:`gla_chunk`: one chunk of the chunkwise form, written plainly;
- :func:`gla_chunkwise`: the chunkwise-parallel form (``eq-fam-gla-chunk-out``,
  ``eq-fam-gla-chunk-state``). With ``b_r`` the cumulative log-decay (per
  channel) from a chunk's start through token ``r`` and ``S_0`` the state
  entering the chunk,

      o_r = sum_{i<=r} (q_r o e^{b_r - b_i})^T k_i v_i + (q_r o e^{b_r})^T S_0
      S_C = Diag(e^{b_C}) S_0 + sum_i (k_i o e^{b_C - b_i}) v_i^T

  The pair products ``sum_c q_rc k_ic e^{b_rc - b_ic}`` are built level by level
  over halves of the chunk, each pair factored through the boundary between
  its halves into two products of per-token decays ``<= 1``: KDA's
  overflow-safe machinery (:func:`fixedstate.kernels.chunk_decays`), shared,
  not copied. No exponent is ever positive and no ``1/Gamma`` is formed, so
  log-decays of -100 per token are as safe as -0.01. The intra-chunk part is
  computed for groups of chunks at once (sized to stay in cache); only the
  ``(d_k, d_v)`` state is carried from chunk to chunk.
"""

from __future__ import annotations

import numpy as np

from ._threads import one_blas_thread
from ._validate import (Arg, as_float_array, as_float_batch, check_log_gate, check_positive_int, float_dtype,
                        prepare_layer_args)
from .kernels import chunks_per_group  # the one formula for the size of a group of chunks
from .kernels import chunk_decays  # KDA's overflow-safe per-channel pair products, shared with GLA
from .kernels import flat          # merges the leading axes into one
from .kernels import segment_sums  # sums of log-gates over segments, with no cancellation
from .kernels import split_chunks  # the chunks of a sequence, padded with tokens that change nothing

__all__ = [
    "gla_step", "gla_recurrent", "gla_chunkwise", "gla_loop", "gla_chunk",
    "retnet_recurrent", "retnet_chunkwise", "retnet_log_decays",
    "hgrn2_recurrent", "hgrn2_chunkwise", "mlstm_recurrent", "mlstm_chunkwise",
]


# --------------------------------------------------------------------------- validation

def _prepare(q, k, v, log_gate, scale, initial_state, *, tokens=True, one_sequence=False):
    """Validate; return the leading shape and q, k, v, log_gate, initial_state broadcast to it and cast."""
    lead, (q, k, v, log_gate), initial_state, scale = prepare_layer_args(
        [Arg("q", q, ("T", "d_k")), Arg("k", k, ("T", "d_k")), Arg("v", v, ("T", "d_v")),
         Arg("log_gate", log_gate, ("T", "d_k"), check_log_gate, allow_nonfinite=True)],
        initial_state=initial_state, scale=scale, tokens=tokens,
        one_sequence="use gla_recurrent or gla_chunkwise for batches" if one_sequence else None)
    return lead, q, k, v, log_gate, initial_state, scale


def _run(form, q, k, v, log_gate, scale, initial_state, *extra):
    lead, q, k, v, g, S, scale = _prepare(q, k, v, log_gate, scale, initial_state)
    T, d_v = q.shape[-2], v.shape[-1]
    out, S = form(flat(q, lead, 2), flat(k, lead, 2), flat(v, lead, 2), flat(g, lead, 2),
                  flat(S, lead, 2), scale, *extra)
    return out.reshape(lead + (T, d_v)), S.reshape(lead + S.shape[1:])


# --------------------------------------------------------------------------- one token and the scan

def gla_step(q, k, v, *, log_gate, scale=1.0, initial_state=None):
    """One GLA token: ``S_t = Diag(exp(log_gate)) S_{t-1} + k v^T``, ``o = scale * S_t^T q`` (``eq-fam-gla``).

    Parameters
    ----------
    q, k : (..., d_k) arrays. v : (..., d_v) array.
    log_gate : (..., d_k) per-channel log-decays <= 0, scaling the rows of S.
    scale : number multiplying the readout (default 1).
    initial_state : (..., d_k, d_v) array, the state before the token, or None (zeros).

    Returns
    -------
    o : (..., d_v) array, read from the updated state.
    state : (..., d_k, d_v) array, the new state (the one passed in is not modified).
    """
    lead, q, k, v, g, S, scale = _prepare(q, k, v, log_gate, scale, initial_state, tokens=False)
    write = k[..., :, None] * v[..., None, :]                          # k v^T
    S = write if S is None else np.exp(g)[..., :, None] * S + write    # Diag(alpha) S_{t-1} + k v^T
    o = np.matmul(q[..., None, :], S)[..., 0, :]                       # S_t^T q
    return (o * o.dtype.type(scale) if scale != 1.0 else o), S


@one_blas_thread
def _recurrent(q, k, v, log_gate, S, scale):
    """The scan; q, k, log_gate: (B, T, d_k), v: (B, T, d_v), S: (B, d_k, d_v) or None."""
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    decays = np.exp(log_gate)[..., None]                               # exponents <= 0
    outputs = np.empty((B, T, d_v), dtype=dtype)
    for t in range(T):
        S *= decays[:, t]                                              # Diag(alpha_t) S_{t-1}
        S += k[:, t, :, None] * v[:, t, None, :]                       # + k_t v_t^T
        outputs[:, t] = np.matmul(q[:, t, None, :], S)[:, 0]           # S_t^T q_t
    if scale != 1.0:
        outputs *= dtype.type(scale)
    return outputs, S


def gla_recurrent(q, k, v, *, log_gate, scale=1.0, initial_state=None):
    """GLA over a sequence, one token at a time (``eq-fam-gla``).

    ``S_t = Diag(exp(log_gate_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

    Parameters
    ----------
    q, k : (..., T, d_k). v : (..., T, d_v).
    log_gate : (..., T, d_k) per-channel log-decays <= 0.
    scale : readout scale. initial_state : (..., d_k, d_v) or None (zeros).

    Returns
    -------
    outputs : (..., T, d_v) array. final_state : (..., d_k, d_v) array.
    """
    return _run(_recurrent, q, k, v, log_gate, scale, initial_state)


# --------------------------------------------------------------------------- reference functions

def gla_loop(q, k, v, *, log_gate, scale=1.0, initial_state=None):
    """The token loop of GLA for one sequence, ``eq-fam-gla``, written to be read beside the equation.

    ``q, k`` (T, d_k), ``v`` (T, d_v), ``log_gate`` (T, d_k), no leading axes;
    ``initial_state`` (d_k, d_v) or None (zeros). Returns the outputs (T, d_v)
    and the final state (d_k, d_v).
    """
    _, q, k, v, log_gate, S, c = _prepare(q, k, v, log_gate, scale, initial_state, one_sequence=True)
    S = np.zeros((k.shape[1], v.shape[1]), dtype=v.dtype) if S is None else S      # S_0
    o = np.empty_like(v)
    for t in range(len(q)):
        alpha = np.exp(log_gate[t])                       # the decays alpha_t, one per key channel
        S = alpha[:, None] * S + np.outer(k[t], v[t])     # eq-fam-gla: S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T
        o[t] = c * (S.T @ q[t])                           # o_t = c S_t^T q_t
    return o, S


def gla_chunk(q, k, v, *, log_gate, scale=1.0, initial_state=None):
    """One chunk of GLA's chunkwise form, ``eq-fam-gla-chunk-out`` and ``eq-fam-gla-chunk-state``, line by line.

    Given the chunk's ``C`` tokens (``q, k`` (C, d_k), ``v`` (C, d_v),
    ``log_gate`` (C, d_k), no leading axes) and the incoming state ``S_0``
    (``initial_state``, (d_k, d_v) or None for zeros), returns the chunk's
    outputs (C, d_v) and the outgoing state ``S_C``. The per-channel decays
    between pairs are formed here as a (C, C, d_k) array ``exp(b_r - b_i)`` with
    the pairs ``i > r`` masked to ``-inf`` before the exponential, so every
    exponent is ``<= 0``: plain, and ``d_k`` times the memory of the fast form,
    which builds the same products level by level (:func:`gla_chunkwise`).
    Applied chunk after chunk it gives what :func:`gla_recurrent` gives.
    """
    _, Q, K, V, log_gate, S0, c = _prepare(q, k, v, log_gate, scale, initial_state, one_sequence=True)
    if len(Q) < 1:
        raise ValueError(f"q: expected at least one token, got shape {Q.shape}")
    S0 = np.zeros((K.shape[1], V.shape[1]), dtype=V.dtype) if S0 is None else S0
    C = len(Q)
    b = np.cumsum(log_gate, axis=0)                       # b_r = sum_{i<=r} log alpha_i, (C, d_k), <= 0
    i_le_r = np.tril(np.ones((C, C), dtype=bool))[:, :, None]
    D = np.exp(np.where(i_le_r, b[:, None, :] - b[None, :, :], -np.inf))    # D_ric = e^{b_rc - b_ic} if i <= r
    A = np.einsum("rc,ric,ic->ri", Q, D, K)               # A_ri = sum_c q_rc e^{b_rc - b_ic} k_ic
    O = c * (A @ V + (np.exp(b) * Q) @ S0)                # eq-fam-gla-chunk-out
    S_C = np.exp(b[-1])[:, None] * S0 + (np.exp(b[-1] - b) * K).T @ V       # eq-fam-gla-chunk-state
    return O.astype(V.dtype, copy=False), S_C.astype(V.dtype, copy=False)


# --------------------------------------------------------------------------- chunkwise form

# The intra-chunk work runs over groups of consecutive chunks whose (tokens x d) arrays take
# about kernels.GROUP_BYTES (kernels.chunks_per_group, the delta rule's formula), so that the
# level-by-level pair products stay in the processor's cache; the result does not depend on it.


@one_blas_thread
def gla_chunks(q, k, v, log_gate, S, scale, chunk_size, *, group_bytes=None):
    """The kernel of :func:`gla_chunkwise` on flattened arrays (``eq-fam-gla-chunk-out``,
    ``eq-fam-gla-chunk-state``), one BLAS thread.

    ``q, k, log_gate``: (B, T, d_k); ``v``: (B, T, d_v); ``S``: (B, d_k, d_v) or None
    (zeros); ``chunk_size`` an integer >= 1. No validation: :func:`gla_chunkwise`
    validates, flattens the leading axes and calls it (it is not in ``__all__``).
    Returns the outputs (B, T, d_v), times ``scale``, and the final state. The chunks
    of all B sequences go through the pair products in groups of
    :func:`fixedstate.kernels.chunks_per_group` chunks (``group_bytes``, default
    :data:`fixedstate.kernels.GROUP_BYTES`); the result does not depend on the group
    size (the tests pass small ones).
    """
    B, T, d_k = k.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    C = chunk_size
    C2 = 1 << (C - 1).bit_length()                  # C rounded up to a power of two (the levels need it)
    n = max(1, -(-T // C))
    N = B * n

    def chunks(x, fill=0.0):
        """(B, T, d) -> (B * n, C2, d): n chunks of C tokens, each padded to C2 with ``fill``."""
        return split_chunks(np.ascontiguousarray(x), fill, chunk_size=C).reshape(N, C2, x.shape[-1])

    # Padding tokens have q = k = 0 and decay 1: they neither write nor read nor decay.
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    alpha = chunks(np.exp(log_gate), fill=1.0)                      # per-token decays, exponents <= 0
    out = np.empty((N, C2, d_v), dtype=dtype)
    local = np.empty((N, d_k, d_v), dtype=dtype)
    gamma = np.empty((N, C2, d_k), dtype=dtype)
    group = chunks_per_group(C2, max(d_k, d_v), dtype.itemsize, group_bytes=group_bytes)   # chunks per group
    for g0 in range(0, N, group):
        g = slice(g0, min(N, g0 + group))
        m = g.stop - g0
        qk = np.zeros((m, C2, C2), dtype=dtype)
        kk = np.zeros((m, C2, C2), dtype=dtype)                     # (the delta rule's; unused here)
        # e^{b_r} and e^{b_C - b_i}, and the decayed pair products sum_c q_rc k_ic e^{b_rc - b_ic}, i < r
        gamma[g], to_end = chunk_decays(alpha[g], q=qc[g], k=kc[g], qk=qk, kk=kk)
        qk.reshape(m, C2 * C2)[:, ::C2 + 1] = np.einsum("nrc,nrc->nr", qc[g], kc[g])   # the pairs i = r
        np.matmul(qk, vc[g], out=out[g])                             # eq-fam-gla-chunk-out, within the chunk
        np.matmul((kc[g] * to_end).swapaxes(-1, -2), vc[g], out=local[g])   # eq-fam-gla-chunk-state, from zero
    # the only sequential part: carry the state from chunk to chunk
    local = local.reshape(B, n, d_k, d_v)
    decay_last = gamma[:, -1].reshape(B, n, d_k, 1)                  # e^{b_C}
    S = np.zeros((B, d_k, d_v), dtype=dtype) if S is None else S.copy()
    entering = np.empty((B, n, d_k, d_v), dtype=dtype)
    for j in range(n):
        entering[:, j] = S
        S *= decay_last[:, j]
        S += local[:, j]
    gamma *= qc                                                      # q_r o e^{b_r}
    out += np.matmul(gamma, entering.reshape(N, d_k, d_v))           # + (q_r o e^{b_r})^T S_0
    outputs = out.reshape(B, n * C2, d_v) if C2 == C else out.reshape(B, n, C2, d_v)[:, :, :C].reshape(B, n * C, d_v)
    outputs = outputs[:, :T]
    if scale != 1.0:
        outputs = outputs * dtype.type(scale)
    return np.ascontiguousarray(outputs), S


def gla_chunkwise(q, k, v, *, log_gate, scale=1.0, initial_state=None, chunk_size=64):
    """GLA in chunkwise-parallel form (``eq-fam-gla-chunk-out``, ``eq-fam-gla-chunk-state``).

    Same arguments and results as :func:`gla_recurrent`, plus ``chunk_size``
    (an integer >= 1; the length need not be a multiple of it; a chunk size
    that is not a power of two is padded up to one inside each chunk). The
    per-channel decay between tokens ``i <= r`` of a chunk, ``exp(b_r - b_i)``,
    is never formed from ``exp(b_r) / exp(b_i)``: each pair is factored
    through the boundary between the halves of the block where it meets,
    ``exp(b_r - b_p) exp(b_p - b_i)``, both products of per-token decays <= 1
    (the machinery KDA's chunkwise form uses), so no exponent is ever
    positive, however strong the decays.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return _run(gla_chunks, q, k, v, log_gate, scale, initial_state, chunk_size)


# --------------------------------------------------------------------------- special cases and relatives

def _broadcast_gate(q, k, v, log_gate, name, *, per_token):
    """A scalar log-decay per head (and per token if ``per_token``) broadcast to ``(..., T, d_k)``.

    The result has the precision the layer computes in (a Python number is weak, as in numpy).
    """
    dtype = float_dtype(q, k, v, log_gate)
    qa = as_float_batch(q, "q", (None, None), ("T", "d_k"))
    T, d_k = qa.shape[-2:]
    if per_token:
        g = check_log_gate(as_float_batch(log_gate, name, (T,), ("T",), allow_nonfinite=True), name)
        return g.astype(dtype, copy=False)[..., None] * np.ones(d_k, dtype=dtype)
    g = check_log_gate(as_float_array(log_gate, name, allow_nonfinite=True), name).astype(dtype, copy=False)
    return g[..., None, None] * np.ones((T, d_k), dtype=dtype)


def retnet_log_decays(n_heads):
    """RetNet's fixed per-head log-decays ``log(1 - 2^(-5 - h))``, ``h = 0, ..., n_heads - 1`` (``eq-fam-retnet``).

    Returns a float64 array (n_heads,), to pass as ``log_gate``.
    """
    n_heads = check_positive_int(n_heads, "n_heads")
    return np.log1p(-np.exp2(-5.0 - np.arange(n_heads)))


def retnet_recurrent(q, k, v, *, log_gate, scale=1.0, initial_state=None):
    """RetNet's retention, recurrent form (``eq-fam-retnet``).

    ``S_t = gamma S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

    ``gamma = exp(log_gate)``, one number per head, constant in time:
    ``log_gate`` is a number or an array ``<= 0`` whose shape broadcasts
    against the leading axes (``(H,)`` when they are ``(batch, H)``; see
    :func:`retnet_log_decays`). It is :func:`gla_recurrent` with the gate
    broadcast over tokens and channels. Other arguments and the results as
    :func:`gla_recurrent`. (RetNet's group norm and swish gate are outside the
    recurrence and not included.)
    """
    g = _broadcast_gate(q, k, v, log_gate, "log_gate", per_token=False)
    return gla_recurrent(q, k, v, log_gate=g, scale=scale, initial_state=initial_state)


def retnet_chunkwise(q, k, v, *, log_gate, scale=1.0, initial_state=None, chunk_size=64):
    """RetNet's retention in chunkwise form: :func:`gla_chunkwise` with the scalar gate broadcast (``eq-fam-retnet``).

    Arguments as :func:`retnet_recurrent`, plus ``chunk_size``.
    """
    g = _broadcast_gate(q, k, v, log_gate, "log_gate", per_token=False)
    return gla_chunkwise(q, k, v, log_gate=g, scale=scale, initial_state=initial_state, chunk_size=chunk_size)


def hgrn2_recurrent(q, v, *, log_gate, scale=1.0, initial_state=None):
    """HGRN2's recurrence: GLA with the key tied to the forget gate, ``k_t = 1 - f_t`` (``eq-fam-hgrn2``).

    ``S_t = Diag(f_t) S_{t-1} + (1 - f_t) v_t^T``, ``o_t = scale * S_t^T q_t``
    with ``f_t = exp(log_gate_t)`` (per channel, (..., T, d_k)); ``q`` (..., T,
    d_k) plays the output gate's role, ``v`` (..., T, d_v) the input. HGRN2's
    lower bound on the forget gate (rising with depth) is the caller's choice
    of ``log_gate``.
    """
    k = -np.expm1(as_float_batch(log_gate, "log_gate", (None, None), ("T", "d_k"), allow_nonfinite=True))
    return gla_recurrent(q, k, v, log_gate=log_gate, scale=scale, initial_state=initial_state)


def hgrn2_chunkwise(q, v, *, log_gate, scale=1.0, initial_state=None, chunk_size=64):
    """HGRN2 in chunkwise form: :func:`gla_chunkwise` with ``k_t = 1 - exp(log_gate_t)`` (``eq-fam-hgrn2``)."""
    k = -np.expm1(as_float_batch(log_gate, "log_gate", (None, None), ("T", "d_k"), allow_nonfinite=True))
    return gla_chunkwise(q, k, v, log_gate=log_gate, scale=scale, initial_state=initial_state,
                         chunk_size=chunk_size)


def mlstm_recurrent(q, k, v, *, log_gate, log_input, scale=1.0, initial_state=None):
    """The mLSTM cell without its max-stabiliser, as GLA with a normaliser column (``eq-fam-mlstm``).

    ``S_t = f_t S_{t-1} + i_t k_t v_t^T``, ``n_t = f_t n_{t-1} + i_t k_t`` and
    ``o_t = scale * S_t^T q_t / max(|n_t^T q_t|, 1)``, with the forget gate
    ``f_t = exp(log_gate_t)`` (``log_gate <= 0``, (..., T)) and the
    exponential input gate ``i_t = exp(log_input_t)`` ((..., T), any sign: it
    is not bounded, which is why the paper adds a stabiliser; keep it moderate
    here). The state returned is ``(..., d_k, d_v + 1)``, its last column
    ``n``, as :mod:`fixedstate.linear_attention` keeps its normaliser;
    ``initial_state`` likewise. (The paper's output gate and ``1/sqrt(d_k)`` key
    scale are outside the recurrence: pass scaled keys.)
    """
    g = _broadcast_gate(q, k, v, log_gate, "log_gate", per_token=True)
    ka = as_float_batch(k, "k", (None, None), ("T", "d_k"))
    li = as_float_batch(log_input, "log_input", (ka.shape[-2],), ("T",))
    va = as_float_batch(v, "v", (None, None), ("T", "d_v"))
    ones = np.ones(va.shape[:-1] + (1,), dtype=va.dtype)
    values = np.concatenate([va, ones], axis=-1)                      # the column of ones carries n_t
    keys = np.exp(li)[..., None].astype(ka.dtype, copy=False) * ka    # i_t k_t
    raw, S = gla_recurrent(q, keys, values, log_gate=g.astype(ka.dtype, copy=False), scale=1.0,
                           initial_state=initial_state)
    out = raw[..., :-1] / np.maximum(np.abs(raw[..., -1:]), 1.0)
    return (out * out.dtype.type(scale) if scale != 1.0 else out), S


# --------------------------------------------------------------------------- mLSTM with its max-stabiliser, chunkwise

@one_blas_thread
def _mlstm_chunks(q, k, v, log_gate, log_input, S, m, chunk_size):
    """The kernel of :func:`mlstm_chunkwise` on flattened arrays (``eq-fam-mlstm-chunk``), one BLAS thread.

    ``q, k``: (B, T, d_k); ``v``: (B, T, d_v); ``log_gate, log_input``: (B, T); ``S``:
    (B, d_k, d_v + 1) the stabilised state (its last column the normaliser) and ``m``
    (B,) its log-scale (``-inf`` for an empty state); ``chunk_size`` an integer >= 1. No
    validation. Returns the (unscaled) outputs (B, T, d_v), the
    stabilised final state and its log-scale.
    """
    B, T, d_k = q.shape
    d_v = v.shape[-1]
    dtype = q.dtype
    values = np.concatenate([v, np.ones((B, T, 1), dtype=dtype)], axis=-1)   # the column of ones carries n
    out = np.empty((B, T, d_v), dtype=dtype)
    S, m = S.copy(), m.copy()
    for start in range(0, T, chunk_size):
        c = slice(start, min(T, start + chunk_size))
        n = c.stop - start
        lower = np.tri(n, dtype=bool)
        # the log-weight of every contribution to token r: the entering state's and each write i <= r's
        from_state = np.cumsum(log_gate[:, c], axis=1) + m[:, None]                  # b_r + m_0, (B, n)
        D = np.where(lower, segment_sums(log_gate[:, c]) + log_input[:, None, c], -np.inf)   # (B, n, n)
        m_r = np.maximum(from_state, D.max(axis=2))                                  # the stabiliser m_r
        W = np.exp(D - m_r[:, :, None])                                              # every exponent <= 0
        W *= np.matmul(q[:, c], k[:, c].swapaxes(-1, -2))                            # times q_r^T k_i
        num = np.matmul(W, values[:, c])
        num += np.exp(from_state - m_r)[:, :, None] * np.matmul(q[:, c], S)          # the entering state
        with np.errstate(over="ignore"):                 # e^{-m_r} = inf only when every gate is tiny: output 0
            floor = np.exp(-m_r)[:, :, None]                                         # max(|n~^T q|, e^{-m_r})
        out[:, c] = num[..., :d_v] / np.maximum(np.abs(num[..., d_v:]), floor)
        m_end = m_r[:, -1]
        S *= np.exp(from_state[:, -1] - m_end)[:, None, None]
        S += np.matmul((k[:, c] * np.exp(D[:, -1] - m_end[:, None])[:, :, None]).swapaxes(-1, -2), values[:, c])
        m = m_end
    return out, S, m


def mlstm_chunkwise(q, k, v, *, log_gate, log_input, scale=1.0, initial_state=None, chunk_size=64):
    """The mLSTM cell in chunkwise form with its max-stabiliser (``eq-fam-mlstm-chunk``).

    The same layer as :func:`mlstm_recurrent`, ``eq-fam-mlstm``, computed so that no
    exponential of an input gate is ever formed: within a chunk the log-weight of each
    contribution to token ``r``, ``b_r + m_0`` for the entering state (``b_r`` the
    cumulative log forget gate from the chunk's start) and ``b_r - b_i + log i_i`` for the
    write of token ``i <= r``, is taken relative to their maximum ``m_r``, the stabiliser
    (Beck et al. 2024); numerator and normaliser are divided by ``e^{m_r}``, and the
    floor 1 of the denominator becomes ``e^{-m_r}``. Every exponent is at most 0, so
    input gates of ``e^{1000}`` are as safe as ``e^{1}``. The state is carried from chunk
    to chunk stabilised, with its log-scale ``m``: the true state is ``e^m`` times it.

    Parameters
    ----------
    q, k : (..., T, d_k). v : (..., T, d_v). log_gate : (..., T) log forget gates <= 0.
    log_input : (..., T) log input gates, any sign. scale : readout scale.
    initial_state : None (an empty state), an array (..., d_k, d_v + 1) (the unstabilised
    state with its normaliser column, as :func:`mlstm_recurrent` takes it), or a pair
    ``(state, log_scale)`` as this function returns it.
    chunk_size : an integer >= 1 (the length need not be a multiple of it).

    Returns
    -------
    outputs : (..., T, d_v). final_state : the pair ``(state, log_scale)``, ``state``
    (..., d_k, d_v + 1) stabilised and ``log_scale`` (...), the true state being
    ``exp(log_scale) * state``.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    log_scale = None
    if isinstance(initial_state, tuple):
        if len(initial_state) != 2:
            raise ValueError(f"initial_state: expected an array or a pair (state, log_scale), got a tuple of "
                             f"{len(initial_state)}")
        initial_state, log_scale = initial_state
        log_scale = as_float_array(log_scale, "initial_state", allow_nonfinite=True)
        if np.any(np.isnan(log_scale)) or np.any(log_scale == np.inf):
            raise ValueError("initial_state: expected a log-scale that is finite or -inf, got NaN or +inf")
    lead, (q, k, v, lf, li), _, scale = prepare_layer_args(
        [Arg("q", q, ("T", "d_k")), Arg("k", k, ("T", "d_k")), Arg("v", v, ("T", "d_v")),
         Arg("log_gate", log_gate, ("T",), check_log_gate), Arg("log_input", log_input, ("T",))],
        scale=scale)
    T, d_k, d_v, dtype = q.shape[-2], q.shape[-1], v.shape[-1], q.dtype
    if initial_state is None:
        S = np.zeros(lead + (d_k, d_v + 1), dtype=dtype)
        m = np.full(lead, -np.inf, dtype=dtype)
    else:
        S = as_float_batch(initial_state, "initial_state", (d_k, d_v + 1), ("d_k", "d_v + 1"))
        S = np.broadcast_to(S, np.broadcast_shapes(S.shape, lead + (d_k, d_v + 1))).astype(dtype)
        lead = S.shape[:-2]
        m = np.zeros(lead, dtype=dtype) if log_scale is None else np.broadcast_to(log_scale, lead).astype(dtype)
    bq = lambda x, n: np.broadcast_to(x, lead + x.shape[x.ndim - n:])
    out, S, m = _mlstm_chunks(flat(bq(q, 2), lead, 2), flat(bq(k, 2), lead, 2), flat(bq(v, 2), lead, 2),
                             flat(bq(lf, 1), lead, 1), flat(bq(li, 1), lead, 1), flat(S, lead, 2),
                             m.reshape(-1), chunk_size)
    if scale != 1.0:
        out *= dtype.type(scale)
    return out.reshape(lead + (T, d_v)), (S.reshape(lead + (d_k, d_v + 1)), m.reshape(lead))
