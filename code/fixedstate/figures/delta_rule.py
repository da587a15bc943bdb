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


def draw_four_writes(gate=1.0, beta=1.0, overlap=0.6):
    """Draw the interactive delta-rule figure for one setting of the sliders.

    One panel per key (a, b, c): the four components of the value each layer
    recalls, as bars (plain linear attention, gated delta rule), with the target
    (the latest value written under that key) as black outlines. Returns the
    matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    res = four_writes(gate, beta, overlap)
    fig, axes = plt.subplots(1, 3, figsize=(7.2, 2.8), sharey=True)
    x = np.arange(4)
    for ax, name in zip(axes, FOUR_WRITES_KEYS):
        target = res["targets"][name]
        lin, dlt = res["linear"][name], res["delta"][name]
        ax.bar(x - 0.2, lin, width=0.38, color="tab:orange", label="linear attention")
        ax.bar(x + 0.2, dlt, width=0.38, color="tab:blue", label="delta rule")
        ax.bar(x, target, width=0.8, fill=False, edgecolor="black", linewidth=1.2, label="target")
        err_l = np.linalg.norm(lin - target)
        err_d = np.linalg.norm(dlt - target)
        ax.set_title(f"recall of {name}\nerror: linear {err_l:.2f}, delta {err_d:.2f}")
        ax.set_xticks(x, ["e1", "e2", "e3", "e4"])
        ax.set_ylim(-0.7, 2.1)
        ax.axhline(0.0, color="gray", linewidth=0.6)
    axes[0].set_ylabel("recalled component")
    axes[0].legend(loc="upper left", fontsize=7, frameon=False)
    fig.suptitle(f"gate {gate:g}, beta {beta:g}, overlap a.c = {overlap:g}", fontsize=9)
    return fig
