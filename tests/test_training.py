"""Tests for the blocks' backward passes and fixedstate.training (chapter 9).

Every gradient is checked against central finite differences in float64 with
``fixedstate.gradcheck`` (relative error <= 1e-6, the bound the chapter states);
Adam is checked on a quadratic; a tiny training run must learn; and one
configuration of the stored sweep is rerun and must reproduce its accuracy.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _examples import examples

from fixedstate import blocks as bl
from fixedstate import gradcheck as gc
from fixedstate import training as tr

FAST = examples(15)
BOUND = 1e-6
ROOT = Path(__file__).resolve().parent.parent
leading = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


def check(f, inputs, backward, seed=12345):
    """Max relative error of ``backward(weights) -> {name: grad}`` against finite differences of ``f``."""
    weights = gc.random_weights(f(**inputs), seed=seed)
    # step 1e-5, not gradcheck's 1e-6: for these small float64 problems it balances the rounding of the two
    # evaluations (about 1e-16 |L| / h) against the truncation (about h^2), so that an input whose gradient is
    # small by chance (one entry, a near-cancelling sum) is still checked well below BOUND
    return gc.max_relative_error(f, inputs, backward(*weights), weights, step=1e-5)


# ----------------------------------------------------------------------------- blocks

@FAST
@given(lead=leading, d_in=st.integers(1, 4), d_out=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_linear_and_mlp_backward_match_finite_differences(lead, d_in, d_out, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (d_in,))
    w, b = rng.standard_normal((d_in, d_out)), rng.standard_normal(d_out)
    w2 = rng.standard_normal((d_out, 3))
    err = check(lambda x, weight, bias: bl.linear(x, weight, bias), {"x": x, "weight": w, "bias": b},
                lambda d: dict(zip(("x", "weight", "bias"), bl.linear_backward(x, w, d))))
    assert err <= BOUND
    err = check(lambda x, W_1, W_2: bl.mlp(x, W_1, W_2), {"x": x, "W_1": w, "W_2": w2},
                lambda d: dict(zip(("x", "W_1", "W_2"), bl.mlp_backward(x, w, w2, d))))
    assert err <= BOUND


@FAST
@given(lead=leading, d=st.integers(2, 5), seed=st.integers(0, 10**6), with_weight=st.booleans())
def test_norm_backwards_match_finite_differences(lead, d, seed, with_weight):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (d,)) + 0.1
    w = rng.standard_normal(d) if with_weight else None
    if with_weight:
        err = check(lambda x, weight: bl.rms_norm(x, weight), {"x": x, "weight": w},
                    lambda g: dict(zip(("x", "weight"), bl.rms_norm_backward(x, g, w))))
    else:
        err = check(lambda x: bl.rms_norm(x), {"x": x}, lambda g: {"x": bl.rms_norm_backward(x, g)[0]})
    assert err <= BOUND
    err = check(lambda x: bl.l2_normalize(x), {"x": x}, lambda g: {"x": bl.l2_normalize_backward(x, g)})
    assert err <= BOUND


@pytest.mark.parametrize("name", ["silu", "sigmoid", "softplus"])
def test_activation_backwards_match_finite_differences(name):
    x = np.linspace(-6, 6, 25).reshape(5, 5)
    fwd, bwd = getattr(bl, name), getattr(bl, name + "_backward")
    assert check(lambda x: fwd(x), {"x": x}, lambda g: {"x": bwd(x, g)}) <= BOUND


@FAST
@given(lead=leading, T=st.integers(1, 6), d=st.integers(1, 3), K=st.integers(1, 4), seed=st.integers(0, 10**6),
       with_state=st.booleans(), with_bias=st.booleans())
def test_short_conv_backward_matches_finite_differences(lead, T, d, K, seed, with_state, with_bias):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(lead + (T, d)), rng.standard_normal((d, K))
    inputs = {"x": x, "weight": w}
    if with_state:
        inputs["initial_state"] = rng.standard_normal(lead + (K - 1, d))
    if with_bias:
        inputs["bias"] = rng.standard_normal(d)

    def f(**kw):
        return bl.short_conv(**kw)

    def backward(d_y, d_state):
        dx, dw, db, ds = bl.short_conv_backward(x, w, d_y, initial_state=inputs.get("initial_state"),
                                                bias=inputs.get("bias"), d_final_state=d_state)
        grads = {"x": dx, "weight": dw}
        if with_state:
            grads["initial_state"] = ds
        if with_bias:
            grads["bias"] = db
        return grads

    assert check(f, inputs, backward) <= BOUND


@pytest.mark.parametrize("x_lead, state_lead", [((2, 3), (3,)), ((), (2,)), ((2, 1), (1, 3)), ((2,), (1,))])
def test_short_conv_backward_gives_each_gradient_its_input_shape(x_lead, state_lead):
    """x and initial_state broadcast against each other; each gradient is summed back to its input's shape."""
    rng = np.random.default_rng(7)
    T, d, K = 5, 2, 3
    x, w = rng.standard_normal(x_lead + (T, d)), rng.standard_normal((d, K))
    state = rng.standard_normal(state_lead + (K - 1, d))
    inputs = {"x": x, "weight": w, "initial_state": state}

    def backward(d_y, d_state):
        dx, dw, _, ds = bl.short_conv_backward(x, w, d_y, initial_state=state, d_final_state=d_state)
        assert dx.shape == x.shape and ds.shape == state.shape
        return {"x": dx, "weight": dw, "initial_state": ds}

    assert check(lambda **kw: bl.short_conv(**kw), inputs, backward) <= BOUND


def test_embedding_backward_sums_over_repeated_tokens():
    rng = np.random.default_rng(0)
    tokens = np.array([[1, 3, 1], [0, 1, 4]])
    table = rng.standard_normal((6, 3))
    err = check(lambda table: bl.embedding(tokens, table), {"table": table},
                lambda g: {"table": bl.embedding_backward(tokens, table, g)})
    assert err <= BOUND
    g = rng.standard_normal((2, 3, 3))
    d = bl.embedding_backward(tokens, table, g)
    np.testing.assert_allclose(d[1], g[0, 0] + g[0, 2] + g[1, 1], rtol=1e-14)
    assert not d[2].any() and not d[5].any()


def test_block_backwards_keep_float32_and_name_a_bad_gradient():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    g = np.ones((2, 4, 2), np.float32)
    assert all(a.dtype == np.float32 for a in bl.linear_backward(x, w, g))
    assert bl.rms_norm_backward(x, x)[0].dtype == np.float32
    assert bl.l2_normalize_backward(x, x).dtype == np.float32
    assert bl.silu_backward(x, x).dtype == np.float32
    conv = bl.short_conv_backward(x, np.ones((3, 2), np.float32), x)
    assert conv[0].dtype == np.float32 and conv[1].dtype == np.float32
    with pytest.raises(ValueError, match="d_out"):
        bl.linear_backward(x, w, np.ones((2, 4, 3)))
    with pytest.raises(ValueError, match="d_y"):
        bl.short_conv_backward(x, np.ones((3, 2)), np.ones((2, 5, 3)))
    with pytest.raises(ValueError, match="d_out"):
        bl.rms_norm_backward(x, np.ones(3))


# ----------------------------------------------------------------------------- loss and Adam

def test_cross_entropy_and_its_gradient():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((2, 5, 7))
    t = np.full((2, 5), -1)
    t[0, 1], t[1, 3], t[1, 4] = 3, 0, 6
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = -(logp[0, 1, 3] + logp[1, 3, 0] + logp[1, 4, 6]) / 3
    assert tr.cross_entropy(z, t) == pytest.approx(want, rel=1e-13)

    def f(z):
        return np.array(tr.cross_entropy(z, t))

    assert check(f, {"z": z}, lambda w: {"z": w * tr.cross_entropy_backward(z, t)}) <= BOUND
    g = tr.cross_entropy_backward(z, t)
    assert not g[t < 0].any()
    np.testing.assert_allclose(g.sum(-1), 0, atol=1e-15)
    with pytest.raises(ValueError, match="targets"):
        tr.cross_entropy(z, np.full((2, 5), -1))
    with pytest.raises(ValueError, match="targets"):
        tr.cross_entropy(z, np.full((2, 5), 7))


def test_adam_first_step_is_lr_times_sign_and_it_minimises_a_quadratic():
    rng = np.random.default_rng(3)
    A = rng.standard_normal((4, 4))
    H = A @ A.T + np.eye(4)                         # positive definite
    b = rng.standard_normal(4)
    x_star = np.linalg.solve(H, b)
    params = {"x": np.zeros(4)}
    state = tr.adam_init(params)
    g0 = H @ params["x"] - b
    tr.adam_step(params, {"x": g0}, state, lr=0.01, eps=1e-12)
    np.testing.assert_allclose(params["x"], -0.01 * np.sign(g0), rtol=1e-9)
    for n in range(3000):
        tr.adam_step(params, {"x": H @ params["x"] - b}, state, lr=0.01 * (1 - n / 3000))
    assert np.linalg.norm(params["x"] - x_star) < 1e-3 * np.linalg.norm(x_star)


def test_adam_clips_the_global_norm_and_checks_its_arguments():
    params = {"a": np.zeros(2), "b": np.zeros(1)}
    state = tr.adam_init(params)
    norm = tr.adam_step(params, {"a": np.array([3.0, 0.0]), "b": np.array([4.0])}, state, lr=0.1, clip=1.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose(state["m"]["a"], [0.1 * 3 / 5, 0.0])
    with pytest.raises(ValueError, match="lr"):
        tr.adam_step(params, {"a": np.zeros(2), "b": np.zeros(1)}, state, lr=-1)
    with pytest.raises(ValueError, match="grads"):
        tr.adam_step(params, {"a": np.zeros(2)}, state, lr=0.1)


# ----------------------------------------------------------------------------- the model

@pytest.mark.parametrize("mixer", sorted(tr.MODEL_LAYERS))
def test_model_gradient_matches_finite_differences(mixer):
    config = tr.ModelConfig(mixer, vocab_size=9, d_model=4, d_ff=5, conv_size=3)
    params = tr.init_model(config, 1)
    rng = np.random.default_rng(2)
    for name in params:                              # move away from the symmetric start (ones, zeros)
        params[name] = params[name] + 0.1 * rng.standard_normal(params[name].shape)
    tokens, targets = tr.mqar_data(2, vocab_size=9, n_pairs=2, seq_len=9, rng=3)
    _, grads = tr.loss_and_grads(params, config, tokens, targets)
    assert set(grads) == set(params)
    for name, p in params.items():
        fd = np.empty_like(p)
        for j in np.ndindex(*p.shape):
            old = p[j]
            values = []
            for h in (1e-6, -1e-6):
                p[j] = old + h
                values.append(tr.cross_entropy(tr.model_forward(params, config, tokens)[0], targets))
            p[j] = old
            fd[j] = (values[0] - values[1]) / 2e-6
        err = np.max(np.abs(grads[name] - fd)) / np.max(np.abs(fd))
        assert err <= BOUND, f"{mixer}: gradient of {name} off by {err:.1e} relative"


def test_model_keeps_float32_and_rejects_an_unknown_mixer():
    config = tr.ModelConfig("gated_delta", vocab_size=9, d_model=4)
    params = tr.init_model(config, 0, dtype=np.float32)
    tokens, targets = tr.mqar_data(2, vocab_size=9, n_pairs=2, seq_len=9, rng=0)
    loss, grads = tr.loss_and_grads(params, config, tokens, targets)
    assert math.isfinite(loss) and all(g.dtype == np.float32 for g in grads.values())
    with pytest.raises(ValueError, match="mixer"):
        tr.ModelConfig("lstm", vocab_size=9, d_model=4)


def test_a_tiny_training_run_learns():
    r = tr.train("softmax", d_model=8, n_pairs=2, steps=120, lr=3e-2, seed=0, vocab_size=16, seq_len=16,
                 batch_size=16, n_test=64)
    losses = r["losses"]
    assert np.all(np.isfinite(losses))
    assert losses[-20:].mean() < 0.5 * losses[:20].mean()
    assert r["test_accuracy"] > 3 / 8                 # chance is 1/8: the values are half of 16 tokens


def test_one_configuration_of_the_sweep_reproduces_its_stored_accuracy():
    """Rerun the cheapest stored configuration; its accuracy must agree within ``TOLERANCE``.

    The data, initialisation and order of operations are seeded, so on the machine
    that wrote the file the rerun is identical; on another processor float32
    rounding in a different BLAS kernel can move a few of the test answers, hence a
    tolerance of 0.03 (three percentage points of accuracy).
    """
    TOLERANCE = 0.03
    stored = json.loads((ROOT / "results" / "mqar_sweep.json").read_text())
    run = next(r for r in stored["runs"] if r["mixer"] == "softmax" and r["d_model"] == min(stored["settings"]["d_models"])
               and r["n_pairs"] == min(stored["settings"]["n_pairs"]) and r["seed"] == 0)
    again = tr.run_config(run["mixer"], run["d_model"], run["n_pairs"], run["seed"], run["lr"],
                          stored["settings"])
    assert abs(again["test_accuracy"] - run["test_accuracy"]) <= TOLERANCE


# ----------------------------------------------------------------------------- the SSD follow-up

def test_the_default_ssd_initialisation_is_the_sweeps():
    """Without ``ssd_dt_init`` the step bias is 0 (the sweep's init) and the draws are those of before."""
    config = tr.ModelConfig("ssd", vocab_size=9, d_model=4)
    params = tr.init_model(config, 0)
    assert all(params[f"layers.{i}.dt_bias"][0] == 0.0 and params[f"layers.{i}.A_log"][0] == 0.0 for i in range(2))
    assert "ssd_dt_init" not in tr.SWEEP
    other = tr.init_model(config, 0, ssd_dt_init=0.01)
    assert set(other) == set(params)
    for name in params:                               # only the step bias differs
        if not name.endswith("dt_bias"):
            np.testing.assert_array_equal(other[name], params[name])


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-13), (np.float32, 1e-6)])
def test_ssd_dt_init_sets_the_initial_step_and_decay(dtype, rtol):
    delta0 = 0.01
    config = tr.ModelConfig("ssd", vocab_size=9, d_model=4)
    params = tr.init_model(config, 0, dtype=dtype, ssd_dt_init=delta0)
    for i in range(2):
        b = params[f"layers.{i}.dt_bias"]
        assert b.dtype == dtype
        np.testing.assert_allclose(bl.softplus(b.astype(np.float64)), delta0, rtol=rtol)
        params[f"layers.{i}.W_dt"][:] = 0               # the input's share removed: every token's step is the bias's
    tokens, _ = tr.mqar_data(2, vocab_size=9, n_pairs=2, seq_len=9, rng=0)
    _, cache = tr.model_forward(params, config, tokens)
    for c in cache["layers"]:
        gates = c["mixer"]["gates"]
        decay = np.exp(gates["a"] * gates["delta"])
        np.testing.assert_allclose(decay, math.exp(-delta0), rtol=rtol)
    # a large step does not overflow the inverse softplus
    big = tr.init_model(config, 0, ssd_dt_init=800.0)
    np.testing.assert_allclose(big["layers.0.dt_bias"], 800.0, rtol=1e-15)


@pytest.mark.parametrize("bad", [0, 0.0, -0.01, math.nan, math.inf, True, "0.01", [0.01]])
def test_ssd_dt_init_rejects_bad_values(bad):
    config = tr.ModelConfig("ssd", vocab_size=9, d_model=4)
    with pytest.raises(ValueError, match="ssd_dt_init"):
        tr.init_model(config, 0, ssd_dt_init=bad)
    with pytest.raises(ValueError, match="ssd_dt_init"):
        tr.train("ssd", d_model=4, n_pairs=2, steps=1, lr=1e-2, seed=0, vocab_size=9, seq_len=9,
                 batch_size=2, n_test=2, ssd_dt_init=bad)


FOLLOWUP = ROOT / "results" / "mqar_ssd_followup.json"


def test_the_stored_followup_has_its_provenance_and_every_run():
    stored = json.loads(FOLLOWUP.read_text())
    s = stored["settings"]
    assert s["mixers"] == ["ssd"] and s["ssd_dt_init"] == 0.01
    sweep = json.loads((ROOT / "results" / "mqar_sweep.json").read_text())["settings"]
    assert {k: v for k, v in s.items() if k not in ("mixers", "ssd_dt_init")} == \
        {k: v for k, v in sweep.items() if k != "mixers"}          # the sweep's protocol otherwise
    prov = stored["provenance"]
    assert isinstance(prov["commit"], str) and len(prov["commit"]) == 40
    assert prov["uncommitted_changes"] is False
    for key in ("date", "machine", "tuning_budget", "init", "command", "wall_seconds"):
        assert prov[key], key
    assert prov["seeds"]["sweep"] == s["seeds"] and prov["seeds"]["tuning"] == s["tune_seed"]
    assert "0.01" in prov["init"]
    keys = [(r["d_model"], r["n_pairs"], r["seed"]) for r in stored["runs"]]
    assert sorted(keys) == [(d, n, seed) for d in s["d_models"] for n in s["n_pairs"] for seed in s["seeds"]]
    assert all(r["mixer"] == "ssd" and r["lr"] == stored["chosen_lr"]["ssd"] for r in stored["runs"])
    tuning = [r for r in stored["tuning"] if r["mixer"] == "ssd"]
    assert sorted(r["lr"] for r in tuning) == sorted(s["lr_grid"])
    assert all((r["d_model"], r["n_pairs"], r["seed"]) == (s["tune_d_model"], s["tune_n_pairs"], s["tune_seed"])
               for r in tuning)                                       # the sweep's tuning configuration
    assert "experiment-ssd" in prov["command"] and "--ssd-followup" in prov["command"]
    assert stored["chosen_lr"]["ssd"] == tr._choose_lr(tuning)       # the sweep's rule picked it


def test_one_configuration_of_the_followup_reproduces_its_stored_accuracy():
    """As the sweep's rerun test: the cheapest follow-up configuration, within the same tolerance."""
    TOLERANCE = 0.03
    stored = json.loads(FOLLOWUP.read_text())
    s = stored["settings"]
    run = next(r for r in stored["runs"] if r["d_model"] == min(s["d_models"])
               and r["n_pairs"] == min(s["n_pairs"]) and r["seed"] == 0)
    again = tr.run_config(run["mixer"], run["d_model"], run["n_pairs"], run["seed"], run["lr"], s)
    assert abs(again["test_accuracy"] - run["test_accuracy"]) <= TOLERANCE
