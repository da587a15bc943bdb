"""Tests for fixedstate.timing: the timer and the measurements built on it."""

import numpy as np
import pytest

from fixedstate import hybrid as hy
from fixedstate import timing


def test_best_time_passes_arguments_and_keeps_the_fastest_run():
    calls = []

    def f(a, b=0):
        calls.append((a, b))

    t = timing.best_time(f, 1, b=2, repeats=4)
    assert calls == [(1, 2)] * 4
    assert 0 <= t < 1
    with pytest.raises(ValueError, match="repeats"):
        timing.best_time(f, 1, repeats=0)
    with pytest.raises(ValueError, match="fn"):
        timing.best_time("f")


@pytest.mark.parametrize("layer", ["delta", "gated", "kda"])
def test_time_forms_reports_agreeing_forms(layer):
    res = timing.time_forms(40, 4, 3, chunk_size=8, repeats=1, layer=layer)
    assert res["recurrent"] > 0 and res["chunkwise"] > 0 and res["max_rel_diff"] < 1e-10
    with pytest.raises(ValueError, match="layer"):
        timing.time_forms(8, 2, 2, layer="mamba")


def test_time_lab_update_is_positive():
    assert timing.time_lab_update(4, repeats=1) > 0


def test_measure_decode_seconds_shape_and_sign():
    params = hy.init_stack(2, 8, 2, (1,))
    t = timing.measure_decode_seconds(params, [0, 64], n_steps=2)
    assert t.shape == (2,) and np.all(t > 0) and np.all(np.isfinite(t))
    assert timing.measure_decode_seconds(params, 16, n_steps=1).shape == ()
