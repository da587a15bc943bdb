"""Figures that work with a kernel and without one, and each chapter's drawing code.

This package holds everything that draws; the cores never import matplotlib.
One submodule per chapter module holds that chapter's drawing functions:

- :mod:`fixedstate.figures.delta_rule`: ``four_writes``, ``draw_four_writes``;
- :mod:`fixedstate.figures.recall`: ``draw_lab``, ``draw_capacity``.

The helpers below (:func:`book_style`, :func:`interactive_figure`,
:func:`figure_png`, :func:`grid_size`) serve every chapter.

The book's interactive figures are sliders over a drawing function from this
package. Two modes share one call:

- **live** (the default, in Jupyter): moving a slider calls ``draw`` again, so
  the figure is recomputed from the package at whatever values the reader picks.
- **frames** (when the environment variable ``FIXEDSTATE_FIGURES=frames`` is set,
  as ``make execute`` does before storing outputs for the HTML book): ``draw`` is
  called once for every point of the slider grid, the pictures are stored in
  nested ipywidgets ``Stack`` widgets, and each slider's ``index`` is tied to its
  stacks' ``selected_index`` with ``jslink``. The link runs in the browser, so
  the sliders still change the figure in the static HTML, where no Python runs.

Use::

    interactive_figure(draw, {"gate": [0.5, 0.75, 1.0], "beta": [0.25, 0.5, 1.0]})

where ``draw(gate=..., beta=...)`` returns a matplotlib ``Figure``.
"""

from __future__ import annotations

import io
import itertools
import numbers
import os
import time
from typing import Callable, Mapping, Sequence

__all__ = ["book_style", "interactive_figure", "figure_png", "grid_size", "FIGURE_MODES"]

FIGURE_MODES = ("live", "frames")
_ENV = "FIXEDSTATE_FIGURES"


def book_style() -> None:
    """Set the book's matplotlib defaults: small figures at a modest resolution.

    Keeps the stored notebooks (and so the repository and the HTML pages) small.
    """
    import matplotlib as mpl

    mpl.rcParams.update({
        "figure.figsize": (6.0, 3.4),
        "figure.dpi": 80,
        "savefig.dpi": 80,
        "font.size": 10,
        "axes.titlesize": 10,
        "axes.labelsize": 10,
        "legend.fontsize": 9,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "figure.constrained_layout.use": True,
    })


def figure_png(fig, *, dpi: int = 80, colors: int = 128) -> bytes:
    """Render a matplotlib figure to PNG bytes and close it.

    The picture is reduced to an adaptive palette of ``colors`` colours, which
    makes line plots and heat maps three to five times smaller with no visible
    change.
    """
    import matplotlib.pyplot as plt
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    buf.seek(0)
    img = Image.open(buf).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    img.save(out, format="png", optimize=True)
    return out.getvalue()


def _check_params(params) -> dict[str, list]:
    if not isinstance(params, Mapping) or not params:
        raise ValueError(f"params: expected a non-empty dict of slider name -> list of values, got {params!r}")
    checked = {}
    for name, values in params.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"params: expected slider names that are Python identifiers, got {name!r}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
            raise ValueError(f"params[{name!r}]: expected a non-empty list of values, got {values!r}")
        kinds = {isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values}
        if len(kinds) != 1 or (not kinds.pop() and not all(isinstance(v, str) for v in values)):
            raise ValueError(f"params[{name!r}]: expected all numbers or all strings, got {values!r}")
        if len(set(values)) != len(values):
            raise ValueError(f"params[{name!r}]: expected distinct values, got {values!r}")
        checked[name] = list(values)
    return checked


def _label(value) -> str:
    if isinstance(value, str):
        return value
    return f"{value:g}"


def _control(name: str, values: list, index: int, description: str | None):
    import ipywidgets as widgets

    options = [(_label(v), v) for v in values]
    style = {"description_width": "initial"}
    if all(isinstance(v, str) for v in values):
        ctl = widgets.ToggleButtons(options=options, index=index, description=description or name,
                                    style=style)
    else:
        ctl = widgets.SelectionSlider(options=options, index=index, description=description or name,
                                      continuous_update=True, style=style,
                                      layout=widgets.Layout(width="420px"))
    return ctl


def interactive_figure(draw: Callable[..., object], params: Mapping[str, Sequence], *,
                       initial: Mapping[str, object] | None = None,
                       labels: Mapping[str, str] | None = None,
                       mode: str | None = None, max_frames: int = 100):
    """A figure with one slider per parameter, live in Jupyter and static-friendly in HTML.

    Parameters
    ----------
    draw : callable
        ``draw(**values)`` returns a matplotlib Figure for one choice of values.
    params : dict
        Slider name -> list of values (all numbers, shown as a slider, or all
        strings, shown as buttons). The names are ``draw``'s keyword arguments.
    initial : dict, optional
        Starting value of each slider (default: the first value of each list).
    labels : dict, optional
        Text shown beside each slider (default: its name).
    mode : {"live", "frames"}, optional
        Default: the environment variable ``FIXEDSTATE_FIGURES``, else ``"live"``.
    max_frames : int
        Refuse a frames grid larger than this (page weight).

    Returns
    -------
    ipywidgets.VBox
        The controls above the picture. The attribute ``render_seconds`` holds
        the time ``draw`` took on its last call (live mode) or on average per
        frame (frames mode). In frames mode, ``frame_count`` is the number of
        pictures and ``links`` the browser-side links from sliders to stacks.
    """
    import ipywidgets as widgets

    if not callable(draw):
        raise ValueError(f"draw: expected a callable returning a matplotlib Figure, got {draw!r}")
    grid = _check_params(params)
    mode = mode if mode is not None else os.environ.get(_ENV, "live")
    if mode not in FIGURE_MODES:
        raise ValueError(f"mode: expected one of {FIGURE_MODES}, got {mode!r}")
    initial = dict(initial or {})
    for name in initial:
        if name not in grid:
            raise ValueError(f"initial: names a slider {name!r} that is not in params {list(grid)}")
    start = {}
    for name, values in grid.items():
        value = initial.get(name, values[0])
        if value not in values:
            raise ValueError(f"initial[{name!r}]: expected one of {values}, got {value!r}")
        start[name] = values.index(value)
    labels = dict(labels or {})
    controls = {name: _control(name, grid[name], start[name], labels.get(name)) for name in grid}
    names = list(grid)

    if mode == "live":
        image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        box = widgets.VBox([*controls.values(), image])

        def render(_change=None):
            values = {n: grid[n][controls[n].index] for n in names}
            t0 = time.perf_counter()
            fig = draw(**values)
            box.render_seconds = time.perf_counter() - t0
            image.value = figure_png(fig)

        for ctl in controls.values():
            ctl.observe(render, names="index")
        render()
        return box

    n_frames = 1
    for values in grid.values():
        n_frames *= len(values)
    if n_frames > max_frames:
        raise ValueError(f"params: the grid has {n_frames} frames, more than max_frames={max_frames}; "
                         "use fewer slider values")
    timings = []
    links = []

    def build(level: int, fixed: dict):
        if level == len(names):
            t0 = time.perf_counter()
            fig = draw(**fixed)
            timings.append(time.perf_counter() - t0)
            return widgets.Image(value=figure_png(fig), format="png",
                                 layout=widgets.Layout(max_width="100%"))
        name = names[level]
        children = [build(level + 1, {**fixed, name: v}) for v in grid[name]]
        stack = widgets.Stack(children, selected_index=start[name])
        links.append(widgets.jslink((controls[name], "index"), (stack, "selected_index")))
        return stack

    stack = build(0, {})
    box = widgets.VBox([*controls.values(), stack])
    box.render_seconds = sum(timings) / len(timings)
    box.frame_count = n_frames
    box.links = links
    return box


def grid_size(params: Mapping[str, Sequence]) -> int:
    """Number of frames a parameter grid produces."""
    return len(list(itertools.product(*_check_params(params).values())))
