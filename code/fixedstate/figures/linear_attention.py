"""The drawing code of chapter {ref}`chap-linear-attention`: the crossover figure.

The counts come from :mod:`fixedstate.costs`:
:func:`~fixedstate.costs.softmax_attention_flops` (``eq-sm-flops``),
:func:`~fixedstate.costs.linear_attention_flops` (``eq-la-flops``) and
:func:`~fixedstate.costs.crossover_length` (``eq-la-crossover``); this module
only draws them.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..costs import crossover_length, linear_attention_flops, softmax_attention_flops
from .engine import changing, figure_parts, live_update, new_figure, text_fields

__all__ = ["CROSSOVER_LENGTHS", "SOFTMAX_COUNTS", "draw_crossover"]

CROSSOVER_LENGTHS = np.arange(1, 1101)
"""The sequence lengths of the crossover figure."""

SOFTMAX_COUNTS = ("full square", "causal half")
"""The two ways of counting softmax's FLOPs the figure offers (``causal=False``, ``True``)."""


@lru_cache(maxsize=len(SOFTMAX_COUNTS))
def _softmax_mflop(causal: bool, d_k: int, d_v: int) -> np.ndarray:
    return softmax_attention_flops(CROSSOVER_LENGTHS, d_k, d_v, causal=causal) / 1e6


@live_update("continuous")
def draw_crossover(r=128, softmax_count="full square", *, d_k=128, d_v=128, fig=None):
    """Draw the FLOPs of softmax and of linear attention against the length, for one setting of the sliders.

    A parabola (softmax attention, counting the ``softmax_count``: the full
    ``T x T`` square or its causal half), a straight line (linear attention
    with feature width ``r``), both in MFLOP for lengths 1 to 1,100 with
    ``d_k = d_v = 128``, and a dotted vertical line at the crossover length, the
    first length at which linear attention costs less. The title gives ``r``, the
    count and the crossover. Returns the matplotlib Figure.

    Updatable (see :mod:`fixedstate.figures`): with ``fig``, a figure this
    function built, it changes the two curves, the dotted line and the numbers of
    the title and returns it. **Live sliders: continuous** (the latest value
    wins): an update evaluates two formulas at 1,100 lengths and finds the
    crossover (well under a millisecond; the parabola of each count is kept),
    then redraws three lines and a few words over the kept background (``make
    bench-figures`` measures it).
    """
    if softmax_count not in SOFTMAX_COUNTS:
        raise ValueError(f"softmax_count: expected one of {SOFTMAX_COUNTS}, got {softmax_count!r}")
    causal = softmax_count == "causal half"
    soft = _softmax_mflop(causal, d_k, d_v)
    lin = linear_attention_flops(CROSSOVER_LENGTHS, r, d_v) / 1e6
    cross = crossover_length(r, d_k, d_v, causal=causal)
    if fig is None:
        fig = _crossover_figure(d_k, d_v)
    parts = figure_parts(fig)
    parts["softmax"].set_ydata(soft)
    parts["linear"].set_ydata(lin)
    parts["crossover"].set_xdata([cross, cross])
    for field, text in zip(parts["title"], (f"{r:g}", softmax_count, f"{cross:g}")):
        field.set_text(text)
    return fig


def _crossover_figure(d_k: int, d_v: int):
    fig, ax = new_figure()
    parts = figure_parts(fig)
    zero = np.zeros(len(CROSSOVER_LENGTHS))
    (parts["softmax"],) = ax.plot(CROSSOVER_LENGTHS, zero, label="softmax attention")
    (parts["linear"],) = ax.plot(CROSSOVER_LENGTHS, zero, label="linear attention")
    parts["crossover"] = ax.axvline(1, color="gray", ls=":", label="crossover")
    changing(fig, parts["softmax"], parts["linear"], parts["crossover"])
    ax.set_xlim(-54, 1155)
    ax.set_ylim(0, 700)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(rf"MFLOP ($d_k$ = {d_k}, $d_v$ = {d_v})")
    ax.legend(loc="upper left")
    parts["title"] = text_fields(ax, "r = {}, softmax counts the {}: crossover at T = {}",
                                 ("000", "causal half", "0000"), fontsize=ax.title.get_fontsize())
    return fig
