"""Associative recall: what a fixed-size state forgets (chapter "What a fixed state forgets", chap-recall).

The experiment needs no training. Write ``N`` key-value pairs into a memory,
then query every key and compare what comes back with the value written under
it. The memory is one of the book's layers:

- ``"softmax"``: softmax attention over the full KV cache (the cache grows by
  one row per pair, so nothing is ever lost; a small ``temperature`` makes the
  lookup sharp);
- ``"linear"``: additive linear attention with the identity feature map,
  ``S <- S + k v^T`` (equation ``eq-rc-additive``);
- ``"delta"``: the delta rule, ``S <- S + beta k (v - S^T k)^T`` (``eq-rc-delta``);
- ``"gated_delta"``: the gated delta rule, decay by ``gate`` then the delta
  correction (``eq-rc-gated``);
- ``"ssm"``: a diagonal selective state-space model (Mamba's scan,
  :func:`fixedstate.ssm.selective_scan_sequential`) wired as a memory: input
  ``x_t = v_t``, ``B_t = k_t``, ``C_t = q_t``, every decay ``exp(delta A) = gate``
  and step ``delta = 1``, so ``S <- gate S + k v^T`` (``eq-rc-ssm``): additive
  writes with a decay.

The four fixed-state memories are ``(d_k, d_v)`` arrays read out as
``o = S^T q`` (``eq-rc-readout``). The writes go through the package's own layers
(:mod:`fixedstate.softmax_attention`, :mod:`fixedstate.linear_attention`,
:mod:`fixedstate.delta_rule`, :mod:`fixedstate.ssm`); :func:`capacity_curve`
does the same arithmetic with a leading batch axis (all seeds at once, every
prefix length from one pass), checking its arguments once rather than at every
call of a layer, and the tests prove it gives the layers' numbers, bit for bit
(:func:`batched_final_states` is the same computation through the layers).

Contents:

- :func:`make_keys`, :func:`make_values`: unit keys, random or orthonormal, with
  a controlled overlap ``k_i . k_j`` (``eq-rc-overlap``).
- :func:`write_memory`, :func:`read_memory`, :func:`recall_pairs`: one experiment.
- :func:`crosstalk`: the interference term that additive writes leave (``eq-rc-crosstalk``).
- :func:`capacity_curve`: recall accuracy against ``N / d_k``, averaged over seeds.
- :func:`vocabulary_recall`: accuracy when the answer is decoded from a vocabulary
  of candidate values (nearest by cosine), optionally through a feature map.
- :func:`make_mqar`, :func:`mqar_answers`, :func:`score_mqar`: the multi-query
  associative recall task of Zoology (Arora et al., 2024).
- :func:`no_retrieval_accuracy`, :func:`no_retrieval_score`: what MQAR gives away
  without retrieval, the accuracy of the best predictor that never links a key to
  its value (``eq-tr-no-retrieval``), exactly over the task's draws or on a batch.

The chapter's lab, what one slider move recomputes, is :mod:`fixedstate.recall_lab`.

Decays: the public parameter ``gate`` is the decay ``g`` in ``(0, 1]`` that the
chapter's sliders show; the cores take log-decays, so every call passes
``log_gate = log(g)`` (``g = exp(log g)``).
"""

from __future__ import annotations

import numbers
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ._threads import blas_threads
from ._validate import as_float_array, as_generator, check_dim, check_interval, check_positive_int, check_same_length
from .blocks import embedding
from .delta_rule import delta_rule_recurrent, gated_delta_rule_recurrent
from .linear_attention import identity_feature_map, linear_attention_recurrent
from .kernels import additive_scan, delta_scan, row_softmax, ssd_state
from .layer_ids import DELTA, GATED_DELTA, LINEAR, SOFTMAX, SSM, check_layer_id
from .softmax_attention import KVCache, softmax_attention, softmax_attention_step
from .ssm import selective_scan_sequential

__all__ = [
    "MECHANISMS",
    "make_keys",
    "make_values",
    "write_memory",
    "read_memory",
    "nearest_value",
    "recall_pairs",
    "RecallResult",
    "crosstalk",
    "batched_final_states",
    "capacity_curve",
    "CapacityCurve",
    "make_mqar",
    "MQARBatch",
    "mqar_answers",
    "score_mqar",
    "NO_RETRIEVAL_STRATEGIES",
    "no_retrieval_accuracy",
    "no_retrieval_score",
    "no_retrieval_se",
    "vocabulary_recall",
]

MECHANISMS = (SOFTMAX, LINEAR, DELTA, GATED_DELTA, SSM)
"""The memories compared in the chapter (ids of :mod:`fixedstate.layer_ids`), in the order the figures show them."""

FIXED_STATE = (LINEAR, DELTA, GATED_DELTA, SSM)


# ----------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------

def _mechanism(mechanism) -> str:
    return check_layer_id(mechanism, MECHANISMS, "mechanism")


def _overlap(overlap) -> float:
    arr = as_float_array(overlap, "overlap", ndim=0)
    check_interval(arr, "overlap", 0.0, 1.0)
    return float(arr)


def _positive(value, name: str) -> float:
    arr = as_float_array(value, name, ndim=0)
    if not float(arr) > 0:
        raise ValueError(f"{name}: expected a positive number, got {float(arr)!r}")
    return float(arr)


def _unit_interval(value, name: str, *, low_closed: bool) -> float:
    arr = as_float_array(value, name, ndim=0)
    check_interval(arr, name, 0.0, 1.0, low_closed=low_closed)
    return float(arr)


def _params(temperature, beta, gate):
    return (_positive(temperature, "temperature"),
            _unit_interval(beta, "beta", low_closed=False),
            _unit_interval(gate, "gate", low_closed=False))


# ----------------------------------------------------------------------------
# keys and values
# ----------------------------------------------------------------------------

def _random_unit(rng, shape) -> np.ndarray:
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _orthonormal_rows(rng, n: int, d: int) -> np.ndarray:
    """``n <= d`` orthonormal rows of length ``d`` from a random rotation."""
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    q = q * np.sign(np.diag(r))  # Haar-distributed
    return q[:, :n].T.copy()


def make_keys(n_pairs, d_k, *, overlap=0.0, orthogonal=False, rng=None) -> np.ndarray:
    """Unit-length keys with a controlled overlap, equation ``eq-rc-overlap``.

    ``orthogonal=True`` (needs ``n_pairs <= d_k``): the keys have Gram matrix
    exactly ``(1 - overlap) I + overlap 1 1^T``, so every pair has ``k_i . k_j =
    overlap``; with ``overlap = 0`` they are orthonormal. Built as ``G^{1/2} Q``
    with ``Q`` orthonormal rows from a random rotation.

    ``orthogonal=False``: ``k_i = sqrt(overlap) c + sqrt(1 - overlap) u_i`` with a
    shared random unit direction ``c`` and random unit vectors ``u_i``
    perpendicular to it, so ``k_i . k_j = overlap + (1 - overlap) u_i . u_j``:
    ``overlap`` on average, plus the chance overlap of random directions. With
    ``overlap = 0`` these are plain random unit vectors.

    Parameters
    ----------
    n_pairs : int >= 1
    d_k : int >= 1
    overlap : float in [0, 1]
    orthogonal : bool
    rng : numpy Generator, int seed or None (seed 0)

    Returns
    -------
    array of shape ``(n_pairs, d_k)``, every row of length 1.
    """
    n = check_positive_int(n_pairs, "n_pairs")
    d = check_positive_int(d_k, "d_k")
    rho = _overlap(overlap)
    if not isinstance(orthogonal, (bool, np.bool_)):
        raise ValueError(f"orthogonal: expected True or False, got {orthogonal!r}")
    rng = as_generator(rng, default_seed=0)
    if orthogonal:
        if n > d:
            raise ValueError(f"n_pairs: asked for distinct orthogonal keys, but at most d_k = {d} "
                             f"such keys exist in {d} dimensions, got n_pairs = {n}")
        gram = (1.0 - rho) * np.eye(n) + rho * np.ones((n, n))
        w, u = np.linalg.eigh(gram)
        root = (u * np.sqrt(np.clip(w, 0.0, None))) @ u.T
        return root @ _orthonormal_rows(rng, n, d)
    if rho == 0.0:
        return _random_unit(rng, (n, d))
    _check_overlap_room(rho, d)
    c, u = _shared_and_perpendicular(rng, n, d)
    return _mix_keys(c, u, rho)


def _check_overlap_room(rho: float, d: int) -> None:
    if 0.0 < rho < 1.0 and d < 2:
        raise ValueError(f"d_k: keys with overlap {rho} < 1 need d_k >= 2 (a shared direction and "
                         f"one perpendicular to it), got d_k = {d}")


def _shared_and_perpendicular(rng, n: int, d: int):
    """The random draws of :func:`make_keys` with an overlap: a unit ``c`` ``(d,)``, unit ``u_i`` ``(n, d)`` perpendicular to it.

    They do not depend on the overlap, which only mixes them (:func:`_mix_keys`).
    """
    c = _random_unit(rng, (d,))
    u = rng.standard_normal((n, d))
    u -= np.outer(u @ c, c)
    norms = np.linalg.norm(u, axis=1, keepdims=True)
    return c, u / np.where(norms > 0, norms, 1.0)


def _mix_keys(c, u, rho: float) -> np.ndarray:
    """``k_i = sqrt(rho) c + sqrt(1 - rho) u_i`` (``eq-rc-overlap``); ``c`` ``(..., d)``, ``u`` ``(..., n, d)``."""
    return np.sqrt(rho) * c[..., None, :] + np.sqrt(1.0 - rho) * u


def make_values(n_pairs, d_v, *, orthogonal=False, rng=None) -> np.ndarray:
    """Unit-length values, ``(n_pairs, d_v)``: random directions, or orthonormal rows
    (``orthogonal=True``, needs ``n_pairs <= d_v``)."""
    n = check_positive_int(n_pairs, "n_pairs")
    d = check_positive_int(d_v, "d_v")
    rng = as_generator(rng, default_seed=0)
    if orthogonal:
        if n > d:
            raise ValueError(f"n_pairs: asked for orthonormal values, but at most d_v = {d} exist, "
                             f"got n_pairs = {n}")
        return _orthonormal_rows(rng, n, d)
    return _random_unit(rng, (n, d))


# ----------------------------------------------------------------------------
# one experiment, through the package's layers
# ----------------------------------------------------------------------------

def _pairs(keys, values):
    k = as_float_array(keys, "keys", ndim=2)
    v = as_float_array(values, "values", ndim=2)
    if k.shape[0] < 1:
        raise ValueError(f"keys: expected at least one pair (N >= 1), got shape {k.shape}")
    if k.shape[1] < 1:
        raise ValueError(f"keys: expected d_k >= 1, got shape {k.shape}")
    if v.shape[1] < 1:
        raise ValueError(f"values: expected d_v >= 1, got shape {v.shape}")
    check_same_length("keys", k, "values", v)
    return k.astype(np.float64), v.astype(np.float64)


def _run_fixed_state(mechanism, queries, keys, values, *, beta, gate, step=None, initial_state=None):
    """Run a fixed-state memory over a sequence through the package's layer.

    ``queries``, ``keys``: ``(..., n, d_k)``; ``values``: ``(..., n, d_v)``; any
    leading axes (the cores broadcast them). ``beta`` and ``gate`` (the decay in
    (0, 1]) are numbers; ``step`` is the SSM's step size ``(..., n)`` (default 1).
    Returns ``(outputs (..., n, d_v), S (..., d_k, d_v))``; ``initial_state`` is
    an ``S`` of that shape, or None for zeros.
    """
    n, d_k, d_v = keys.shape[-2], keys.shape[-1], values.shape[-1]
    if mechanism == "linear":
        return linear_attention_recurrent(queries, keys, values, feature_map=identity_feature_map,
                                          normalize=False, initial_state=initial_state)
    if mechanism == "ssm":
        # x = v, B = k, C = q, A = log(gate) in every entry: h = exp(step A) h + step v k^T, S = h^T
        delta = np.ones(values.shape) if step is None else np.broadcast_to(step[..., None], values.shape)
        h0 = None if initial_state is None else np.swapaxes(initial_state, -1, -2)
        out, h = selective_scan_sequential(values, delta, np.full((d_v, d_k), np.log(gate)), keys, queries,
                                           initial_state=h0)
        return out, np.swapaxes(h, -1, -2)
    betas = np.full(n, beta)
    if mechanism == "delta":
        return delta_rule_recurrent(queries, keys, values, beta=betas, initial_state=initial_state)
    return gated_delta_rule_recurrent(queries, keys, values, beta=betas, log_gate=np.full(n, np.log(gate)),
                                      initial_state=initial_state)


def write_memory(mechanism, keys, values, *, beta=1.0, gate=0.9, passes=1):
    """Write the pairs ``(k_i, v_i)`` in order into a fresh memory, through the package's layer.

    ``passes > 1`` writes the whole list of pairs that many times in a row (for
    the delta rule with ``beta = 1`` and unit keys each pass is one sweep of the
    Kaczmarz method for ``K S = V``, equation ``eq-rc-kaczmarz``).

    - ``"softmax"``: the KV cache, grown one pair at a time by
      :func:`fixedstate.softmax_attention.softmax_attention_step`; returns the
      tuple ``(keys (N, d_k), values (N, d_v))`` of the cached pairs.
    - ``"linear"``: :func:`fixedstate.linear_attention.linear_attention_recurrent` with the
      identity feature map and no normalizer: ``S = sum_i k_i v_i^T`` (``eq-rc-additive``).
    - ``"delta"``: :func:`fixedstate.delta_rule.delta_rule_recurrent` with every
      ``beta_i = beta`` (``eq-rc-delta``).
    - ``"gated_delta"``: :func:`fixedstate.delta_rule.gated_delta_rule_recurrent`
      with every ``beta_i = beta`` and every log-gate ``log(gate)`` (``eq-rc-gated``).
    - ``"ssm"``: :func:`fixedstate.ssm.selective_scan_sequential` with ``x = values``,
      ``B = keys``, step ``delta = 1`` and ``A = log(gate)`` in every entry, so
      ``h = gate h + v k^T``; the state returned is ``S = h^T`` (``eq-rc-ssm``).

    The fixed-state memories are returned as the state ``S`` of shape ``(d_k, d_v)``.
    """
    mechanism = _mechanism(mechanism)
    k, v = _pairs(keys, values)
    beta = _unit_interval(beta, "beta", low_closed=False)
    gate = _unit_interval(gate, "gate", low_closed=False)
    passes = check_positive_int(passes, "passes")
    if passes > 1:
        k, v = np.tile(k, (passes, 1)), np.tile(v, (passes, 1))
    if mechanism == "softmax":
        cache = None
        for i in range(k.shape[0]):
            _, cache = softmax_attention_step(k[i], k[i], v[i], initial_state=cache)
        return cache.keys.copy(), cache.values.copy()
    _, state = _run_fixed_state(mechanism, k, k, v, beta=beta, gate=gate)
    return np.asarray(state, dtype=np.float64)


def read_memory(mechanism, memory, queries, *, temperature=0.01) -> np.ndarray:
    """Read a memory written by :func:`write_memory` at every query.

    Fixed-state memories: ``o = S^T q`` for each row ``q`` of ``queries``
    (``(M, d_k)`` -> ``(M, d_v)``). Softmax: ``o = sum_j softmax_j(q . k_j /
    temperature) v_j`` over the whole cache (``eq-rc-softmax``), computed with
    :func:`fixedstate.softmax_attention.softmax_attention` (non-causal, every query
    sees every cached key). The softmax memory is the pair ``(keys, values)`` that
    :func:`write_memory` returns, or a :class:`~fixedstate.softmax_attention.KVCache`.
    """
    mechanism = _mechanism(mechanism)
    temperature = _positive(temperature, "temperature")
    if mechanism == "softmax":
        if isinstance(memory, KVCache):
            memory = tuple(memory)
        if not isinstance(memory, (tuple, list)) or len(memory) != 2:
            raise ValueError("memory: expected the softmax cache, a tuple (keys (N, d_k), values (N, d_v)), "
                             f"got {type(memory).__name__}")
        ck, cv = _pairs(memory[0], memory[1])
        q = as_float_array(queries, "queries", ndim=2)
        check_dim(q, "queries", 1, ck.shape[1], "d_k, the width of the cached keys")
        out, _ = softmax_attention(q, ck, cv, causal=False, scale=1.0 / temperature)
        return out
    state = as_float_array(memory, "memory", ndim=2)
    q = as_float_array(queries, "queries", ndim=2)
    check_dim(q, "queries", 1, state.shape[0], "d_k, the first axis of the state S (d_k, d_v)")
    return q @ state


def nearest_value(recalled, values) -> np.ndarray:
    """Index of the stored value nearest (Euclidean distance) to each recalled vector.

    ``recalled``: ``(M, d_v)``; ``values``: ``(N, d_v)``; result: ``(M,)`` ints.
    Ties go to the lowest index.
    """
    r = as_float_array(recalled, "recalled", ndim=2)
    v = as_float_array(values, "values", ndim=2)
    check_dim(r, "recalled", 1, v.shape[1], "d_v, the width of the values")
    # |r - v_j|^2 = |r|^2 - 2 r.v_j + |v_j|^2: the first term does not depend on j
    return np.argmin(np.sum(v * v, axis=1)[None, :] - 2.0 * (r @ v.T), axis=1)


@dataclass
class RecallResult:
    """What :func:`recall_pairs` measured.

    ``recalled`` ``(N, d_v)``: what the memory returned for each key; ``errors``
    ``(N,)``: ``|recalled_i - v_i| / |v_i|``; ``correct`` ``(N,)``: whether the
    nearest stored value is ``v_i``; ``accuracy``: the fraction correct;
    ``mean_error``: the mean of ``errors``.
    """

    mechanism: str
    recalled: np.ndarray
    errors: np.ndarray
    correct: np.ndarray
    accuracy: float
    mean_error: float


def recall_pairs(mechanism, keys, values, *, temperature=0.01, beta=1.0, gate=0.9,
                 passes=1) -> RecallResult:
    """Write every pair, query every key, score the answers (the chapter's lab).

    ``keys``: ``(N, d_k)``; ``values``: ``(N, d_v)``. The memory is written by
    :func:`write_memory` and read by :func:`read_memory`; accuracy uses
    :func:`nearest_value` among the ``N`` stored values (with a softmax cache
    written ``passes`` times, each value is stored several times; the nearest is
    still taken among the ``N`` distinct pairs).
    """
    k, v = _pairs(keys, values)
    memory = write_memory(mechanism, k, v, beta=beta, gate=gate, passes=passes)
    recalled = read_memory(mechanism, memory, k, temperature=temperature)
    errors = np.linalg.norm(recalled - v, axis=1) / np.linalg.norm(v, axis=1)
    correct = nearest_value(recalled, v) == np.arange(k.shape[0])
    return RecallResult(mechanism, recalled, errors, correct, float(np.mean(correct)),
                        float(np.mean(errors)))


def crosstalk(keys, values) -> np.ndarray:
    """The interference term of additive writes, equation ``eq-rc-crosstalk``.

    For the state ``S = sum_j k_j v_j^T`` the read at ``k_i`` is
    ``(k_i . k_i) v_i + sum_{j != i} (k_j . k_i) v_j``; this returns the sum over
    ``j != i`` for every ``i``. ``keys``: ``(N, d_k)``; ``values``: ``(N, d_v)``;
    result ``(N, d_v)``.
    """
    k, v = _pairs(keys, values)
    gram = k @ k.T
    np.fill_diagonal(gram, 0.0)
    return gram @ v


# ----------------------------------------------------------------------------
# capacity curves: batched over seeds, every prefix from one pass
# ----------------------------------------------------------------------------

def batched_final_states(mechanism, keys, values, *, beta=1.0, gate=0.9, checkpoints=None):
    """The fixed-state memories of a batch of independent sequences at once.

    ``keys``: ``(B, N, d_k)``; ``values``: ``(B, N, d_v)``. Returns the states
    ``(B, d_k, d_v)`` after all ``N`` writes or, with ``checkpoints`` (a sorted
    list of prefix lengths), a list of such states, one after each prefix.
    The writes are those of :func:`write_memory` (``eq-rc-additive``,
    ``eq-rc-delta``, ``eq-rc-gated``, ``eq-rc-ssm``), made by the scans of the same
    layers (:mod:`fixedstate.kernels`) with the batch as a leading axis, once over
    the sequence, the state taken at each checkpoint, so every prefix comes from
    one pass; the arguments are checked here, once. The SSM memory's recurrence
    ``S <- gate S + k v^T`` is a Mamba-2 head with scalar decay, computed piece by
    piece (checkpoint to checkpoint) in the matrix form of
    :func:`fixedstate.ssm.ssd_quadratic` rather than token by token. The tests
    prove the states equal to those of the layers' public forms, bit for bit
    (:func:`capacity_curve` uses the same scans).
    """
    mechanism = _mechanism(mechanism)
    if mechanism == "softmax":
        raise ValueError("mechanism: 'softmax' keeps a cache, not a fixed state; expected one of "
                         f"{FIXED_STATE}")
    k = as_float_array(keys, "keys", ndim=3)
    v = as_float_array(values, "values", ndim=3)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"values: expected the batch and length of keys {k.shape[:2]}, got shape {v.shape}")
    beta = _unit_interval(beta, "beta", low_closed=False)
    gate = _unit_interval(gate, "gate", low_closed=False)
    n = k.shape[1]
    marks = [n] if checkpoints is None else list(checkpoints)
    if any(not 1 <= m <= n for m in marks) or sorted(marks) != marks:
        raise ValueError(f"checkpoints: expected sorted prefix lengths in [1, {n}], got {marks}")
    with blas_threads(1):  # small products, one after the other: threads cost more than they give
        states = _memory_states(mechanism, np.ascontiguousarray(k, dtype=np.float64),
                                np.ascontiguousarray(v, dtype=np.float64), beta, gate, marks)
    return states if checkpoints is not None else states[0]


@dataclass
class CapacityCurve:
    """Recall accuracy (and mean relative error) against the number of pairs.

    ``n_values`` ``(P,)``; ``ratios`` = ``n_values / d_k``; ``accuracy`` and
    ``error`` map each mechanism to an array ``(P,)`` averaged over seeds;
    ``per_seed_accuracy`` maps it to ``(n_seeds, P)``.
    """

    d_k: int
    d_v: int
    n_values: np.ndarray
    ratios: np.ndarray
    accuracy: dict = field(default_factory=dict)
    error: dict = field(default_factory=dict)
    per_seed_accuracy: dict = field(default_factory=dict)


def capacity_curve(d_k, n_values, *, mechanisms=MECHANISMS, d_v=None, overlap=0.0, n_seeds=8,
                   seed=0, temperature=0.01, beta=1.0, gate=0.9, passes=1) -> CapacityCurve:
    """Recall accuracy against ``N / d_k`` for each mechanism, averaged over seeds.

    For each of ``n_seeds`` seeds (drawn from ``np.random.default_rng(seed)``, so
    the curve is reproducible) one sequence of ``max(n_values)`` random unit keys
    (:func:`make_keys` with ``overlap``, not orthogonal) and random unit values is
    written; the memory after the first ``N`` writes answers the first ``N`` keys,
    for every ``N`` in ``n_values``. All mechanisms see the same keys and values.
    With ``passes > 1`` the first ``N`` pairs are written ``passes`` times over
    (one run per ``N``); softmax and additive recall are unchanged in direction
    by repetition (the additive read is scaled by ``passes``, the softmax read is
    the same), so only the delta-rule family and the SSM are re-run.

    The arguments are checked here, once; the states are then computed without
    the layers' own checks (the numbers of :func:`batched_final_states`, bit for
    bit) and with one BLAS thread. The random draws are kept for a few settings
    (16): every overlap ``> 0`` mixes the same draws (:func:`make_keys`), so a
    figure that recomputes the curves at many overlaps draws them once.

    Parameters
    ----------
    d_k : int >= 1
    n_values : increasing ints >= 1, the numbers of pairs
    d_v : int >= 1, default ``d_k``
    overlap, temperature, beta, gate : as in :func:`make_keys` and :func:`recall_pairs`

    Returns
    -------
    CapacityCurve
    """
    d_k = check_positive_int(d_k, "d_k")
    d_v = d_k if d_v is None else check_positive_int(d_v, "d_v")
    n_seeds = check_positive_int(n_seeds, "n_seeds")
    ns = np.asarray(n_values)
    if ns.ndim != 1 or ns.size == 0 or ns.dtype.kind not in "iu":
        raise ValueError(f"n_values: expected a non-empty list of integers, got {n_values!r}")
    if ns.min() < 1:
        raise ValueError(f"n_values: expected numbers of pairs N >= 1, got {int(ns.min())}")
    if np.any(np.diff(ns) <= 0):
        raise ValueError(f"n_values: expected strictly increasing values, got {ns.tolist()}")
    if isinstance(mechanisms, str):
        mechanisms = (mechanisms,)
    mechanisms = tuple(_mechanism(m) for m in mechanisms)
    if not mechanisms:
        raise ValueError("mechanisms: expected at least one mechanism, got none")
    rho = _overlap(overlap)
    temperature, beta, gate = _params(temperature, beta, gate)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed: expected an integer, got {seed!r}")
    passes = check_positive_int(passes, "passes")
    if rho > 0.0:
        _check_overlap_room(rho, d_k)
    with blas_threads(1):  # small products, one after the other: threads cost more than they give
        return _capacity_curve(d_k, ns.astype(int), mechanisms, d_v, rho, n_seeds, int(seed), temperature,
                               beta, gate, passes)


# Random draws of capacity_curve kept for a few settings: an interactive figure recomputes the curves at
# many overlaps with the same seeds, and every overlap > 0 mixes the same draws (_mix_keys).
_DRAWS_KEPT = 16


@lru_cache(maxsize=_DRAWS_KEPT)
def _capacity_draws(d_k: int, d_v: int, n_max: int, n_seeds: int, seed: int, overlapping: bool):
    """The draws of :func:`capacity_curve` from ``default_rng(seed)``, read-only: ``(keys, values)``.

    ``keys`` is the stack ``(n_seeds, n_max, d_k)`` of :func:`make_keys` without
    overlap, or (``overlapping``) the pair ``(c (n_seeds, d_k), u (n_seeds,
    n_max, d_k))`` that :func:`make_keys` mixes for any overlap ``> 0``; the
    values are ``(n_seeds, n_max, d_v)``. The same draws, in the same order, as
    ``make_keys`` called seed after seed and then ``_random_unit`` for the values.
    """
    rng = np.random.default_rng(seed)
    if overlapping:
        parts = [_shared_and_perpendicular(rng, n_max, d_k) for _ in range(n_seeds)]
        keys = (np.stack([c for c, _ in parts]), np.stack([u for _, u in parts]))
    else:
        keys = (np.stack([_random_unit(rng, (n_max, d_k)) for _ in range(n_seeds)]),)
    values = _random_unit(rng, (n_seeds, n_max, d_v))
    for arr in (*keys, values):
        arr.flags.writeable = False
    return keys, values


def _capacity_curve(d_k, ns, mechanisms, d_v, rho, n_seeds, seed, temperature, beta, gate, passes):
    """:func:`capacity_curve` on checked arguments (``ns`` an int array)."""
    n_max = int(ns[-1])
    draws, values = _capacity_draws(d_k, d_v, n_max, n_seeds, seed, rho > 0.0)
    keys = _mix_keys(*draws, rho) if rho > 0.0 else draws[0]
    marks = [int(x) for x in ns]
    # contiguous prefixes: numpy's batched matmul is slow on strided views
    prefix = {n: (np.ascontiguousarray(keys[:, :n, :]), np.ascontiguousarray(values[:, :n, :]))
              for n in marks}
    curve = CapacityCurve(d_k, d_v, ns, ns / d_k)
    arange = {n: np.arange(n) for n in marks}
    for mech in mechanisms:
        if mech == "softmax":
            states = None
        elif passes == 1 or mech == "linear":
            states = _memory_states(mech, keys, values, beta, gate, marks)
        else:
            states = [_memory_states(mech, np.tile(prefix[n][0], (1, passes, 1)), np.tile(prefix[n][1], (1, passes, 1)),
                                 beta, gate, [passes * n])[0] for n in marks]
        acc = np.empty((n_seeds, len(marks)))
        err = np.empty((n_seeds, len(marks)))
        for p, n in enumerate(marks):
            k_n, vals = prefix[n]
            if mech == "softmax":
                # softmax_attention(k_n, k_n, vals, causal=False, scale=1 / temperature), unchecked; the layer
                # multiplies by its cache's copy of the keys (k_n @ k_n^T itself would go to a symmetric
                # product, rounded differently)
                cached = np.array(k_n)
                recalled = row_softmax((1.0 / temperature) * (k_n @ cached.swapaxes(-1, -2))) @ vals
            elif mech == "linear":
                recalled = passes * (k_n @ states[p])  # writing the pairs `passes` times adds S that often
            else:
                recalled = k_n @ states[p]
            sims = recalled @ vals.transpose(0, 2, 1)  # unit values: nearest = largest dot
            # the means and norms of numpy (np.mean, np.linalg.norm), without their per-call overhead
            acc[:, p] = np.add.reduce(np.argmax(sims, axis=2) == arange[n][None, :], axis=1, dtype=float) / n
            diff = recalled - vals
            err[:, p] = np.add.reduce(np.sqrt(np.add.reduce(diff * diff, axis=2)), axis=1) / n
        curve.accuracy[mech] = acc.mean(axis=0)
        curve.error[mech] = err.mean(axis=0)
        curve.per_seed_accuracy[mech] = acc
    return curve


def _memory_states(mechanism, k, v, beta, gate, marks):
    """The states ``(B, d_k, d_v)`` of a fixed-state memory after each prefix length in ``marks``.

    ``k`` ``(B, N, d_k)`` and ``v`` ``(B, N, d_v)`` in float64, ``marks`` sorted
    in ``[1, N]``; ``beta`` and ``gate`` checked numbers. The scans the layers
    themselves run (:mod:`fixedstate.kernels`), once over the sequence without the
    reads, the state taken at each mark: :func:`~fixedstate.kernels.additive_scan`
    (``eq-rc-additive``, the scan of
    :func:`fixedstate.linear_attention.linear_attention_recurrent`),
    :func:`~fixedstate.kernels.delta_scan` (``eq-rc-delta``, ``eq-rc-gated``, the
    scan of :func:`fixedstate.delta_rule.delta_rule_recurrent` and its gated form)
    and, for the SSM memory (``eq-rc-ssm``), :func:`~fixedstate.kernels.ssd_state`,
    the final state of :func:`fixedstate.ssm.ssd_quadratic` piece by piece from
    mark to mark. The tests prove the states equal to the layers', bit for bit.
    """
    B, n = k.shape[:2]
    if mechanism == "linear":
        return additive_scan(None, k, v, None, marks=marks)[1]
    if mechanism in ("delta", "gated_delta"):
        log_gate = np.full((B, n), np.log(gate)) if mechanism == "gated_delta" else None
        return delta_scan(None, k, v, np.full((B, n), beta), log_gate, None, 1.0, False, marks=marks)[1]
    # the SSM memory S <- gate S + k v^T: log-decay log(gate) per token (a * delta with a = log(gate), delta = 1)
    states, done = [], 0
    S = np.zeros((B, k.shape[2], v.shape[2]))
    for m in marks:
        if m > done:
            S = ssd_state(np.full(m - done, np.log(gate)), k[:, done:m], v[:, done:m] * 1.0, S)
            done = m
        states.append(S.copy())
    return states


def vocabulary_recall(mechanism, d_k, d_v, n_values, *, n_candidates=128, n_seeds=8, seed=0,
                      feature_map=None, beta=1.0, gate=0.9) -> np.ndarray:
    """Recall accuracy when the answer is decoded from a vocabulary of candidate values.

    For each seed, ``n_candidates`` random unit values of width ``d_v`` form the
    vocabulary; the first ``N`` of them are written under ``N`` random unit keys
    of width ``d_k`` (:func:`write_memory`), every key is read back
    (``eq-rc-readout``), and the answer counts as right when the candidate with the
    largest cosine to the output is the value written under that key. With
    ``feature_map`` (a callable ``(N, d_k) -> (N, r)``) the memory stores
    ``phi(k)`` instead of ``k`` and is read at ``phi(k)``: its state is ``r x d_v``.
    ``mechanism`` is a fixed-state memory (not ``"softmax"``).

    Returns the mean accuracy over the seeds, an array shaped like ``n_values``.
    """
    mechanism = _mechanism(mechanism)
    if mechanism == "softmax":
        raise ValueError(f"mechanism: expected a fixed-state memory, one of {FIXED_STATE}, got 'softmax'")
    d_k = check_positive_int(d_k, "d_k")
    d_v = check_positive_int(d_v, "d_v")
    n_candidates = check_positive_int(n_candidates, "n_candidates")
    n_seeds = check_positive_int(n_seeds, "n_seeds")
    ns = [check_positive_int(n, "n_values") for n in np.atleast_1d(np.asarray(n_values)).tolist()]
    if max(ns) > n_candidates:
        raise ValueError(f"n_values: expected at most n_candidates = {n_candidates} pairs (each pair "
                         f"stores a distinct candidate), got {max(ns)}")
    if feature_map is not None and not callable(feature_map):
        raise ValueError(f"feature_map: expected a callable (N, d_k) -> (N, r) or None, got {feature_map!r}")
    acc = np.zeros(len(ns))
    for s in range(n_seeds):
        rng = np.random.default_rng([int(seed), s])
        candidates = make_values(n_candidates, d_v, rng=rng)
        for p, n in enumerate(ns):
            keys = make_keys(n, d_k, rng=rng)
            if feature_map is not None:
                keys = as_float_array(feature_map(keys), "feature_map", ndim=2)
            out = read_memory(mechanism, write_memory(mechanism, keys, candidates[:n], beta=beta, gate=gate), keys)
            # cosine with every candidate: the candidates have length one, so divide by |out| only
            cos = (out @ candidates.T) / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-300)
            acc[p] += np.mean(np.argmax(cos, axis=1) == np.arange(n))
    return acc / n_seeds


# ----------------------------------------------------------------------------
# multi-query associative recall (Zoology)
# ----------------------------------------------------------------------------

@dataclass
class MQARBatch:
    """A batch of MQAR sequences from :func:`make_mqar`.

    ``tokens`` ``(B, T)`` ints; ``targets`` ``(B, T)`` ints, the value a model
    should answer at each query position and ``-1`` elsewhere. Token ``0`` is the
    filler; ``key_tokens`` and ``value_tokens`` are the two disjoint halves of the
    rest of the vocabulary.
    """

    tokens: np.ndarray
    targets: np.ndarray
    vocab_size: int
    n_pairs: int
    key_tokens: np.ndarray
    value_tokens: np.ndarray


def make_mqar(n_sequences, vocab_size, n_pairs, seq_len, *, n_queries=None, rng=None,
              distinct_values=False) -> MQARBatch:
    """Multi-query associative recall sequences, after Zoology (Arora et al., 2024).

    Each sequence starts with ``n_pairs`` key-value bigrams ``k_1 v_1 ... k_N v_N``
    (distinct keys drawn from the key half of the vocabulary, values from the
    value half, repeats allowed), followed by ``n_queries`` (default ``n_pairs``)
    queries at random positions in the rest of the sequence: a query is one of
    the written keys (each at most once) followed by its value, and the target
    at the key's position is that value. Other positions hold the filler ``0``.

    Parameters
    ----------
    n_sequences : int >= 1
    vocab_size : int >= 3 (token 0 is the filler, the rest splits into keys and values)
    n_pairs : int >= 1, at most the number of key tokens ``(vocab_size - 1) // 2``
    seq_len : int >= ``2 * n_pairs + 2 * n_queries``
    n_queries : int in [1, n_pairs], default ``n_pairs``
    rng : numpy Generator, int seed or None (seed 0)
    distinct_values : bool. ``False`` (the default): values drawn with repeats, as
        above. ``True``: the values of a sequence are distinct, drawn without
        replacement like its keys, as Zoology's generator draws both (there are
        at least as many value tokens as key tokens, so any valid ``n_pairs`` fits)

    Returns
    -------
    MQARBatch with ``tokens`` and ``targets`` of shape ``(n_sequences, seq_len)``
    """
    b = check_positive_int(n_sequences, "n_sequences")
    n_values, n, m = _mqar_sizes(vocab_size, n_pairs, n_queries, distinct_values)   # shared with the baseline
    t_len = check_positive_int(seq_len, "seq_len")
    vocab = int(vocab_size)
    n_keys = vocab - 1 - n_values
    if t_len < 2 * n + 2 * m:
        raise ValueError(f"seq_len: expected at least 2 * n_pairs + 2 * n_queries = {2 * n + 2 * m}, "
                         f"got {t_len}")
    rng = as_generator(rng, default_seed=0)
    key_tokens = np.arange(1, 1 + n_keys)
    value_tokens = np.arange(1 + n_keys, vocab)
    tokens = np.zeros((b, t_len), dtype=np.int64)
    targets = np.full((b, t_len), -1, dtype=np.int64)
    free = t_len - 2 * n  # positions after the context
    for s in range(b):
        ks = rng.choice(key_tokens, size=n, replace=False)
        vs = rng.choice(value_tokens, size=n, replace=bool(not distinct_values))
        tokens[s, 0:2 * n:2] = ks
        tokens[s, 1:2 * n:2] = vs
        which = rng.choice(n, size=m, replace=False)
        # m non-overlapping bigram slots among the free positions: choose m starts in a
        # shortened line of free - m cells, then spread them by one cell each
        starts = np.sort(rng.choice(free - m, size=m, replace=False)) + np.arange(m)
        pos = 2 * n + starts
        tokens[s, pos] = ks[which]
        tokens[s, pos + 1] = vs[which]
        targets[s, pos] = vs[which]
    return MQARBatch(tokens, targets, vocab, n, key_tokens, value_tokens)


def _tokens(tokens, vocab_size):
    arr = np.asarray(tokens)
    if arr.ndim != 2 or arr.dtype.kind not in "iu":
        raise ValueError(f"tokens: expected a 2-d integer array (B, T), got {arr.dtype} array of shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"tokens: expected token ids in [0, {vocab_size}), got values in "
                         f"[{int(arr.min())}, {int(arr.max())}]")
    return arr


def mqar_answers(mechanism, batch: MQARBatch, *, d_k, d_v=None, temperature=0.01, beta=1.0, gate=0.9,
                 rng=None) -> np.ndarray:
    """Answer an MQAR batch with a hand-wired one-layer model built on a mechanism.

    Nothing is trained. Each key token gets a random unit key embedding of width
    ``d_k`` (other tokens embed to zero keys); each value token a random unit
    value embedding of width ``d_v`` (default ``d_k``). At position ``t`` the layer
    writes the pair (key embedding of token ``t-1``, value embedding of token
    ``t``): the previous-token shift that Zoology's analysis of recall relies on,
    hard-coded. It queries with the key embedding of token ``t``, and the
    answer is the value token whose embedding is nearest to the output. The layer
    runs causally over the whole batch at once with the package's layers (the
    batch is their leading axis). The gated
    delta rule decays at every token (filler included); the ``"ssm"`` memory is
    made selective by hand: its step ``delta`` is 1 where a pair is written and
    ``1e-9`` elsewhere, so it decays only when it writes.

    Every position writes, queries included: a query bigram ``k v`` that repeats
    an earlier pair writes that pair again before later queries read the state.
    For the delta rule a repeated write makes its pair exact again; for additive
    writes it doubles the pair and its crosstalk. Chapter 5 measures how much of
    the delta rule's MQAR lead this accounts for.

    Returns ``(B, T)`` predicted token ids (-1 where the query is a zero vector).
    """
    mechanism = _mechanism(mechanism)
    if not isinstance(batch, MQARBatch):
        raise ValueError(f"batch: expected an MQARBatch from make_mqar, got {type(batch).__name__}")
    d_k = check_positive_int(d_k, "d_k")
    d_v = d_k if d_v is None else check_positive_int(d_v, "d_v")
    temperature, beta, gate = _params(temperature, beta, gate)
    tokens = _tokens(batch.tokens, batch.vocab_size)
    rng = as_generator(rng, default_seed=0)
    emb_k = np.zeros((batch.vocab_size, d_k))
    emb_k[batch.key_tokens] = _random_unit(rng, (batch.key_tokens.size, d_k))
    emb_v = np.zeros((batch.vocab_size, d_v))
    emb_v[batch.value_tokens] = _random_unit(rng, (batch.value_tokens.size, d_v))
    b, t_len = tokens.shape
    # every sequence at once: the cores take the batch as a leading axis
    q = embedding(tokens, emb_k)  # (B, T, d_k)
    k = np.concatenate([np.zeros((b, 1, d_k)), q[:, :-1]], axis=1)  # key of the previous token
    v = embedding(tokens, emb_v)  # (B, T, d_v)
    if mechanism == "softmax":
        out, _ = softmax_attention(q, k, v, causal=True, scale=1.0 / temperature)
    else:
        # the SSM's selectivity, hand-wired: a full step where a pair is written, a step of
        # 1e-9 elsewhere (no decay, no write)
        step = np.where(np.any(k != 0, axis=-1), 1.0, 1e-9)
        out, _ = _run_fixed_state(mechanism, q, k, v, beta=beta, gate=gate, step=step)
    sims = np.asarray(out, dtype=np.float64) @ emb_v[batch.value_tokens].T
    answer = batch.value_tokens[np.argmax(sims, axis=-1)]
    return np.where(np.any(q != 0, axis=-1), answer, -1).astype(np.int64)


def score_mqar(predictions, targets) -> float:
    """Fraction of query positions (``targets >= 0``) where ``predictions`` equals the target.

    ``predictions`` and ``targets``: integer arrays of the same shape ``(B, T)``.
    """
    p = np.asarray(predictions)
    t = np.asarray(targets)
    if p.shape != t.shape:
        raise ValueError(f"predictions: expected the shape of targets {t.shape}, got {p.shape}")
    if p.dtype.kind not in "iu" or t.dtype.kind not in "iu":
        raise ValueError(f"predictions, targets: expected integer token ids, got {p.dtype} and {t.dtype}")
    mask = t >= 0
    if not np.any(mask):
        raise ValueError("targets: expected at least one query position (a target >= 0), got none")
    return float(np.mean(p[mask] == t[mask]))


# ----------------------------------------------------------------------------
# what MQAR gives away without retrieval: the best predictor that never links a key to its value
# ----------------------------------------------------------------------------

NO_RETRIEVAL_STRATEGIES = ("most_frequent", "uniform_remaining", "uniform_context")


def _mqar_sizes(vocab_size, n_pairs, n_queries, distinct_values=False):
    """Validated ``(n_values, n_pairs, n_queries)`` for :func:`make_mqar`'s arguments."""
    if not isinstance(distinct_values, (bool, np.bool_)):
        raise ValueError(f"distinct_values: expected True or False, got {distinct_values!r}")
    vocab = check_positive_int(vocab_size, "vocab_size", minimum=3)
    n = check_positive_int(n_pairs, "n_pairs")
    m = n if n_queries is None else check_positive_int(n_queries, "n_queries")
    n_keys = (vocab - 1) // 2
    if n > n_keys:
        raise ValueError(f"n_pairs: expected at most {n_keys} pairs, the number of distinct key tokens "
                         f"in a vocabulary of {vocab}, got {n}")
    if m > n:
        raise ValueError(f"n_queries: expected at most n_pairs = {n} (each key is queried once), got {m}")
    return vocab - 1 - n_keys, n, m


def _mean_largest_count(r, n_values) -> float:
    """The expected largest number of times one value occurs among ``r`` values drawn uniformly
    and independently from ``n_values``.

    ``P(largest count <= c) = r! [x^r] (sum_{i <= c} (x / n_values)^i / i!)^n_values``: the
    number of sequences in which no value occurs more than ``c`` times, over ``n_values^r``.
    The power is taken by repeated squaring of polynomials cut at degree ``r``; every
    coefficient is positive, so the result is exact to a few units of rounding.
    """
    expected = 0.0
    for c in range(r):                      # E[largest] = sum over c >= 0 of P(largest > c)
        base = np.zeros(r + 1)
        i = np.arange(min(c, r) + 1)
        base[i] = np.exp(-i * np.log(n_values) - np.array([math.lgamma(k + 1) for k in i]))
        power, e = np.eye(1, r + 1)[0], n_values
        while e:
            if e & 1:
                power = np.convolve(power, base)[:r + 1]
            e >>= 1
            if e:
                base = np.convolve(base, base)[:r + 1]
        expected += 1.0 - power[r] * math.exp(math.lgamma(r + 1))
    return expected


def no_retrieval_accuracy(vocab_size, n_pairs, *, n_queries=None, distinct_values=False) -> float:
    """Expected MQAR accuracy of the best predictor that never links a key to its value (``eq-tr-no-retrieval``).

    Exact, for sequences drawn by :func:`make_mqar` with the same arguments.
    There the values are drawn independently and uniformly from the
    ``n_values = vocab_size - 1 - (vocab_size - 1) // 2`` value tokens, and the
    queried keys come in a uniformly random order, each followed by its
    answer. A predictor that sees everything but which value was written next
    to which key knows, at the ``j``-th query (``j = 0, 1, ...``), the values of
    the ``n_pairs - j`` pairs not yet answered; its answer is any one of them
    with equal probability, so the best it can do is name the value that occurs
    most often among them (ties broken at random), which is right with
    probability (largest count) / ``(n_pairs - j)``. Those ``n_pairs - j`` values
    are themselves independent uniform draws, so the expected accuracy is

    ``(1 / n_queries) * sum_j E[M_{n_pairs - j}] / (n_pairs - j)``,

    ``M_r`` the largest number of times one value occurs among ``r`` draws.
    With ``distinct_values`` (Zoology's draw) every count is 1, and the sum is
    ``(1 / n_queries) * sum_j 1 / (n_pairs - j)``.

    Parameters
    ----------
    vocab_size, n_pairs, n_queries, distinct_values : as for :func:`make_mqar`

    Returns
    -------
    float in ``(0, 1]``
    """
    n_values, n, m = _mqar_sizes(vocab_size, n_pairs, n_queries, distinct_values)
    if distinct_values:
        return float(sum(1 / (n - j) for j in range(m)) / m)
    return float(sum(_mean_largest_count(n - j, n_values) / (n - j) for j in range(m)) / m)


def no_retrieval_score(batch: MQARBatch, *, strategy="most_frequent", per_query=False):
    """Expected accuracy on ``batch`` of a predictor that never links a key to its value (``eq-tr-no-retrieval``).

    Exact for the given sequences: every random choice of the predictor (a
    guess, a tie) is averaged over, not drawn. At each query the predictor
    knows the values written in the sequence's context and the answers already
    shown after earlier queries, never which value was written next to which
    key. ``strategy``:

    - ``"most_frequent"``: among the values not yet answered (the context's
      values, each answer removed once), name one that occurs most often, ties
      broken at random. This is the best such predictor; its expected accuracy
      over :func:`make_mqar`'s draws is :func:`no_retrieval_accuracy`;
    - ``"uniform_remaining"``: a uniform guess among the distinct values not yet answered;
    - ``"uniform_context"``: a uniform guess among the distinct values of the context.

    Parameters
    ----------
    batch : MQARBatch from :func:`make_mqar`
    strategy : one of ``NO_RETRIEVAL_STRATEGIES``
    per_query : bool. ``True`` returns, instead of the mean, the probability of
        being right at every query position (a predictor that draws its guess and
        its ties is right there with that probability, independently of its other
        queries), from which the spread of such a predictor's score follows.

    Returns
    -------
    float in ``[0, 1]``, the mean over the batch's query positions; with
    ``per_query=True`` an array of the shape of ``batch.targets``, the
    probability at each query position and NaN elsewhere
    """
    if not isinstance(batch, MQARBatch):
        raise ValueError(f"batch: expected an MQARBatch from make_mqar, got {type(batch).__name__}")
    if strategy not in NO_RETRIEVAL_STRATEGIES:
        raise ValueError(f"strategy: expected one of {NO_RETRIEVAL_STRATEGIES}, got {strategy!r}")
    tokens = _tokens(batch.tokens, batch.vocab_size)
    targets = np.asarray(batch.targets)
    n = batch.n_pairs
    if not isinstance(per_query, (bool, np.bool_)):
        raise ValueError(f"per_query: expected True or False, got {per_query!r}")
    hits = np.full(targets.shape, np.nan)
    right, total = 0.0, 0
    for row, target, hit in zip(tokens, targets, hits):
        context = [int(v) for v in row[1:2 * n:2]]
        remaining = {v: context.count(v) for v in context}
        n_distinct = len(remaining)
        for t in np.nonzero(target >= 0)[0]:
            answer = int(target[t])
            if strategy == "most_frequent":
                top = max(remaining.values())
                tied = [v for v, c in remaining.items() if c == top]
                hit[t] = (answer in tied) / len(tied)
            elif strategy == "uniform_remaining":
                hit[t] = (answer in remaining) / len(remaining)
            else:
                hit[t] = (answer in context) / n_distinct
            right += hit[t]
            total += 1
            if answer in remaining:                 # the answer is shown after the query
                remaining[answer] -= 1
                if remaining[answer] == 0:
                    del remaining[answer]
    if total == 0:
        raise ValueError("batch: expected at least one query position (a target >= 0), got none")
    return hits if per_query else right / total


def no_retrieval_se(batch: MQARBatch) -> float:
    """Standard error of the score of the best predictor that never links a key to its value (``eq-tr-no-retrieval``).

    Such a predictor's score on ``batch`` varies for two reasons, both counted:
    which sequences were drawn (the variance of the per-sequence means of
    :func:`no_retrieval_score`'s ``per_query`` probabilities, over the
    sequences), and which of several equally frequent values it names at a
    query (a query right with probability ``q`` adds ``q (1 - q)``, independently
    of the others). A score more than a few of these above
    :func:`no_retrieval_score` shows retrieval.

    Parameters
    ----------
    batch : MQARBatch from :func:`make_mqar`, with at least two sequences

    Returns
    -------
    float, the standard error of the batch's mean score
    """
    q = no_retrieval_score(batch, per_query=True)                     # NaN where nothing is asked
    asked = ~np.isnan(q)
    if q.shape[0] < 2 or np.any(asked.sum(axis=1) == 0):
        raise ValueError(f"batch: expected at least two sequences, each with a query, got {q.shape[0]} "
                         f"sequences with {asked.sum(axis=1).min() if q.size else 0} queries in the sparest")
    per_sequence = np.nanmean(q, axis=1)
    tie_var = np.nansum(q * (1 - q), axis=1) / asked.sum(axis=1) ** 2
    return float(np.sqrt((np.var(per_sequence, ddof=1) + tie_var.mean()) / len(per_sequence)))
