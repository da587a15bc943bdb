"""The drawing engine behind every figure of the book: sliders, frames, and figures that update in place.

What :mod:`fixedstate.figures` describes (the two modes, updatable drawing
functions, live updates) is implemented here; the package re-exports the public
names. It draws with matplotlib's public API alone (the Agg canvas, its
``copy_from_bbox`` and ``restore_region`` for the kept backgrounds) and writes
its PNGs with Pillow.

Why no speed-up of its own: issue #29 allowed a hand-written PNG encoder and a
cache of glyph pictures (which replaced private text routines of matplotlib)
only if the live sliders missed 50 ms without them. They do not.
``make bench-figures`` without either, on 2 December 2026: on a quiet machine
every live slider's 95th percentile was at or below 34 ms (the slowest,
chapter 5's ``draw_lab``, 32 ms); on the shared two-core machine the book is
built on, under a load average of 25 to 30, the 95th percentile of an update's
processor time (``cpu95``) was at most 38 ms (``draw_lab``; 28 ms with the two
speed-ups; ``draw_four_writes``, whose updates are mostly text, changed most:
12 ms with them, 30 ms without). What keeps
the figures that update in place fast is here, on matplotlib's public API: a
layout computed once, backgrounds kept per state of the axes, and only the
changing artists (``changing``, the fields of ``text_fields``) drawn on an update.
"""

from __future__ import annotations

import inspect
import io
import itertools
import math
import numbers
import os
import time
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import numpy as np

__all__ = ["book_style", "interactive_figure", "figure_png", "render_png", "new_figure", "changing",
           "text_fields", "bar_collection", "set_bar_heights", "bar_heights", "figure_parts", "live_update",
           "keep_background",
           "grid_size", "FIGURE_MODES", "LIVE_UPDATES"]

FIGURE_MODES = ("live", "frames")
LIVE_UPDATES = ("continuous", "release")
_ENV = "FIXEDSTATE_FIGURES"
_CHANGING = "_fixedstate_changing"
_PARTS = "_fixedstate_parts"
_RENDERER = "_fixedstate_renderer"


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


# ----------------------------------------------------------------------------- pictures

def _png(image, colors: int | None) -> bytes:
    """PNG bytes of a Pillow RGB ``image``: on an adaptive palette of ``colors`` colours, or fast (``None``).

    Pillow writes no time stamp and no name of the software, so the bytes depend
    on the pixels alone (the stored frames of the notebooks stay the same from
    one machine to the next).
    """
    from PIL import Image

    out = io.BytesIO()
    if not colors:
        image.save(out, format="png", compress_level=1)
    else:
        image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, format="png", optimize=True)
    return out.getvalue()


def figure_png(fig, *, dpi: int = 80, colors: int | None = 128) -> bytes:
    """Render a matplotlib figure to PNG bytes and close it.

    The picture is reduced to an adaptive palette of ``colors`` colours, which
    makes line plots and heat maps three to five times smaller with no visible
    change. ``colors=None`` skips that step and compresses lightly, for speed
    (the live sliders).
    """
    import matplotlib.pyplot as plt
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None},
                **({} if colors else {"pil_kwargs": {"compress_level": 1}}))
    plt.close(fig)
    if not colors:
        return buf.getvalue()
    buf.seek(0)
    return _png(Image.open(buf).convert("RGB"), colors)


def new_figure(nrows: int = 1, ncols: int = 1, **subplots_kw):
    """A figure and its axes, ``Figure.subplots(nrows, ncols, **subplots_kw)``, outside pyplot.

    ``figsize`` is passed to the figure, the rest to ``subplots``. pyplot does not
    manage the figure, so a notebook does not show it by itself at the end of a
    cell and it need not be closed: the interactive figures keep it and show its
    pictures.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=subplots_kw.pop("figsize", None))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **subplots_kw)


def figure_parts(fig) -> dict:
    """The dict in which a drawing function keeps the artists it updates (created empty)."""
    parts = getattr(fig, _PARTS, None)
    if parts is None:
        parts = {}
        setattr(fig, _PARTS, parts)
    return parts


def changing(fig, *artists) -> list:
    """Register ``artists`` as the ones an update of ``fig`` changes; returns every registered artist.

    They are drawn over the kept background, in the order registered, by
    :func:`render_png`. Register also a static artist that must stay on top of a
    changing one (an outline over a bar). Called with no artists, returns the list.
    """
    registered = getattr(fig, _CHANGING, None)
    if registered is None:
        registered = []
        setattr(fig, _CHANGING, registered)
    for artist in artists:
        if artist not in registered:
            artist.set_animated(True)
            registered.append(artist)
    return registered


def bar_collection(ax, x, heights=None, *, width: float = 0.8, label: str | None = None, **kwargs):
    """Bars at ``x`` as one ``PolyCollection`` (drawn in one call, where ``ax.bar`` draws one patch each).

    ``heights`` default to zero; ``kwargs`` are the collection's (``facecolors``,
    ``edgecolors``, ``linewidths``, ...). Change the bars with
    :func:`set_bar_heights`; read them back with :func:`bar_heights`.
    """
    from matplotlib.collections import PolyCollection

    bars = PolyCollection(np.zeros((0, 4, 2)), label=label, **kwargs)
    bars.bar_width = float(width)
    set_bar_heights(bars, np.zeros(len(x)) if heights is None else heights, x)
    ax.add_collection(bars, autolim=False)
    return bars


def set_bar_heights(bars, heights, x=None) -> None:
    """Give the bars of :func:`bar_collection` new ``heights`` (and, optionally, new positions ``x``)."""
    if x is not None:
        bars.bar_x = np.asarray(x, dtype=float)
    heights = np.asarray(heights, dtype=float)
    left = bars.bar_x[:len(heights)] - bars.bar_width / 2
    right = left + bars.bar_width
    zero = np.zeros_like(heights)
    bars.set_verts(np.stack([np.stack([left, zero], -1), np.stack([left, heights], -1),
                             np.stack([right, heights], -1), np.stack([right, zero], -1)], axis=1))
    bars.bar_heights = heights


def bar_heights(bars) -> np.ndarray:
    """The heights of the bars of :func:`bar_collection`, read from the polygons that are drawn."""
    return np.array([path.vertices[1, 1] for path in bars.get_paths()])


def text_fields(ax, template: str, widest: Sequence[str], *, xy=(0.5, 1.0), xycoords="axes fraction",
                offset=(0.0, 4.0), ha: str = "center", **text_kw) -> list:
    """A line of text in which only the fields change: returns the fields' Text artists, registered as changing.

    ``template`` is a ``str.format`` template with positional fields,
    ``"error: linear {}, delta {}"``; ``widest`` gives, for each field, the
    widest text it will show (``"0.00"``: digits have equal widths), which sets
    the room it gets. The words around the fields are drawn once, in the kept
    background; an update sets each field's text (``fields[0].set_text("0.12")``)
    and redraws only those few characters, much faster than a whole line (text
    is the slowest thing matplotlib draws). Braces that belong to the text
    (mathtext, ``$e^{{a}}$``) are doubled, as in ``str.format``. The line is placed at ``xy`` (in
    ``xycoords``) plus ``offset`` in points, aligned by ``ha``, on its baseline.
    """
    import string

    fig = ax.figure
    pieces = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        if pieces and pieces[-1][1] is None:  # parse splits a literal at each escaped brace: join it again
            literal = pieces.pop()[0] + literal
        pieces.append((literal, field, spec, conversion))
    n_fields = sum(1 for _, field, _, _ in pieces if field is not None)
    if len(widest) != n_fields:
        raise ValueError(f"widest: expected one text per field of {template!r} ({n_fields}), got {list(widest)!r}")
    renderer = fig.canvas.get_renderer() if hasattr(fig.canvas, "get_renderer") else None
    if renderer is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        renderer = FigureCanvasAgg(fig).get_renderer()
    probe = ax.annotate("", xy=(0, 0), **text_kw)

    def width(text: str) -> float:  # in points
        probe.set_text(text)
        return probe.get_window_extent(renderer).width * 72.0 / fig.dpi if text else 0.0

    runs, prefix, widths = [], "", iter(widest)
    for literal, field, _, _ in pieces:
        if literal:
            runs.append((width(prefix), literal, False))
            prefix += literal
        if field is not None:
            runs.append((width(prefix), "", True))
            prefix += next(widths)
    total = width(prefix)
    probe.remove()
    start = {"left": 0.0, "center": -total / 2, "right": -total}[ha]
    fields = []
    for x, text, is_field in runs:
        artist = ax.annotate(text, xy=xy, xycoords=xycoords, xytext=(offset[0] + start + x, offset[1]),
                             textcoords="offset points", ha="left", va="baseline", **text_kw)
        if is_field:
            fields.append(artist)
    changing(fig, *fields)
    return fields


class _Renderer:
    """Draws one updatable figure: the background once per state of its axes, the changing artists each time."""

    def __init__(self, fig, max_backgrounds: int = 24):
        self.fig = fig
        self.backgrounds: OrderedDict = OrderedDict()
        self.max_backgrounds = max_backgrounds
        self.canvas = None
        self.laid_out = False
        self.full_draws = 0

    def _key(self, moving: set) -> tuple:
        fig = self.fig
        key = [tuple(fig.get_size_inches()), fig.dpi]
        for ax in fig.axes:
            key += [ax.get_visible(), tuple(ax.get_position().bounds), ax.get_xlim(), ax.get_ylim(),
                    ax.get_xscale(), ax.get_yscale(), ax.get_xlabel(), ax.get_ylabel()]
            titles = (getattr(ax, name, None) for name in ("_left_title", "title", "_right_title"))
            key += [t.get_text() for t in titles if t is not None and t not in moving]
        suptitle = getattr(fig, "_suptitle", None)
        key.append(None if suptitle is None or suptitle in moving else suptitle.get_text())
        return tuple(key)

    def draw(self) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        fig = self.fig
        if not isinstance(fig.canvas, FigureCanvasAgg):
            FigureCanvasAgg(fig)
        if fig.canvas is not self.canvas:  # a new canvas: the kept pictures belong to the old one
            self.canvas, self.backgrounds = fig.canvas, OrderedDict()
        canvas = self.canvas
        moving = changing(fig)
        if not self.laid_out:
            canvas.draw()  # computes the layout once, with the first values ...
            self.full_draws += 1
            if fig.get_layout_engine() is not None:
                fig.set_layout_engine("none")  # ... and keeps it: axes stay put between updates
            self.laid_out = True
            self.backgrounds[self._key(set(moving))] = canvas.copy_from_bbox(fig.bbox)
        key = self._key(set(moving))
        background = self.backgrounds.get(key)
        if background is None:
            canvas.draw()  # everything but the changing artists (they are animated)
            self.full_draws += 1
            background = canvas.copy_from_bbox(fig.bbox)
            self.backgrounds[key] = background
            if len(self.backgrounds) > self.max_backgrounds:
                self.backgrounds.popitem(last=False)
        else:
            self.backgrounds.move_to_end(key)
            canvas.restore_region(background)
        for artist in moving:
            if artist.get_visible() and artist.figure is fig:
                fig.draw_artist(artist)

    def png(self, colors: int | None) -> bytes:
        from PIL import Image

        self.draw()
        return _png(Image.frombuffer("RGBA", self.canvas.get_width_height(physical=True), self.canvas.buffer_rgba(),
                                     "raw", "RGBA", 0, 1).convert("RGB"), colors)


def _renderer_of(fig) -> _Renderer:
    renderer = getattr(fig, _RENDERER, None)
    if renderer is None:
        renderer = _Renderer(fig)
        setattr(fig, _RENDERER, renderer)
    return renderer


def keep_background(fig) -> None:
    """Draw the background of ``fig`` for the present state of its axes and keep it, ahead of need.

    For a drawing function whose updates move an axis limit between a few
    values: called once per value when it builds the figure, it spares the
    update that first reaches a value a full drawing (at most 24 pictures are
    kept per figure).
    """
    _renderer_of(fig).draw()


def render_png(fig, *, colors: int | None = None) -> bytes:
    """PNG bytes of ``fig`` as it is now, without closing it (the figure of an updatable drawing).

    Only the artists registered with :func:`changing` are drawn again over the
    background kept from an earlier call with the same state of the axes; a
    figure with none registered is drawn in full. ``colors``: as
    :func:`figure_png` (``None``, the default, for speed).
    """
    return _renderer_of(fig).png(colors)


# ----------------------------------------------------------------------------- drawing functions

def live_update(update: str):
    """Declare when a drawing function's live sliders redraw: ``"continuous"`` or ``"release"``.

    A decorator; it sets the function's ``live_update`` attribute, which
    :func:`interactive_figure` reads. See the module's documentation.
    """
    if update not in LIVE_UPDATES:
        raise ValueError(f"update: expected one of {LIVE_UPDATES}, got {update!r}")

    def mark(draw):
        draw.live_update = update
        return draw

    return mark


def _updates_in_place(draw) -> bool:
    try:
        parameter = inspect.signature(draw).parameters.get("fig")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)


def _live_update_of(draw, in_place: bool) -> str:
    update = getattr(draw, "live_update", None)
    while update is None and isinstance(getattr(draw, "func", None), Callable):  # functools.partial(draw, ...)
        draw = draw.func
        update = getattr(draw, "live_update", None)
    if update is None:
        return "continuous" if in_place else "release"
    if update not in LIVE_UPDATES:
        raise ValueError(f"draw.live_update: expected one of {LIVE_UPDATES}, got {update!r}")
    return update


class _Drawing:
    """Calls ``draw`` for one choice of values and returns the picture: in place when it can."""

    def __init__(self, draw, colors: int | None):
        self.draw = draw
        self.colors = colors
        self.in_place = _updates_in_place(draw)
        self.fig = None

    def picture(self, values: dict) -> bytes:
        """The picture at ``values``; ``draw_seconds`` and ``picture_seconds`` say how long each half took."""
        t0 = time.perf_counter()
        if not self.in_place:
            fig = self.draw(**values)
            self.draw_seconds = time.perf_counter() - t0
            png = figure_png(fig, colors=self.colors)
        else:
            fig = self.draw(**values, fig=self.fig)
            self.draw_seconds = time.perf_counter() - t0
            if fig is not self.fig:
                import matplotlib.pyplot as plt

                plt.close(fig)  # in case draw used pyplot: the widget shows the figure, not the notebook
                self.fig = fig
            png = render_png(fig, colors=self.colors)
        self.picture_seconds = time.perf_counter() - t0 - self.draw_seconds
        return png


# ----------------------------------------------------------------------------- sliders

def _slider_values(params) -> dict[str, list]:
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


def _frames_control(name: str, values: list, index: int, description: str | None):
    """The control of the frames mode: one position per value of the grid."""
    import ipywidgets as widgets

    options = [(_label(v), v) for v in values]
    style = {"description_width": "initial"}
    if all(isinstance(v, str) for v in values):
        return widgets.ToggleButtons(options=options, index=index, description=description or name, style=style)
    return widgets.SelectionSlider(options=options, index=index, description=description or name,
                                   continuous_update=True, style=style, layout=widgets.Layout(width="420px"))


def _nice_steps(span: float, divisions: int = 50):
    """Round steps (1, 2, 5 times a power of ten) from about ``span / divisions`` down."""
    raw = span / divisions
    exponent = math.floor(math.log10(raw))
    for e in range(exponent, exponent - 4, -1):
        for mantissa in (5, 2, 1):
            step = mantissa * 10.0 ** e
            if step <= raw * (1 + 1e-9):
                yield step


def _on_lattice(values, origin: float, step: float) -> bool:
    return all(abs((v - origin) / step - round((v - origin) / step)) < 1e-6 for v in values)


def _float_step(values: list[float], low: float, high: float) -> float:
    """A round step about a fiftieth of the range, fine enough that every listed value is on the slider."""
    steps = list(_nice_steps(high - low))
    return next((s for s in steps if _on_lattice(values, low, s)), steps[0])


def _decimals(step: float) -> int:
    """Decimals that show every multiple of ``step``: 2 for 0.01 and 0.05, 3 for 0.005."""
    return max(0, -math.floor(math.log10(step) + 1e-9))


def _is_log_spread(values: list[float]) -> bool:
    """Values over at least two decades, more evenly spaced in log than in linear scale."""
    ordered = sorted(values)
    if ordered[0] <= 0 or len(ordered) < 3 or ordered[-1] / ordered[0] < 100:
        return False

    def unevenness(xs):
        gaps = [b - a for a, b in zip(xs, xs[1:])]
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean

    return unevenness([math.log(v) for v in ordered]) < unevenness(ordered)


def _live_control(name: str, values: list, value, description: str | None, continuous: bool):
    """The control of the live mode: buttons for strings, a slider over the whole numeric range."""
    import ipywidgets as widgets

    style = {"description_width": "initial"}
    description = description or name
    if all(isinstance(v, str) for v in values):
        return widgets.ToggleButtons(options=[(v, v) for v in values], value=value, description=description,
                                     style=style)
    layout = widgets.Layout(width="420px")
    low, high = min(values), max(values)
    common = dict(description=description, continuous_update=continuous, style=style, layout=layout,
                  disabled=low == high)
    if all(isinstance(v, numbers.Integral) for v in values):
        step = 1
        if high - low > 500:
            step = int(next((s for s in _nice_steps(high - low, 100) if s >= 1 and s == int(s)
                             and _on_lattice(values, low, s)), 1))
        return widgets.IntSlider(value=int(value), min=int(low), max=int(high), step=step, **common)
    if _is_log_spread(values):
        lo, hi = math.log10(low), math.log10(high)
        step = next(_nice_steps(hi - lo))
        return widgets.FloatLogSlider(value=float(value), base=10, min=lo, max=hi, step=step,
                                      readout_format=".3g", **common)
    if low == high:
        return widgets.FloatSlider(value=float(value), min=float(low), max=float(low) + 1, step=1, **common)
    step = _float_step([float(v) for v in values], float(low), float(high))
    return widgets.FloatSlider(value=float(value), min=float(low), max=float(high), step=step,
                               readout_format=f".{_decimals(step)}f", **common)


def _live_value(control):
    """A control's value as ``draw`` receives it: an int, a string, or a float rid of binary noise."""
    import ipywidgets as widgets

    value = control.value
    if isinstance(control, widgets.FloatLogSlider):
        return float(f"{value:.4g}")
    if isinstance(control, widgets.FloatSlider):
        return round(float(value), _decimals(control.step) + 3)
    return value


# ----------------------------------------------------------------------------- the figure

def interactive_figure(draw: Callable[..., object], params: Mapping[str, Sequence], *,
                       initial: Mapping[str, object] | None = None,
                       labels: Mapping[str, str] | None = None,
                       mode: str | None = None, max_frames: int = 100):
    """A figure with one slider per parameter, live in Jupyter and static-friendly in HTML.

    Parameters
    ----------
    draw : callable
        ``draw(**values)`` returns a matplotlib Figure for one choice of values.
        If it also accepts ``fig=``, it is updatable (see the module's
        documentation): the figure is built once and updated in place.
    params : dict
        Slider name -> list of values (all numbers, shown as a slider, or all
        strings, shown as buttons). The names are ``draw``'s keyword arguments.
        The frames mode draws every combination; the live mode's sliders cover
        the range from the smallest to the largest number of each list.
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
        The controls above the picture. Attributes: ``controls`` (name -> the
        control), ``render_seconds`` (the time the last update took, computation
        and picture, in live mode; on average per frame in frames mode). In live
        mode: ``draw_seconds`` and ``picture_seconds`` (the last update's two
        halves: ``draw``, that is the computation and the changes to the figure,
        then rendering the picture), ``image`` (the picture widget), ``renders``
        (updates drawn so far),
        ``values`` (the values of the picture shown), ``figure`` (the figure
        kept and updated, for an updatable ``draw``; else None), ``live_update``
        (``"continuous"`` or ``"release"``) and ``update()`` (redraw at the
        controls' current values). In frames mode: ``frame_count`` (the number
        of pictures) and ``links`` (the browser-side links from sliders to stacks).
    """
    import ipywidgets as widgets

    if not callable(draw):
        raise ValueError(f"draw: expected a callable returning a matplotlib Figure, got {draw!r}")
    grid = _slider_values(params)
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
    names = list(grid)

    if mode == "live":
        drawing = _Drawing(draw, colors=None)
        update = _live_update_of(draw, drawing.in_place)
        controls = {name: _live_control(name, grid[name], grid[name][start[name]], labels.get(name),
                                        continuous=update == "continuous") for name in names}
        image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        box = widgets.VBox([*controls.values(), image])
        box.controls, box.image, box.live_update, box.renders = controls, image, update, 0

        def render(_change=None):
            values = {n: _live_value(controls[n]) for n in names}
            t0 = time.perf_counter()
            image.value = drawing.picture(values)
            box.render_seconds = time.perf_counter() - t0
            box.draw_seconds, box.picture_seconds = drawing.draw_seconds, drawing.picture_seconds
            box.renders += 1
            box.values = values
            box.figure = drawing.fig

        for ctl in controls.values():
            ctl.observe(render, names="value")
        box.update = render
        render()
        return box

    controls = {name: _frames_control(name, grid[name], start[name], labels.get(name)) for name in names}
    n_frames = 1
    for values in grid.values():
        n_frames *= len(values)
    if n_frames > max_frames:
        raise ValueError(f"params: the grid has {n_frames} frames, more than max_frames={max_frames}; "
                         "use fewer slider values")
    drawing = _Drawing(draw, colors=128)
    timings = []
    links = []

    def build(level: int, fixed: dict):
        if level == len(names):
            t0 = time.perf_counter()
            picture = drawing.picture(fixed)
            timings.append(time.perf_counter() - t0)
            return widgets.Image(value=picture, format="png", layout=widgets.Layout(max_width="100%"))
        name = names[level]
        children = [build(level + 1, {**fixed, name: v}) for v in grid[name]]
        stack = widgets.Stack(children, selected_index=start[name])
        links.append(widgets.jslink((controls[name], "index"), (stack, "selected_index")))
        return stack

    stack = build(0, {})
    box = widgets.VBox([*controls.values(), stack])
    box.controls = controls
    box.render_seconds = sum(timings) / len(timings)
    box.frame_count = n_frames
    box.links = links
    return box


def grid_size(params: Mapping[str, Sequence]) -> int:
    """Number of frames a parameter grid produces."""
    return len(list(itertools.product(*_slider_values(params).values())))
