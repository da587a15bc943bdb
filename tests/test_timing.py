"""Tests for fixedstate.timing: the timer and the measurements built on it."""

import numpy as np
import pytest

from hypothesis import given
from hypothesis import strategies as st

from _examples import examples

from fixedstate import costs
from fixedstate import delta_rule as dr
from fixedstate import toy_stack as ts
from fixedstate import kernels
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


@pytest.mark.parametrize("layer", ["delta", "gated_delta", "kda"])
def test_time_forms_reports_agreeing_forms(layer):
    res = timing.time_forms(40, 4, 3, chunk_size=8, repeats=1, layer=layer)
    assert res["recurrent"] > 0 and res["chunkwise"] > 0 and res["max_rel_diff"] < 1e-10
    with pytest.raises(ValueError, match="layer"):
        timing.time_forms(8, 2, 2, layer="mamba")


def test_time_lab_update_is_positive():
    assert timing.time_lab_update(4, repeats=1) > 0


def test_measure_decode_seconds_shape_and_sign():
    params = ts.init_stack(2, 8, 2, (1,))
    t = timing.measure_decode_seconds(params, [0, 64], n_steps=2)
    assert t.shape == (2,) and np.all(t > 0) and np.all(np.isfinite(t))
    assert timing.measure_decode_seconds(params, 16, n_steps=1).shape == ()


def test_best_time_runs_with_one_blas_thread_unless_told_otherwise():
    from threadpoolctl import ThreadpoolController, threadpool_limits
    blas = ThreadpoolController().select(user_api="blas")
    if not blas.lib_controllers:
        pytest.skip("no BLAS that threadpoolctl can control")
    seen = []

    def record():
        seen.append(max(lib.num_threads for lib in ThreadpoolController().select(user_api="blas").lib_controllers))

    with threadpool_limits(2, user_api="blas"):
        timing.best_time(record, repeats=2)
        timing.best_time(record, repeats=1, blas_threads=None)
        assert max(lib.num_threads for lib in blas.lib_controllers) == 2     # restored
    assert seen == [1, 1, 2]
    with pytest.raises(ValueError, match="blas_threads"):
        timing.best_time(record, blas_threads=0)


def test_time_forms_rounds_and_flops():
    res = timing.time_forms(40, 4, 3, chunk_size=8, repeats=1, rounds=3, layer="gated_delta")
    assert res["flops"] == costs.delta_rule_chunkwise_flops(40, 4, 3, chunk_size=8)
    assert res["ratio"] == pytest.approx(res["recurrent"] / res["chunkwise"])


def test_gemm_rate_and_chunkwise_table():
    assert timing.gemm_rate(np.float32, n=64, repeats=2) > 0
    table = timing.chunkwise_table(64, 8, layers=("gated_delta", "kda"), dtypes=(np.float64,), chunk_size=16, repeats=1,
                                   rounds=1, rates={"float64": 1e9})
    assert [(r["layer"], r["threads"]) for r in table["rows"]] == [("gated_delta", None), ("gated_delta", 1), ("kda", None),
                                                                     ("kda", 1)]
    for r in table["rows"]:
        assert r["limit"] == pytest.approx(r["flops"] / 1e9)
        assert r["chunkwise_vs_limit"] == pytest.approx(r["chunkwise"] / r["limit"])
        assert r["products"] > 0 and r["products_vs_limit"] == pytest.approx(r["products"] / r["limit"])
        assert r["chunkwise_vs_products"] == pytest.approx(r["chunkwise"] / r["products"])
        assert r["max_rel_diff"] < 1e-10
    text = timing.format_chunkwise_table(table)
    assert len(text.splitlines()) == 5 and "GEMM limit ms" in text and "default" in text and "prod/limit" in text


@examples(25)
@given(layer=st.sampled_from(["delta", "gated_delta", "kda"]), T=st.integers(1, 70), d_k=st.integers(1, 9),
       d_v=st.integers(1, 9), chunk=st.sampled_from([1, 3, 8, 16]), lead=st.sampled_from([(), (2,), (2, 3)]),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_products_replay_makes_exactly_the_counted_products(layer, T, d_k, d_v, chunk, lead, dtype):
    # the replay holds every product the form makes: its FLOPs are the cost model's, shapes, leading axes and all
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal(lead + (T, d_k)).astype(dtype) for _ in range(2))
    # unit keys, as the layers expect: with |k|^2 beta > 2 the recurrence diverges to inf and nan over 70 tokens,
    # and the equality below would then compare nan with nan
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = rng.standard_normal(lead + (T, d_v)).astype(dtype)
    params = {"beta": rng.uniform(0.1, 0.9, lead + (T,)).astype(dtype)}
    if layer == "gated_delta":
        params["log_gate"] = -rng.uniform(0, 0.1, lead + (T,)).astype(dtype)
    elif layer == "kda":
        params["log_gate"] = -rng.uniform(0, 0.1, lead + (T, d_k)).astype(dtype)
    form = {"delta": dr.delta_rule_chunkwise, "gated_delta": dr.gated_delta_rule_chunkwise, "kda": dr.kda_chunkwise}[layer]
    out, state = form(q, k, v, chunk_size=chunk, **params)
    replay, flops = timing.products_replay(layer, q, k, v, chunk_size=chunk, **params)
    batch = int(np.prod(lead, dtype=np.int64))
    # the gate adds no product: the gated delta rule's count is the delta rule's
    counted = "kda" if layer == "kda" else "delta"
    assert flops == costs.delta_rule_chunkwise_flops(T, d_k, d_v, chunk_size=chunk, layer=counted, batch=batch)
    assert replay() is None and replay() is None                     # runs, and runs again
    with kernels.recording_products() as after:                      # the recording ended with the call
        again, _ = form(q, k, v, chunk_size=chunk, **params)
    assert len(after) == len(replay.steps)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(again, out)


def test_products_replay_keeps_shared_arrays_and_transposed_views_as_in_the_form():
    # the state is one array in every step of the loop over chunks, and K K^T stays a product of an array with
    # its own transpose (numpy makes that half a product)
    q, k, v, params = timing.random_layer_inputs(64, 8, 8, layer="gated_delta")
    replay, _ = timing.products_replay("gated_delta", q, k, v, chunk_size=8, **params)
    steps = replay.steps
    adds = [s for s in steps if s[0] == "add"]
    assert len(adds) == 64 // 8 and len({id(s[3]) for s in adds}) == 1          # one state, updated in place
    assert any(np.shares_memory(s[1], s[2]) and s[2].base is not None for s in steps if s[0] == "matmul")


@pytest.mark.parametrize("layer, dtype", [("gated_delta", np.float64), ("gated_delta", np.float32), ("kda", np.float64)])
def test_products_replay_operands_have_the_forms_shapes_strides_and_dtypes(layer, dtype):
    # operand by operand, the replay's arrays are laid out as the form's: the h x h blocks of the UT transform's
    # inverse keep the row pitch of the C x C matrix they are cut from, the first C rows of [W; Gamma Q] their gaps
    q, k, v, params = timing.random_layer_inputs(512, 32, 16, layer=layer, dtype=dtype)
    with kernels.recording_products() as steps:
        {"gated_delta": dr.gated_delta_rule_chunkwise, "kda": dr.kda_chunkwise}[layer](q, k, v, chunk_size=32, **params)
    seen = [(a, b, out) for _, a, b, out, _, _ in steps]
    replay, _ = timing.products_replay(layer, q, k, v, chunk_size=32, **params)
    assert len(replay.steps) == len(seen)
    gapped = 0
    for form_arrays, step in zip(seen, replay.steps):
        for x, y in zip(form_arrays, step[1:4]):
            assert (y.shape, y.strides, y.dtype) == (x.shape, x.strides, x.dtype)
            assert not np.shares_memory(y, q) and not np.shares_memory(y, k)      # the replay's own arrays
            gapped += not (x.flags.c_contiguous or x.flags.f_contiguous)
    assert gapped > 0                   # the case that a contiguous copy would get wrong is among them


def test_products_replay_refuses_an_unknown_layer_and_ends_its_recording_on_an_error():
    q, k, v, params = timing.random_layer_inputs(16, 4, 4, layer="gated_delta")
    a, b = np.ones((2, 3)), np.ones((3, 2))
    with kernels.recording_products() as outer:
        with pytest.raises(ValueError, match="layer"):
            timing.products_replay("mamba", q, k, v, **params)
        with pytest.raises(ValueError, match="beta"):
            timing.products_replay("gated_delta", q, k, v, beta=params["beta"] + 5, log_gate=params["log_gate"])
        kernels.matmul(a, b)
    # the failed recordings are over: the caller's own recording is back and saw only its own product
    assert [(kind, x is a, y is b) for kind, x, y, *_ in outer] == [("matmul", True, True)]
    kernels.matmul(a, b)
    assert len(outer) == 1                                  # and no recording outlives its block


def test_chunkwise_table_rows_run_under_the_callers_threads_and_under_one_thread():
    from threadpoolctl import ThreadpoolController, threadpool_limits
    blas = ThreadpoolController().select(user_api="blas")
    if not blas.lib_controllers:
        pytest.skip("no BLAS that threadpoolctl can control")
    with threadpool_limits(2, user_api="blas"):
        table = timing.chunkwise_table(32, 4, layers=("gated_delta",), dtypes=(np.float64,), chunk_size=8, repeats=1,
                                       rounds=1, rates={"float64": 1e9})
        assert [lib.num_threads for lib in blas.lib_controllers] == [2] * len(blas.lib_controllers)
    default, one = table["rows"]
    assert default["threads"] is None and default["blas_threads"] == [2] * len(blas.lib_controllers)
    assert one["threads"] == 1 and one["blas_threads"] == [1] * len(blas.lib_controllers)


def test_chunkwise_table_measures_the_rate_in_turns_with_the_forms():
    table = timing.chunkwise_table(32, 4, layers=("gated_delta",), dtypes=(np.float32,), threads=(1,), chunk_size=8,
                                   repeats=1, rounds=2)
    (row,) = table["rows"]
    assert table["rates"]["float32"] > 0 and row["rate"] > 0
    assert row["limit"] == pytest.approx(row["flops"] / row["rate"])


def test_the_suites_timing_setting_makes_one_run_and_refuses_other_values(monkeypatch):
    calls = []
    monkeypatch.delenv("FIXEDSTATE_TIMING", raising=False)
    timing.best_time(lambda: calls.append(1), repeats=4)
    assert len(calls) == 4
    monkeypatch.setenv("FIXEDSTATE_TIMING", "once")
    calls.clear()
    timing.best_time(lambda: calls.append(1), repeats=4)
    assert len(calls) == 1
    seen = []
    real = timing.best_time
    monkeypatch.setattr(timing, "best_time", lambda *a, **kw: seen.append(kw.get("repeats")) or real(*a, **kw))
    timing.time_forms(16, 4, 4, repeats=3, rounds=3)
    assert len(seen) == 2                       # one round: the recurrent and the chunkwise form, once each
    with pytest.raises(ValueError, match="repeats"):            # arguments are checked as for a reader
        timing.best_time(lambda: None, repeats=0)
    monkeypatch.setenv("FIXEDSTATE_TIMING", "twice")
    with pytest.raises(ValueError, match="FIXEDSTATE_TIMING"):
        timing.best_time(lambda: None)
