"""The drawing code of chapter {ref}`chap-recall`: the lab and the capacity curves.

What the sliders recompute lives in :mod:`fixedstate.recall_lab`
(:func:`~fixedstate.recall_lab.update`, that is :func:`~fixedstate.recall_lab.experiment`
and :func:`~fixedstate.recall_lab.curves`, and :func:`~fixedstate.recall.capacity_curve`);
this module only draws it. Both figures are updatable (see :mod:`fixedstate.figures`):
built once, then changed in place as the sliders move.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .. import recall_lab
from ..recall import MECHANISMS, capacity_curve
from .engine import bar_collection, changing, figure_parts, live_update, new_figure, set_bar_heights

__all__ = ["LAB_MECHANISM_LABELS", "LAB_COLORS", "draw_lab", "draw_capacity"]

LAB_MECHANISM_LABELS = {"softmax": "softmax (full KV cache)", "linear": "additive linear attention",
                        "delta": "delta rule", "gated_delta": "gated delta rule",
                        "ssm": "diagonal SSM (decay + add)"}
"""The legend label of each mechanism of :data:`fixedstate.recall.MECHANISMS`."""

LAB_COLORS = {"softmax": "black", "linear": "tab:orange", "delta": "tab:blue",
              "gated_delta": "tab:green", "ssm": "tab:purple"}
"""The colour of each mechanism in the chapter's figures."""

_LAB_MAX_PAIRS = 32  # the largest N of the chapter's slider: the bars' axis has room for it
_CURVES_KEPT = 256  # capacity curves kept for a slider that comes back to a value


@lru_cache(maxsize=_CURVES_KEPT)
def _lab_curves(d_k, overlap, d_v, seed, gate):
    return recall_lab.curves(d_k, overlap, d_v=d_v, seed=seed, gate=gate)


@lru_cache(maxsize=_CURVES_KEPT)
def _capacity_curve(d_k, overlap, seed, n_seeds, gate):
    return capacity_curve(d_k, recall_lab.n_values(d_k), overlap=overlap, n_seeds=n_seeds, seed=seed, gate=gate)


def _ceiling(value: float, floor: float) -> float:
    """The smallest of 1, 1.6, 2.5, 4, 6 times a power of ten that is at least ``value`` (and ``floor``).

    An axis limit moves in these steps rather than with every update, so the
    axis (kept as a picture between updates) changes rarely.
    """
    value = max(value, floor)
    power = 10.0 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 1.6, 2.5, 4, 6, 10) if m * power >= value * (1 - 1e-12))


@live_update("continuous")
def draw_lab(mechanism="delta", n_pairs=8, overlap=0.0, d_v=None, *, d_k=16, seed=0, gate=0.9, fig=None):
    """Draw the lab for one setting of its sliders; returns the matplotlib Figure.

    ``d_v`` is the width of the values (default ``d_k``), so the fixed state is
    ``d_k x d_v``; the values and the capacity curves both use it.

    Left: the recall error ``|o_i - v_i|`` of every key, in the order written,
    green where the nearest stored value is the right one and red where it is
    not. Right: the capacity curves (accuracy against ``N / d_k``) of every
    mechanism at this overlap and value width, the chosen one drawn bold, with a
    dashed line at the current ``N``. ``gate`` is the decay in (0, 1] of the gated
    delta rule and the SSM, as in :func:`fixedstate.recall_lab.update`.

    Updatable (see :mod:`fixedstate.figures`): with ``fig``, a figure this
    function built, it updates that figure in place and returns it. **Live
    sliders: continuous** (the latest value wins). A move of ``N`` or of the
    mechanism reruns one experiment (about a millisecond: the capacity curves do
    not depend on them and are kept, for 256 settings at most); a move of the
    overlap or of ``d_v`` also recomputes the curves
    (:func:`fixedstate.recall_lab.curves`, the larger part of such an update).
    Only the bars, the curves and the left title are drawn again; ``make
    bench-figures`` measures an update.
    """
    d_v = d_k if d_v is None else d_v
    result = recall_lab.experiment(mechanism, n_pairs, d_k, overlap, d_v=d_v, seed=seed, gate=gate)
    curve = _lab_curves(d_k, float(overlap), d_v, seed, gate)
    if fig is None:
        fig = _lab_figure()
    parts = figure_parts(fig)
    ax0, ax1 = fig.axes
    set_bar_heights(parts["bars"], result.errors, np.arange(1, n_pairs + 1))
    parts["bars"].set_facecolor(np.where(result.correct, "tab:green", "tab:red"))
    ax0.set_ylim(0, _ceiling(float(result.errors.max()) * 1.05, 1.6))
    ax0.set_xlim(0.4, max(_LAB_MAX_PAIRS, n_pairs) + 0.6)  # room for the slider's largest N
    ax0.set_title(f"{LAB_MECHANISM_LABELS[mechanism]}\nN = {n_pairs}, d_k = {d_k}, d_v = {d_v}, "
                  f"overlap {overlap:g}: {int(result.correct.sum())}/{n_pairs} recalled")
    for mech, line in parts["curves"].items():
        bold = mech == mechanism
        line.set_data(curve.ratios, curve.accuracy[mech])
        line.set(marker="o" if bold else "None", linewidth=2.2 if bold else 1.0, alpha=1.0 if bold else 0.45)
    parts["now"].set_xdata([n_pairs / d_k] * 2)
    ax1.set_xlim(curve.ratios.min() / 1.25, curve.ratios.max() * 1.25)
    return fig


def _lab_figure():
    from matplotlib.ticker import MaxNLocator

    fig, (ax0, ax1) = new_figure(1, 2, figsize=(7.6, 3.0), gridspec_kw={"width_ratios": [1.1, 1]})
    parts = figure_parts(fig)
    parts["bars"] = bar_collection(ax0, [], width=0.8)
    changing(fig, parts["bars"])
    ax0.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax0.set_xlabel("key i, in the order written")
    ax0.set_ylabel("recall error |o_i - v_i|")
    changing(fig, ax0.title)
    parts["curves"] = {}
    for mech in MECHANISMS:
        (line,) = ax1.plot([], [], ms=3, color=LAB_COLORS[mech], label=LAB_MECHANISM_LABELS[mech])
        parts["curves"][mech] = line
    parts["now"] = ax1.axvline(1.0, color="gray", ls="--", lw=0.8)
    changing(fig, *parts["curves"].values(), parts["now"])
    ax1.set_xscale("log", base=2)
    ax1.set_ylim(-0.03, 1.03)
    ax1.set_xlabel("N / d_k (log scale)")
    ax1.set_ylabel("accuracy (mean of 8 seeds)")
    ax1.set_title("capacity curves at this overlap and d_v")
    ax1.legend(fontsize=6.5, loc="lower left", frameon=False)
    return fig


@live_update("release")
def draw_capacity(d_k=16, overlap=0.0, *, seed=0, n_seeds=8, gate=0.9, fig=None):
    """Draw every mechanism's capacity curve (accuracy and mean error against ``N / d_k``).

    The axis ``N / d_k`` is the same for every ``d_k`` from 8 to 32 (it widens
    beyond), so the curves of two key widths can be compared in place.

    Updatable (see :mod:`fixedstate.figures`): with ``fig``, a figure this
    function built, it updates that figure in place and returns it. **Live
    sliders: on release**: every move recomputes all five capacity curves
    (:func:`fixedstate.recall.capacity_curve`, 8 seeds by a dozen ``N`` up to
    ``4 d_k``: several milliseconds at ``d_k = 8``, a few tens at ``d_k = 32``),
    which a drag would ask for at every step of ``d_k``; settings already seen
    are kept (256 at most). ``make bench-figures`` measures an update.
    """
    curve = _capacity_curve(int(d_k), float(overlap), seed, n_seeds, gate)
    if fig is None:
        fig = _capacity_figure(n_seeds)
    parts = figure_parts(fig)
    ax0, ax1 = fig.axes
    for mech in MECHANISMS:
        parts["accuracy"][mech].set_data(curve.ratios, curve.accuracy[mech])
        parts["error"][mech].set_data(curve.ratios, curve.error[mech])
    low = min(1 / 40, curve.ratios.min() / 1.25)
    high = max(5.0, curve.ratios.max() * 1.25)
    for ax in (ax0, ax1):
        ax.set_xlim(low, high)
    ax1.set_ylim(-0.03, _ceiling(max(float(e.max()) for e in curve.error.values()) * 1.05, 1.0))
    ax0.set_title(f"d_k = {d_k}, overlap {overlap:g}")
    return fig


def _capacity_figure(n_seeds: int):
    fig, (ax0, ax1) = new_figure(1, 2, figsize=(7.6, 3.0))
    parts = figure_parts(fig)
    parts["accuracy"], parts["error"] = {}, {}
    for mech in MECHANISMS:
        (acc,) = ax0.plot([], [], marker="o", ms=3, color=LAB_COLORS[mech], label=LAB_MECHANISM_LABELS[mech])
        (err,) = ax1.plot([], [], marker="o", ms=3, color=LAB_COLORS[mech])
        parts["accuracy"][mech], parts["error"][mech] = acc, err
    changing(fig, *parts["accuracy"].values(), *parts["error"].values(), ax0.title)
    for ax in (ax0, ax1):
        ax.set_xscale("log", base=2)
        ax.axvline(1.0, color="gray", ls=":", lw=0.8)
        ax.set_xlabel("N / d_k (log scale)")
    ax0.set_ylim(-0.03, 1.03)
    ax0.set_ylabel(f"accuracy (mean of {n_seeds} seeds)")
    ax1.set_ylabel("mean recall error |o_i - v_i|")
    ax1.set_title("error (values have length 1)")
    ax0.legend(fontsize=6.5, loc="lower left", frameon=False)
    return fig
