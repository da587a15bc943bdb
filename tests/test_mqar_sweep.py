"""The recall sweep's engine (tools/mqar_sweep.py): resumable, the same records on any engine, and its stored result.

- a sweep killed midway and started again finishes with every run once, and the same
  records as a sweep that was never stopped;
- a line cut off by the stop is dropped, and a store of other settings is refused;
- on a dask.distributed LocalCluster of two workers the sweep gives the same records
  as the local engine (every run is deterministic given its seeds);
- results/mqar_quick.json (make experiment-quick): its cheapest run, trained again here,
  gives its stored accuracy exactly, and its summaries follow from its runs.

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

import pytest

from fixedstate import mqar_stats as st
from fixedstate import training as tr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import mqar_calibrate  # noqa: E402
import mqar_sweep  # noqa: E402

TINY = {"mixers": ["softmax", "gated_delta"], "d_models": [4], "lengths": [[16, 4]], "tune_length": [16, 4],
        "seeds": [0, 1], "steps": 25, "n_test": 8, "lr_grid": [3e-3, 1e-2, 3e-2], "max_widen": 0}
N_RUNS = 2 * 3 + 2 * 2          # tuning: 2 mixers x 3 rates; sweep: 2 mixers x 2 seeds


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


QUICK = ROOT / "results" / "mqar_quick.json"


def test_the_stored_quick_sweep_reproduces_and_its_summaries_follow_from_its_runs():
    stored = json.loads(QUICK.read_text())
    prov = stored["provenance"]
    assert prov["commit"] and prov["clean_tree"] is True and prov["engine"] in ("local", "dask")
    assert prov["workers"] >= 1 and prov["seeds"]["sweep"] == list(stored["settings"]["seeds"])
    cheapest = min(stored["runs"], key=lambda r: (r["d_model"], r["seq_len"], r["seconds"]))
    run = {k: cheapest[k] for k in tr.recall_main_runs(tr.RECALL_QUICK, {
        (m, d): 0.0 for m in tr.RECALL_QUICK["mixers"] for d in tr.RECALL_QUICK["d_models"]})[0]}
    again = tr.recall_run(run)
    assert again["test_accuracy"] == cheapest["test_accuracy"]
    assert again["final_loss"] == cheapest["final_loss"]
    for point in stored["points"]:
        accs = [r["test_accuracy"] for r in stored["runs"]
                if (r["mixer"], r["d_model"], r["seq_len"]) == (point["mixer"], point["d_model"], point["seq_len"])]
        base = stored["baselines"][str(point["seq_len"])]
        expect = st.point_summary(accs, baseline=base["test_set"], baseline_se=base["test_set_se"],
                                  threshold=stored["settings"]["threshold"], margin=stored["settings"]["margin"])
        assert point["solved"] == expect["solved"] and point["above"] == expect["above"]
        assert point["solved_ci"] == list(expect["solved_ci"])
    for key, lr in stored["chosen_lr"].items():
        m, d = key.split("|")
        tuning = [r for r in stored["tuning"] if (r["mixer"], str(r["d_model"])) == (m, d)]
        assert st.choose_lr(tuning)[0] == lr


def test_the_budget_is_runs_times_steps_times_seconds_over_cores():
    settings = {"mixers": ["softmax", "linear"], "lengths": [(8, 2), (16, 4)], "tune_length": (16, 4),
                "d_models": [4, 8], "seeds": [0, 1, 2], "lr_grid": [1, 2], "steps": 10}
    rows = [{"mixer": m, "seq_len": T, "d_model": d, "step": 2.0 * T, "projected": 1.0 * T}
            for m in settings["mixers"] for T in (8, 16) for d in (4, 8) if (m, T, d) != ("linear", 16, 8)]
    lines = []
    steps = mqar_calibrate.budget(rows, settings, cores=2, minutes=100, print_line=lines.append)
    # per mixer: 3 seeds x 2 widths at T = 8, (3 + 2) x 2 widths at T = 16; linear's missing row takes softmax's
    per_step = 2 * (3 * 2 * 8 + 5 * 2 * 16)
    assert steps == 12000 // per_step == 28 and any("not measured" in line for line in lines)
    assert f"{per_step} projected" in lines[-1]
