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


# ----------------------------------------------------------------------------- chapter figures

import numpy as np  # noqa: E402

from fixedstate import recall as rc  # noqa: E402
from fixedstate.figures import delta_rule as fdr  # noqa: E402
from fixedstate.figures import recall as frc  # noqa: E402


@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.9])
def test_four_writes(overlap):
    res = fdr.four_writes(gate=1.0, beta=1.0, overlap=overlap)
    e = np.eye(4)
    # linear attention piles up: old + new value of a, plus overlap times c's value
    assert np.allclose(res["linear"]["a"], e[0] + e[3] + overlap * e[2], atol=1e-14)
    assert np.allclose(res["linear"]["b"], e[1], atol=1e-14)
    # the delta rule with beta 1 recalls a's new value exactly, and b is untouched
    assert np.allclose(res["delta"]["a"], e[3], atol=1e-14)
    assert np.allclose(res["delta"]["b"], e[1], atol=1e-14)
    # c is disturbed exactly when it overlaps a
    assert np.allclose(res["delta"]["c"], e[2], atol=1e-14) == (overlap == 0.0)
    assert set(res["linear"]) == set(fdr.FOUR_WRITES_KEYS)


def test_four_writes_gate_fades_b():
    g = 0.5
    res = fdr.four_writes(gate=g, beta=1.0, overlap=0.5)
    # b was written second, then two more steps of decay (its key is orthogonal to a and c)
    assert np.allclose(res["delta"]["b"], g ** 2 * np.eye(4)[1], atol=1e-14)


@pytest.mark.parametrize("kwargs, name", [({"gate": 0.0}, "gate"), ({"gate": 1.5}, "gate"),
                                          ({"overlap": -0.1}, "overlap")])
def test_four_writes_refuses_bad_sliders(kwargs, name):
    with pytest.raises(ValueError, match=name):
        fdr.four_writes(**kwargs)


def test_draw_four_writes_has_three_panels():
    fig = fdr.draw_four_writes(0.9, 0.5, 0.5)
    assert len(fig.axes) == 3 and [ax.get_title().split("\n")[0] for ax in fig.axes] == [
        "recall of a", "recall of b", "recall of c"]
    plt.close(fig)


def test_draw_lab_shows_each_keys_error_and_colour():
    fig = frc.draw_lab("linear", 12, 0.3, d_k=8, seed=2)
    result, _ = rc.lab_update("linear", 12, 8, 0.3, seed=2)
    bars = fig.axes[0].patches
    assert len(bars) == 12
    assert np.allclose([b.get_height() for b in bars], result.errors, rtol=1e-12)
    red = [b.get_facecolor()[0] > 0.7 and b.get_facecolor()[1] < 0.3 for b in bars]
    assert red == list(~result.correct)
    plt.close(fig)


def test_draw_lab_uses_the_value_width():
    fig = frc.draw_lab("linear", 12, 0.0, 32, d_k=8, seed=2)
    result, curve = rc.lab_update("linear", 12, 8, 0.0, d_v=32, seed=2)
    assert np.allclose([b.get_height() for b in fig.axes[0].patches], result.errors, rtol=1e-12)
    assert "d_v = 32" in fig.axes[0].get_title()
    lines = fig.axes[1].get_lines()
    assert np.array_equal(lines[1].get_ydata(), curve.accuracy["linear"])
    plt.close(fig)
    # the default d_v is d_k
    fig = frc.draw_lab("linear", 12, 0.3, d_k=8, seed=2)
    assert "d_v = 8" in fig.axes[0].get_title()
    plt.close(fig)


def test_draw_capacity_draws_every_mechanism():
    fig = frc.draw_capacity(8, 0.3, n_seeds=2)
    curve = rc.capacity_curve(8, rc.lab_n_values(8), overlap=0.3, n_seeds=2)
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines[:len(rc.MECHANISMS)]] == [
        frc.LAB_MECHANISM_LABELS[m] for m in rc.MECHANISMS]
    for line, m in zip(lines, rc.MECHANISMS):
        assert np.array_equal(line.get_ydata(), curve.accuracy[m])
    plt.close(fig)


def test_cores_do_not_import_matplotlib():
    import pathlib

    package = pathlib.Path(rc.__file__).parent
    drawing = [p.relative_to(package).as_posix() for p in package.rglob("*.py")
               if ("import matplotlib" in p.read_text() or "from matplotlib" in p.read_text())
               and p.parent.name != "figures"]
    assert drawing == []
