"""The drawing code of chapter {ref}`chap-softmax-cost`: the KV-cache figure.

The sizes come from :func:`fixedstate.costs.kv_cache_bytes` (``eq-sm-kv-cache``);
this module only draws them.
"""

from __future__ import annotations

import numpy as np

from ..costs import kv_cache_bytes
from .engine import changing, figure_parts, live_update, new_figure, text_fields

__all__ = ["KV_CONTEXT", "kv_cache_gb", "draw_kv"]

KV_CONTEXT = np.linspace(0, 1_000_000, 201).astype(np.int64)
"""The context lengths of the KV-cache figure: 0 to one million tokens."""


def kv_cache_gb(kv_heads, bytes_per_number, *, n_layers=32, head_dim=128):
    """The KV cache in GB (``10**9`` bytes) at every length of :data:`KV_CONTEXT` (``eq-sm-kv-cache``)."""
    return kv_cache_bytes(KV_CONTEXT, n_layers=n_layers, n_kv_heads=kv_heads, head_dim=head_dim,
                          bytes_per_element=bytes_per_number) / 1e9


@live_update("continuous")
def draw_kv(kv_heads=32, bytes_per_number=2, *, n_layers=32, head_dim=128, fig=None):
    """Draw the KV cache of one sequence against the context length, for one setting of the sliders.

    A line of the cache in GB (:func:`kv_cache_gb`: ``n_layers`` layers of
    ``kv_heads`` key-value heads of width ``head_dim``, ``bytes_per_number``
    bytes per stored number) for contexts from 0 to one million tokens, with a
    dotted line at 80 GB (one large accelerator). Returns the matplotlib Figure.

    Updatable (see :mod:`fixedstate.figures`): with ``fig``, a figure this
    function built, it changes the line and the two numbers of the title and
    returns it. **Live sliders: continuous** (the latest value wins): an update
    computes 201 sizes (microseconds) and redraws one line and two numbers over
    the kept background, far under the 50 ms an update may take (``make
    bench-figures`` measures it).
    """
    gb = kv_cache_gb(kv_heads, bytes_per_number, n_layers=n_layers, head_dim=head_dim)
    if fig is None:
        fig = _kv_figure(n_layers, head_dim)
    parts = figure_parts(fig)
    parts["line"].set_ydata(gb)
    parts["title"][0].set_text(f"{kv_heads:g}")
    parts["title"][1].set_text(f"{bytes_per_number:g}")
    return fig


def _kv_figure(n_layers: int, head_dim: int):
    fig, ax = new_figure()
    parts = figure_parts(fig)
    (parts["line"],) = ax.plot(KV_CONTEXT / 1e3, np.zeros(len(KV_CONTEXT)), color="tab:blue")
    ax.axhline(80, color="gray", ls=":", label="80 GB (one large accelerator)")
    changing(fig, parts["line"])
    ax.set_xlabel("context (thousands of tokens)")
    ax.set_ylabel("KV cache (GB)")
    ax.set_xlim(-50, 1050)
    ax.set_ylim(0, 1100)
    ax.legend(loc="upper left")
    parts["title"] = text_fields(ax, f"{n_layers} layers, {{}} KV heads of {head_dim}, {{}} bytes per number",
                                 ("00", "0.00"), fontsize=ax.title.get_fontsize())
    return fig
