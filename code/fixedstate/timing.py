"""Wall-clock measurements: one timer, and the measurements the chapters and benchmarks make with it.

- :func:`best_time`: the fastest of a few runs of a call, the usual defence
  against other work on a shared machine (as :mod:`timeit` recommends: the
  slower runs measure the other programs, not the code);
- :func:`time_forms`: the recurrent and chunkwise forms of a delta-rule layer
  (chapter {ref}`chap-delta-rule`, ``benchmarks/delta_rule_bench.py``);
- :func:`time_lab_update`: what one move of a slider of the recall lab costs
  (chapter {ref}`chap-recall`);
- :func:`measure_decode_seconds`: one decode step of the hybrid toy stack at a
  given context length (chapter {ref}`chap-hybrids`).

Every number here depends on the machine: the book prints them from cells
whose outputs are not compared.
"""

from __future__ import annotations

import time

import numpy as np

from . import delta_rule as dr
from ._validate import check_positive_int
from .blocks import l2_normalize
from .hybrid import stack_decode_step, synthetic_cache
from .recall import lab_update

__all__ = ["best_time", "time_forms", "time_lab_update", "measure_decode_seconds"]


def best_time(fn, *args, repeats=5, **kwargs) -> float:
    """Seconds of the fastest of ``repeats`` calls ``fn(*args, **kwargs)``.

    ``best_time(f)`` times ``f()``; ``best_time(np.linalg.solve, A, b, repeats=7)``
    times ``np.linalg.solve(A, b)``. The keyword ``repeats`` is this function's
    own: it is not passed on to ``fn``. The results of the calls are discarded.
    """
    if not callable(fn):
        raise ValueError(f"fn: expected a callable, got {type(fn).__name__} {fn!r}")
    repeats = check_positive_int(repeats, "repeats")
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return float(best)


def time_forms(T, d_k=128, d_v=128, *, dtype=np.float64, chunk_size=64, repeats=3, layer="gated", seed=0):
    """Time the recurrent and chunkwise forms of one delta-rule layer on random data.

    Random queries, unit keys, values and ``beta`` in ``[0.1, 0.9]``; the gated
    delta rule gets log-gates ``log(g)`` with ``g`` uniform in ``[0.9, 1]``, KDA
    gets ``kda_log_gate(z - 3)`` with ``z`` standard normal ``(T, d_k)``. Each
    form runs once untimed (its output is compared), then :func:`best_time`.

    Parameters
    ----------
    T, d_k, d_v : sizes. dtype : float32 or float64. chunk_size : for the chunkwise form.
    repeats : best of this many runs is reported. layer : "delta", "gated" or "kda".

    Returns
    -------
    dict with ``recurrent`` and ``chunkwise`` (seconds, best of ``repeats``),
    ``ratio`` (recurrent / chunkwise) and ``max_rel_diff`` between the outputs.
    """
    T = check_positive_int(T, "T")
    d_k = check_positive_int(d_k, "d_k")
    d_v = check_positive_int(d_v, "d_v")
    repeats = check_positive_int(repeats, "repeats")
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, d_k)).astype(dtype)
    k = l2_normalize(rng.standard_normal((T, d_k))).astype(dtype)
    v = rng.standard_normal((T, d_v)).astype(dtype)
    params = {"beta": rng.uniform(0.1, 0.9, T).astype(dtype)}
    if layer == "delta":
        rec, chk = dr.delta_rule_recurrent, dr.delta_rule_chunkwise
    elif layer == "gated":
        rec, chk = dr.gated_delta_rule_recurrent, dr.gated_delta_rule_chunkwise
        params["log_gate"] = np.log(rng.uniform(0.9, 1.0, T)).astype(dtype)
    elif layer == "kda":
        rec, chk = dr.kda_recurrent, dr.kda_chunkwise
        params["log_gate"] = dr.kda_log_gate(rng.standard_normal((T, d_k)) - 3.0).astype(dtype)
    else:
        raise ValueError(f"layer: expected 'delta', 'gated' or 'kda', got {layer!r}")
    o_rec, _ = rec(q, k, v, **params)
    o_chk, _ = chk(q, k, v, **params, chunk_size=chunk_size)
    t_rec = best_time(rec, q, k, v, **params, repeats=repeats)
    t_chk = best_time(chk, q, k, v, **params, chunk_size=chunk_size, repeats=repeats)
    rel = float(np.max(np.abs(o_chk - o_rec)) / max(np.max(np.abs(o_rec)), np.finfo(dtype).tiny))
    return {"recurrent": t_rec, "chunkwise": t_chk, "ratio": t_rec / t_chk, "max_rel_diff": rel}


def time_lab_update(d_k, *, n_pairs=None, mechanism="gated_delta", overlap=0.3, repeats=5) -> float:
    """Wall-clock seconds of one :func:`fixedstate.recall.lab_update` (no drawing) at key width ``d_k``.

    The fastest of ``repeats`` runs (:func:`best_time`). ``n_pairs`` defaults to
    ``2 * d_k``.
    """
    d_k = check_positive_int(d_k, "d_k")
    n = 2 * d_k if n_pairs is None else check_positive_int(n_pairs, "n_pairs")
    return best_time(lab_update, mechanism, n, d_k, overlap, repeats=repeats)


def measure_decode_seconds(params: dict, context_lengths, *, n_steps: int = 5, seed: int = 0) -> np.ndarray:
    """Fastest wall-clock seconds of one :func:`fixedstate.hybrid.stack_decode_step` at each context length.

    For each length a :func:`fixedstate.hybrid.synthetic_cache` is built and one
    untimed step warms up (it also gives the full KV caches their spare rows,
    the one reallocation), then ``n_steps`` steps are timed one at a time with
    :func:`best_time`, each continuing from the cache the previous one left
    (the KV caches grow by one token per step, an append into spare rows). The
    work of a step depends on the sizes of the caches and states, not on their
    contents, so every step reads the same random token. Returns an array
    shaped like ``context_lengths``.
    """
    lengths = [check_positive_int(n, "context_lengths", minimum=0)
               for n in np.atleast_1d(np.asarray(context_lengths)).tolist()]
    n_steps = check_positive_int(n_steps, "n_steps")
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        cache = synthetic_cache(params, n, seed=seed)
        token = rng.standard_normal(params["d_model"]).astype(params["layers"][0]["W_q"].dtype)
        stack_decode_step(params, token, cache)  # warm-up
        out.append(best_time(stack_decode_step, params, token, cache, repeats=n_steps))
    return np.reshape(np.array(out), np.shape(context_lengths))
