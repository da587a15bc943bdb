"""The interactive-figure helper: live in Jupyter, precomputed frames for the HTML book."""

import ipywidgets as widgets
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from fixedstate.figures import (bar_heights, book_style, figure_parts, figure_png, grid_size,  # noqa: E402
                                interactive_figure)


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
    box.children[0].value = 2
    assert calls == [(1, "x"), (2, "x")]
    assert image.value != first
    assert box.render_seconds >= 0 and box.renders == 2 and box.values == {"a": 2, "b": "x"}


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
from fixedstate import recall_lab  # noqa: E402
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
    for ax in fig.axes:  # every bar inside its panel
        low, high = ax.get_xlim()
        xs = np.concatenate([p.vertices[:, 0] for c in ax.collections for p in c.get_paths()])
        assert low < xs.min() and xs.max() < high
    plt.close(fig)


def _lab_bars(fig):
    return figure_parts(fig)["bars"]


def test_draw_lab_shows_each_keys_error_and_colour():
    fig = frc.draw_lab("linear", 12, 0.3, d_k=8, seed=2)
    result, _ = recall_lab.update("linear", 12, 8, 0.3, seed=2)
    bars = _lab_bars(fig)
    assert bars in fig.axes[0].collections
    assert np.allclose(bar_heights(bars), result.errors, rtol=1e-12)
    red = [c[0] > 0.7 and c[1] < 0.3 for c in bars.get_facecolor()]
    assert red == list(~result.correct)
    plt.close(fig)


def test_draw_lab_uses_the_value_width():
    fig = frc.draw_lab("linear", 12, 0.0, 32, d_k=8, seed=2)
    result, curve = recall_lab.update("linear", 12, 8, 0.0, d_v=32, seed=2)
    assert np.allclose(bar_heights(_lab_bars(fig)), result.errors, rtol=1e-12)
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
    curve = rc.capacity_curve(8, recall_lab.n_values(8), overlap=0.3, n_seeds=2)
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


# ----------------------------------------------------------------------------- live sliders over a range

from fixedstate.figures import (changing, live_update, new_figure, render_png,  # noqa: E402
                                set_bar_heights, bar_collection, text_fields)

FOUR_WRITES_GRID = {"gate": [1.0, 0.9, 0.75, 0.5], "beta": [0.25, 0.5, 0.75, 1.0], "overlap": [0.0, 0.5, 0.9]}


def test_live_sliders_cover_the_range_of_their_values_and_buttons_stay_buttons():
    box = interactive_figure(draw, {"a": [1, 2, 3]}, mode="live")
    assert isinstance(box.controls["a"], widgets.IntSlider)
    assert (box.controls["a"].min, box.controls["a"].max, box.controls["a"].step) == (1, 3, 1)
    box = interactive_figure(fdr.draw_four_writes, FOUR_WRITES_GRID, initial={"gate": 0.9}, mode="live")
    gate = box.controls["gate"]
    assert isinstance(gate, widgets.FloatSlider) and not isinstance(gate, widgets.FloatLogSlider)
    assert (gate.min, gate.max, gate.value) == (0.5, 1.0, 0.9)
    for name, values in FOUR_WRITES_GRID.items():  # every listed value is a position of its slider
        ctl = box.controls[name]
        assert all(abs((v - ctl.min) / ctl.step - round((v - ctl.min) / ctl.step)) < 1e-9 for v in values)
        assert 10 <= (ctl.max - ctl.min) / ctl.step <= 200
    box = interactive_figure(draw, {"a": [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0], "b": ["x", "y"]},
                             initial={"a": 1.0}, mode="live")
    a = box.controls["a"]  # values spread over decades: a logarithmic slider
    assert isinstance(a, widgets.FloatLogSlider) and (a.min, a.max, a.value) == (-2, 1, 1.0)
    assert isinstance(box.controls["b"], widgets.ToggleButtons)
    box.controls["a"].value = 10 ** -1.55
    assert box.values["a"] == pytest.approx(10 ** -1.55, rel=1e-3)


def test_frames_mode_keeps_the_grid():
    box = interactive_figure(fdr.draw_four_writes, {"gate": [1.0, 0.5], "beta": [1.0], "overlap": [0.5]},
                             mode="frames")
    assert isinstance(box.controls["gate"], widgets.SelectionSlider)
    assert [v for _, v in box.controls["gate"].options] == [1.0, 0.5] and box.frame_count == 2


def _four_writes_heights(fig, name):
    parts = figure_parts(fig)
    return bar_heights(parts["linear"][name]), bar_heights(parts["delta"][name])


def test_live_four_writes_redraws_at_a_value_between_the_grid_points():
    box = interactive_figure(fdr.draw_four_writes, FOUR_WRITES_GRID,
                             initial={"gate": 1.0, "beta": 1.0, "overlap": 0.5}, mode="live")
    fig = box.figure
    first = box.image.value
    box.controls["gate"].value = 0.83  # between 0.75 and 0.9
    box.controls["beta"].value = 0.62  # between 0.5 and 0.75
    assert box.values == {"gate": 0.83, "beta": 0.62, "overlap": 0.5}
    assert box.figure is fig, "the figure is built once and updated in place"
    assert box.image.value != first and box.renders == 3
    want = fdr.four_writes(0.83, 0.62, 0.5)
    for name in fdr.FOUR_WRITES_KEYS:
        lin, dlt = _four_writes_heights(fig, name)
        assert np.allclose(lin, want["linear"][name], atol=1e-14)
        assert np.allclose(dlt, want["delta"][name], atol=1e-14)
        err = [f.get_text() for f in figure_parts(fig)["error"][name]]
        assert err == [f"{np.linalg.norm(want[k][name] - want['targets'][name]):.2f}" for k in ("linear", "delta")]
    assert [f.get_text() for f in figure_parts(fig)["settings"]] == ["0.83", "0.62", "0.50"]


def test_live_lab_redraws_at_values_between_the_grid_points():
    box = interactive_figure(frc.draw_lab, {"mechanism": list(rc.MECHANISMS), "n_pairs": [8, 16, 32],
                                            "overlap": [0.0, 0.6], "d_v": [16, 64]},
                             initial={"mechanism": "linear", "n_pairs": 8, "d_v": 16}, mode="live")
    assert isinstance(box.controls["mechanism"], widgets.ToggleButtons)
    assert isinstance(box.controls["n_pairs"], widgets.IntSlider)
    box.controls["n_pairs"].value = 13
    box.controls["overlap"].value = 0.37
    box.controls["d_v"].value = 40
    box.controls["mechanism"].value = "gated_delta"
    fig = box.figure
    result = recall_lab.experiment("gated_delta", 13, 16, 0.37, d_v=40)
    curve = recall_lab.curves(16, 0.37, d_v=40)
    assert np.allclose(bar_heights(_lab_bars(fig)), result.errors, rtol=1e-12)
    assert len(bar_heights(_lab_bars(fig))) == 13
    assert "N = 13" in fig.axes[0].get_title() and "d_v = 40" in fig.axes[0].get_title()
    lines = figure_parts(fig)["curves"]
    for mech in rc.MECHANISMS:
        assert np.array_equal(lines[mech].get_ydata(), curve.accuracy[mech])
    assert lines["gated_delta"].get_linewidth() > lines["linear"].get_linewidth()
    assert figure_parts(fig)["now"].get_xdata()[0] == 13 / 16
    # fewer pairs again: the extra bars go
    box.controls["n_pairs"].value = 9
    assert len(bar_heights(_lab_bars(fig))) == 9


def test_live_capacity_redraws_at_values_between_the_grid_points():
    box = interactive_figure(frc.draw_capacity, {"d_k": [8, 16, 32], "overlap": [0.0, 0.3, 0.6]},
                             initial={"d_k": 16}, mode="live")
    box.controls["d_k"].value = 20
    box.controls["overlap"].value = 0.45
    curve = rc.capacity_curve(20, recall_lab.n_values(20), overlap=0.45)
    parts = figure_parts(box.figure)
    for mech in rc.MECHANISMS:
        assert np.array_equal(parts["accuracy"][mech].get_xdata(), curve.ratios)
        assert np.array_equal(parts["accuracy"][mech].get_ydata(), curve.accuracy[mech])
        assert np.array_equal(parts["error"][mech].get_ydata(), curve.error[mech])
    assert box.figure.axes[0].get_title() == "d_k = 20, overlap 0.45"


def test_each_figure_declares_when_its_live_sliders_redraw():
    expected = {fdr.draw_four_writes: "continuous", frc.draw_lab: "continuous", frc.draw_capacity: "release"}
    for fn, update in expected.items():
        assert fn.live_update == update
        said = "continuous" if update == "continuous" else "on release"
        assert f"Live sliders: {said}" in " ".join(fn.__doc__.split())
    box = interactive_figure(frc.draw_capacity, {"d_k": [8, 16], "overlap": [0.0, 0.3]}, mode="live")
    assert box.live_update == "release" and not box.controls["d_k"].continuous_update
    box = interactive_figure(fdr.draw_four_writes, {"gate": [1.0, 0.5]}, mode="live")
    assert box.live_update == "continuous" and box.controls["gate"].continuous_update
    # a drawing that builds a new figure at every call is slow: it redraws on release
    box = interactive_figure(draw, {"a": [1, 2]}, mode="live")
    assert box.live_update == "release" and not box.controls["a"].continuous_update
    with pytest.raises(ValueError, match="update"):
        live_update("sometimes")


def test_frames_mode_renders_every_frame_from_one_figure():
    figs = []

    def counting(gate=1.0, beta=1.0, overlap=0.5, *, fig=None):
        out = fdr.draw_four_writes(gate, beta, overlap, fig=fig)
        figs.append(out)
        return out

    box = interactive_figure(counting, {"gate": [1.0, 0.5], "beta": [0.5, 1.0]}, mode="frames")
    assert box.frame_count == 4 and len(figs) == 4 and len({id(f) for f in figs}) == 1
    outer = _stacks(box)[0]
    pictures = [img.value for s in outer.children for img in s.children]
    assert len(set(pictures)) == 4 and all(p[:8] == b"\x89PNG\r\n\x1a\n" for p in pictures)


def _pixels(png):
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def test_an_update_in_place_looks_like_a_figure_drawn_afresh():
    book_style()
    fig = fdr.draw_four_writes(1.0, 1.0, 0.5)
    render_png(fig)
    for gate, beta, overlap in [(0.6, 0.3, 0.9), (0.83, 0.62, 0.5)]:
        updated = _pixels(render_png(fdr.draw_four_writes(gate, beta, overlap, fig=fig)))
        fresh = _pixels(render_png(fdr.draw_four_writes(gate, beta, overlap)))
        assert updated.shape == fresh.shape
        differ = np.any(np.abs(updated - fresh) > 60, axis=-1)
        assert differ.mean() < 0.002, f"{differ.sum()} pixels differ"


def test_a_changed_axis_is_drawn_in_full_once_then_its_picture_reused():
    fig, ax = new_figure()
    (line,) = ax.plot([0, 1], [0, 1])
    ax.set_ylim(0, 1)
    changing(fig, line)
    render_png(fig)
    renderer = fig._fixedstate_renderer
    full = renderer.full_draws
    line.set_ydata([0, 0.5])
    render_png(fig)
    assert renderer.full_draws == full, "only the line changed: the background is reused"
    ax.set_ylim(0, 2)
    render_png(fig)
    assert renderer.full_draws == full + 1
    ax.set_ylim(0, 1)  # back to the first limits: their picture is kept
    render_png(fig)
    assert renderer.full_draws == full + 1


def test_bar_collection_and_text_fields():
    fig, ax = new_figure()
    bars = bar_collection(ax, [1, 2, 3], [0.5, -1.0, 2.0], width=0.5)
    assert np.allclose(bar_heights(bars), [0.5, -1.0, 2.0])
    set_bar_heights(bars, [3.0, 4.0], x=[5, 6])
    assert np.allclose(bar_heights(bars), [3.0, 4.0])
    assert np.allclose(bars.get_paths()[0].vertices[:4, 0], [4.75, 4.75, 5.25, 5.25])
    fields = text_fields(ax, "error: linear {}, delta {}", ("0.00", "0.00"))
    assert len(fields) == 2 and all(f in changing(fig) for f in fields)
    x0, x1 = (f.get_window_extent(fig.canvas.get_renderer()).x0 for f in fields)
    assert x0 < x1
    with pytest.raises(ValueError, match="widest"):
        text_fields(ax, "{} and {}", ("0",))


def test_layer_diagrams_draw_every_box_and_refuse_an_unknown_layer():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    from fixedstate.figures.layers import LAYER_DIAGRAMS, draw_layer

    for name, spec in LAYER_DIAGRAMS.items():
        fig = draw_layer(name)
        ax = fig.axes[0]
        boxes = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
        arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
        assert len(boxes) == len(spec["nodes"]) and len(arrows) == len(spec["edges"])
        labels = {t.get_text() for t in ax.texts}
        assert {label for _, _, label, _ in spec["nodes"].values()} <= labels
        assert all(a in spec["nodes"] and b in spec["nodes"] for a, b in spec["edges"])
        plt.close(fig)
    with pytest.raises(ValueError, match="name"):
        draw_layer("transformer")


def _canvas_rgb(fig) -> np.ndarray:
    return np.asarray(fig.canvas.buffer_rgba())[:, :, :3].copy()


def test_text_fields_drawn_over_the_kept_background_are_the_pixels_of_a_full_drawing():
    # an update pastes the kept background and draws the fields over it; drawing the whole figure afresh,
    # fields included, gives the same pixels, also after the axes move (a new background is drawn)
    fig, ax = new_figure(figsize=(3, 2))
    ax.plot([0, 1], [0, 1])
    fields = text_fields(ax, "error: linear {}, delta {}", ("0.00", "0.00"), fontsize=9)
    pictures = []
    for a, b, position in [("0.12", "1.00", None), ("-0.5", "0.00", None), ("0.12", "1.00", None),
                           ("gy", "", None), ("gy", "", [0.3, 0.2, 0.5, 0.5])]:
        fields[0].set_text(a)
        fields[1].set_text(b)
        if position is not None:
            ax.set_position(position)
        pictures.append(render_png(fig))
        updated = _canvas_rgb(fig)
        assert np.array_equal(_pixels(pictures[-1]), updated), "the PNG holds the canvas's pixels"
        for field in fields:
            field.set_animated(False)
        fig.canvas.draw()
        for field in fields:
            field.set_animated(True)
        assert np.array_equal(updated, _canvas_rgb(fig)), f"fields {a!r}, {b!r}: the update differs from a full drawing"
    assert pictures[0] == pictures[2] and len(set(pictures)) == 4  # the pictures differ where the texts or axes do


def _png_chunks(data: bytes) -> list[bytes]:
    import struct

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    kinds, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kinds.append(data[at + 4:at + 8])
        at += 12 + length
    assert at == len(data) and kinds[-1] == b"IEND"
    return kinds


@pytest.mark.parametrize("colors", [None, 16])
def test_pictures_are_pngs_of_the_pixels_alone(colors):
    # no time stamp, no software name, no text: the bytes depend on the pixels only (deterministic frames)
    fig, ax = new_figure(figsize=(2, 1.5))
    (line,) = ax.plot([0, 1], [0, 1])
    ax.set_title("a title")
    changing(fig, line)
    picture = render_png(fig, colors=colors)
    drawn = figure_png(draw(2, "y"), colors=colors)
    for data in (picture, drawn):
        assert set(_png_chunks(data)) <= {b"IHDR", b"PLTE", b"pHYs", b"IDAT", b"IEND"}  # pHYs: the dpi
    pixels = _pixels(picture)
    if colors is None:
        assert np.array_equal(pixels, _canvas_rgb(fig))
    else:
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) <= colors
    assert render_png(fig, colors=colors) == picture  # the same figure, the same bytes

# ----------------------------------------------------------------------------- the figures of chapters 1, 2, 4, 6

import functools  # noqa: E402

from fixedstate import costs  # noqa: E402
from fixedstate import hybrid as hy  # noqa: E402
from fixedstate import ssm  # noqa: E402
from fixedstate.figures import hybrid as fhy  # noqa: E402
from fixedstate.figures import keep_background  # noqa: E402
from fixedstate.figures import linear_attention as fla  # noqa: E402
from fixedstate.figures import softmax_attention as fsm  # noqa: E402
from fixedstate.figures import ssm as fssm  # noqa: E402

KV_GRID = {"kv_heads": [32, 8, 1], "bytes_per_number": [4, 2, 1, 0.5]}
CROSSOVER_GRID = {"r": [32, 64, 128, 256, 512], "softmax_count": ["full square", "causal half"]}
SELECTIVITY_GRID = {"step_token8": [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0], "step_others": [0.1, 0.5]}
MEMORY_GRID = {"every": [1, 2, 4, 8, 16, 64]}


def _selectivity_inputs():
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(size=16) * 0.5, 2)
    x[8] = 3.0
    return dict(x=x, A=np.array([[-0.5, -1.0, -2.0]]), B=np.ones((16, 3)), C=np.ones((16, 3)) / 3)


def test_live_kv_redraws_at_values_between_the_grid_points():
    box = interactive_figure(fsm.draw_kv, KV_GRID, initial={"kv_heads": 32, "bytes_per_number": 2}, mode="live")
    fig = box.figure
    assert isinstance(box.controls["kv_heads"], widgets.IntSlider)
    box.controls["kv_heads"].value = 13  # between 8 and 32
    box.controls["bytes_per_number"].value = 1.35  # between 1 and 2
    assert box.values == {"kv_heads": 13, "bytes_per_number": 1.35} and box.figure is fig
    want = costs.kv_cache_bytes(fsm.KV_CONTEXT, n_layers=32, n_kv_heads=13, head_dim=128,
                                bytes_per_element=1.35) / 1e9
    line = figure_parts(fig)["line"]
    assert np.array_equal(line.get_xdata(), fsm.KV_CONTEXT / 1e3)
    assert np.allclose(line.get_ydata(), want, rtol=1e-15, atol=0)
    assert [f.get_text() for f in figure_parts(fig)["title"]] == ["13", "1.35"]


def test_live_crossover_redraws_at_values_between_the_grid_points():
    box = interactive_figure(fla.draw_crossover, CROSSOVER_GRID, initial={"r": 128}, mode="live")
    fig = box.figure
    assert isinstance(box.controls["r"], widgets.IntSlider)
    assert isinstance(box.controls["softmax_count"], widgets.ToggleButtons)
    box.controls["r"].value = 300  # between 256 and 512
    box.controls["softmax_count"].value = "causal half"
    parts = figure_parts(fig)
    T = fla.CROSSOVER_LENGTHS
    assert np.allclose(parts["linear"].get_ydata(), costs.linear_attention_flops(T, 300, 128) / 1e6, rtol=1e-15)
    assert np.allclose(parts["softmax"].get_ydata(),
                       costs.softmax_attention_flops(T, 128, 128, causal=True) / 1e6, rtol=1e-15)
    cross = costs.crossover_length(300, 128, 128, causal=True)
    assert list(parts["crossover"].get_xdata()) == [cross, cross]
    assert [f.get_text() for f in parts["title"]] == ["300", "causal half", str(cross)]
    with pytest.raises(ValueError, match="softmax_count"):
        fla.draw_crossover(64, "half")


def test_selectivity_states_step_token_by_token_and_in_a_batch():
    inputs = _selectivity_inputs()
    states = fssm.selectivity_states(**inputs, step_token8=2.5, step_others=0.23)
    h = np.zeros((1, 3))
    for t in range(16):
        delta = np.array([2.5 if t == 8 else 0.23])
        _, h = ssm.selective_scan_step(inputs["x"][t:t + 1], delta, inputs["A"], inputs["B"][t], inputs["C"][t],
                                       initial_state=h)
        assert np.array_equal(states[t], h[0])
    batch = fssm.selectivity_states(**inputs, step_token8=np.array([[0.1], [2.5]]),
                                    step_others=np.array([[0.23, 0.5]]))
    assert batch.shape == (2, 2, 16, 3)
    assert np.allclose(batch[1, 0], states, rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match="x"):
        fssm.selectivity_states(np.ones(5), inputs["A"], inputs["B"], inputs["C"], 1.0, 0.5)


def test_live_selectivity_redraws_at_values_between_the_grid_points():
    inputs = _selectivity_inputs()
    draw = functools.partial(fssm.draw_selectivity, **inputs)
    box = interactive_figure(draw, SELECTIVITY_GRID, initial={"step_token8": 1.0, "step_others": 0.5}, mode="live")
    assert box.live_update == "continuous" and box.controls["step_token8"].continuous_update
    assert isinstance(box.controls["step_token8"], widgets.FloatLogSlider)
    fig = box.figure
    for s8, so in [(2.0, 0.5), (2.0, 0.23), (0.0446, 0.23)]:  # off the grid (0.0446 is a value the live slider offers)
        box.controls["step_token8"].value = s8
        box.controls["step_others"].value = so
        assert box.values["step_token8"] == s8 and box.values["step_others"] == so
        want = fssm.selectivity_states(**inputs, step_token8=s8, step_others=so)
        for line, column in zip(figure_parts(fig)["states"], want.T):
            assert np.allclose(line.get_ydata(), column, rtol=1e-13, atol=1e-15)
        low, high = fig.axes[1].get_ylim()
        assert low <= want.min() and want.max() <= high
        kept, written = (f.get_text() for f in figure_parts(fig)["title"])
        assert kept == f"{np.exp(-0.5 * s8):.3f}" and written == f"{s8 * 3.0:.3g}"


def test_live_memory_redraws_at_values_between_the_grid_points():
    box = interactive_figure(fhy.draw_memory, MEMORY_GRID, initial={"every": 4}, mode="live")
    fig = box.figure
    assert isinstance(box.controls["every"], widgets.IntSlider)
    for every, attention in [(3, 10), (40, 0)]:  # 3: layers 2, 5, ..., 29; 40: past the end of the stack
        box.controls["every"].value = every
        config = hy.with_layout(hy.qwen35_9b_config(), hy.every_nth_layer(32, every) if every <= 32 else ())
        assert len(config.attention_layers) == attention
        kv = hy.stack_kv_cache_bytes(config, fhy.MEMORY_CONTEXTS) / 2**30
        states = hy.stack_state_bytes(config) / 2**30
        parts = figure_parts(fig)
        assert np.allclose(bar_heights(parts["kv"]), kv, rtol=1e-15)
        assert np.allclose(bar_heights(parts["total"]), kv + states, rtol=1e-15)
    assert fig.axes[0].get_title() == "no attention layer"
    box.controls["every"].value = 3
    assert fig.axes[0].get_title() == "attention in every 3rd layer (10 of 32)"
    assert [fhy.every_nth(n) for n in (1, 2, 4, 11, 12, 13, 21, 22, 23, 64)] == [
        "every layer", "every 2nd layer", "every 4th layer", "every 11th layer", "every 12th layer",
        "every 13th layer", "every 21st layer", "every 22nd layer", "every 23rd layer", "every 64th layer"]


def test_the_chapter_figures_declare_when_their_live_sliders_redraw_and_keep_their_frames():
    for fn in (fsm.draw_kv, fla.draw_crossover, fssm.draw_selectivity, fhy.draw_memory):
        assert fn.live_update == "continuous"
        assert "Live sliders: continuous" in " ".join(fn.__doc__.split())
    draw = functools.partial(fssm.draw_selectivity, **_selectivity_inputs())
    box = interactive_figure(draw, {"step_token8": [0.01, 1.0, 10.0], "step_others": [0.5]}, mode="frames")
    outer = _stacks(box)[0]
    pictures = [img.value for s in outer.children for img in s.children]
    assert box.frame_count == 3 and len(set(pictures)) == 3


def test_kept_backgrounds_spare_the_full_drawings():
    draw = functools.partial(fssm.draw_selectivity, **_selectivity_inputs())
    fig = draw(0.01, 0.5)
    renderer = fig._fixedstate_renderer
    full = renderer.full_draws
    for s8 in (0.01, 0.3, 1.0, 3.0, 10.0):  # the state axis moves through its limits
        render_png(draw(s8, 0.5, fig=fig))
    assert renderer.full_draws == full, "every limit of the state axis was drawn when the figure was built"
    fig2, ax = new_figure()
    keep_background(fig2)
    assert fig2._fixedstate_renderer.full_draws == 1
