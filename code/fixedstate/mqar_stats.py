"""The protocol and statistics of chapter 9's recall sweep: what a point reports, and how a learning rate is chosen.

Outcomes of MQAR training are bimodal (a run learns to retrieve, or it stays near
the no-retrieval baseline), so a point of the sweep (one mixer, width and
sequence length, several seeds) reports counts with intervals beside the mean:

- :func:`wilson_interval`: the Wilson score interval of a binomial proportion
  (95% by default), the interval every fraction of the sweep is given with;
- :func:`point_summary`: at one point, the mean test accuracy, the fraction of
  seeds that **solve** the task (accuracy ``>= threshold``, 0.9 by default) and the
  fraction **above the no-retrieval baseline** (accuracy above the exact
  baseline of the test set plus ``margin`` standard errors of it), each with its
  interval;
- :func:`choose_lr`: the tuning rule on a grid (for runs tested at several lengths:
  the accuracy at the longest, then the mean over the lengths, then the final
  loss), which says whether the value it chose sits at an edge of the grid, and
  :func:`widen_grid`, the values one step beyond that edge that the sweep then
  tries.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from ._validate import check_positive_int

__all__ = ["Z95", "wilson_interval", "point_summary", "choose_lr", "widen_grid"]

#: The standard normal quantile of a two-sided 95% interval.
Z95 = 1.959963984540054


def _fraction_arg(value, name, low=0.0, high=1.0):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value <= high:
        raise ValueError(f"{name}: expected a number in [{low}, {high}], got {value!r}")
    return float(value)


def wilson_interval(successes, n, *, z=Z95) -> tuple[float, float]:
    """The Wilson score interval for a proportion: ``successes`` out of ``n`` trials.

    ``(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)`` with ``p =
    successes / n``; ``z`` the normal quantile (default ``Z95``, a 95% interval).
    Unlike the normal approximation it stays inside [0, 1] and is not empty at
    0 or ``n`` successes, which the sweep's small counts (5 seeds) often are.
    Returns ``(low, high)``.
    """
    n = check_positive_int(n, "n")
    if isinstance(successes, bool) or not isinstance(successes, numbers.Integral) or not 0 <= successes <= n:
        raise ValueError(f"successes: expected an integer in [0, n={n}], got {successes!r}")
    if isinstance(z, bool) or not isinstance(z, numbers.Real) or not z > 0:
        raise ValueError(f"z: expected a positive number, got {z!r}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low, high = max(0.0, centre - half), min(1.0, centre + half)
    if successes == 0:
        low = 0.0
    if successes == n:
        high = 1.0
    return low, high


def point_summary(accuracies, *, baseline, baseline_se=0.0, threshold=0.9, margin=3.0, z=Z95) -> dict:
    """What one point of the sweep reports, from the test accuracies of its seeds.

    Parameters
    ----------
    accuracies : sequence of floats in [0, 1] or None (a run that diverged: it counts
        as a seed that neither solves nor beats the baseline, and is left out of the mean)
    baseline : float, the no-retrieval baseline's score on the test set
    baseline_se : float >= 0, its standard error (:func:`fixedstate.recall.no_retrieval_se`)
    threshold : the accuracy at which a seed solves the task
    margin : a seed is above the baseline when its accuracy exceeds
        ``baseline + margin * baseline_se``

    Returns
    -------
    dict with ``n`` (seeds), ``diverged``, ``mean`` (over the runs that did not diverge,
    None if none), ``solved`` and ``above`` (counts), ``solved_fraction``,
    ``solved_ci``, ``above_fraction``, ``above_ci`` (Wilson intervals, ``z``),
    and the ``threshold`` and ``above_line`` used.
    """
    accs = list(accuracies)
    if not accs:
        raise ValueError("accuracies: expected at least one seed's accuracy, got none")
    for a in accs:
        if a is not None:
            _fraction_arg(a, "accuracies")
    baseline = _fraction_arg(baseline, "baseline")
    baseline_se = _fraction_arg(baseline_se, "baseline_se")
    threshold = _fraction_arg(threshold, "threshold")
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not margin >= 0:
        raise ValueError(f"margin: expected a number >= 0, got {margin!r}")
    line = baseline + margin * baseline_se
    finite = [a for a in accs if a is not None]
    n = len(accs)
    solved = sum(a >= threshold for a in finite)
    above = sum(a > line for a in finite)
    return {"n": n, "diverged": n - len(finite), "mean": float(np.mean(finite)) if finite else None,
            "solved": solved, "solved_fraction": solved / n, "solved_ci": wilson_interval(solved, n, z=z),
            "above": above, "above_fraction": above / n, "above_ci": wilson_interval(above, n, z=z),
            "threshold": threshold, "above_line": line}


def _accuracies(record, at):
    """A tuning record's accuracies as ``{seq_len: accuracy}`` (a single-length record: ``{0: accuracy}``)."""
    acc = record["test_accuracy"]
    if isinstance(acc, Mapping):
        out = {int(t): a for t, a in acc.items()}
        if at is not None and int(at) not in out:
            raise ValueError(f"at: expected one of the tested lengths {sorted(out)}, got {at!r}")
        return out
    if at is not None:
        raise ValueError(f"at: expected None for records of a single length (test_accuracy a number), got {at!r}")
    return {0: acc}


def _rank(record, at):
    """Best first: runs that did not diverge, by higher accuracy at ``at`` (default: the longest
    length), then higher mean accuracy over the lengths, then lower final loss."""
    if record["diverged"]:
        return (1, 0.0, 0.0, 0.0)
    acc = _accuracies(record, at)
    return (0, -acc[max(acc) if at is None else int(at)], -float(np.mean(list(acc.values()))), record["final_loss"])


def choose_lr(records, *, at=None) -> tuple[float, str]:
    """The tuning rule: the ``lr`` of the best of ``records``, and where it sits on their grid.

    ``records`` are the tuning runs of one mixer and width (dicts with ``lr``,
    ``diverged``, ``test_accuracy``, ``final_loss``), one per learning rate.
    ``test_accuracy`` is a number (a run tested at one length) or a dict from the
    sequence length (an int or its decimal string, as JSON keys are) to the
    accuracy there (a run tested at several lengths,
    :func:`fixedstate.training.recall_run`). Best means the highest accuracy at
    the length ``at`` (default: the longest tested), then the highest mean
    accuracy over the tested lengths, then the lowest final loss; diverged runs
    come last; an exact tie goes to the smaller rate. Returns ``(lr, where)``
    with ``where`` ``"low"`` or ``"high"`` when the chosen value is the smallest
    or largest of the grid (an edge: the grid should be widened), else
    ``"inside"``.
    """
    records = list(records)
    if len(records) < 3:
        raise ValueError(f"records: expected the runs of a grid of at least 3 learning rates, got {len(records)}")
    lrs = sorted(r["lr"] for r in records)
    if len(set(lrs)) != len(lrs):
        raise ValueError(f"records: expected one run per learning rate, got the rates {lrs}")
    tested = {frozenset(_accuracies(r, at)) for r in records if not r["diverged"]}
    if len(tested) > 1:
        raise ValueError(f"records: expected every run tested at the same lengths, got {sorted(map(sorted, tested))}")
    best = min(records, key=lambda r: (_rank(r, at), r["lr"]))["lr"]
    where = "low" if best == lrs[0] else "high" if best == lrs[-1] else "inside"
    return best, where


def widen_grid(grid, where, *, steps=1) -> tuple:
    """The ``steps`` learning rates beyond the ``where`` (``"low"`` or ``"high"``) edge of a geometric ``grid``.

    The grid's ratio is that of its two values at that edge; the new values
    continue it (``grid[0] / ratio, ...`` below, ``grid[-1] * ratio, ...`` above).
    """
    g = sorted(float(x) for x in grid)
    if len(g) < 2 or g[0] <= 0:
        raise ValueError(f"grid: expected at least two positive learning rates, got {grid!r}")
    steps = check_positive_int(steps, "steps")
    if where == "low":
        ratio = g[1] / g[0]
        return tuple(g[0] / ratio ** i for i in range(1, steps + 1))
    if where == "high":
        ratio = g[-1] / g[-2]
        return tuple(g[-1] * ratio ** i for i in range(1, steps + 1))
    raise ValueError(f"where: expected 'low' or 'high', got {where!r}")
