"""The recall sweep: its protocol, its engine (tools/mqar_sweep.py), and its stored result.

- a run trains on a mixture of lengths, one batch per step in turn, from one seeded
  stream, and is tested at each length on that length's own test set; with one
  length it is training.train exactly; its record gives accuracy, state and the
  hybrid's ablation by length;
- a sweep killed midway and started again finishes with every run once, and the same
  records as a sweep that was never stopped;
- a line cut off by the stop is dropped, and a store of other settings is refused;
- on a dask.distributed LocalCluster of two workers the sweep gives the same records
  as the local engine (every run is deterministic given its seeds);
- results/mqar_quick.json (make experiment-quick) and results/mqar_recall.json (make
  experiment): the cheapest run of each, trained again here, gives its stored accuracy
  exactly, and their summaries follow from their runs.

This file needs dask.distributed (the book's environment, pyproject's extra ``sweep``);
tools/test_pythons.py leaves it out of the wheel's environments.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fixedstate import mqar_stats as st
from fixedstate import training as tr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import mqar_calibrate  # noqa: E402
import mqar_sweep  # noqa: E402

TINY = {"mixers": ["softmax", "gated_delta"], "d_models": [4], "train_lengths": [[8, 2], [16, 4]],
        "lengths": [[8, 2], [16, 4]], "tune_length": [16, 4], "seeds": [0, 1], "steps": 24, "n_test": 8,
        "lr_grid": [3e-3, 1e-2, 3e-2], "max_widen": 0}
N_RUNS = 2 * 3 + 2 * 2          # tuning: 2 mixers x 3 rates; sweep: 2 mixers x 2 seeds


# ----------------------------------------------------------------------------- the protocol of a run

SMALL = dict(d_model=4, vocab_size=16, batch_size=4, n_test=8, distinct_values=True, test_seed=7)


@pytest.mark.parametrize("mixer", ["softmax", "gated_delta", "ssd", "hybrid"])
def test_a_mixture_of_one_length_is_train(mixer):
    one = tr.train(mixer, n_pairs=2, seq_len=8, steps=7, lr=3e-2, seed=5, **SMALL)
    mix = tr.train_mixture(mixer, train_lengths=[(8, 2)], lengths=[(8, 2)], steps=7, lr=3e-2, seed=5, **SMALL)
    assert np.array_equal(one["losses"], mix["losses"]) and np.isfinite(one["losses"]).all()
    assert all(np.array_equal(one["params"][k], mix["params"][k]) for k in one["params"])
    assert mix["test_accuracy"] == {8: one["test_accuracy"]}
    assert all(np.array_equal(a, b) for a, b in zip(one["test_set"], mix["test_sets"][8]))


@pytest.mark.parametrize("steps, tail", [(20, 3), (65, 6), (2, 2)])
def test_a_mixture_takes_its_lengths_in_turn_from_one_stream_and_tests_each_on_its_own_set(steps, tail):
    # with a learning rate of 0 the parameters stay the initial ones, so every loss can be recomputed
    mixture, tested = [(8, 2), (12, 3), (16, 4)], [(16, 4), (10, 2)]
    r = tr.train_mixture("softmax", train_lengths=mixture, lengths=tested, steps=steps, lr=0.0, seed=3, **SMALL)
    config = tr.ModelConfig("softmax", SMALL["vocab_size"], SMALL["d_model"])
    params = tr.init_model(config, np.random.default_rng((3, 0)), dtype=np.float32)
    assert all(np.array_equal(params[k], r["params"][k]) for k in params)
    data = np.random.default_rng((3, 1))
    for step in range(min(steps, 21)):                            # seven cycles are enough to see the order
        seq_len, n_pairs = mixture[step % 3]
        tokens, targets = tr.mqar_data(4, vocab_size=16, n_pairs=n_pairs, seq_len=seq_len, rng=data,
                                       distinct_values=True)
        assert tr.loss_and_grads(params, config, tokens, targets)[0] == r["losses"][step]
    assert r["final_loss"] == np.mean(r["losses"][-tail:])        # whole cycles of the mixture, at least one
    assert set(r["test_accuracy"]) == set(r["test_sets"]) == {16, 10}
    for seq_len, n_pairs in tested:
        tokens, targets = tr.mqar_data(8, vocab_size=16, n_pairs=n_pairs, seq_len=seq_len,
                                       rng=np.random.default_rng((7, n_pairs)), distinct_values=True)
        assert np.array_equal(r["test_sets"][seq_len][0], tokens)
        assert r["test_accuracy"][seq_len] == tr.evaluate(params, config, tokens, targets)


@pytest.mark.parametrize("kwargs, name", [({"train_lengths": []}, "train_lengths"),
                                          ({"train_lengths": [(8, 2, 1)]}, "train_lengths"),
                                          ({"train_lengths": "8,2"}, "train_lengths"),
                                          ({"lengths": [(8, 2), (8, 1)]}, "lengths"),
                                          ({"lengths": [(8, 0)]}, "lengths"),
                                          ({"steps": 0}, "steps")])
def test_train_mixture_bad_input(kwargs, name):
    args = {"train_lengths": [(8, 2)], "lengths": [(8, 2)], "steps": 2, "lr": 1e-2, "seed": 0, **SMALL, **kwargs}
    with pytest.raises(ValueError, match=name):
        tr.train_mixture("softmax", **args)


def test_a_runs_record_gives_accuracy_state_and_the_hybrids_ablation_by_length():
    settings = {**tr.RECALL_QUICK, "d_models": (4,), "train_lengths": ((8, 2), (16, 4)),
                "lengths": ((8, 2), (16, 4), (32, 4)), "seeds": (0,), "steps": 6, "n_test": 8}
    runs = {r["mixer"]: r for r in tr.recall_main_runs(settings, {(m, 4): 1e-2 for m in ("softmax", "swa", "hybrid")})}
    lengths = {"8", "16", "32"}
    soft, hybrid = tr.recall_run(runs["softmax"]), tr.recall_run(runs["hybrid"])
    for rec in (soft, hybrid):
        assert set(rec["test_accuracy"]) == set(rec["state_bytes"]) == lengths
        assert json.loads(json.dumps(rec)) == rec                      # the store holds it as it is
        assert rec["train_lengths"] == [[8, 2], [16, 4]] and rec["key"] == tr.run_key(runs[rec["mixer"]])
    # attention's KV cache grows with the length; the hybrid's fixed-state layer adds a constant d x d
    assert soft["state_bytes"]["32"] == 2 * soft["state_bytes"]["16"] == 4 * soft["state_bytes"]["8"]
    assert hybrid["state_bytes"]["32"] - soft["state_bytes"]["32"] / 2 == 4 * 4 * 4
    assert soft["ablation"] is None and set(hybrid["ablation"]) == {"0", "1"}
    assert all(set(by_length) == lengths for by_length in hybrid["ablation"].values())


# ----------------------------------------------------------------------------- the engine


def _command(store, out, *extra):
    return [sys.executable, str(ROOT / "tools" / "mqar_sweep.py"), "--settings", "quick", "--override",
            json.dumps(TINY), "--store", str(store), "--out", str(out), *extra]


def _records(out):
    result = json.loads(Path(out).read_text())
    drop = ("seconds", "seconds_per_step", "commit")
    return {r["key"]: {k: v for k, v in r.items() if k not in drop} for r in result["tuning"] + result["runs"]}


def _store_keys(store):
    lines = Path(store).read_text().splitlines()
    return [json.loads(line)["key"] for line in lines[1:]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The tiny sweep run once without a stop, on the local engine with two workers."""
    d = tmp_path_factory.mktemp("straight")
    subprocess.run(_command(d / "store.jsonl", d / "out.json", "--workers", "2"), check=True, cwd=ROOT,
                   capture_output=True, timeout=300)
    return _records(d / "out.json")


def test_a_straight_sweep_has_every_run_once(straight):
    assert len(straight) == N_RUNS
    assert {r["stage"] for r in straight.values()} == {"tune", "main"}


def test_killed_midway_then_resumed_gives_every_run_once_and_the_same_records(tmp_path, straight):
    store, out = tmp_path / "store.jsonl", tmp_path / "out.json"
    proc = subprocess.Popen(_command(store, out, "--workers", "1"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if store.exists() and len(store.read_text().splitlines()) >= 1 + 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the sweep finished before it could be stopped"
    os.killpg(proc.pid, signal.SIGKILL)                    # the sweep and its worker, mid-run
    proc.wait()
    done_before = _store_keys(store)
    assert 3 <= len(done_before) < N_RUNS and not out.exists()
    result = subprocess.run(_command(store, out, "--workers", "1"), cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=True)
    assert f"({len(done_before)} runs already done)" in result.stdout
    keys = _store_keys(store)
    assert len(keys) == len(set(keys)) == N_RUNS                  # none lost, none twice
    assert keys[:len(done_before)] == done_before
    assert _records(out) == straight
    provenance = json.loads(out.read_text())["provenance"]
    assert provenance["runs_from_earlier_invocations"] == len(done_before)


def test_a_cut_off_line_is_dropped_and_other_settings_are_refused(tmp_path):
    settings = {**tr.RECALL_QUICK, **TINY}
    path = tmp_path / "s.jsonl"
    store = mqar_sweep.Store(path, settings)
    store.add({"key": "a", "x": 1})
    with open(path, "a") as f:
        f.write('{"key": "b", "x"')                             # the stop came mid-line
    again = mqar_sweep.Store(path, settings)
    assert list(again.records) == ["a"] and path.read_text().endswith('"x": 1}\n')
    with pytest.raises(ValueError, match="already"):
        again.add({"key": "a", "x": 2})
    with pytest.raises(SystemExit, match="other settings"):
        mqar_sweep.Store(path, {**settings, "steps": 26})
    assert mqar_sweep.Store(path, {**settings, "steps": 26}, fresh=True).records == {}


def test_a_two_worker_dask_cluster_gives_the_same_records(tmp_path, straight):
    out = tmp_path / "out.json"
    subprocess.run(_command(tmp_path / "store.jsonl", out, "--engine", "dask", "--workers", "2"), cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    assert _records(out) == straight
    provenance = json.loads(out.read_text())["provenance"]
    assert provenance["engine"] == "dask" and provenance["workers"] == 2


STORED = {"quick": (ROOT / "results" / "mqar_quick.json", tr.RECALL_QUICK),
          "full": (ROOT / "results" / "mqar_recall.json", tr.RECALL_SWEEP)}


@pytest.mark.parametrize("name", sorted(STORED))
def test_a_stored_sweep_reproduces_and_its_summaries_follow_from_its_runs(name):
    """make experiment-quick's and make experiment's stored results: the cheapest run, trained again at this
    commit, gives its stored accuracy and loss exactly; the settings are the package's; every point, rate
    and baseline follows from the stored runs."""
    path, package_settings = STORED[name]
    stored = json.loads(path.read_text())
    prov = stored["provenance"]
    assert prov["commit"] and prov["clean_tree"] is True and prov["engine"] in ("local", "dask")
    assert prov["workers"] >= 1 and prov["seeds"]["sweep"] == list(stored["settings"]["seeds"])
    assert stored["settings"] == mqar_sweep._jsonable(package_settings)
    cheapest = min(stored["runs"], key=lambda r: (r["d_model"], r["seconds"]))
    run = {k: cheapest[k] for k in tr.recall_main_runs(package_settings, {
        (m, d): 0.0 for m in package_settings["mixers"] for d in package_settings["d_models"]})[0]}
    again = tr.recall_run(run)
    assert again["test_accuracy"] == cheapest["test_accuracy"]
    assert again["final_loss"] == cheapest["final_loss"]
    settings = stored["settings"]
    for length in settings["lengths"]:
        assert stored["baselines"][str(length[0])] == json.loads(json.dumps(tr.recall_baseline(settings, length)))
    assert len(stored["points"]) == len(settings["mixers"]) * len(settings["d_models"]) * len(settings["lengths"])
    for point in stored["points"]:
        t = str(point["seq_len"])
        recs = [r for r in stored["runs"] if (r["mixer"], r["d_model"]) == (point["mixer"], point["d_model"])]
        assert len(recs) == len(settings["seeds"])
        base = stored["baselines"][t]
        expect = st.point_summary([r["test_accuracy"][t] for r in recs], baseline=base["test_set"],
                                  baseline_se=base["test_set_se"], threshold=settings["threshold"],
                                  margin=settings["margin"])
        assert point["solved"] == expect["solved"] and point["above"] == expect["above"]
        assert point["solved_ci"] == list(expect["solved_ci"]) and point["mean"] == expect["mean"]
        assert point["state_bytes"] == recs[0]["state_bytes"][t]
        if point["mixer"] == "hybrid":
            assert point["ablation_mean"] == {i: np.mean([r["ablation"][i][t] for r in recs]) for i in ("0", "1")}
    for key, lr in stored["chosen_lr"].items():
        m, d = key.split("|")
        tuning = [r for r in stored["tuning"] if (r["mixer"], str(r["d_model"])) == (m, d)]
        assert st.choose_lr(tuning, at=settings["tune_length"][0])[0] == lr


def test_the_budget_is_runs_times_steps_times_seconds_over_cores():
    settings = {"mixers": ["softmax", "linear"], "train_lengths": [(8, 2), (16, 4)], "d_models": [4, 8],
                "seeds": [0, 1, 2], "lr_grid": [1, 2], "max_widen": 2, "steps": 10}
    rows = [{"mixer": m, "seq_len": T, "d_model": d, "step": 2.0 * T + d}
            for m in settings["mixers"] for T in (8, 16) for d in (4, 8) if (m, T, d) != ("linear", 16, 8)]
    lines = []
    steps = mqar_calibrate.budget(rows, settings, cores=2, minutes=100, print_line=lines.append)
    # a run's step is the mean over the mixture's lengths, (2 * 8 + d + 2 * 16 + d) / 2 = 24 + d; 3 seeds + 2 rates
    # per mixer and width; linear's missing row (T = 16, d = 8) takes softmax's, the same here
    per_step = 2 * (3 + 2) * ((24 + 4) + (24 + 8))
    assert steps == 12000 // per_step == 20 and any("not measured" in line for line in lines)
    assert f"{per_step:.1f} core-seconds" in lines[-1] and f"{per_step * 7 / 5:.1f} if every grid" in lines[-1]
    with pytest.raises(ValueError, match="rows: no mixer measured at T = 16, d = 8"):
        mqar_calibrate.budget([r for r in rows if (r["seq_len"], r["d_model"]) != (16, 8)], settings, cores=2,
                              minutes=100, print_line=lines.append)
