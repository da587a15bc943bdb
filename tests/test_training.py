"""Tests for fixedstate.training (chapter 9); the blocks' backward passes are tested in test_blocks.py.

Every gradient is checked against central finite differences in float64 with
``fixedstate.gradcheck`` (relative error <= 1e-6, the bound the chapter states);
Adam is checked on a quadratic; a tiny training run must learn; and one
configuration of the stored sweep is rerun and must reproduce its accuracy.
"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from _finite_differences import BOUND, check

from fixedstate import blocks as bl
from fixedstate import training as tr

ROOT = Path(__file__).resolve().parent.parent


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
    config = tr.ModelConfig(mixer, vocab_size=9, d_model=4, d_ff=5, conv_size=3,
                            window=3 if mixer == "swa" else None)          # a window shorter than the 9 tokens
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


@pytest.mark.parametrize("mixer", sorted(tr.MODEL_LAYERS))
def test_the_model_checks_its_parameters_once_at_its_boundary(mixer):
    """The blocks inside the model run unchecked, so model_forward and model_backward check every parameter
    first: present, of its shape, finite (a ValueError naming it); param_shapes lists init_model's."""
    config = tr.ModelConfig(mixer, vocab_size=9, d_model=4, window=3 if mixer == "swa" else None)
    params = tr.init_model(config, 0, dtype=np.float32, ssd_init="mamba2" if mixer == "ssd" else "unit")
    assert {n: p.shape for n, p in params.items()} == tr.param_shapes(config)
    assert list(params) == list(tr.param_shapes(config))
    tokens, targets = tr.mqar_data(2, vocab_size=9, n_pairs=2, seq_len=9, rng=0)
    logits, cache = tr.model_forward(params, config, tokens)
    d_logits = tr.cross_entropy_backward(logits, targets)
    for name in params:
        for bad, what in ((np.full_like(params[name], np.nan), "finite"),
                          (np.zeros(params[name].shape + (1,), params[name].dtype), "shape")):
            broken = {**params, name: bad}
            with pytest.raises(ValueError, match=rf"params\['{re.escape(name)}'\].*{what}"):
                tr.model_forward(broken, config, tokens)
            with pytest.raises(ValueError, match=rf"params\['{re.escape(name)}'\].*{what}"):
                tr.model_backward(broken, config, cache, d_logits)
        missing = {n: p for n, p in params.items() if n != name}
        with pytest.raises(ValueError, match=re.escape(repr(name))):
            tr.model_forward(missing, config, tokens)
    as_lists = {n: p.tolist() for n, p in params.items()}      # array-likes are taken as the blocks took them
    np.testing.assert_array_equal(tr.model_forward(as_lists, config, tokens)[0],
                                  tr.model_forward({n: p.astype(np.float64) for n, p in params.items()},
                                                   config, tokens)[0])


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
    assert stored["chosen_lr"]["ssd"] == tr.choose_lr(tuning)       # the sweep's rule picked it


def test_one_configuration_of_the_followup_reproduces_its_stored_accuracy():
    """As the sweep's rerun test: the cheapest follow-up configuration, within the same tolerance."""
    TOLERANCE = 0.03
    stored = json.loads(FOLLOWUP.read_text())
    s = stored["settings"]
    run = next(r for r in stored["runs"] if r["d_model"] == min(s["d_models"])
               and r["n_pairs"] == min(s["n_pairs"]) and r["seed"] == 0)
    again = tr.run_config(run["mixer"], run["d_model"], run["n_pairs"], run["seed"], run["lr"], s)
    assert abs(again["test_accuracy"] - run["test_accuracy"]) <= TOLERANCE


# ----------------------------------------------------------------------------- the recall sweep (issue 30)

def test_a_window_is_required_by_swa_and_checked():
    with pytest.raises(ValueError, match="window"):
        tr.ModelConfig("swa", vocab_size=9, d_model=4)
    with pytest.raises(ValueError, match="window"):
        tr.ModelConfig("swa", vocab_size=9, d_model=4, window=0)
    assert tr.ModelConfig("swa", vocab_size=9, d_model=4, window=2).options("swa") == {"window": 2}
    assert tr.ModelConfig("softmax", vocab_size=9, d_model=4).options("softmax") == {}


def test_swa_with_a_window_of_the_whole_sequence_is_the_softmax_model():
    tokens, targets = tr.mqar_data(2, vocab_size=9, n_pairs=2, seq_len=9, rng=3)
    soft = tr.ModelConfig("softmax", vocab_size=9, d_model=4)
    swa = tr.ModelConfig("swa", vocab_size=9, d_model=4, window=9)
    params = tr.init_model(soft, 0)
    assert set(params) == set(tr.init_model(swa, 0))
    np.testing.assert_allclose(tr.model_forward(params, swa, tokens)[0], tr.model_forward(params, soft, tokens)[0],
                               rtol=1e-13, atol=1e-13)


def test_zeroing_a_core_is_the_model_with_that_layers_mixer_writing_nothing():
    config = tr.ModelConfig("hybrid", vocab_size=9, d_model=4)
    params = tr.init_model(config, 0)
    tokens, targets = tr.mqar_data(3, vocab_size=9, n_pairs=2, seq_len=9, rng=3)
    silent = dict(params)
    silent["layers.1.W_o"] = np.zeros_like(params["layers.1.W_o"])    # W_o applied to a zero core output
    np.testing.assert_allclose(tr.model_forward(params, config, tokens, zero_cores=(1,))[0],
                               tr.model_forward(silent, config, tokens)[0], rtol=1e-14, atol=1e-14)
    assert not np.allclose(tr.model_forward(params, config, tokens, zero_cores=(0,))[0],
                           tr.model_forward(params, config, tokens)[0])
    assert tr.evaluate(params, config, tokens, targets, zero_cores=()) == tr.evaluate(params, config, tokens, targets)
    for bad in ((2,), (-1,), 1, (True,)):
        with pytest.raises(ValueError, match="zero_cores"):
            tr.model_forward(params, config, tokens, zero_cores=bad)


def test_the_mamba2_initialisation_of_the_ssd():
    config = tr.ModelConfig("ssd", vocab_size=9, d_model=4)
    a_logs, steps = [], []
    for seed in range(200):
        p = tr.init_model(config, seed, ssd_init="mamba2")
        a_logs += [p["layers.0.A_log"][0], p["layers.1.A_log"][0]]
        steps += [float(np.log1p(np.exp(p["layers.0.dt_bias"][0]))), float(np.log1p(np.exp(p["layers.1.dt_bias"][0])))]
    A, steps = np.exp(a_logs), np.array(steps)
    assert 1 <= A.min() and A.max() <= 16 and A.max() - A.min() > 12                   # U(1, 16)
    assert 1e-3 * (1 - 1e-9) <= steps.min() and steps.max() <= 0.1 * (1 + 1e-9)        # log-uniform in [1e-3, 0.1]
    assert abs(np.mean(np.log(steps)) - 0.5 * (np.log(1e-3) + np.log(0.1))) < 0.3
    unit = tr.init_model(config, 0)
    assert unit["layers.0.A_log"][0] == 0 and unit["layers.0.dt_bias"][0] == 0
    with pytest.raises(ValueError, match="ssd_init"):
        tr.init_model(config, 0, ssd_init="s4d")
    with pytest.raises(ValueError, match="ssd_dt_init"):
        tr.init_model(config, 0, ssd_init="mamba2", ssd_dt_init=0.01)


def test_the_recall_sweeps_meet_the_issues_minimums():
    s = tr.RECALL_SWEEP
    assert set(s["mixers"]) == {"softmax", "swa", "linear", "delta", "gated_delta", "ssd", "hybrid"}
    assert len(s["d_models"]) >= 4 and len(s["lengths"]) >= 2 and len(s["seeds"]) >= 5
    assert max(n for _, n in s["lengths"]) >= 32 and s["vocab_size"] >= 128 and s["distinct_values"]
    assert s["ssd_init"] == "mamba2" and s["tune_seed"] not in s["seeds"] and len(s["lr_grid"]) >= 3
    assert tuple(s["tune_length"]) == max(tuple(x) for x in s["lengths"])
    q = tr.RECALL_QUICK
    assert set(q["mixers"]) <= set(s["mixers"]) and q["tune_seed"] not in q["seeds"]


def test_recall_runs_are_listed_once_each_and_a_run_is_deterministic():
    s = {**tr.RECALL_QUICK, "mixers": ("swa", "hybrid"), "d_models": (4,), "lengths": ((16, 4),),
         "tune_length": (16, 4), "seeds": (0, 1), "steps": 6, "n_test": 8}
    tune = tr.recall_tuning_runs(s)
    main = tr.recall_main_runs(s, {("swa", 4): 1e-2, ("hybrid", 4): 3e-2})
    keys = [tr.run_key(r) for r in tune + main]
    assert len(keys) == len(set(keys)) == 2 * len(s["lr_grid"]) + 2 * 2
    first, again = tr.recall_run(main[-1]), tr.recall_run(main[-1])
    assert first["mixer"] == "hybrid" and first["key"] == tr.run_key(main[-1])
    for name in ("test_accuracy", "final_loss", "ablation", "state_bytes"):
        assert first[name] == again[name]
    assert set(first["ablation"]) == {"0", "1"}
    swa = tr.recall_run(main[0])
    assert swa["window"] == tr.swa_window(4) == 3 and swa["ablation"] is None
    base = tr.recall_baseline(s, (16, 4))
    assert abs(base["test_set"] - base["expected"]) < 4 * base["test_set_se"] + 0.05
