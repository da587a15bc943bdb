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
