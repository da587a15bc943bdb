"""Figures that work with a kernel and without one, and each chapter's drawing code.

This package holds everything that draws; the cores never import matplotlib.
One submodule per chapter module holds that chapter's drawing functions:

- :mod:`fixedstate.figures.softmax_attention`: ``draw_kv`` (chapter 1);
- :mod:`fixedstate.figures.linear_attention`: ``draw_crossover`` (chapter 2);
- :mod:`fixedstate.figures.delta_rule`: ``four_writes``, ``draw_four_writes`` (chapter 3);
- :mod:`fixedstate.figures.ssm`: ``selectivity_states``, ``draw_selectivity`` (chapter 4);
- :mod:`fixedstate.figures.recall`: ``draw_lab``, ``draw_capacity`` (chapter 5);
- :mod:`fixedstate.figures.hybrid`: ``stack_memory_gib``, ``draw_memory`` (chapter 6);
- :mod:`fixedstate.figures.training`: ``recall_frontier_figure``, the recall sweep's
  accuracy against the state kept, with the fixed-state frontier (chapter 9; static).

The helpers below serve every chapter (the drawing engine,
:mod:`fixedstate.figures.engine`, re-exported here; it draws with matplotlib's
public API and writes PNGs with Pillow): :func:`book_style`,
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
slowest: :func:`text_fields` keeps the words of a line of text in the
background and redraws only its numbers.

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


from .engine import (FIGURE_MODES, LIVE_UPDATES, bar_collection, bar_heights, book_style, changing, figure_parts,
                     figure_png, grid_size, interactive_figure, keep_background, live_update, new_figure,
                     render_png, set_bar_heights, text_fields)

__all__ = ["book_style", "interactive_figure", "figure_png", "render_png", "new_figure", "changing",
           "text_fields", "bar_collection", "set_bar_heights", "bar_heights", "figure_parts", "live_update",
           "keep_background",
           "grid_size", "FIGURE_MODES", "LIVE_UPDATES"]
