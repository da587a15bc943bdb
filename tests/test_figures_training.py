"""Chapter 9's figure: recall against the state kept, one panel per length, drawn from a sweep's results."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402

from _examples import examples  # noqa: E402
from test_mqar_stats import QUICK, made_up_results, sweeps  # noqa: E402

from fixedstate import mqar_stats as ms  # noqa: E402
from fixedstate.figures import figure_png  # noqa: E402
from fixedstate.figures import training as ftr  # noqa: E402


def _gid_lines(ax, gid):
    return [line for line in ax.get_lines() if line.get_gid() == gid]


def _check_figure(results, fig, lengths, frontier_mixers=None):
    pairs = dict(ms.tested_lengths(results))
    assert len(fig.axes) == len(lengths)                                 # one panel per length
    for ax, t in zip(fig.axes, lengths):
        assert ax.get_title() == f"T = {t}, {pairs[t]} pairs" and ax.get_xscale() == "log"
        pts = ms.points_at(results, t)
        mixers = list(dict.fromkeys(p["mixer"] for p in pts))
        means = [line.get_gid() for line in ax.get_lines() if str(line.get_gid()).startswith("mean:")]
        assert means == [f"mean:{m}" for m in mixers]                    # one line per mixer
        for m in mixers:
            (line,) = _gid_lines(ax, f"mean:{m}")
            mine = [p for p in pts if p["mixer"] == m]
            assert list(line.get_xdata()) == [p["state_bytes"] for p in mine]
            np.testing.assert_array_equal(line.get_ydata(), [np.nan if p["mean"] is None else p["mean"] for p in mine])
            assert matplotlib.colors.same_color(line.get_color(), ftr.MIXER_COLORS[m])    # one colour per mixer
        (baseline,) = _gid_lines(ax, "baseline")                         # at the stored baseline
        assert list(baseline.get_ydata()) == [results["baselines"][str(t)]["test_set"]] * 2
        front = ms.frontier(results, t, frontier_mixers)
        lines = _gid_lines(ax, "frontier")
        if front:
            (line,) = lines
            assert list(line.get_xdata()) == [f[0] for f in front] + [ax.get_xlim()[1]]
            assert list(line.get_ydata()) == [f[1] for f in front] + [front[-1][1]]
            assert line.get_drawstyle() == "steps-post"
        else:
            assert lines == []
        # every seed that did not diverge is a dot at its accuracy; a diverged one an x at 0
        dots = sorted(float(y) for c in ax.collections for y in c.get_offsets()[:, 1])
        seeds = [(r["mixer"], r["d_model"], r["test_accuracy"]) for r in results["runs"]]
        want = [a[str(t)] for _, _, a in seeds if a is not None]
        want += [0.0] * len({(m, d) for m, d, a in seeds if a is None})
        assert dots == sorted(want)
        left, right = ax.get_xlim()
        assert left < min(p["state_bytes"] for p in pts) and max(p["state_bytes"] for p in pts) < right
        assert ax.get_xticklabels()
        for tick, label in zip(ax.get_xticks(), ax.get_xticklabels()):  # KiB, at powers of two bytes
            kib = float(label.get_text())
            assert kib * 1024 == tick == 2.0 ** round(np.log2(tick)) and left <= tick <= right
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:len(results["settings"]["mixers"])] == [ftr.MIXER_LABELS[m] for m in results["settings"]["mixers"]]
    assert "no retrieval (exact)" in labels
    assert ("fixed-state frontier" in labels) == any(ms.frontier(results, t, frontier_mixers) for t in lengths)


def test_the_figure_of_the_quick_sweep():
    fig = ftr.recall_frontier_figure(QUICK)
    _check_figure(QUICK, fig, [16, 32])
    assert _gid_lines(fig.axes[0], "frontier") == []                    # the quick sweep ran no fixed-state mixer
    png = figure_png(fig)                                                # draws, legend below the panels
    assert png.startswith(b"\x89PNG")
    fig = ftr.recall_frontier_figure(QUICK, [32], frontier_mixers=["swa", "hybrid"])
    _check_figure(QUICK, fig, [32], ["swa", "hybrid"])
    plt.close("all")


def test_the_figure_of_a_full_sweep_draws_the_fixed_state_frontier():
    mixers = ["softmax", "swa", "linear", "delta", "gated_delta", "ssd", "hybrid"]
    results = made_up_results(mixers, [8, 16, 32], [(32, 8), (64, 16), (128, 32)],
                              lambda m, d, t, s: None if (m, d, s) == ("ssd", 32, 1) else ((d + 3 * s) % 11) / 10)
    fig = ftr.recall_frontier_figure(results)
    _check_figure(results, fig, [32, 64, 128])
    assert all(_gid_lines(ax, "frontier") for ax in fig.axes)
    assert fig.get_size_inches()[0] <= 7.6                               # the book's widest figures
    figure_png(fig)
    plt.close("all")


@examples(10)
@given(results=sweeps(), data=st.data())
def test_the_figure_has_a_panel_per_length_a_line_per_mixer_and_the_baseline(results, data):
    tested = [t for t, _ in ms.tested_lengths(results)]
    lengths = data.draw(st.lists(st.sampled_from(tested), min_size=1, unique=True))
    fig = ftr.recall_frontier_figure(results, lengths)
    _check_figure(results, fig, lengths)
    plt.close("all")


def test_the_figure_refuses_bad_input():
    for lengths in ([64], [], "16", [16, 16], [True], 16):
        with pytest.raises(ValueError, match="lengths"):
            ftr.recall_frontier_figure(QUICK, lengths)
    with pytest.raises(ValueError, match="results"):
        ftr.recall_frontier_figure({"settings": {}})
    with pytest.raises(ValueError, match="mixers"):
        ftr.recall_frontier_figure(QUICK, frontier_mixers=["linear"])
    assert set(ftr.MIXER_LABELS) == set(ftr.MIXER_COLORS) == set(ms.FIXED_STATE_MIXERS) | {"softmax", "swa", "hybrid"}
    plt.close("all")
