"""Drawing code of chapter "The layers as they ship" (``chap-shipped-layers``): block diagrams.

:func:`draw_layer` draws one of the four layers of :mod:`fixedstate.layers` as
boxes and arrows: the input at the bottom, the output at the top, the main
path (projection, short convolution, core, norm, output projection) in the
middle column and the gates on the sides. The boxes are coloured by kind:
projections, the short convolution, the recurrent core, norms, and gates or
activations. Where a box names a shape, it is that of one token (or of a state).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

__all__ = ["LAYER_DIAGRAMS", "draw_layer"]

_COLOURS = {"proj": "#dbe9f6", "conv": "#fde2c4", "core": "#f9c6c0", "norm": "#d9f0d3", "gate": "#ece2f0",
            "io": "#ffffff"}

# Each diagram: nodes name -> (x, y, label, kind), then edges (from, to). Coordinates in box units.
LAYER_DIAGRAMS = {
    "gated_deltanet": {
        "title": "Gated DeltaNet (Qwen3-Next)",
        "nodes": {
            "x": (0, 0, "x  (d_model)", "io"),
            "proj": (0, 1, "in_proj → q, k, v", "proj"),
            "conv": (0, 2, "short conv (K = 4), SiLU", "conv"),
            "l2": (0, 3, "L2-normalise q, k per head\nrepeat q, k over value heads", "norm"),
            "core": (0, 4.2, "gated delta rule, scale d_k^-1/2\nstate S: (H_v, d_k, d_v)", "core"),
            "norm": (0, 5.4, "RMSNorm per head × SiLU(z)", "norm"),
            "out": (0, 6.4, "out_proj", "proj"),
            "y": (0, 7.3, "y  (d_model)", "io"),
            "b": (3.0, 1.6, "β = sigmoid(x W_b)", "gate"),
            "a": (3.0, 2.8, "log g = −exp(A_log)\n· softplus(x W_a + dt_bias)", "gate"),
            "z": (-3.0, 3.6, "z = x W_z", "proj"),
        },
        "edges": [("x", "proj"), ("proj", "conv"), ("conv", "l2"), ("l2", "core"), ("core", "norm"),
                  ("norm", "out"), ("out", "y"), ("x", "b"), ("x", "a"), ("b", "core"), ("a", "core"),
                  ("x", "z"), ("z", "norm")],
    },
    "kda": {
        "title": "Kimi Delta Attention (Kimi Linear)",
        "nodes": {
            "x": (0, 0, "x  (d_model)", "io"),
            "proj": (0, 1, "q_proj, k_proj, v_proj", "proj"),
            "conv": (0, 2, "short conv (K = 4), SiLU", "conv"),
            "l2": (0, 3, "L2-normalise q, k per head", "norm"),
            "core": (0, 4.2, "KDA: a decay per key channel\nstate S: (H, d_k, d_v)", "core"),
            "norm": (0, 5.4, "RMSNorm per head × sigmoid(g)", "norm"),
            "out": (0, 6.4, "o_proj", "proj"),
            "y": (0, 7.3, "y  (d_model)", "io"),
            "b": (3.0, 1.6, "β = sigmoid(x W_b)", "gate"),
            "a": (3.0, 2.8, "log α = −exp(A_log) · softplus(\nf + dt_bias), f = x W_f↓ W_f↑", "gate"),
            "z": (-3.0, 3.6, "g = x W_g↓ W_g↑\n(low rank)", "proj"),
        },
        "edges": [("x", "proj"), ("proj", "conv"), ("conv", "l2"), ("l2", "core"), ("core", "norm"),
                  ("norm", "out"), ("out", "y"), ("x", "b"), ("x", "a"), ("b", "core"), ("a", "core"),
                  ("x", "z"), ("z", "norm")],
    },
    "mamba": {
        "title": "Mamba block",
        "nodes": {
            "x": (0, 0, "x  (d_model)", "io"),
            "proj": (0, 1, "in_proj → u, z  (d_inner each)", "proj"),
            "conv": (0, 2, "short conv (K = 4, bias), SiLU", "conv"),
            "xproj": (3.0, 3.0, "x_proj → dt (rank r), B, C (N)\nΔ = softplus(dt W_dt + b)", "gate"),
            "core": (0, 4.2, "selective scan, A = −exp(A_log), + D u\nstate h: (d_inner, N)", "core"),
            "gate": (0, 5.4, "y · SiLU(z)", "gate"),
            "out": (0, 6.4, "out_proj", "proj"),
            "y": (0, 7.3, "y  (d_model)", "io"),
            "z": (-3.0, 3.6, "z", "proj"),
        },
        "edges": [("x", "proj"), ("proj", "conv"), ("conv", "core"), ("conv", "xproj"), ("xproj", "core"),
                  ("core", "gate"), ("gate", "out"), ("out", "y"), ("proj", "z"), ("z", "gate")],
    },
    "mamba2": {
        "title": "Mamba-2 block",
        "nodes": {
            "x": (0, 0, "x  (d_model)", "io"),
            "proj": (0, 1, "in_proj → z, xBC, dt", "proj"),
            "conv": (0, 2, "short conv over x, B, C (K = 4, bias), SiLU", "conv"),
            "split": (0, 3, "x: H heads of P\nB, C: G groups of N", "proj"),
            "dt": (3.1, 2.9, "Δ = softplus(dt + dt_bias)\na = −exp(A_log) per head", "gate"),
            "core": (0, 4.2, "SSD (scalar decay per head), + D x\nstate S: (H, N, P)", "core"),
            "norm": (0, 5.4, "RMSNorm(y · SiLU(z)) per group", "norm"),
            "out": (0, 6.4, "out_proj", "proj"),
            "y": (0, 7.3, "y  (d_model)", "io"),
            "z": (-3.0, 3.6, "z", "proj"),
        },
        "edges": [("x", "proj"), ("proj", "conv"), ("conv", "split"), ("split", "core"), ("proj", "dt"),
                  ("dt", "core"), ("core", "norm"), ("norm", "out"), ("out", "y"), ("proj", "z"), ("z", "norm")],
    },
}


def draw_layer(name: str, *, ax=None):
    """Draw the block diagram of a layer of :mod:`fixedstate.layers`; returns the figure.

    ``name`` is one of ``"gated_deltanet"``, ``"kda"``, ``"mamba"``, ``"mamba2"``
    (the keys of :data:`LAYER_DIAGRAMS`). Boxes: blue projections, orange the
    short convolution, red the recurrent core, green norms, purple gates and
    activations; arrows carry one token's vectors from the input (bottom) to
    the output (top).
    """
    if name not in LAYER_DIAGRAMS:
        raise ValueError(f"name: expected one of {sorted(LAYER_DIAGRAMS)}, got {name!r}")
    spec = LAYER_DIAGRAMS[name]
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.6), layout="constrained")
    else:
        fig = ax.figure
    ax.set_axis_off()
    ax.set_xlim(-4.6, 4.6)
    ax.set_ylim(-0.5, 7.8)
    boxes = {}
    for key, (x, y, label, kind) in spec["nodes"].items():
        lines = label.split("\n")
        w = max(len(s) for s in lines) * 0.085 + 0.3
        h = 0.3 + 0.22 * len(lines)
        patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                               fc=_COLOURS[kind], ec="0.3", lw=0.8, zorder=2)
        ax.add_patch(patch)
        ax.text(x, y, label, ha="center", va="center", fontsize=7.5, zorder=3)
        boxes[key] = (x, y, w, h)
    for a, b in spec["edges"]:
        xa, ya, wa, ha = boxes[a]
        xb, yb, wb, hb = boxes[b]
        if abs(xa - xb) < 1e-9:
            start, end = (xa, ya + ha / 2), (xb, yb - hb / 2)
        elif abs(xb) < abs(xa):               # from a side box into the main column
            start = (xa - wa / 2 if xa > xb else xa + wa / 2, ya)
            end = (xb + wb / 2 if xa > xb else xb - wb / 2, yb)
        else:                                 # from the main column out to a side box
            start = (xa + wa / 2 if xb > xa else xa - wa / 2, ya)
            end = (xb, yb - hb / 2)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=8, lw=0.8, color="0.25",
                                     connectionstyle="arc3,rad=0.0" if abs(xa - xb) < 1e-9 else "arc3,rad=0.15",
                                     zorder=1))
    ax.set_title(spec["title"])
    return fig
