"""The interactive-figure helper: live in Jupyter, precomputed frames for the HTML book."""

import ipywidgets as widgets
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from fixedstate.figures import book_style, figure_png, grid_size, interactive_figure  # noqa: E402


def draw(a, b="x"):
    """A figure whose pixels depend on both parameters."""
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1], [0, a])
    ax.set_title(f"{a} {b}")
    return fig


def _stacks(widget):
    return [c for c in widget.children if isinstance(c, widgets.Stack)]


def test_frames_mode_builds_one_image_per_grid_point_and_links_every_stack():
    box = interactive_figure(draw, {"a": [1, 2, 3], "b": ["x", "y"]}, mode="frames")
    assert box.frame_count == 6 == grid_size({"a": [1, 2, 3], "b": ["x", "y"]})
    outer = _stacks(box)[0]
    assert len(outer.children) == 3
    assert all(isinstance(s, widgets.Stack) and len(s.children) == 2 for s in outer.children)
    images = [img.value for s in outer.children for img in s.children]
    assert len(set(images)) == 6, "every grid point must give a different picture"
    # Each stack is tied in the browser to the slider of its level.
    links = box.links
    slider, buttons = box.children[0], box.children[1]
    linked_sources = [(l.source[0], l.target[0]) for l in links]
    assert (slider, outer) in linked_sources
    for inner in outer.children:
        assert (buttons, inner) in linked_sources
    assert isinstance(slider, widgets.SelectionSlider) and isinstance(buttons, widgets.ToggleButtons)


def test_frames_mode_starts_at_the_initial_values():
    box = interactive_figure(draw, {"a": [1, 2, 3], "b": ["x", "y"]}, initial={"a": 2, "b": "y"},
                             mode="frames")
    outer = _stacks(box)[0]
    assert outer.selected_index == 1
    assert all(s.selected_index == 1 for s in outer.children)
    assert box.children[0].value == 2 and box.children[1].value == "y"


def test_live_mode_recomputes_when_a_slider_moves():
    calls = []

    def counting_draw(a, b):
        calls.append((a, b))
        return draw(a, b)

    box = interactive_figure(counting_draw, {"a": [1, 2], "b": ["x", "y"]}, mode="live")
    image = box.children[-1]
    first = image.value
    box.children[0].index = 1
    assert calls == [(1, "x"), (2, "x")]
    assert image.value != first
    assert box.render_seconds >= 0


def test_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("FIXEDSTATE_FIGURES", "frames")
    box = interactive_figure(draw, {"a": [1, 2]})
    assert _stacks(box)
    monkeypatch.setenv("FIXEDSTATE_FIGURES", "live")
    box = interactive_figure(draw, {"a": [1, 2]})
    assert not _stacks(box) and isinstance(box.children[-1], widgets.Image)


@pytest.mark.parametrize("params, match", [
    ({}, "params"),
    ({"a": []}, r"params\['a'\]"),
    ({"a": [1, "x"]}, r"params\['a'\]"),
    ({"a": [1, 1]}, r"params\['a'\]"),
    ({"not valid": [1]}, "params"),
])
def test_bad_params_are_refused_by_name(params, match):
    with pytest.raises(ValueError, match=match):
        interactive_figure(draw, params, mode="live")


def test_bad_mode_initial_and_grid_size_are_refused():
    with pytest.raises(ValueError, match="mode"):
        interactive_figure(draw, {"a": [1]}, mode="static")
    with pytest.raises(ValueError, match="initial"):
        interactive_figure(draw, {"a": [1]}, initial={"a": 5}, mode="live")
    with pytest.raises(ValueError, match="initial"):
        interactive_figure(draw, {"a": [1]}, initial={"z": 1}, mode="live")
    with pytest.raises(ValueError, match="max_frames"):
        interactive_figure(draw, {"a": list(range(11)), "b": list(range(11))}, mode="frames")
    with pytest.raises(ValueError, match="draw"):
        interactive_figure("not callable", {"a": [1]}, mode="live")


def test_figure_png_is_a_small_png_and_closes_the_figure():
    book_style()
    fig = draw(1)
    data = figure_png(fig)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)
    assert len(data) < 20_000
