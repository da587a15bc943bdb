"""The recall chapter's lab (chapter "What a fixed state forgets", chap-recall): what one slider move recomputes.

The lab runs one experiment of :mod:`fixedstate.recall` (``n_pairs`` random keys
written into one memory and read back) and, beside it, every memory's capacity
curve at the same key width and overlap. This module holds only that choice of
experiment and axis; the arithmetic is :func:`fixedstate.recall.recall_pairs` and
:func:`fixedstate.recall.capacity_curve`. :mod:`fixedstate.figures.recall` draws
the result and :func:`fixedstate.timing.time_lab_update` times :func:`update`.

- :func:`n_values`: the numbers of pairs on the lab's capacity axis;
- :func:`experiment`: the one experiment;
- :func:`curves`: the capacity curves of every memory;
- :func:`update`: both, what a slider move recomputes.
"""

from __future__ import annotations

import numpy as np

from ._validate import check_positive_int
from .layer_ids import check_layer_id
from .recall import MECHANISMS, CapacityCurve, RecallResult, capacity_curve, make_keys, make_values, recall_pairs

__all__ = ["n_values", "experiment", "curves", "update"]


def n_values(d_k, max_ratio=4) -> np.ndarray:
    """The numbers of pairs on the lab's capacity axis: 12 points from ``N = 1`` to ``max_ratio * d_k``."""
    d_k = check_positive_int(d_k, "d_k")
    max_ratio = check_positive_int(max_ratio, "max_ratio")
    return np.unique(np.round(np.geomspace(1, max_ratio * d_k, 12)).astype(int))


def experiment(mechanism, n_pairs, d_k, overlap, *, d_v=None, seed=0, temperature=0.01, beta=1.0,
               gate=0.9) -> RecallResult:
    """The lab's one experiment, the first half of :func:`update`.

    ``n_pairs`` random unit keys of width ``d_k`` with overlap ``overlap``
    (:func:`~fixedstate.recall.make_keys`) and random unit values of width ``d_v``
    (default ``d_k``), drawn from ``np.random.default_rng(seed)``, written and read
    back by :func:`~fixedstate.recall.recall_pairs`. Returns its
    :class:`~fixedstate.recall.RecallResult`.
    """
    mechanism = check_layer_id(mechanism, MECHANISMS, "mechanism")
    n = check_positive_int(n_pairs, "n_pairs")
    d_k = check_positive_int(d_k, "d_k")
    d_v = d_k if d_v is None else check_positive_int(d_v, "d_v")
    rng = np.random.default_rng(seed)
    keys = make_keys(n, d_k, overlap=overlap, rng=rng)
    values = make_values(n, d_v, rng=rng)
    return recall_pairs(mechanism, keys, values, temperature=temperature, beta=beta, gate=gate)


def curves(d_k, overlap, *, d_v=None, seed=0, n_seeds=8, temperature=0.01, beta=1.0,
           gate=0.9) -> CapacityCurve:
    """The lab's capacity curves, the second half of :func:`update`.

    Every mechanism's :func:`~fixedstate.recall.capacity_curve` over :func:`n_values`
    (``n_seeds`` seeds, values of width ``d_v``, default ``d_k``). They do not depend
    on the mechanism or the number of pairs of the experiment.
    """
    d_k = check_positive_int(d_k, "d_k")
    d_v = d_k if d_v is None else check_positive_int(d_v, "d_v")
    return capacity_curve(d_k, n_values(d_k), d_v=d_v, overlap=overlap, n_seeds=n_seeds, seed=seed,
                          temperature=temperature, beta=beta, gate=gate)


def update(mechanism, n_pairs, d_k, overlap, *, d_v=None, seed=0, n_seeds=8, temperature=0.01,
           beta=1.0, gate=0.9):
    """Everything the lab recomputes when a slider moves.

    One experiment (:func:`experiment`: :func:`~fixedstate.recall.recall_pairs`
    through the package's layers) with ``n_pairs`` random unit keys of width ``d_k``
    and overlap ``overlap`` and random unit values of width ``d_v`` (default ``d_k``;
    the state is ``d_k x d_v``), and the capacity curves of every mechanism
    (:func:`curves`: :func:`~fixedstate.recall.capacity_curve` over :func:`n_values`,
    ``n_seeds`` seeds, same ``d_v``).

    Returns ``(result, curve)``: a :class:`~fixedstate.recall.RecallResult` and a
    :class:`~fixedstate.recall.CapacityCurve`.
    """
    result = experiment(mechanism, n_pairs, d_k, overlap, d_v=d_v, seed=seed, temperature=temperature,
                        beta=beta, gate=gate)
    curve = curves(d_k, overlap, d_v=d_v, seed=seed, n_seeds=n_seeds, temperature=temperature, beta=beta,
                   gate=gate)
    return result, curve
