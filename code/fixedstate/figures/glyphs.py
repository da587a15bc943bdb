"""The glyph cache: text layouts and glyph pictures kept between the updates of a live figure.

Text is what matplotlib draws slowest. :class:`TextCache` keeps, for the texts a
live update changes, the layout of each string and the picture of each glyph, and
pastes the kept pictures; it works by replacing two private text routines of
matplotlib's Agg renderer while the changing artists are drawn, and turns itself
off (matplotlib draws as usual) if this matplotlib lacks them.
:func:`fixedstate.figures.engine.text_fields` marks the fields it draws.

Why it is kept (issue #29 asked to keep it only if the sliders need it):
``make bench-figures`` on 2 December 2026, on the shared two-core machine the
book is built on, under a load average of 9 to 27 (other jobs running), the
minimum over two sweeps of each figure. Wall-clock 95th percentiles there are
ruled by the waits for a processor, so the processor time of an update
(``cpu95``, near what an update takes on an idle machine) separates the
variants. With the cache against without it (the hand-written PNG encoder in
both), cpu95 in ms: draw_kv 4.4 / 5.9, draw_crossover 5.6 / 8.6,
draw_four_writes 10.2 / 20.2, draw_selectivity 8.9 / 8.7, draw_lab 19.2 / 28.9,
draw_capacity 23.9 / 24.1, draw_memory 6.7 / 7.5; with neither speed-up,
draw_four_writes 27.5 and draw_capacity 35.9. The cache halves the processor time
of the figures whose updates are mostly text (draw_four_writes, draw_crossover)
and takes a third off draw_lab's. No figure's cpu95 passes 50 ms without it, but
with one other job on each core an update's wall-clock time is about twice its
processor time, and draw_lab (29 ms without the cache, 19 with it) then misses
50 ms without it and meets it with it: that, on the machine the book is built on,
is why it is kept. A sweep on a quiet machine should confirm it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TextCache", "TEXT_CACHE", "FIELD"]

#: The attribute that marks a Text artist as a field of :func:`~fixedstate.figures.engine.text_fields`.
FIELD = "_fixedstate_field"


class TextCache:
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
        place = getattr(text, FIELD)
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


#: The one cache the renderer of every live figure uses (``TEXT_CACHE.enabled = False`` turns it off).
TEXT_CACHE = TextCache()
