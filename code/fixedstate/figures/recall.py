"""The drawing code of chapter {ref}`chap-recall`: the lab and the capacity curves.

What the sliders recompute lives in :mod:`fixedstate.recall`
(:func:`~fixedstate.recall.lab_update`, :func:`~fixedstate.recall.capacity_curve`);
this module only draws it.
"""

from __future__ import annotations

import numpy as np

from ..recall import MECHANISMS, capacity_curve, lab_n_values, lab_update

__all__ = ["LAB_MECHANISM_LABELS", "LAB_COLORS", "draw_lab", "draw_capacity"]

LAB_MECHANISM_LABELS = {"softmax": "softmax (full KV cache)", "linear": "additive linear attention",
                        "delta": "delta rule", "gated_delta": "gated delta rule",
                        "ssm": "diagonal SSM (decay + add)"}
"""The legend label of each mechanism of :data:`fixedstate.recall.MECHANISMS`."""

LAB_COLORS = {"softmax": "black", "linear": "tab:orange", "delta": "tab:blue",
              "gated_delta": "tab:green", "ssm": "tab:purple"}
"""The colour of each mechanism in the chapter's figures."""


def draw_lab(mechanism="delta", n_pairs=8, overlap=0.0, d_v=None, *, d_k=16, seed=0, gate=0.9):
    """Draw the lab for one setting of its sliders; returns the matplotlib Figure.

    ``d_v`` is the width of the values (default ``d_k``), so the fixed state is
    ``d_k x d_v``; the values and the capacity curves both use it.

    Left: the recall error ``|o_i - v_i|`` of every key, in the order written,
    green where the nearest stored value is the right one and red where it is
    not. Right: the capacity curves (accuracy against ``N / d_k``) of every
    mechanism at this overlap, the chosen one drawn bold, with a marker at the
    current ``N``. ``gate`` is the decay in (0, 1] of the gated delta rule and
    the SSM, as in :func:`fixedstate.recall.lab_update`.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    d_v = d_k if d_v is None else d_v
    result, curve = lab_update(mechanism, n_pairs, d_k, overlap, d_v=d_v, seed=seed, gate=gate)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(7.6, 3.0), gridspec_kw={"width_ratios": [1.1, 1]})
    idx = np.arange(1, n_pairs + 1)
    colors = np.where(result.correct, "tab:green", "tab:red")
    ax0.bar(idx, result.errors, color=colors, width=0.8)
    ax0.set_ylim(0, max(1.6, float(result.errors.max()) * 1.05))
    ax0.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax0.set_xlabel("key i, in the order written")
    ax0.set_ylabel("recall error |o_i - v_i|")
    ax0.set_title(f"{LAB_MECHANISM_LABELS[mechanism]}\nN = {n_pairs}, d_k = {d_k}, d_v = {d_v}, "
                  f"overlap {overlap:g}: {int(result.correct.sum())}/{n_pairs} recalled")
    for mech in MECHANISMS:
        bold = mech == mechanism
        ax1.plot(curve.ratios, curve.accuracy[mech], marker="o" if bold else None, ms=3,
                 lw=2.2 if bold else 1.0, alpha=1.0 if bold else 0.45, color=LAB_COLORS[mech],
                 label=LAB_MECHANISM_LABELS[mech])
    ax1.axvline(n_pairs / d_k, color="gray", ls="--", lw=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set_ylim(-0.03, 1.03)
    ax1.set_xlabel("N / d_k (log scale)")
    ax1.set_ylabel("accuracy (mean of 8 seeds)")
    ax1.set_title(f"capacity curves, overlap {overlap:g}, d_v = {d_v}")
    ax1.legend(fontsize=6.5, loc="lower left", frameon=False)
    return fig


def draw_capacity(d_k=16, overlap=0.0, *, seed=0, n_seeds=8, gate=0.9):
    """Draw every mechanism's capacity curve (accuracy and mean error against ``N / d_k``)."""
    import matplotlib.pyplot as plt

    curve = capacity_curve(d_k, lab_n_values(d_k), overlap=overlap, n_seeds=n_seeds, seed=seed, gate=gate)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(7.6, 3.0))
    for mech in MECHANISMS:
        ax0.plot(curve.ratios, curve.accuracy[mech], marker="o", ms=3, color=LAB_COLORS[mech],
                 label=LAB_MECHANISM_LABELS[mech])
        ax1.plot(curve.ratios, curve.error[mech], marker="o", ms=3, color=LAB_COLORS[mech])
    for ax in (ax0, ax1):
        ax.set_xscale("log", base=2)
        ax.axvline(1.0, color="gray", ls=":", lw=0.8)
        ax.set_xlabel("N / d_k (log scale)")
    ax0.set_ylim(-0.03, 1.03)
    ax0.set_ylabel(f"accuracy (mean of {n_seeds} seeds)")
    ax1.set_ylabel("mean recall error |o_i - v_i|")
    ax0.set_title(f"d_k = {d_k}, overlap {overlap:g}")
    ax1.set_title("error (values have length 1)")
    ax0.legend(fontsize=6.5, loc="lower left", frameon=False)
    return fig
