"""fixedstate.mqar_stats: the Wilson interval, a point's summary, the tuning rule and the widened grid."""

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import mqar_stats as ms


def _binomial_coverage(low, high, n, p):
    """P(the interval of k successes covers p) under Binomial(n, p), summed exactly."""
    return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1) if low[k] <= p <= high[k])


@examples(40)
@given(n=st.integers(1, 60), data=st.data())
def test_wilson_interval_contains_the_fraction_and_solves_its_quadratic(n, data):
    k = data.draw(st.integers(0, n))
    low, high = ms.wilson_interval(k, n)
    p = k / n
    assert 0 <= low <= p <= high <= 1
    z = ms.Z95
    # its ends are the two p0 at which the score statistic |p - p0| / sqrt(p0 (1 - p0) / n) equals z
    for end in (low, high):
        if 0 < end < 1:
            assert abs(abs(p - end) - z * math.sqrt(end * (1 - end) / n)) < 1e-12


def test_wilson_interval_known_values_and_coverage():
    low, high = ms.wilson_interval(0, 5)
    assert low == 0 and abs(high - 0.43448246) < 1e-8           # z^2 / (n + z^2)
    low, high = ms.wilson_interval(5, 5)
    assert high == 1 and abs(low - (1 - 0.43448246)) < 1e-8
    n = 5
    ends = [ms.wilson_interval(k, n) for k in range(n + 1)]
    lows, highs = [e[0] for e in ends], [e[1] for e in ends]
    # near-nominal coverage in the middle of the range, for the sweep's five seeds
    assert _binomial_coverage(lows, highs, n, 0.5) >= 0.93


@pytest.mark.parametrize("args, name", [((6, 5), "successes"), ((-1, 5), "successes"), ((1, 0), "n"),
                                        ((1.0, 5), "successes")])
def test_wilson_interval_bad_input(args, name):
    with pytest.raises(ValueError, match=name):
        ms.wilson_interval(*args)


def test_point_summary_counts_solved_and_above_the_baseline_line():
    s = ms.point_summary([1.0, 0.95, 0.5, 0.2, None], baseline=0.3, baseline_se=0.02, threshold=0.9, margin=3)
    assert s["n"] == 5 and s["diverged"] == 1
    assert s["solved"] == 2 and s["above"] == 3 and abs(s["above_line"] - 0.36) < 1e-12
    assert s["mean"] == pytest.approx(np.mean([1.0, 0.95, 0.5, 0.2]), abs=1e-15)
    assert s["solved_ci"] == ms.wilson_interval(2, 5) and s["above_ci"] == ms.wilson_interval(3, 5)
    assert ms.point_summary([None], baseline=0.1)["mean"] is None
    for kw, name in (({"accuracies": []}, "accuracies"), ({"accuracies": [1.2]}, "accuracies"),
                     ({"accuracies": [0.5], "baseline": 2}, "baseline"),
                     ({"accuracies": [0.5], "margin": -1}, "margin")):
        with pytest.raises(ValueError, match=name):
            ms.point_summary(kw.pop("accuracies"), **{"baseline": 0.1, **kw})


def _rec(lr, acc, loss=1.0, diverged=False):
    return {"lr": lr, "test_accuracy": None if diverged else acc, "final_loss": None if diverged else loss,
            "diverged": diverged}


def test_choose_lr_says_where_the_choice_sits():
    grid = [_rec(1e-3, 0.2), _rec(3e-3, 0.9), _rec(1e-2, 0.5)]
    assert ms.choose_lr(grid) == (3e-3, "inside")
    assert ms.choose_lr([_rec(1e-3, 0.2), _rec(3e-3, 0.5), _rec(1e-2, 0.9)]) == (1e-2, "high")
    assert ms.choose_lr([_rec(1e-3, 0.9), _rec(3e-3, 0.5), _rec(1e-2, 0, diverged=True)]) == (1e-3, "low")
    # ties in accuracy go to the lower final loss, exact ties to the smaller rate
    assert ms.choose_lr([_rec(1e-3, 0.5, 2.0), _rec(3e-3, 0.5, 1.0), _rec(1e-2, 0.5, 3.0)]) == (3e-3, "inside")
    assert ms.choose_lr([_rec(1e-3, 0.5), _rec(3e-3, 0.5), _rec(1e-2, 0.5)]) == (1e-3, "low")
    with pytest.raises(ValueError, match="records"):
        ms.choose_lr(grid[:2])
    with pytest.raises(ValueError, match="records"):
        ms.choose_lr(grid + [_rec(1e-3, 0.1)])


def test_widen_grid_continues_the_geometric_grid():
    assert ms.widen_grid((1e-3, 3e-3, 1e-2), "high") == pytest.approx((1e-2 * 10 / 3,))
    assert ms.widen_grid((1e-3, 3e-3, 1e-2), "low", steps=2) == pytest.approx((1e-3 / 3, 1e-3 / 9))
    for args, name in ((((1e-3,), "high"), "grid"), (((1e-3, 1e-2), "middle"), "where")):
        with pytest.raises(ValueError, match=name):
            ms.widen_grid(*args)


def _mrec(lr, accs, loss=1.0, diverged=False):
    """A tuning record of a run tested at several lengths: ``accs`` maps the length (a string, as JSON) to accuracy."""
    return {"lr": lr, "test_accuracy": None if diverged else accs, "final_loss": None if diverged else loss,
            "diverged": diverged}


def test_choose_lr_on_runs_tested_at_several_lengths_reads_the_longest_then_the_mean_then_the_loss():
    # the longest length decides, whatever the shorter ones say
    grid = [_mrec(1e-3, {"32": 1.0, "128": 0.5}), _mrec(3e-3, {"32": 0.1, "128": 0.6}),
            _mrec(1e-2, {"32": 0.9, "128": 0.55})]
    assert ms.choose_lr(grid) == (3e-3, "inside")
    # the longest is the largest number, not the last key nor the largest string ("64" > "128" as strings)
    grid = [_mrec(1e-3, {"128": 0.2, "64": 0.9}), _mrec(3e-3, {"128": 0.3, "64": 0.1}),
            _mrec(1e-2, {"128": 0.25, "64": 1.0})]
    assert ms.choose_lr(grid) == (3e-3, "inside")
    assert ms.choose_lr(grid, at=64) == (1e-2, "high")
    # a tie at the longest goes to the higher mean over the lengths, then to the lower final loss
    grid = [_mrec(1e-3, {"32": 0.7, "128": 0.5}), _mrec(3e-3, {"32": 0.9, "128": 0.5}, loss=2.0),
            _mrec(1e-2, {"32": 0.9, "128": 0.5}, loss=1.5)]
    assert ms.choose_lr(grid) == (1e-2, "high")
    grid[2]["final_loss"] = 2.5
    assert ms.choose_lr(grid) == (3e-3, "inside")
    # int keys as a run holds them in memory, diverged runs last
    grid = [_mrec(1e-3, {32: 0.1, 128: 0.1}), _mrec(3e-3, None, diverged=True), _mrec(1e-2, {32: 0.2, 128: 0.1})]
    assert ms.choose_lr(grid) == (1e-2, "high")


def test_choose_lr_refuses_mixed_lengths_and_a_length_not_tested():
    grid = [_mrec(1e-3, {"32": 0.1, "128": 0.2}), _mrec(3e-3, {"32": 0.1, "64": 0.2}),
            _mrec(1e-2, {"32": 0.1, "128": 0.2})]
    with pytest.raises(ValueError, match="records"):
        ms.choose_lr(grid)
    with pytest.raises(ValueError, match="records"):
        ms.choose_lr([_rec(1e-3, 0.2), _mrec(3e-3, {"32": 0.5}), _rec(1e-2, 0.9)])
    with pytest.raises(ValueError, match="at"):
        ms.choose_lr([_mrec(lr, {"32": 0.1, "128": 0.2}) for lr in (1e-3, 3e-3, 1e-2)], at=64)
    with pytest.raises(ValueError, match="at"):
        ms.choose_lr([_rec(lr, 0.2) for lr in (1e-3, 3e-3, 1e-2)], at=64)


# ----------------------------------------------------------------------------- reading a sweep's results

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from fixedstate import costs  # noqa: E402
from fixedstate import training as tr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICK = json.loads((ROOT / "results" / "mqar_quick.json").read_text())
sys.path.insert(0, str(ROOT / "tools"))

import mqar_sweep  # noqa: E402

SWEPT = tuple(tr.MODEL_LAYERS)            # the mixers a sweep can run, in the book's order


def made_up_results(mixers, d_models, lengths, accuracy, *, seeds=3, ablation=None, lr_at_edge=None):
    """A sweep's results as tools/mqar_sweep.py writes them, from made-up accuracies (through JSON, as stored).

    ``accuracy(mixer, d_model, seq_len, seed)`` is a float, or None for a run that diverged (then at every
    length); ``ablation(mixer, d_model, seq_len, seed, layer)`` the accuracy with that layer's core zeroed
    (default: a made-up number below the accuracy). State bytes are the sweep's own.
    """
    lengths = [[int(t), int(n)] for t, n in lengths]
    settings = {"name": "made-up", "mixers": list(mixers), "d_models": list(d_models), "lengths": lengths,
                "train_lengths": lengths, "seeds": list(range(seeds)), "threshold": 0.9, "margin": 3.0}
    runs = []
    for m in mixers:
        layers = tr.MODEL_LAYERS[m]
        for d in d_models:
            window = tr.swa_window(d) if "swa" in layers else None
            for s in range(seeds):
                accs = {str(t): accuracy(m, d, t, s) for t, _ in lengths}
                diverged = any(a is None for a in accs.values())
                abl = None
                if len(set(layers)) > 1 and not diverged:
                    abl = {str(i): {str(t): (ablation(m, d, t, s, i) if ablation else round(accs[str(t)] / (i + 2), 6))
                                    for t, _ in lengths} for i in range(len(layers))}
                runs.append({"stage": "main", "mixer": m, "d_model": d, "seed": s, "lr": 0.01 * (1 + d % 3),
                             "key": f"main|{m}|d{d}|s{s}", "window": window, "diverged": diverged,
                             "test_accuracy": None if diverged else accs, "final_loss": None if diverged else 1.0,
                             "state_bytes": {str(t): costs.model_state_bytes(layers, seq_len=t, d_k=d, d_v=d,
                                                                             window=window) for t, _ in lengths},
                             "ablation": abl})
    baselines = {str(t): {"seq_len": t, "n_pairs": n, "expected": 0.9 / n, "test_set": 0.9 / n + 1e-3,
                          "test_set_se": 0.1 / n} for t, n in lengths}
    results = {"settings": settings, "chosen_lr": {}, "lr_grids": {}, "lr_at_edge": dict(lr_at_edge or {}),
               "baselines": baselines, "points": mqar_sweep.summarise(settings, runs, baselines), "tuning": [],
               "runs": runs, "provenance": {}}
    return json.loads(json.dumps(results))


ACCURACY = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), st.floats(0, 1), st.none())


@st.composite
def sweeps(draw, diverged=True):
    """Made-up results: a few mixers, widths, lengths and seeds, accuracies with ties and diverged runs."""
    mixers = draw(st.lists(st.sampled_from(SWEPT), min_size=1, max_size=5, unique=True))
    mixers.sort(key=SWEPT.index)
    d_models = sorted(draw(st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=3, unique=True)))
    lengths = sorted(draw(st.lists(st.sampled_from([(16, 4), (32, 8), (64, 16)]), min_size=1, max_size=3,
                                   unique=True)))
    seeds = draw(st.integers(1, 3))
    values = {(m, d, t, s): draw(ACCURACY if diverged else ACCURACY.filter(lambda a: a is not None))
              for m in mixers for d in d_models for t, _ in lengths for s in range(seeds)}
    dead = {(m, d, s) for (m, d, t, s), a in values.items() if a is None}
    edges = {f"{m}|{d}": draw(st.sampled_from(["low", "high"])) for m in mixers for d in d_models
             if draw(st.booleans())}
    return made_up_results(mixers, d_models, lengths,
                           lambda m, d, t, s: None if (m, d, s) in dead else (values[(m, d, t, s)] or 0.0),
                           seeds=seeds, lr_at_edge=edges)


def _all_results():
    return [QUICK, made_up_results(SWEPT, [4, 8], [(16, 4), (32, 8)], lambda m, d, t, s: ((d + t + s) % 7) / 6)]


def test_tested_lengths_and_points_at_sort_by_mixer_then_state():
    assert ms.tested_lengths(QUICK) == [(16, 4), (32, 8)]
    for results in _all_results():
        for t, _ in ms.tested_lengths(results):
            pts = ms.points_at(results, t)
            assert sorted(map(json.dumps, pts)) == sorted(json.dumps(p) for p in results["points"]
                                                          if p["seq_len"] == t)
            order = results["settings"]["mixers"]
            keys = [(order.index(p["mixer"]), p["state_bytes"], p["d_model"]) for p in pts]
            assert keys == sorted(keys) and all(p["seq_len"] == t for p in pts)
    # the KV cache grows with the length, a fixed state does not
    assert [p["state_bytes"] for p in ms.points_at(QUICK, 16) if p["mixer"] == "softmax"] == [2048, 4096]
    assert [p["state_bytes"] for p in ms.points_at(QUICK, 32) if p["mixer"] == "softmax"] == [4096, 8192]


def _best_at_or_below(points, state):
    return max((p["mean"] for p in points if p["state_bytes"] <= state), default=None)


def _check_frontier(results, t, mixers):
    front = ms.frontier(results, t, mixers)
    chosen = [m for m in results["settings"]["mixers"] if m in ms.FIXED_STATE_MIXERS] if mixers is None else mixers
    pts = [p for p in ms.points_at(results, t) if p["mixer"] in chosen and p["mean"] is not None]
    # monotone: state and accuracy both rise strictly
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(front, front[1:]))
    # every frontier point is a real point of the sweep
    real = {(p["state_bytes"], p["mean"], p["mixer"], p["d_model"]) for p in pts}
    assert all(f in real for f in front)
    # it is the envelope: the best mean at or below each state rises exactly at its points
    rises = [s for s in sorted({p["state_bytes"] for p in pts})
             if _best_at_or_below(pts, s) != _best_at_or_below(pts, s - 1)]
    assert [f[0] for f in front] == rises
    assert [f[1] for f in front] == [_best_at_or_below(pts, s) for s in rises]
    return front


@examples(40)
@given(results=sweeps(), data=st.data())
def test_the_frontier_is_a_rising_envelope_of_real_points(results, data):
    swept = results["settings"]["mixers"]
    subset = data.draw(st.lists(st.sampled_from(swept), unique=True))
    for t, _ in ms.tested_lengths(results):
        _check_frontier(results, t, None)
        _check_frontier(results, t, subset)
        assert ms.frontier(results, t, []) == []


def test_the_frontier_of_the_quick_sweep():
    for t in (16, 32):
        # the quick sweep ran no fixed-state mixer: the default frontier is empty
        assert ms.frontier(QUICK, t) == []
        front = _check_frontier(QUICK, t, ["softmax", "swa", "hybrid"])
        assert front[0][2:] == ("swa", 8) and front[-1][1] == 1.0
    # at T = 32 the window's cache stays at 0.5 and 2 KiB, the hybrid passes it, softmax at 4 KiB passes that
    assert [f[2:] for f in ms.frontier(QUICK, 32, ["softmax", "swa", "hybrid"])] == [
        ("swa", 8), ("swa", 16), ("hybrid", 8), ("softmax", 8)]
    # ties at one state keep the first point in the sweep's order
    tied = made_up_results(["linear", "delta"], [8], [(16, 4)], lambda m, d, t, s: 0.5)
    assert ms.frontier(tied, 16) == [(2 * 8 * 8 * 4, 0.5, "linear", 8)]       # two layers of 8 x 8 floats
    assert ms.frontier(tied, 16, ["delta", "linear"]) == [(512, 0.5, "linear", 8)]


_ROW = re.compile(r"\s{2,}")
_CI = re.compile(r"^(\d+)/(\d+) \[([0-9.]+), ([0-9.]+)\]$")


def _parse_points(text):
    head, header, *rows = text.split("\n")
    assert _ROW.split(header) == ["mixer", "d", "KiB", "mean", "solved [95% CI]", "above [95% CI]", "lr", "note"]
    return head, [_ROW.split(r) for r in rows]


def _check_count(cell, k, n, ci):
    got = _CI.match(cell)
    assert got, cell
    assert (int(got[1]), int(got[2])) == (k, n)
    assert abs(float(got[3]) - ci[0]) <= 0.005 + 1e-12 and abs(float(got[4]) - ci[1]) <= 0.005 + 1e-12
    assert got[3] == f"{ci[0]:.2f}" and got[4] == f"{ci[1]:.2f}"


def _check_format_points(results, t):
    text = ms.format_points(results, t)
    head, rows = _parse_points(text)
    pts = ms.points_at(results, t)
    base = results["baselines"][str(t)]
    numbers = [float(x) for x in re.findall(r"\d+\.\d+", head)]
    assert head.startswith(f"T = {t} ({dict(ms.tested_lengths(results))[t]} pairs)")
    assert numbers[:3] == [round(base["test_set"], 3), round(base["test_set_se"], 3), round(pts[0]["above_line"], 3)]
    assert len(rows) == len(pts)
    for row, p in zip(rows, pts):
        note = row[7] if len(row) == 8 else ""
        assert row[:3] == [p["mixer"], str(p["d_model"]), row[2]] and float(row[2]) * 1024 == p["state_bytes"]
        if p["mean"] is None:
            assert row[3] == "-"
        else:
            assert abs(float(row[3]) - p["mean"]) <= 5e-4 + 1e-12 and row[3] == f"{p['mean']:.3f}"
        _check_count(row[4], p["solved"], p["n"], p["solved_ci"])
        _check_count(row[5], p["above"], p["n"], p["above_ci"])
        assert abs(float(row[6]) - p["lr"]) <= 0.05 * p["lr"]
        assert (f"{p['diverged']} diverged" in note) == (p["diverged"] > 0)
        edge = results["lr_at_edge"].get(f"{p['mixer']}|{p['d_model']}")
        assert (f"lr at the {edge} edge" in note) == bool(edge)
    assert text == ms.format_points(json.loads(json.dumps(results)), t)      # the same text from the stored file
    return rows


def test_format_points_of_the_quick_sweep():
    rows = _check_format_points(QUICK, 32)
    assert rows[0][:6] == ["softmax", "8", "4", "1.000", "5/5 [0.57, 1.00]", "5/5 [0.57, 1.00]"]
    assert ms.format_points(QUICK, 16).split("\n")[0].startswith("T = 16 (4 pairs): no-retrieval baseline 0.521")


@examples(30)
@given(results=sweeps())
def test_format_points_numbers_equal_the_points(results):
    for t, _ in ms.tested_lengths(results):
        _check_format_points(results, t)


def _direct_ablation(results):
    """The ablation recomputed by plain loops over the runs."""
    out = {}
    for r in results["runs"]:
        if r["ablation"] is None:
            continue
        for t, _ in results["settings"]["lengths"]:
            key = (r["mixer"], r["d_model"], t)
            row = out.setdefault(key, {"intact": [], "zeroed": {}})
            row["intact"].append(r["test_accuracy"][str(t)])
            for i, by_length in r["ablation"].items():
                row["zeroed"].setdefault(int(i), []).append(by_length[str(t)])
    return out


def _check_ablation(results):
    summary = ms.ablation_summary(results)
    direct = _direct_ablation(results)
    assert {(s["mixer"], s["d_model"], s["seq_len"]) for s in summary} == set(direct)
    assert len(summary) == len(direct)
    for s in summary:
        want = direct[(s["mixer"], s["d_model"], s["seq_len"])]
        assert s["n"] == len(want["intact"]) and s["layers"] == tuple(tr.MODEL_LAYERS[s["mixer"]])
        for got, values in [(s["intact"], want["intact"])] + [(s["zeroed"][i], v) for i, v in want["zeroed"].items()]:
            assert got["min"] == min(values) and got["max"] == max(values)
            assert abs(got["mean"] - sum(values) / len(values)) <= 1e-15
        assert set(s["zeroed"]) == set(want["zeroed"])
        # the points' own ablation means agree
        point = [p for p in results["points"] if (p["mixer"], p["d_model"], p["seq_len"])
                 == (s["mixer"], s["d_model"], s["seq_len"])][0]
        assert {int(i): v for i, v in point["ablation_mean"].items()} == pytest.approx(
            {i: z["mean"] for i, z in s["zeroed"].items()}, abs=1e-15)
    return summary


def _parse_ablation(text):
    blocks = {}
    for block in text.split("\n\n"):
        head, header, *rows = block.split("\n")
        blocks[head.split(" ")[0].rstrip(":")] = (head, _ROW.split(header), [_ROW.split(r) for r in rows])
    return blocks


def _spread_of(cell):
    got = re.fullmatch(r"(\d\.\d{3}) \[(\d\.\d{3}), (\d\.\d{3})\]", cell)
    assert got, cell
    return [float(x) for x in got.groups()]


def _check_format_ablation(results, summary):
    if not summary:
        assert ms.format_ablation(results).startswith("no run of this sweep has an ablation")
        return
    blocks = _parse_ablation(ms.format_ablation(results))
    assert len(blocks) == len({s["mixer"] for s in summary})
    for s in summary:
        head, header, rows = blocks[s["mixer"]]
        assert header[:4] == ["d", "T", "n", "intact"]
        assert header[4:] == [f"layer {i} ({s['layers'][i]}) zeroed" for i in sorted(s["zeroed"])]
        (row,) = [r for r in rows if r[:2] == [str(s["d_model"]), str(s["seq_len"])]]
        assert int(row[2]) == s["n"]
        for cell, spread in zip(row[3:], [s["intact"]] + [s["zeroed"][i] for i in sorted(s["zeroed"])]):
            assert _spread_of(cell) == [round(spread[k], 3) for k in ("mean", "min", "max")]
            assert cell == f"{spread['mean']:.3f} [{spread['min']:.3f}, {spread['max']:.3f}]"


def test_the_ablation_of_the_quick_sweep():
    summary = _check_ablation(QUICK)
    assert [(s["d_model"], s["seq_len"]) for s in summary] == [(8, 16), (8, 32), (16, 16), (16, 32)]
    # the hybrid's attention layer carries the recall: zeroing it leaves little, zeroing the other nothing lost
    for s in summary:
        assert s["n"] == 5 and s["zeroed"][1]["max"] < 0.05
        assert abs(s["zeroed"][0]["mean"] - s["intact"]["mean"]) < 0.01
    _check_format_ablation(QUICK, summary)


@examples(30)
@given(results=sweeps())
def test_the_ablation_summary_equals_a_direct_recomputation(results):
    _check_format_ablation(results, _check_ablation(results))


def test_reading_results_refuses_bad_input():
    broken_point = dict(QUICK, points=[{k: v for k, v in QUICK["points"][0].items() if k != "mean"}])
    broken_run = dict(QUICK, runs=[{k: v for k, v in QUICK["runs"][0].items() if k != "diverged"}])
    bad_lengths = dict(QUICK, settings=dict(QUICK["settings"], lengths=[16, 32]))
    for fn in (ms.points_at, ms.frontier, ms.format_points):
        for results in ([], {"settings": {}}, dict(QUICK, settings={"mixers": []}), broken_point, broken_run,
                        bad_lengths):
            with pytest.raises(ValueError, match="results"):
                fn(results, 16)
        for seq_len in (64, "16", True, 16.0, None):
            with pytest.raises(ValueError, match="seq_len"):
                fn(QUICK, seq_len)
    for mixers in ("softmax", ["softmax", "linear"], [None], 3):
        with pytest.raises(ValueError, match="mixers"):
            ms.frontier(QUICK, 16, mixers)
    for fn in (ms.ablation_summary, ms.format_ablation, ms.tested_lengths):
        with pytest.raises(ValueError, match="results"):
            fn({"points": []})
    no_length = dict(QUICK, runs=[dict(r, test_accuracy={"16": 0.5}) if r["ablation"] else r for r in QUICK["runs"]])
    with pytest.raises(ValueError, match="results"):
        ms.ablation_summary(no_length)
    with pytest.raises(ValueError, match="results"):
        ms.format_points(dict(QUICK, baselines={"16": QUICK["baselines"]["16"]}), 32)
