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

What chapter 9 reports from a sweep's results (the dict that
``tools/mqar_sweep.py`` writes, ``results/mqar_quick.json`` or
``results/mqar_recall.json``), as pure functions of that dict:

- :func:`tested_lengths` and :func:`points_at`: the lengths tested, and the points of
  one of them, by mixer then state;
- :func:`frontier`: the upper envelope of mean accuracy against state bytes of
  the fixed-state mixers (:data:`FIXED_STATE_MIXERS`), the best any of them
  reaches at or below each state size;
- :func:`format_points`: the per-point table (mean, solved and above-baseline
  counts with their intervals, the rate) under its no-retrieval baseline;
- :func:`ablation_summary` and :func:`format_ablation`: the hybrid's accuracy with
  each layer's core zeroed, by width and length, over its seeds.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from ._validate import check_positive_int
from .layer_ids import DELTA, GATED_DELTA, KDA, LINEAR, SSD, SSM
from .training import MODEL_LAYERS

__all__ = ["Z95", "FIXED_STATE_MIXERS", "wilson_interval", "point_summary", "choose_lr", "widen_grid", "tested_lengths",
           "points_at", "frontier", "format_points", "ablation_summary", "format_ablation"]

#: The standard normal quantile of a two-sided 95% interval.
Z95 = 1.959963984540054

#: The mixers whose state does not grow with the sequence (:func:`fixedstate.costs.layer_state_bytes`):
#: the ones :func:`frontier` takes by default. Softmax attention's KV cache grows with the length;
#: sliding-window attention keeps a bounded cache of keys and values, not a fixed state; the hybrid
#: carries a KV cache.
FIXED_STATE_MIXERS = (LINEAR, DELTA, GATED_DELTA, KDA, SSM, SSD)


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


# ----------------------------------------------------------------------------- reading a sweep's results

_RESULT_KEYS = ("settings", "baselines", "points", "runs")
_RUN_KEYS = ("mixer", "d_model", "diverged", "test_accuracy", "ablation")
_POINT_KEYS = ("mixer", "d_model", "seq_len", "n_pairs", "state_bytes", "lr", "n", "diverged", "mean", "solved",
               "solved_ci", "above", "above_ci", "above_line")


def _check_results(results):
    """Raise unless ``results`` has the shape of what tools/mqar_sweep.py writes; return its tested lengths."""
    if not isinstance(results, Mapping):
        raise ValueError(f"results: expected the dict of a recall sweep (tools/mqar_sweep.py), "
                         f"got {type(results).__name__}")
    missing = [k for k in _RESULT_KEYS if k not in results]
    if missing:
        raise ValueError(f"results: expected a recall sweep's results with the keys {list(_RESULT_KEYS)}, "
                         f"missing {missing}")
    settings = results["settings"]
    if not isinstance(settings, Mapping) or "lengths" not in settings or "mixers" not in settings:
        raise ValueError("results: expected settings with 'lengths' and 'mixers', got "
                         f"{sorted(settings) if isinstance(settings, Mapping) else type(settings).__name__}")
    try:
        lengths = {int(seq_len): int(n_pairs) for seq_len, n_pairs in settings["lengths"]}
    except (TypeError, ValueError):
        raise ValueError(f"results: expected settings['lengths'] as pairs (seq_len, n_pairs), "
                         f"got {settings['lengths']!r}") from None
    for what, records, keys in (("point", results["points"], _POINT_KEYS), ("run", results["runs"], _RUN_KEYS)):
        for r in records:
            if not isinstance(r, Mapping) or any(k not in r for k in keys):
                have = sorted(r) if isinstance(r, Mapping) else type(r).__name__
                raise ValueError(f"results: expected every {what} to have the keys {list(keys)}, got {have}")
    return lengths


def _seq_len_arg(results, seq_len):
    lengths = _check_results(results)
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or int(seq_len) not in lengths:
        raise ValueError(f"seq_len: expected one of the tested lengths {sorted(lengths)}, got {seq_len!r}")
    if str(int(seq_len)) not in results["baselines"]:
        raise ValueError(f"results: expected a baseline at the tested length {int(seq_len)}, "
                         f"got baselines at {sorted(results['baselines'])}")
    return int(seq_len)


def _mixer_rank(results):
    order = {m: i for i, m in enumerate(results["settings"]["mixers"])}
    return lambda m: (order.get(m, len(order)), m)


def tested_lengths(results) -> list[tuple[int, int]]:
    """The lengths a sweep's ``results`` were tested at: ``[(seq_len, n_pairs), ...]``, in the settings' order.

    Checks first that ``results`` has the shape of what tools/mqar_sweep.py writes.
    """
    return list(_check_results(results).items())


def points_at(results, seq_len) -> list[dict]:
    """The points of one tested length ``seq_len`` of a sweep's ``results``, sorted by mixer then state.

    ``results``: the dict tools/mqar_sweep.py writes (``settings``, ``baselines``,
    ``points``, ``runs``, ...). The mixers come in the order of the sweep's
    settings (the book's order, :data:`fixedstate.layer_ids.LAYER_IDS`), and one
    mixer's points by state in bytes, then width. Returns copies of the point
    dicts (:func:`point_summary`'s keys, with ``mixer``, ``d_model``, ``seq_len``,
    ``n_pairs``, ``state_bytes``, ``lr``).
    """
    seq_len = _seq_len_arg(results, seq_len)
    rank = _mixer_rank(results)
    pts = [dict(p) for p in results["points"] if int(p["seq_len"]) == seq_len]
    return sorted(pts, key=lambda p: (rank(p["mixer"]), p["state_bytes"], p["d_model"]))


def _mixers_arg(results, mixers):
    swept = list(results["settings"]["mixers"])
    if mixers is None:
        return [m for m in swept if m in FIXED_STATE_MIXERS]
    if isinstance(mixers, str) or not hasattr(mixers, "__iter__"):
        raise ValueError(f"mixers: expected a sequence of the sweep's mixers {swept}, got {mixers!r}")
    mixers = list(mixers)
    unknown = [m for m in mixers if m not in swept]
    if unknown:
        raise ValueError(f"mixers: expected mixers of the sweep {swept}, got {unknown}")
    return mixers


def frontier(results, seq_len, mixers=None) -> list[tuple[int, float, str, int]]:
    """The upper envelope of mean test accuracy against state bytes at one length, over ``mixers``.

    ``mixers``: the mixers whose points count (default: those of
    :data:`FIXED_STATE_MIXERS` that the sweep ran; an empty list if it ran none).
    A point is on the frontier when every other point of these mixers with as
    little state or less has a lower mean accuracy: reading from small states to
    large, the best mean accuracy reached at or below each state size, a step
    function that only rises. Points whose seeds all diverged (mean None) are left
    out; of points with the same state and mean, the first in :func:`points_at`'s
    order is kept. Returns ``[(state_bytes, mean_accuracy, mixer, d_model), ...]``,
    by increasing state, each a real point of the sweep; both state and accuracy
    strictly increase along it.
    """
    seq_len = _seq_len_arg(results, seq_len)
    chosen = _mixers_arg(results, mixers)
    rank = _mixer_rank(results)
    pts = [p for p in points_at(results, seq_len) if p["mixer"] in chosen and p["mean"] is not None]
    pts.sort(key=lambda p: (p["state_bytes"], -p["mean"], rank(p["mixer"]), p["d_model"]))
    out = []
    for p in pts:
        if not out or p["mean"] > out[-1][1]:                 # the best at a state comes first
            out.append((int(p["state_bytes"]), float(p["mean"]), p["mixer"], int(p["d_model"])))
    return out


def _kib(n_bytes) -> str:
    """Bytes in KiB, exact for the sweep's sizes (multiples of 4 bytes): ``0.25``, ``1.25``, ``64``."""
    return f"{n_bytes / 1024:g}"


def _lr(lr) -> str:
    return f"{lr:.2g}"


def _count_ci(k, n, ci) -> str:
    return f"{k}/{n} [{ci[0]:.2f}, {ci[1]:.2f}]"


def _table(header, rows) -> list[str]:
    """Left-aligned text columns, two spaces apart, with no trailing spaces."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def format_points(results, seq_len) -> str:
    """The per-point table of one tested length, as text, under a line giving its baseline.

    The first line: the length and its pairs, the exact no-retrieval baseline on
    the test set with its standard error, the accuracy a seed must exceed to be
    above it (``above_line``) and the one at which it solves the task
    (``threshold``). Then one row per point, in :func:`points_at`'s order:
    mixer, width ``d``, the state in KiB (the stored bytes / 1024, exact), the
    mean test accuracy over the seeds that did not diverge (3 decimals), the
    seeds that solve and that are above the baseline, each ``k/n [lo, hi]`` with
    its 95% Wilson interval (2 decimals), the learning rate (2 significant
    digits), and a note: the seeds that diverged, and a rate chosen at an edge
    of its grid (``results["lr_at_edge"]``). Every number is read from the
    stored results, so the text is the same on every machine.
    """
    seq_len = _seq_len_arg(results, seq_len)
    pts = points_at(results, seq_len)
    base = results["baselines"][str(seq_len)]
    settings = results["settings"]
    n_pairs = dict((int(t), int(n)) for t, n in settings["lengths"])[seq_len]
    above = pts[0]["above_line"] if pts else None
    head = (f"T = {seq_len} ({n_pairs} pairs): no-retrieval baseline {base['test_set']:.3f} "
            f"(s.e. {base['test_set_se']:.3f})")
    if above is not None:
        head += f"; above it: > {above:.3f}"
    if "threshold" in settings:
        head += f"; solved: >= {settings['threshold']:g}"
    edges = results.get("lr_at_edge", {})
    rows = []
    for p in pts:
        notes = []
        if p["diverged"]:
            notes.append(f"{p['diverged']} diverged")
        edge = edges.get(f"{p['mixer']}|{p['d_model']}")
        if edge:
            notes.append(f"lr at the {edge} edge")
        rows.append([p["mixer"], str(p["d_model"]), _kib(p["state_bytes"]),
                     "-" if p["mean"] is None else f"{p['mean']:.3f}",
                     _count_ci(p["solved"], p["n"], p["solved_ci"]), _count_ci(p["above"], p["n"], p["above_ci"]),
                     _lr(p["lr"]), "; ".join(notes)])
    header = ["mixer", "d", "KiB", "mean", "solved [95% CI]", "above [95% CI]", "lr", "note"]
    return "\n".join([head, *_table(header, rows)])


def _spread(values) -> dict:
    return {"mean": float(np.mean(values)), "min": float(min(values)), "max": float(max(values))}


def ablation_summary(results) -> list[dict]:
    """The ablation of the sweep's mixed models (the hybrid): accuracy with each layer's core zeroed.

    From ``results["runs"]``: for every mixer whose runs carry an ablation
    (:func:`fixedstate.training.recall_run`: a model of more than one kind of
    layer), every width and every tested length, over the runs that did not
    diverge (a diverged run has no ablation), one dict with ``mixer``,
    ``d_model``, ``seq_len``, ``n`` (the runs counted), ``layers`` (the mixers of
    the model's layers, :data:`fixedstate.training.MODEL_LAYERS`), ``intact``
    (the test accuracy of those runs) and ``zeroed`` (by layer index, an int: the
    test accuracy with that layer's core output zeroed), each a dict of ``mean``,
    ``min`` and ``max`` over the seeds. Ordered by the sweep's mixers, then width,
    then length; an empty list when no run has an ablation.
    """
    lengths = _check_results(results)
    rank = _mixer_rank(results)
    groups = {}
    for r in results["runs"]:
        if r["ablation"] is not None:
            groups.setdefault((r["mixer"], int(r["d_model"])), []).append(r)
    out = []
    for (mixer, d) in sorted(groups, key=lambda k: (rank(k[0]), k[1])):
        recs = groups[(mixer, d)]
        layer_ids = sorted({int(i) for r in recs for i in r["ablation"]})
        for seq_len in lengths:
            t = str(seq_len)
            try:
                intact = [r["test_accuracy"][t] for r in recs]
                zeroed = {i: [r["ablation"][str(i)][t] for r in recs] for i in layer_ids}
            except (KeyError, TypeError):
                raise ValueError(f"results: expected every ablated run of {mixer} at d = {d} to have an accuracy "
                                 f"and an ablation of every layer at T = {seq_len}") from None
            out.append({"mixer": mixer, "d_model": d, "seq_len": seq_len, "n": len(recs),
                        "layers": tuple(MODEL_LAYERS[mixer]) if mixer in MODEL_LAYERS else None,
                        "intact": _spread(intact), "zeroed": {i: _spread(v) for i, v in zeroed.items()}})
    return out


def _spread_text(s) -> str:
    return f"{s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"


def format_ablation(results) -> str:
    """:func:`ablation_summary` as a text table, one block per ablated mixer.

    A line naming the mixer and its layers, then one row per width and length:
    ``d``, ``T``, the runs ``n``, and the test accuracy intact and with each
    layer's core zeroed, each ``mean [min, max]`` over the seeds (3 decimals).
    """
    summary = ablation_summary(results)
    if not summary:
        return "no run of this sweep has an ablation (only a model of more than one kind of layer has one)"
    blocks = []
    for mixer in dict.fromkeys(s["mixer"] for s in summary):
        rows_of = [s for s in summary if s["mixer"] == mixer]
        layers = rows_of[0]["layers"]
        layer_ids = sorted(rows_of[0]["zeroed"])
        name = (lambda i: f"layer {i} ({layers[i]}) zeroed") if layers else (lambda i: f"layer {i} zeroed")
        head = (f"{mixer}" + (f" (layers: {', '.join(layers)})" if layers else "")
                + ": test accuracy, mean [min, max] over the seeds")
        header = ["d", "T", "n", "intact", *[name(i) for i in layer_ids]]
        rows = [[str(s["d_model"]), str(s["seq_len"]), str(s["n"]), _spread_text(s["intact"]),
                 *[_spread_text(s["zeroed"][i]) for i in layer_ids]] for s in rows_of]
        blocks.append("\n".join([head, *_table(header, rows)]))
    return "\n\n".join(blocks)
