"""Wall-clock measurements: one timer, and the measurements the chapters and benchmarks make with it.

- :func:`best_time`: the fastest of a few runs of a call, the usual defence
  against other work on a shared machine (as :mod:`timeit` recommends: the
  slower runs measure the other programs, not the code);
- :func:`time_forms`: the recurrent and chunkwise forms of a delta-rule layer
  (chapter {ref}`chap-delta-rule`, ``benchmarks/delta_rule_bench.py``);
- :func:`gemm_rate` and :func:`chunkwise_table`: the rate of large matrix
  products on this machine, and the forms of every delta-rule layer against the
  time their matrix products would take at that rate (the GEMM limit);
- :func:`products_replay`: the matrix products a chunkwise form makes, replayed
  on their own, so that a form's distance from its limit splits into what its
  products cost at their sizes and what everything else costs;
- :func:`time_lab_update`: what one move of a slider of the recall lab costs
  (chapter {ref}`chap-recall`);
- :func:`measure_decode_seconds`: one decode step of the hybrid toy stack at a
  given context length (chapter {ref}`chap-hybrids`).

Every number here depends on the machine: the book prints them from cells
whose outputs are not compared. On a shared machine the fastest of a few runs
measures the code; where a result is reported over several rounds of such
runs, it is their median.

The test suite runs the chapters with the environment variable
``FIXEDSTATE_TIMING=once`` (see :func:`timing_once`): every routine here then
makes one run in one round, whatever its ``repeats`` and ``rounds``, so that a
timing cell runs all its code, once, in nbval, whose comparison leaves its
outputs out. A reader never sets it: the numbers the book prints are from the
full measurements.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from . import _threads     # blas_threads is also the name of an argument here: the module keeps the two apart
from . import delta_rule as dr
from ._validate import check_positive_int
from .blocks import l2_normalize
from .costs import delta_rule_chunkwise_flops
from .toy_stack import stack_decode_step, synthetic_cache
from .kernels import matmul_add, recording_products
from .layer_ids import DELTA, GATED_DELTA, KDA, check_layer_id
from . import recall_lab

__all__ = ["best_time", "random_layer_inputs", "time_forms", "gemm_rate", "products_replay", "chunkwise_table",
           "format_chunkwise_table", "time_lab_update", "measure_decode_seconds"]

# The layers timed here (ids of fixedstate.layer_ids): their recurrent and chunkwise forms.
_FORMS = {
    DELTA: (dr.delta_rule_recurrent, dr.delta_rule_chunkwise),
    GATED_DELTA: (dr.gated_delta_rule_recurrent, dr.gated_delta_rule_chunkwise),
    KDA: (dr.kda_recurrent, dr.kda_chunkwise),
}


def timing_once() -> bool:
    """True when ``FIXEDSTATE_TIMING=once``: one run in one round for every measurement (the test suite's setting).

    Any other value of the variable is refused with a ``ValueError``, so that a typo never
    silently changes what a measurement does.
    """
    value = os.environ.get("FIXEDSTATE_TIMING", "")
    if value not in ("", "once"):
        raise ValueError(f"FIXEDSTATE_TIMING: expected 'once' or unset, got {value!r}")
    return value == "once"


def best_time(fn, *args, repeats=5, blas_threads=1, **kwargs) -> float:
    """Seconds of the fastest of ``repeats`` calls ``fn(*args, **kwargs)``.

    ``best_time(f)`` times ``f()``; ``best_time(np.linalg.solve, A, b, repeats=7)``
    times ``np.linalg.solve(A, b)``. The keywords ``repeats`` and ``blas_threads``
    are this function's own: they are not passed on to ``fn``. The calls run
    with at most ``blas_threads`` BLAS threads (default 1; None leaves the
    caller's setting), restored after: on a shared machine a second BLAS thread
    that waits for a busy core makes a timing erratic, several times too slow
    now and then. The results of the calls are discarded.
    """
    if not callable(fn):
        raise ValueError(f"fn: expected a callable, got {type(fn).__name__} {fn!r}")
    repeats = check_positive_int(repeats, "repeats")
    if timing_once():
        repeats = 1
    if blas_threads is not None:
        blas_threads = check_positive_int(blas_threads, "blas_threads")
    best = np.inf
    with _threads.blas_threads(blas_threads):
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            best = min(best, time.perf_counter() - t0)
    return float(best)


def random_layer_inputs(T, d_k=128, d_v=128, *, layer=GATED_DELTA, dtype=np.float64, seed=0):
    """The inputs :func:`time_forms` times a layer on: ``(q, k, v, params)``.

    Random queries, unit keys, values and ``beta`` in ``[0.1, 0.9]`` (in ``params``);
    the gated delta rule gets log-gates ``log(g)`` with ``g`` uniform in ``[0.9, 1]``,
    KDA gets ``kda_log_gate(z - 3)`` with ``z`` standard normal ``(T, d_k)``.
    """
    layer = check_layer_id(layer, _FORMS, "layer")
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, d_k)).astype(dtype)
    k = l2_normalize(rng.standard_normal((T, d_k))).astype(dtype)
    v = rng.standard_normal((T, d_v)).astype(dtype)
    params = {"beta": rng.uniform(0.1, 0.9, T).astype(dtype)}
    if layer == GATED_DELTA:
        params["log_gate"] = np.log(rng.uniform(0.9, 1.0, T)).astype(dtype)
    elif layer == KDA:
        params["log_gate"] = dr.kda_log_gate(rng.standard_normal((T, d_k)) - 3.0).astype(dtype)
    return q, k, v, params


def time_forms(T, d_k=128, d_v=128, *, dtype=np.float64, chunk_size=64, repeats=3, layer=GATED_DELTA, seed=0,
               rounds=1, blas_threads=1):
    """Time the recurrent and chunkwise forms of one delta-rule layer on random data.

    The inputs are :func:`random_layer_inputs`. Each form runs once untimed (its
    output is compared), then ``rounds`` rounds each time both forms (the fastest
    of ``repeats`` runs, :func:`best_time`); with several rounds the result is
    their median, the two forms taking turns so that other work on the machine
    falls on both.

    Parameters
    ----------
    T, d_k, d_v : sizes. dtype : float32 or float64. chunk_size : for the chunkwise form.
    repeats : runs per round, the fastest counts. layer : "delta", "gated_delta" or "kda"
    (:mod:`fixedstate.layer_ids`).
    rounds : rounds of runs, the median counts. blas_threads : as in :func:`best_time`
    (the forms themselves run their products with one thread whatever it is).

    Returns
    -------
    dict with ``recurrent`` and ``chunkwise`` (seconds), ``ratio`` (recurrent /
    chunkwise), ``max_rel_diff`` between the outputs and ``flops``, the FLOPs of
    the chunkwise form's matrix products (:func:`fixedstate.costs.delta_rule_chunkwise_flops`).
    """
    T = check_positive_int(T, "T")
    d_k = check_positive_int(d_k, "d_k")
    d_v = check_positive_int(d_v, "d_v")
    repeats = check_positive_int(repeats, "repeats")
    rounds = check_positive_int(rounds, "rounds")
    if timing_once():
        rounds = 1
    q, k, v, params = random_layer_inputs(T, d_k, d_v, layer=layer, dtype=dtype, seed=seed)
    rec, chk = _FORMS[layer]
    o_rec, _ = rec(q, k, v, **params)
    o_chk, _ = chk(q, k, v, **params, chunk_size=chunk_size)
    t_rec, t_chk = [], []
    for _ in range(rounds):
        t_rec.append(best_time(rec, q, k, v, **params, repeats=repeats, blas_threads=blas_threads))
        t_chk.append(best_time(chk, q, k, v, **params, chunk_size=chunk_size, repeats=repeats,
                               blas_threads=blas_threads))
    t_rec, t_chk = float(np.median(t_rec)), float(np.median(t_chk))
    dtype = np.dtype(dtype)
    rel = float(np.max(np.abs(o_chk - o_rec)) / max(np.max(np.abs(o_rec)), np.finfo(dtype).tiny))
    return {"recurrent": t_rec, "chunkwise": t_chk, "ratio": t_rec / t_chk, "max_rel_diff": rel,
            # the gate adds no matrix product: the gated delta rule makes the products of the delta rule
            "flops": delta_rule_chunkwise_flops(T, d_k, d_v, chunk_size=chunk_size, layer=KDA if layer == KDA else DELTA)}


def gemm_rate(dtype=np.float64, *, n=1024, repeats=5, threads=1) -> float:
    """FLOP/s of one ``(n, n) @ (n, n)`` numpy product on this machine (``2 n^3`` FLOPs, the fastest of ``repeats``).

    ``threads`` is the number of BLAS threads (1, as the package's sequence forms
    use; None: the caller's setting). A product this large runs close to the
    processor's peak, so this is the rate against which the chunkwise forms'
    products are measured.
    """
    n = check_positive_int(n, "n")
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    np.matmul(a, b)
    return 2.0 * n ** 3 / best_time(np.matmul, a, b, repeats=repeats, blas_threads=threads)


def _same_layout(x, rng):
    """A new array with the shape, strides and dtype of ``x``, small random values.

    The strides are those of ``x`` exactly: a block that the form takes out of a
    larger matrix (the h x h blocks of the UT transform's inverse, the first C rows
    of ``[W; Gamma Q]``) keeps its row pitch, and so its gaps, in the replay.
    """
    size = x.itemsize
    if any(s % size for s in x.strides):
        raise ValueError(f"x: expected strides that are multiples of the item size {size}, got {x.strides}")
    extent = sum((n - 1) * abs(s) for n, s in zip(x.shape, x.strides)) // size + 1 if x.size else 1
    start = sum((n - 1) * -s for n, s in zip(x.shape, x.strides) if s < 0) // size  # the first element's place
    buffer = rng.uniform(-0.01, 0.01, extent).astype(x.dtype)
    return np.lib.stride_tricks.as_strided(buffer[start:], x.shape, x.strides, writeable=True)


def products_replay(layer, q, k, v, *, chunk_size=64, seed=0, **params):
    """The matrix products of one call of a chunkwise form, as a function that makes only those.

    ``layer`` is ``"delta"``, ``"gated_delta"`` or ``"kda"``; ``q, k, v`` and ``params``
    (``beta``, ``log_gate``) are the form's arguments. The form runs once, and
    every product it makes through :func:`fixedstate.kernels.matmul` and
    :func:`~fixedstate.kernels.matmul_add` (all of them: ``tests/test_costs.py``
    counts them) is recorded (:func:`fixedstate.kernels.recording_products`) with
    its shapes, memory layouts and scalars. An array the form uses in several
    products (the state inside the loop over chunks) is one array in the replay
    too. Returns ``(replay, flops)``: ``replay()`` makes the
    same products in the same order on arrays of the same layouts (small random
    values, made once), and nothing else (``replay.steps`` lists them as
    ``(kind, a, b, out, keep, sign)``, kind ``"matmul"`` or ``"add"``, the
    latter ``out <- keep * out + sign * a @ b``); ``flops`` is their count, equal to
    :func:`fixedstate.costs.delta_rule_chunkwise_flops`. Timing ``replay`` against
    the GEMM limit gives what the products cost at their sizes; the rest of the
    form's time is its elementwise work and numpy's cost per call.

    What the replay keeps and what it does not: each array has the strides of
    the form's (a block of a larger matrix keeps its row pitch), and a product of
    an array with a transposed view of itself (``K K^T``) stays one, so numpy can
    compute it as half a product as in the form. Arrays that are distinct views
    of one buffer in the form (blocks of one matrix) are separate buffers in the
    replay, and a result the form allocates afresh is written into an array made
    once. An ``"add"`` step is done as the form does it, by
    ``kernels.matmul_add``: one BLAS call in float64, in float32 a product
    followed by the scaling and the addition (two passes over ``out``).
    Between the replay's products nothing touches the arrays, so an operand that
    the form has just written (and finds in cache) may have to come from memory
    in the replay: the replay measures the products in this arrangement, it does
    not bound their time inside the form. The recording lasts for that one call
    (it ends after it, also on an error) and sees only the products of the calling
    thread.
    """
    layer = check_layer_id(layer, _FORMS, "layer")
    with recording_products() as calls:
        _FORMS[layer][1](q, k, v, chunk_size=chunk_size, **params)

    rng = np.random.default_rng(seed)
    made = {}

    def twin(x):   # one replay array per distinct array of the form (address, shape, strides, dtype)
        key = (x.__array_interface__["data"][0], x.shape, x.strides, x.dtype.str)
        if key not in made:
            swapped = key[:1] + tuple(t[:-2] + t[:-3:-1] for t in key[1:3]) + key[3:]
            # a transposed view of an array already seen stays one (numpy computes K K^T as half a product)
            made[key] = made[swapped].swapaxes(-1, -2) if x.ndim >= 2 and swapped in made else _same_layout(x, rng)
        return made[key]

    steps = [(kind, twin(a), twin(b), twin(out), keep, sign) for kind, a, b, out, keep, sign in calls]
    flops = sum(2 * int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), dtype=np.int64))
                * a.shape[-2] * a.shape[-1] * b.shape[-1] for _, a, b, _, _, _ in steps)

    @_threads.one_blas_thread
    def replay():
        # The replayed values are never read, only timed: accumulated over many replays they may
        # overflow to inf and nan, which costs a product no more time than a finite value does.
        with np.errstate(over="ignore", invalid="ignore"):
            for kind, a, b, out, keep, sign in steps:
                if kind == "matmul":
                    np.matmul(a, b, out=out)
                else:
                    matmul_add(a, b, out, keep, sign)

    replay.steps = steps
    return replay, int(flops)


def chunkwise_table(T=4096, d=128, *, layers=(DELTA, GATED_DELTA, KDA), dtypes=(np.float64, np.float32),
                    threads=(None, 1), chunk_size=64, repeats=5, rounds=3, rates=None):
    """The recurrent and chunkwise forms of each layer against the GEMM limit (``make bench``, chapter {ref}`chap-delta-rule`).

    For each layer, dtype and BLAS thread setting (None: the caller's setting,
    the library's default unless the caller changed it, left as it is; 1: one
    thread, set with ``threadpoolctl.threadpool_limits`` around the runs),
    :func:`time_forms` at
    ``T`` tokens, ``d_k = d_v = d``, one head. The GEMM limit is the time the
    chunkwise form's matrix products (``flops``) would take at the measured rate
    of large products with one thread (:func:`gemm_rate`): when ``rates`` is not
    given, it is measured after each round of each row, in turns with the forms
    so that other work on the machine falls on both, and a row's limit uses the
    median of its own rounds; otherwise ``rates[dtype]``. No form that does those
    products can be faster on one core. Each row's times are the medians over
    ``rounds`` rounds of :func:`time_forms` (the fastest of ``repeats`` runs).
    Each round also times the chunkwise form's products on their own
    (:func:`products_replay`, the same sizes and layouts, nothing between them):
    ``chunkwise / limit`` is then ``products / limit`` (what products of these
    sizes cost on this machine) times ``chunkwise / products`` (what the form's
    other work adds).

    Returns a dict: ``rates`` (dtype name -> FLOP/s), ``rows`` (one dict per
    configuration: ``layer``, ``dtype``, ``threads``, ``rate`` (the GEMM rate its
    limit uses, FLOP/s), ``blas_threads`` (the
    thread count of each BLAS library when the runs started, as threadpoolctl
    reads it), ``recurrent``, ``chunkwise``,
    ``products``, ``limit`` (seconds), ``flops``, ``speedup`` (recurrent / chunkwise),
    ``recurrent_vs_limit``, ``chunkwise_vs_limit`` and ``products_vs_limit`` (time /
    limit), ``chunkwise_vs_products``) and the
    settings ``T``, ``d``, ``chunk_size``, ``repeats``, ``rounds``.
    """
    rounds = check_positive_int(rounds, "rounds")
    if timing_once():
        rounds = 1
    dtypes = [np.dtype(x) for x in dtypes]
    measured = {dt.name: [] for dt in dtypes} if rates is None else None
    rows = []
    for layer in layers:
        for dt in dtypes:
            for th in threads:
                # None: nothing is changed, the forms meet the caller's threads; a number: set here with
                # threadpoolctl's own context around the runs (not the package's limiter), restored after
                runs, row_rates, product_times = [], [], []
                q, k, v, params = random_layer_inputs(T, d, d, layer=layer, dtype=dt)
                replay, _ = products_replay(layer, q, k, v, chunk_size=chunk_size, **params)
                for _ in range(rounds):
                    with contextlib.nullcontext() if th is None else threadpool_limits(limits=th, user_api="blas"):
                        in_force = _blas_thread_counts()
                        runs.append(time_forms(T, d, d, dtype=dt, chunk_size=chunk_size, repeats=repeats,
                                               layer=layer, blas_threads=None))
                        product_times.append(best_time(replay, repeats=repeats, blas_threads=None))
                    if measured is not None:   # the rate in turns with the forms: other work falls on both
                        row_rates.append(gemm_rate(dt, repeats=repeats))
                        measured[dt.name].append(row_rates[-1])
                r = {key: float(np.median([x[key] for x in runs])) for key in ("recurrent", "chunkwise")}
                r.update(flops=runs[0]["flops"], ratio=r["recurrent"] / r["chunkwise"],
                         max_rel_diff=max(x["max_rel_diff"] for x in runs))
                rate = float(np.median(row_rates)) if measured is not None else rates[dt.name]
                limit = r["flops"] / rate
                products = float(np.median(product_times))
                rows.append({"layer": layer, "dtype": dt.name, "threads": th, "blas_threads": in_force, "rate": rate,
                             "recurrent": r["recurrent"],
                             "chunkwise": r["chunkwise"], "products": products, "limit": limit, "flops": r["flops"],
                             "speedup": r["ratio"], "recurrent_vs_limit": r["recurrent"] / limit,
                             "chunkwise_vs_limit": r["chunkwise"] / limit, "products_vs_limit": products / limit,
                             "chunkwise_vs_products": r["chunkwise"] / products, "max_rel_diff": r["max_rel_diff"]})
    if measured is not None:
        rates = {name: float(np.median(values)) for name, values in measured.items()}
    return {"rates": rates, "rows": rows, "T": T, "d": d, "chunk_size": chunk_size, "repeats": repeats,
            "rounds": rounds}


def _blas_thread_counts():
    """The thread count of each BLAS library loaded, as threadpoolctl reads it now."""
    return [lib["num_threads"] for lib in threadpool_info() if lib.get("user_api") == "blas"]


def format_chunkwise_table(table) -> str:
    """The table of :func:`chunkwise_table` as text: times in ms, ratios to the GEMM limit, to the products alone and between the forms."""
    lines = [f"{'layer':<13}{'dtype':<9}{'BLAS threads':>13}{'recurrent ms':>14}{'chunkwise ms':>14}"
             f"{'products ms':>13}{'GEMM limit ms':>15}{'rec/limit':>11}{'chunk/limit':>13}{'prod/limit':>12}"
             f"{'chunk/prod':>12}{'rec/chunk':>11}"]
    for r in table["rows"]:
        threads = "default" if r["threads"] is None else str(r["threads"])
        if r.get("blas_threads"):
            threads += f" ({max(r['blas_threads'])})"     # the count in force
        lines.append(f"{r['layer']:<13}{r['dtype']:<9}{threads:>13}{1e3 * r['recurrent']:>14.1f}"
                     f"{1e3 * r['chunkwise']:>14.1f}{1e3 * r['products']:>13.1f}{1e3 * r['limit']:>15.1f}"
                     f"{r['recurrent_vs_limit']:>11.2f}{r['chunkwise_vs_limit']:>13.2f}{r['products_vs_limit']:>12.2f}"
                     f"{r['chunkwise_vs_products']:>12.2f}{r['speedup']:>11.2f}")
    return "\n".join(lines)


def time_lab_update(d_k, *, n_pairs=None, mechanism="gated_delta", overlap=0.3, repeats=5) -> float:
    """Wall-clock seconds of one :func:`fixedstate.recall_lab.update` (no drawing) at key width ``d_k``.

    The fastest of ``repeats`` runs (:func:`best_time`). ``n_pairs`` defaults to
    ``2 * d_k``.
    """
    d_k = check_positive_int(d_k, "d_k")
    n = 2 * d_k if n_pairs is None else check_positive_int(n_pairs, "n_pairs")
    return best_time(recall_lab.update, mechanism, n, d_k, overlap, repeats=repeats)


def measure_decode_seconds(params: dict, context_lengths, *, n_steps: int = 5, seed: int = 0) -> np.ndarray:
    """Fastest wall-clock seconds of one :func:`fixedstate.toy_stack.stack_decode_step` at each context length.

    For each length a :func:`fixedstate.toy_stack.synthetic_cache` is built and one
    untimed step warms up (it also gives the full KV caches their spare rows,
    the one reallocation), then ``n_steps`` steps are timed one at a time with
    :func:`best_time`, each continuing from the cache the previous one left
    (the KV caches grow by one token per step, an append into spare rows). The
    work of a step depends on the sizes of the caches and states, not on their
    contents, so every step reads the same random token. The steps run with one
    BLAS thread (the caller's setting is restored after): a step is a chain of
    small products, which a second thread does not speed up but, on a busy
    machine, slows down erratically. Returns an array shaped like ``context_lengths``.
    """
    lengths = [check_positive_int(n, "context_lengths", minimum=0)
               for n in np.atleast_1d(np.asarray(context_lengths)).tolist()]
    n_steps = check_positive_int(n_steps, "n_steps")
    return _decode_seconds(params, lengths, n_steps, seed, np.shape(context_lengths))


@_threads.one_blas_thread
def _decode_seconds(params, lengths, n_steps, seed, shape):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        cache = synthetic_cache(params, n, seed=seed)
        token = rng.standard_normal(params["d_model"]).astype(params["layers"][0]["W_q"].dtype)
        stack_decode_step(params, token, cache)  # warm-up
        out.append(best_time(stack_decode_step, params, token, cache, repeats=n_steps))
    return np.reshape(np.array(out), shape)
