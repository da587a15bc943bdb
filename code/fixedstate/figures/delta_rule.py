"""The drawing code of chapter {ref}`chap-delta-rule`: the four-writes figure.

The computation goes through the package's cores,
:func:`fixedstate.linear_attention.linear_attention_step` (plain linear
attention, ``eq-la-recurrent``) and
:func:`fixedstate.delta_rule.gated_delta_rule_step` (``eq-dr-gated``); this
module only sets up the writes and draws what the two states recall.
"""

from __future__ import annotations

import math

import numpy as np

from .._validate import as_float_array, check_interval
from ..delta_rule import gated_delta_rule_step
from ..linear_attention import identity_feature_map, linear_attention_step
from .engine import bar_collection, changing, figure_parts, live_update, new_figure, set_bar_heights, text_fields

__all__ = ["FOUR_WRITES_KEYS", "four_writes", "draw_four_writes"]

FOUR_WRITES_KEYS = ("a", "b", "c")
"""The keys of the four-writes figure, in the order of its panels."""


def four_writes(gate=1.0, beta=1.0, overlap=0.6):
    """The four writes of the interactive figure, in plain linear attention and the gated delta rule.

    Into a 4x4 state: value e1 under key a = e1, e2 under b = e2, e3 under
    c = overlap * e1 + sqrt(1 - overlap^2) * e3 (unit length, ``a . c = overlap``),
    then a new value e4 under a. Plain linear attention adds each ``k v^T``
    (``eq-la-recurrent``); the gated delta rule applies ``eq-dr-gated`` with the
    decay ``gate`` in (0, 1] (passed to the core as ``log_gate = log(gate)``) and
    ``beta`` at every write.

    Returns a dict with ``keys`` (name -> (4,) key), ``targets`` (name -> the
    latest value written under it), ``linear`` and ``delta`` (name -> what each
    state recalls, ``S^T k``), and the two final states ``linear_state`` and
    ``delta_state``, each ``(4, 4)``.
    """
    overlap = float(check_interval(as_float_array(overlap, "overlap", ndim=0), "overlap", 0.0, 1.0))
    gate = float(check_interval(as_float_array(gate, "gate", ndim=0), "gate", 0.0, 1.0, low_closed=False))
    log_gate = math.log(gate)
    eye = np.eye(4)
    keys = {"a": eye[0], "b": eye[1], "c": overlap * eye[0] + math.sqrt(1.0 - overlap ** 2) * eye[2]}
    writes = [("a", eye[0]), ("b", eye[1]), ("c", eye[2]), ("a", eye[3])]
    s_lin = np.zeros((4, 4))
    s_delta = np.zeros((4, 4))
    for name, value in writes:
        k = keys[name]
        _, s_lin = linear_attention_step(k, k, value, feature_map=identity_feature_map, normalize=False,
                                         initial_state=s_lin)
        _, s_delta = gated_delta_rule_step(k, k, value, beta=beta, log_gate=log_gate, initial_state=s_delta)
    targets = {"a": eye[3], "b": eye[1], "c": eye[2]}
    return {
        "keys": keys, "targets": targets,
        "linear": {n: s_lin.T @ keys[n] for n in FOUR_WRITES_KEYS},
        "delta": {n: s_delta.T @ keys[n] for n in FOUR_WRITES_KEYS},
        "linear_state": s_lin, "delta_state": s_delta,
    }


@live_update("continuous")
def draw_four_writes(gate=1.0, beta=1.0, overlap=0.6, *, fig=None):
    """Draw the interactive delta-rule figure for one setting of the sliders.

    One panel per key (a, b, c): the four components of the value each layer
    recalls, as bars (plain linear attention, gated delta rule), with the target
    (the latest value written under that key) as black outlines, and each
    layer's recall error above the panel. Returns the matplotlib Figure.

    Updatable (see :mod:`fixedstate.figures`): with ``fig``, a figure this
    function built, it sets the bar heights and the texts of that figure and
    returns it. **Live sliders: continuous** (the latest value wins): an update
    recomputes four writes (about a millisecond) and redraws only the bars and
    texts over the kept background, well under the 50 ms an update may take
    (``make bench-figures`` measures it).
    """
    res = four_writes(gate, beta, overlap)
    if fig is None:
        fig = _four_writes_figure()
    parts = figure_parts(fig)
    for name in FOUR_WRITES_KEYS:
        target = res["targets"][name]
        lin, dlt = res["linear"][name], res["delta"][name]
        set_bar_heights(parts["linear"][name], lin)
        set_bar_heights(parts["delta"][name], dlt)
        for field, err in zip(parts["error"][name], (lin - target, dlt - target)):
            field.set_text(f"{np.linalg.norm(err):.2f}")
    for field, value in zip(parts["settings"], (gate, beta, overlap)):
        field.set_text(f"{value:.2f}")
    return fig


def _four_writes_figure():
    """The figure of :func:`draw_four_writes` with its static parts; the changing ones at zero."""
    fig, axes = new_figure(1, 3, figsize=(7.2, 2.8), sharey=True)
    parts = figure_parts(fig)
    parts.update(linear={}, delta={}, error={})
    x = np.arange(4)
    targets = four_writes()["targets"]  # the targets do not depend on the sliders
    for ax, name in zip(axes, FOUR_WRITES_KEYS):
        lin = bar_collection(ax, x - 0.2, width=0.38, facecolors="tab:orange", label="linear attention")
        dlt = bar_collection(ax, x + 0.2, width=0.38, facecolors="tab:blue", label="delta rule")
        outline = bar_collection(ax, x, targets[name], facecolors="none", edgecolors="black", linewidths=1.2,
                                 label="target")
        zero = ax.axhline(0.0, color="gray", linewidth=0.6)
        # the outlines and the zero line are drawn again over the changing bars
        changing(fig, lin, dlt, outline, zero)
        # the title's first line stays; in its second line only the two numbers change
        ax.set_title(f"recall of {name}", pad=18)
        parts["error"][name] = text_fields(ax, "error: linear {}, delta {}", ("0.00", "0.00"),
                                           fontsize=ax.title.get_fontsize())
        ax.set_xticks(x, ["e1", "e2", "e3", "e4"])
        ax.set_xlim(-0.6, 3.6)
        ax.set_ylim(-0.7, 2.1)
        parts["linear"][name], parts["delta"][name] = lin, dlt
    axes[0].set_ylabel("recalled component")
    axes[0].legend(loc="upper left", fontsize=7, frameon=False)
    parts["settings"] = text_fields(axes[1], "gate {}, beta {}, overlap a.c = {}", ("0.00",) * 3,
                                    offset=(0, 34), fontsize=9)
    return fig
