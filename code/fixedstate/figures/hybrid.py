"""The drawing code of chapter {ref}`chap-hybrids`: the memory of a hybrid stack.

The sizes come from :mod:`fixedstate.hybrid`:
:func:`~fixedstate.hybrid.stack_kv_cache_bytes` (``eq-hy-kv``) and
:func:`~fixedstate.hybrid.stack_state_bytes` (``eq-hy-state``) of the
configuration :func:`~fixedstate.hybrid.qwen35_9b_config` with its attention
layers moved by :func:`~fixedstate.hybrid.every_nth_layer`; this module only
draws them.
"""

from __future__ import annotations

import numpy as np

from ..hybrid import every_nth_layer, qwen35_9b_config, stack_kv_cache_bytes, stack_state_bytes, with_layout
from .engine import bar_collection, changing, figure_parts, live_update, new_figure, set_bar_heights

__all__ = ["MEMORY_CONTEXTS", "stack_memory_gib", "draw_memory"]

MEMORY_CONTEXTS = np.array([8192, 32768, 65536, 131072])
"""The context lengths of the memory figure: 8k, 32k, 64k and 128k tokens."""

_GIB = 2.0 ** 30


def stack_memory_gib(every, config=None):
    """KV cache and fixed states, in GiB, of ``config`` with full attention in every ``every``-th layer.

    ``config`` defaults to :func:`fixedstate.hybrid.qwen35_9b_config`; an
    ``every`` larger than its number of layers leaves no attention layer.
    Returns ``(layout, kv, states)``: the attention layers, the cache at each
    length of :data:`MEMORY_CONTEXTS` (``eq-hy-kv``) and the states
    (``eq-hy-state``, the same at every length).
    """
    config = qwen35_9b_config() if config is None else config
    layout = every_nth_layer(config.n_layers, every) if every <= config.n_layers else ()
    stack = with_layout(config, layout)
    kv = stack_kv_cache_bytes(stack, MEMORY_CONTEXTS) / _GIB
    states = np.full(MEMORY_CONTEXTS.shape, stack_state_bytes(stack) / _GIB)
    return layout, kv, states


@live_update("continuous")
def draw_memory(every=4, *, config=None, fig=None):
    """Draw the memory of a hybrid stack at four context lengths, for one setting of the slider.

    Stacked bars at 8k, 32k, 64k and 128k tokens: the KV cache of the
    attention layers (blue) under the fixed states of the linear layers
    (orange), in GiB, for ``config`` (default: the Qwen3.5-9B shape, 32 layers)
    with full attention in every ``every``-th layer (none if ``every`` exceeds
    the number of layers). Returns the matplotlib Figure.

    Updatable (see :mod:`fixedstate.figures`): with ``fig``, a figure this
    function built, it changes the bars and the title and returns it. **Live
    sliders: continuous** (the latest value wins): an update adds up the sizes
    of the layers (well under a millisecond) and redraws eight bars and the
    title over the kept background (``make bench-figures`` measures it).
    """
    config = qwen35_9b_config() if config is None else config
    layout, kv, states = stack_memory_gib(every, config)
    if fig is None:
        fig = _memory_figure()
    parts = figure_parts(fig)
    # the states' bars reach from 0 to the top and the cache's bars are drawn over their lower part
    set_bar_heights(parts["total"], kv + states)
    set_bar_heights(parts["kv"], kv)
    n = config.n_layers
    fig.axes[0].set_title("no attention layer" if not layout
                          else f"attention in {every_nth(every)} ({len(layout)} of {n})")
    return fig


def every_nth(n: int) -> str:
    """``every layer``, ``every 2nd layer``, ``every 3rd layer``, ``every 4th layer``, ..."""
    if n == 1:
        return "every layer"
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"every {n}{suffix} layer"


def _memory_figure():
    fig, ax = new_figure()
    parts = figure_parts(fig)
    x = np.arange(len(MEMORY_CONTEXTS))
    parts["total"] = bar_collection(ax, x, facecolors="tab:orange", label="fixed states")
    parts["kv"] = bar_collection(ax, x, facecolors="tab:blue", label="KV cache")
    changing(fig, parts["total"], parts["kv"], ax.title)
    ax.set_xticks(x, [f"{n // 1024}k" for n in MEMORY_CONTEXTS])
    ax.set_xlim(-0.6, len(x) - 0.4)
    ax.set_ylim(0, 17)
    ax.set_xlabel("context length")
    ax.set_ylabel("GiB (bf16 cache, fp32 states)")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left")  # the cache first, as the bars read from below
    return fig
