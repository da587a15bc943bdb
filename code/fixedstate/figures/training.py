"""The drawing code of chapter {ref}`chap-training`: recall against the state a layer keeps.

What the figure shows is computed in :mod:`fixedstate.mqar_stats` from the
results of the recall sweep (the dict ``tools/mqar_sweep.py`` writes):
:func:`~fixedstate.mqar_stats.points_at` (each mixer's points at one length) and
:func:`~fixedstate.mqar_stats.frontier` (the best mean accuracy the fixed-state
mixers reach at or below each state size); this module only draws them. The
figure is static: it has no slider.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .. import mqar_stats as ms
from ..layer_ids import DELTA, GATED_DELTA, HYBRID, KDA, LINEAR, SOFTMAX, SSD, SSM, SWA

__all__ = ["MIXER_LABELS", "MIXER_COLORS", "recall_frontier_figure"]

MIXER_LABELS = {SOFTMAX: "softmax attention", SWA: "sliding window", LINEAR: "linear attention",
                DELTA: "DeltaNet", GATED_DELTA: "Gated DeltaNet", KDA: "KDA", SSM: "Mamba (SSM)",
                SSD: "Mamba-2 (SSD)", HYBRID: "hybrid (GDN + attention)"}
"""The legend label of each mixer of the recall sweep, by its id (:mod:`fixedstate.layer_ids`)."""

MIXER_COLORS = {SOFTMAX: "black", SWA: "tab:brown", LINEAR: "tab:orange", DELTA: "tab:blue",
                GATED_DELTA: "tab:green", KDA: "tab:cyan", SSM: "tab:purple", SSD: "tab:pink", HYBRID: "tab:red"}
"""The colour of each mixer in chapter 9's figures (those of chapter 5's lab for the mixers it shares)."""

BASELINE_COLOR = "0.35"
FRONTIER_COLOR = "#e3b505"
_JITTER = 0.07  # the seeds' dots of neighbouring mixers, this many octaves of state apart


def _lengths_arg(results, lengths):
    tested = [t for t, _ in ms.tested_lengths(results)]
    if lengths is None:
        return tested
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise ValueError(f"lengths: expected a sequence of tested lengths from {tested}, got {lengths!r}")
    lengths = list(lengths)
    bad = [t for t in lengths if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t not in tested]
    if not lengths or bad or len(set(lengths)) != len(lengths):
        raise ValueError(f"lengths: expected distinct tested lengths from {tested}, got {lengths!r}")
    return [int(t) for t in lengths]


def _seed_accuracies(results, mixer, d_model, seq_len):
    """The accuracy of each seed's run at ``seq_len`` (None for a run that diverged)."""
    t = str(seq_len)
    return [None if r["diverged"] else r["test_accuracy"][t] for r in results["runs"]
            if r["mixer"] == mixer and r["d_model"] == d_model]


def _kib_ticks(low, high):
    """Powers of two (in bytes) in [low, high], at most about six of them, labelled in KiB."""
    lo, hi = math.ceil(math.log2(low)), math.floor(math.log2(high))
    step = max(1, math.ceil((hi - lo) / 6))
    ticks = [2.0 ** e for e in range(lo, hi + 1, step)]
    return ticks, [f"{t / 1024:g}" for t in ticks]


def recall_frontier_figure(results, lengths=None, *, frontier_mixers=None):
    """Draw test accuracy against the state kept at the end of the sequence, one panel per tested length.

    ``results``: the recall sweep's results (tools/mqar_sweep.py; ``results/mqar_recall.json``
    or ``results/mqar_quick.json``). ``lengths``: the tested sequence lengths to show, one
    panel each (default: every one, in the settings' order).

    In each panel, with the state in bytes on a log axis labelled in KiB (the
    points' ``state_bytes``: the KV cache for softmax attention, the window's cache
    for sliding-window attention, ``d_k * d_v`` numbers per fixed-state layer,
    summed over the model's layers), every mixer is one line through its widths'
    mean accuracies (markers; the mean over the seeds that did not diverge), with
    each seed's accuracy a faint dot beside it (the mixers' dots moved a little
    sideways so they do not hide one another; a diverged seed an ``x`` at 0). The
    dashed grey line is the exact no-retrieval baseline on that length's test set,
    and the wide yellow step is the frontier
    (:func:`fixedstate.mqar_stats.frontier` over ``frontier_mixers``, by default the
    fixed-state mixers: drawn only if the sweep ran some), extended to the right
    edge. The legend sits below the panels. Every line carries a ``gid``
    (``"mean:<mixer>"``, ``"baseline"``, ``"frontier"``) by which a test finds it.
    Returns the matplotlib Figure (made with pyplot: a notebook shows it with
    ``plt.show()``).
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    lengths = _lengths_arg(results, lengths)
    pairs = dict(ms.tested_lengths(results))
    panels = {t: ms.points_at(results, t) for t in lengths}
    fronts = {t: ms.frontier(results, t, frontier_mixers) for t in lengths}
    states = [p["state_bytes"] for pts in panels.values() for p in pts]
    if not states:
        raise ValueError(f"results: expected points at the lengths {lengths}, got none")
    low, high = min(states) / 1.6, max(states) * 1.6
    mixers = [m for m in results["settings"]["mixers"] if any(p["mixer"] == m for pts in panels.values() for p in pts)]
    n = len(lengths)
    fig, axes = plt.subplots(1, n, figsize=(min(7.6, 1.3 + 2.3 * n), 3.7), sharex=True, sharey=True,
                             squeeze=False, layout="constrained")
    axes = axes[0]
    ticks, labels = _kib_ticks(low, high)      # inside the limits (so they do not move them), one at least
    for ax, t in zip(axes, lengths):
        baseline = results["baselines"][str(t)]["test_set"]
        ax.axhline(baseline, color=BASELINE_COLOR, ls="--", lw=1.1, zorder=1, gid="baseline")
        front = fronts[t]
        if front:
            xs = [s for s, *_ in front] + [high]
            ys = [a for _, a, *_ in front] + [front[-1][1]]
            ax.step(xs, ys, where="post", color=FRONTIER_COLOR, lw=6, alpha=0.45, solid_capstyle="butt",
                    zorder=0, gid="frontier")
        for i, mixer in enumerate(mixers):
            pts = [p for p in panels[t] if p["mixer"] == mixer]
            colour = MIXER_COLORS.get(mixer, f"C{i}")
            shift = 2.0 ** (_JITTER * (i - (len(mixers) - 1) / 2))
            for p in pts:
                accs = _seed_accuracies(results, mixer, p["d_model"], t)
                done = [a for a in accs if a is not None]
                ax.scatter(np.full(len(done), p["state_bytes"] * shift), done, s=14, color=colour, alpha=0.4,
                           lw=0, zorder=2)
                if len(done) < len(accs):
                    ax.scatter([p["state_bytes"] * shift], [0.0], marker="x", s=18, color=colour, zorder=2)
            ax.plot([p["state_bytes"] for p in pts], [np.nan if p["mean"] is None else p["mean"] for p in pts],
                    color=colour, marker="o", ms=4, lw=1.4, zorder=3, gid=f"mean:{mixer}")
        ax.set_xscale("log")
        ax.set_xticks(ticks, labels)
        ax.minorticks_off()
        ax.set_xlim(low, high)
        ax.set_ylim(-0.04, 1.04)
        ax.set_title(f"T = {t}, {pairs[t]} pairs")
        ax.set_xlabel("state kept (KiB)")
    axes[0].set_ylabel("test accuracy")
    handles = [Line2D([], [], color=MIXER_COLORS.get(m, f"C{i}"), marker="o", ms=4, lw=1.4,
                      label=MIXER_LABELS.get(m, m)) for i, m in enumerate(mixers)]
    handles.append(Line2D([], [], color="0.4", marker="o", ms=4, alpha=0.5, lw=0, label="one seed"))
    handles.append(Line2D([], [], color=BASELINE_COLOR, ls="--", lw=1.1, label="no retrieval (exact)"))
    if any(fronts.values()):
        handles.append(Line2D([], [], color=FRONTIER_COLOR, lw=6, alpha=0.45, label="fixed-state frontier"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(3 if n < 3 else 4, len(handles)), frameon=False, fontsize=8)
    return fig
