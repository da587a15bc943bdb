"""Figures that work with a kernel and without one, and each chapter's drawing code.

This package holds everything that draws; the cores never import matplotlib.
One submodule per chapter module holds that chapter's drawing functions:

- :mod:`fixedstate.figures.softmax_attention`: ``draw_kv`` (chapter 1);
- :mod:`fixedstate.figures.linear_attention`: ``draw_crossover`` (chapter 2);
- :mod:`fixedstate.figures.delta_rule`: ``four_writes``, ``draw_four_writes`` (chapter 3);
- :mod:`fixedstate.figures.ssm`: ``selectivity_states``, ``draw_selectivity`` (chapter 4);
- :mod:`fixedstate.figures.recall`: ``draw_lab``, ``draw_capacity`` (chapter 5);
- :mod:`fixedstate.figures.hybrid`: ``stack_memory_gib``, ``draw_memory`` (chapter 6).

The helpers below serve every chapter: :func:`book_style`,
:func:`interactive_figure`, :func:`grid_size`, :func:`figure_png`, and for the
figures that update in place :func:`new_figure`, :func:`figure_parts`,
:func:`changing`, :func:`bar_collection` (with :func:`set_bar_heights`,
:func:`bar_heights`), :func:`text_fields`, :func:`render_png`,
:func:`keep_background` and :func:`live_update`.

The book's interactive figures are sliders over a drawing function from this
package. Two modes share one call and one drawing function:

- **live** (the default, in Jupyter): every numeric slider covers the whole
  range of its list of values (an ``IntSlider``, a ``FloatSlider``, or a
  ``FloatLogSlider`` for values spread over decades), not only the values
  listed; moving it calls ``draw`` again at the value the reader picks.
- **frames** (when the environment variable ``FIXEDSTATE_FIGURES=frames`` is set,
  as ``make execute`` does before storing outputs for the HTML book): ``draw`` is
  called once for every point of the slider grid, the pictures are stored in
  nested ipywidgets ``Stack`` widgets, and each slider's ``index`` is tied to its
  stacks' ``selected_index`` with ``jslink``. The link runs in the browser, so
  the sliders still change the figure in the static HTML, where no Python runs.

Use::

    interactive_figure(draw, {"gate": [0.5, 0.75, 1.0], "beta": [0.25, 0.5, 1.0]})

where ``draw(gate=..., beta=...)`` returns a matplotlib ``Figure``.

Figures that update in place
----------------------------
A drawing function that also accepts ``fig=`` is *updatable*: ``draw(**values)``
builds a new figure, and ``draw(**values, fig=fig)`` changes the figure it built
before (bar heights, line data, texts) and returns it. Both modes then build the
figure once and keep it: the live sliders update it, and the frames are rendered
from it one grid point after the other. The pattern, with the helpers below::

    @live_update("continuous")
    def draw_thing(a=1.0, *, fig=None):
        if fig is None:
            fig, ax = new_figure()
            (line,) = ax.plot(x, 0 * x)              # static parts drawn once ...
            figure_parts(fig)["line"] = line
            changing(fig, line)                      # ... the artists an update changes
        figure_parts(fig)["line"].set_ydata(a * x)
        return fig

:func:`render_png` draws such a figure: the first time in full, after which it
keeps a picture of everything that is not ``changing`` (the *background*: axes,
ticks, labels, legends) and, on each update, pastes that picture back and draws
only the changing artists over it. A background is kept per state of the axes
(limits, scales, titles and labels), so an update that changes a limit draws
in full once and reuses the picture when the limit comes back; a drawing
function whose limits move between a few values can draw those pictures when
it builds the figure, with :func:`keep_background`. Anything else an update
changes must be registered with :func:`changing`. The layout
(constrained layout) is computed on the first drawing and then kept, so the
axes do not move between updates or frames. Text is what matplotlib draws
slowest: the changing texts are drawn with their layouts and glyph pictures
kept from one update to the next, and :func:`text_fields` redraws only the
numbers of a line of text (each field from its place in pixels and its
strings' glyph pictures, kept: no layout by matplotlib on an update).

Live updates: continuous or on release
--------------------------------------
:func:`live_update` declares, in the drawing function, when its live sliders
redraw. ``"continuous"``: on every value while a slider is dragged. The widget
manager keeps at most one update message of a slider in flight and merges the
values that arrive meanwhile, so a slow update drops the intermediate values and
the latest one wins; the figure never works through a backlog. ``"release"``:
once, when the slider is let go. Without a declaration, an updatable function
updates continuously and one that builds a new figure on every call (slow) on
release.
"""

from __future__ import annotations

import inspect
import io
import itertools
import math
import numbers
import os
import struct
import time
import zlib
from collections import OrderedDict

import numpy as np
from typing import Callable, Mapping, Sequence

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
_FIELD = "_fixedstate_field"


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

def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _encode_png(rgba, size, colors: int | None) -> bytes:
    """PNG bytes of an RGBA buffer ``(width, height)``: quantised to ``colors`` colours (small), or fast (``None``).

    The fast form writes the PNG itself, RGB rows without filters, deflated at
    level 1: about twice as fast as Pillow's encoder (which tries a filter per
    row) for a file about as small, which matters for a live slider.
    """
    width, height = size
    rgb = np.frombuffer(rgba, dtype=np.uint8).reshape(height, width, 4)[:, :, :3]
    if not colors:
        rows = np.zeros((height, 3 * width + 1), dtype=np.uint8)  # each row: filter type 0, then RGB
        rows[:, 1:].reshape(height, width, 3)[...] = rgb  # one copy, through a view of the rows
        header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
        return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
                + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + _png_chunk(b"IEND", b""))
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(rgb)).quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    img.save(out, format="png", optimize=True)
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
    fig.savefig(buf, format="png", dpi=dpi, **({} if colors else {"pil_kwargs": {"compress_level": 1}}))
    plt.close(fig)
    if not colors:
        return buf.getvalue()
    buf.seek(0)
    img = Image.open(buf).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    img.save(out, format="png", optimize=True)
    return out.getvalue()


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
            setattr(artist, _FIELD, {})  # drawn by _TextCache.draw_field: its place in pixels is kept
    changing(fig, *fields)
    return fields


class _TextCache:
    """Text layouts and glyph pictures kept between updates, for the changing texts.

    matplotlib (3.11) lays out (shapes) a text and renders each of its glyphs
    anew every time it draws it, which makes text the slowest part of an
    update. While the changing artists are drawn, the Agg renderer's text
    routines are replaced by ones that keep the layout of each string and the
    picture of each glyph (per font, size and position within a pixel, to a
    quarter pixel: an offset too small to see) and paste the kept pictures.
    Rotated text and mathtext go the usual way, as does everything if this
    matplotlib lacks the private routines (the cache then turns itself off).
    """

    max_entries = 50_000

    def __init__(self):
        self.glyphs: dict = {}
        self.layouts: dict = {}
        self.enabled = True

    def install(self, renderer) -> bool:
        from matplotlib.backends.backend_agg import RendererAgg

        if not (self.enabled and isinstance(renderer, RendererAgg)
                and hasattr(RendererAgg, "_draw_text_glyphs_and_boxes") and hasattr(RendererAgg, "_prepare_font")):
            return False
        draw_glyphs_as_usual = RendererAgg._draw_text_glyphs_and_boxes
        draw_text_as_usual = RendererAgg.draw_text
        cache = self

        def draw_glyphs(gc, x, y, angle, glyphs, boxes):
            if angle % 360 or boxes or not cache.enabled:
                return draw_glyphs_as_usual(renderer, gc, x, y, angle, glyphs, boxes)
            glyphs = list(glyphs)
            try:
                cache.draw_glyphs(renderer, gc, x, y, glyphs)
            except Exception:  # a matplotlib whose private routines differ: draw as it does
                cache.enabled = False
                draw_glyphs_as_usual(renderer, gc, x, y, angle, glyphs, boxes)

        def draw_text(gc, x, y, s, prop, angle, ismath=False, mtext=None):
            if ismath or angle % 360 or not cache.enabled:
                return draw_text_as_usual(renderer, gc, x, y, s, prop, angle, ismath, mtext)
            try:
                glyphs = cache.layout(renderer, s, prop, mtext)
            except Exception:
                cache.enabled = False
                return draw_text_as_usual(renderer, gc, x, y, s, prop, angle, ismath, mtext)
            draw_glyphs(gc, x, y, angle, glyphs, [])

        renderer._draw_text_glyphs_and_boxes = draw_glyphs
        renderer.draw_text = draw_text
        return True

    def draw_field(self, renderer, text) -> None:
        """Draw a field of :func:`text_fields` (a one-line, left-aligned Annotation) from the kept glyphs.

        Where the field's text starts, in pixels, is worked out by matplotlib
        (positions, layout) the first time and again whenever what places it
        changes (the axes' box, the field's anchor and offset, the canvas, the
        font); in between, a draw is the kept layout of the string and its kept
        glyph pictures at that point, the same pixels ``Text.draw`` would give
        through this cache, without its per-draw layout and transforms. Text that
        this cannot draw so (several lines, mathtext, rotated, a box, path
        effects, TeX) is drawn as usual.
        """
        import matplotlib.colors as mcolors

        s = text.get_text()
        if not text.get_visible() or not s:
            return
        if ("\n" in s or "$" in s or text.get_rotation() % 360 or text.get_bbox_patch() is not None
                or text.get_path_effects() or text.get_usetex() or not self.enabled):
            text.draw(renderer)
            return
        place = getattr(text, _FIELD)
        ax = text.axes
        key = (renderer.width, renderer.height, renderer.dpi, None if ax is None else tuple(ax.bbox.bounds),
               tuple(text.xy), tuple(text.xyann), text.xycoords, text.anncoords, text.get_ha(), text.get_va(),
               text.get_fontproperties())
        if place.get("key") != key:
            text.update_positions(renderer)
            if not text._check_xy(renderer):
                text.draw(renderer)
                return
            _, info, _ = text._get_layout(renderer)
            posx, posy = text.get_transform().transform(text.get_unitless_position())
            (dx, dy) = info[0][2]
            y = dy + posy
            place.clear()
            place.update(key=key, x=dx + posx, y=renderer.get_canvas_width_height()[1] - y if renderer.flipy() else y,
                         strings={})
        gc = renderer.new_gc()
        gc.set_foreground(mcolors.to_rgba(text.get_color()), isRGBA=True)
        gc.set_alpha(text.get_alpha())
        gc.set_antialiased(text._antialiased)
        gc.set_snap(text.get_snap())
        text._set_gc_clip(gc)
        try:
            strings = place["strings"]  # each string's glyph pictures and where they go, kept with the place
            pictures = strings.get((s, gc.get_antialiased()))
            if pictures is None:
                if len(strings) > 4096:
                    strings.clear()
                pictures = strings[s, gc.get_antialiased()] = self.pictures(
                    renderer, gc.get_antialiased(), place["x"], place["y"],
                    self.layout(renderer, s, text.get_fontproperties(), text))
            self.paste(renderer, gc, pictures)
        except Exception:  # a matplotlib whose private routines differ: draw as it does
            self.enabled = False
            text.draw(renderer)
        finally:
            gc.restore()
        text.stale = False

    @staticmethod
    def uninstall(renderer) -> None:
        renderer.__dict__.pop("_draw_text_glyphs_and_boxes", None)
        renderer.__dict__.pop("draw_text", None)

    def layout(self, renderer, s, prop, mtext) -> tuple:
        """The glyphs of ``s`` as matplotlib's ``draw_text`` passes them on, laid out once per string and font."""
        from matplotlib.backends.backend_agg import get_hinting_flag

        features = mtext.get_fontfeatures() if mtext is not None else None
        language = mtext.get_language() if mtext is not None else None
        size = prop.get_size_in_points()
        key = (s, tuple(prop.get_family()), prop.get_style(), prop.get_variant(), prop.get_weight(),
               prop.get_stretch(), size, prop.get_file(), renderer.dpi, get_hinting_flag(),
               None if features is None else tuple(features), language)
        glyphs = self.layouts.get(key)
        if glyphs is None:
            if len(self.layouts) > self.max_entries:
                self.layouts.clear()
            font = renderer._prepare_font(prop)
            items = font._layout(s, flags=get_hinting_flag(), features=features, language=language)
            glyphs = self.layouts[key] = tuple((item.ft_object, size, item.glyph_index, 0, 1, item.x, item.y)
                                               for item in items)
        return glyphs

    def draw_glyphs(self, renderer, gc, x, y, glyphs) -> None:
        self.paste(renderer, gc, self.pictures(renderer, gc.get_antialiased(), x, y, glyphs))

    @staticmethod
    def paste(renderer, gc, pictures) -> None:
        for buffer, left, bottom in pictures:
            renderer._renderer.draw_text_image(buffer, left, bottom, 0, gc)

    def pictures(self, renderer, antialiased, x, y, glyphs) -> list:
        """The glyph pictures of laid-out ``glyphs`` at ``(x, y)``, each with where it goes: ``(buffer, left, bottom)``."""
        from matplotlib.backends.backend_agg import get_hinting_flag
        from matplotlib.ft2font import RenderMode

        flags = get_hinting_flag()
        height = renderer.height
        if len(self.glyphs) > self.max_entries:
            self.glyphs.clear()
        pictures = []
        for font, size, index, slant, extend, dx, dy in glyphs:
            # the pen position in 1/64 pixel (as matplotlib passes it to FreeType), to a quarter pixel
            px = round(round(0x40 * (x + dx)) / 16) * 16
            py = round(round(0x40 * (height - y + dy)) / 16) * 16
            key = (font.fname, font.face_index, size, renderer.dpi, index, px % 64, py % 64, flags, antialiased,
                   slant, extend)
            kept = self.glyphs.get(key)
            if kept is None:
                font.set_size(size, renderer.dpi)
                font._set_transform([[round(0x10000 * extend), round(0x10000 * extend * slant)], [0, 0x10000]],
                                    [px % 64, py % 64])
                bitmap = font._render_glyph(index, flags, RenderMode.NORMAL if antialiased else RenderMode.MONO)
                buffer = np.array(bitmap.buffer, copy=True)
                if not antialiased:
                    buffer *= 0xff
                kept = self.glyphs[key] = (buffer, bitmap.left, bitmap.top)
            buffer, left, top = kept
            pictures.append((buffer, left + px // 64, int(height) - (top + py // 64) + buffer.shape[0]))
        return pictures


_TEXT = _TextCache()


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
        renderer = canvas.get_renderer()
        cached = _TEXT.install(renderer)
        try:
            for artist in moving:
                if artist.get_visible() and artist.figure is fig:
                    if cached and hasattr(artist, _FIELD):
                        _TEXT.draw_field(renderer, artist)
                    else:
                        fig.draw_artist(artist)
        finally:
            if cached:
                _TEXT.uninstall(renderer)

    def png(self, colors: int | None) -> bytes:
        self.draw()
        return _encode_png(self.canvas.buffer_rgba(), self.canvas.get_width_height(physical=True), colors)


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
    return len(list(itertools.product(*_check_params(params).values())))
