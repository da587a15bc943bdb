"""Run chapter 9's recall-against-state sweep: a list of independent runs, on every local core or a Dask cluster.

    .venv/bin/python tools/mqar_sweep.py --settings full   [--out results/mqar_recall.json]   # make experiment
    .venv/bin/python tools/mqar_sweep.py --settings quick  [--out results/mqar_quick.json]    # make experiment-quick
    ... --engine dask --workers 2                      # a LocalCluster of 2 worker processes
    ... --engine dask --scheduler tcp://host:8786      # an existing dask.distributed cluster

The sweep (``fixedstate.training.RECALL_SWEEP`` or ``RECALL_QUICK``) has two
stages, each a list of independent runs (``fixedstate.training.recall_run``).
Every run, as in Zoology, trains on the mixture of lengths ``train_lengths``
(one batch per step, cycled in order) and is tested at each of ``lengths``:

1. tuning: every mixer and width on the tuning seed, one run per learning rate
   of the grid, the rate chosen by the accuracy at ``tune_length`` (the
   longest), then the mean accuracy over the lengths, then the final loss
   (``fixedstate.mqar_stats.choose_lr``); where the chosen rate sits at an edge
   of the grid, the grid is widened by one value beyond that edge and the new
   rate run, up to ``max_widen`` times; a choice still at an edge after that is
   flagged in the results;
2. the sweep: every mixer, width and seed at its chosen rate, each run tested at
   every length.

Engines: ``local`` (the default) runs the runs in worker processes, one per core
(``--workers``, default every core), through ``concurrent.futures``; ``dask``
submits them to a ``dask.distributed`` cluster through dask's own ``Client``:
the scheduler at ``--scheduler``, or a ``LocalCluster`` of ``--workers``
single-threaded worker processes. Every worker runs numpy with one BLAS thread.

Every finished run is appended at once to the store (``--store``, a JSON-lines
file; default ``_build/sweeps/<name>.jsonl``), one line per run with its key. A
sweep that is stopped (Ctrl-C, a crash, a killed machine) and started again with
the same settings reads the store, skips every run already in it (a line cut off
by the stop is dropped), and runs only the rest: no run is lost or counted twice.
A store written under other settings is refused (``--fresh`` starts it anew).
The console shows each run as it finishes, with done/total and the estimated
time left.

At the end it writes ``--out``: the settings, the chosen rates (and any at an
edge), the tuning and sweep records, the no-retrieval baseline at each length, a
summary per point, that is per mixer, width and tested length
(``fixedstate.mqar_stats.point_summary``: mean, fraction solved and fraction
above the baseline with 95% Wilson intervals; the state in bytes at that
length; the hybrid's ablation there), and the provenance (commit, whether the tree was clean, date, machine, seeds,
grid, engine, workers, wall time).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fixedstate import mqar_stats as st
from fixedstate import training as tr

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"full": tr.RECALL_SWEEP, "quick": tr.RECALL_QUICK}
OUT = {"full": "results/mqar_recall.json", "quick": "results/mqar_quick.json"}


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _jsonable(settings):
    return json.loads(json.dumps(settings))


def settings_hash(settings) -> str:
    """A short hash of the settings, which the store's first line records."""
    return hashlib.sha256(json.dumps(_jsonable(settings), sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the store

class Store:
    """An append-only JSON-lines file of finished runs, keyed by ``fixedstate.training.run_key``.

    The first line is a header with the settings' hash. Opening an existing
    store reads its records, drops a last line that a stop cut off (no newline
    at its end, or not valid JSON), and refuses a store of other settings.
    """

    def __init__(self, path, settings, *, fresh=False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = {}
        header = {"store": "mqar_sweep", "settings_hash": settings_hash(settings)}
        if fresh or not self.path.exists() or self.path.stat().st_size == 0:
            self.path.write_text(json.dumps(header) + "\n")
            return
        raw = self.path.read_bytes()
        complete = raw[:raw.rfind(b"\n") + 1]               # a cut-off last line is dropped
        lines = complete.decode().splitlines()
        first = json.loads(lines[0]) if lines else {}
        if first.get("settings_hash") != header["settings_hash"]:
            raise SystemExit(f"{self.path}: a store of other settings (hash {first.get('settings_hash')}, these "
                             f"are {header['settings_hash']}); pass --fresh to start anew, or --store another file")
        for line in lines[1:]:
            rec = json.loads(line)
            self.records[rec["key"]] = rec
        if len(complete) != len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))

    def add(self, record):
        if record["key"] in self.records:
            raise ValueError(f"run {record['key']} is in the store already")
        self.records[record["key"]] = record
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


# ----------------------------------------------------------------------------- the engines

def _one_thread_env():
    # OpenMP and BLAS libraries a run loads after this point; numpy's BLAS, loaded already, is held to one
    # thread by each run itself (fixedstate.training.recall_run)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"


class LocalEngine:
    """Worker processes on this machine (``concurrent.futures``, the spawn start method)."""

    name = "local"

    def __init__(self, workers):
        self.workers = workers
        self.pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                           initializer=_one_thread_env)

    def map_unordered(self, fn, items):
        futures = [self.pool.submit(fn, item) for item in items]
        for f in concurrent.futures.as_completed(futures):
            yield f.result()

    def close(self):
        self.pool.shutdown(cancel_futures=True)


class DaskEngine:
    """A ``dask.distributed`` cluster through its ``Client``: an existing scheduler, or a ``LocalCluster``."""

    name = "dask"

    def __init__(self, workers, scheduler=None):
        from dask.distributed import Client, LocalCluster

        self.cluster = None
        if scheduler:
            self.client = Client(scheduler)
        else:
            self.cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                        dashboard_address=None, env={v: "1" for v in ("OMP_NUM_THREADS",
                                                                                      "OPENBLAS_NUM_THREADS",
                                                                                      "MKL_NUM_THREADS")})
            self.client = Client(self.cluster)
        self.workers = len(self.client.scheduler_info()["workers"]) or workers

    def map_unordered(self, fn, items):
        from dask.distributed import as_completed

        futures = [self.client.submit(fn, item, pure=False) for item in items]
        for f in as_completed(futures):
            yield f.result()

    def close(self):
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


def make_engine(engine, workers, scheduler=None):
    if engine == "local":
        return LocalEngine(workers)
    if engine == "dask":
        return DaskEngine(workers, scheduler)
    raise SystemExit(f"--engine: expected 'local' or 'dask', got {engine!r}")


# ----------------------------------------------------------------------------- the sweep

class Progress:
    """Prints done/total and the estimated time left after each run (the total grows as tuning widens grids)."""

    def __init__(self, print_line=print):
        self.print_line = print_line
        self.start = time.perf_counter()
        self.done_here = 0
        self.seconds_here = 0.0

    def line(self, rec, done, total, workers):
        self.done_here += 1
        elapsed = time.perf_counter() - self.start
        left = elapsed / self.done_here * (total - done)
        acc = "diverged" if rec["diverged"] else "acc " + " ".join(
            f"T{t}:{a:.3f}" for t, a in rec["test_accuracy"].items())
        self.print_line(f"[{done:4d}/{total}] {rec['stage']:4s} {rec['mixer']:>11s} d={rec['d_model']:<3d} "
                        f"seed={rec['seed']:<3d} lr={rec['lr']:.1e}: {acc} "
                        f"({rec['seconds']:.0f} s); elapsed {elapsed / 60:.1f} min, about {left / 60:.1f} min left")


def run_all(runs, store, engine, progress, total_hint, commit=None):
    """Run every run whose key is not in ``store``; add each record to it as it finishes (with the
    ``commit`` it ran at); return the records of ``runs``, in order."""
    todo = [r for r in runs if tr.run_key(r) not in store.records]
    for rec in engine.map_unordered(tr.recall_run, todo):
        store.add({**rec, "commit": commit})
        progress.line(rec, len(store.records), max(total_hint(), len(store.records)), engine.workers)
    return [store.records[tr.run_key(r)] for r in runs]


def tune(settings, store, engine, progress, total_hint, commit=None):
    """The tuning stage: run the grids, widen those whose choice sits at an edge; return chosen rates and flags."""
    grids = {(m, d): list(settings["lr_grid"]) for m in settings["mixers"] for d in settings["d_models"]}
    widened = {key: 0 for key in grids}
    while True:
        records = run_all(tr.recall_tuning_runs(settings, grids), store, engine, progress, total_hint, commit)
        chosen, edges, more = {}, {}, False
        for key, grid in grids.items():
            recs = [r for r in records if (r["mixer"], r["d_model"]) == key]
            lr, where = st.choose_lr(recs, at=settings["tune_length"][0])
            chosen[key] = lr
            if where != "inside":
                if widened[key] < settings["max_widen"]:
                    grid.extend(st.widen_grid(grid, where))
                    widened[key] += 1
                    more = True
                else:
                    edges[key] = where
        if not more:
            return chosen, edges, grids


def summarise(settings, main, baselines):
    """Per point (mixer, width, tested length): the statistics of :func:`fixedstate.mqar_stats.point_summary`
    over the seeds' accuracies at that length, the state in bytes there and, for the hybrid, the mean
    accuracy there with each layer's core zeroed (``ablation_mean``, by layer; over the runs that did not
    diverge)."""
    points = []
    for m in settings["mixers"]:
        for d in settings["d_models"]:
            recs = [r for r in main if (r["mixer"], r["d_model"]) == (m, d)]
            for seq_len, n_pairs in settings["lengths"]:
                t = str(seq_len)
                b = baselines[t]
                s = st.point_summary([None if r["diverged"] else r["test_accuracy"][t] for r in recs],
                                     baseline=b["test_set"], baseline_se=b["test_set_se"],
                                     threshold=settings["threshold"], margin=settings["margin"])
                point = {"mixer": m, "d_model": d, "seq_len": seq_len, "n_pairs": n_pairs,
                         "state_bytes": recs[0]["state_bytes"][t], "lr": recs[0]["lr"], **s}
                ablated = [r["ablation"] for r in recs if r["ablation"] is not None]
                if ablated:
                    point["ablation_mean"] = {i: float(np.mean([a[i][t] for a in ablated])) for i in ablated[0]}
                points.append(point)
    return points


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", choices=sorted(SETTINGS), default="full")
    ap.add_argument("--engine", choices=("local", "dask"), default="local")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="worker processes (default: every core)")
    ap.add_argument("--scheduler", default=None, help="with --engine dask: the address of an existing scheduler")
    ap.add_argument("--store", default=None, help="the JSON-lines store of finished runs")
    ap.add_argument("--fresh", action="store_true", help="start the store anew")
    ap.add_argument("--out", default=None)
    ap.add_argument("--override", default=None,
                    help="a JSON object of settings to change (tests: tiny sweeps)")
    args = ap.parse_args(argv)
    settings = dict(SETTINGS[args.settings])
    if args.override:
        settings.update(json.loads(args.override))
    settings = _jsonable(settings)
    settings["lengths"] = [tuple(x) for x in settings["lengths"]]
    settings["train_lengths"] = [tuple(x) for x in settings["train_lengths"]]
    settings["tune_length"] = tuple(settings["tune_length"])
    if settings["tune_length"] not in settings["lengths"]:
        raise SystemExit(f"tune_length: expected one of the tested lengths {settings['lengths']}, "
                         f"got {settings['tune_length']}")
    out = Path(args.out or ROOT / OUT[args.settings])
    store_path = Path(args.store or ROOT / "_build" / "sweeps" / f"{settings['name']}.jsonl")
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    store = Store(store_path, settings, fresh=args.fresh)
    resumed = len(store.records)
    engine = make_engine(args.engine, args.workers, args.scheduler)
    n_main = len(settings["mixers"]) * len(settings["d_models"]) * len(settings["seeds"])
    print(f"MQAR recall sweep '{settings['name']}': {len(settings['mixers'])} mixers x {len(settings['d_models'])} "
          f"widths x {len(settings['seeds'])} seeds = {n_main} runs, each trained on the lengths "
          f"{[t for t, _ in settings['train_lengths']]} in turn and tested at {[t for t, _ in settings['lengths']]}, "
          f"after tuning on a grid of {len(settings['lr_grid'])} rates per mixer and width; engine {engine.name}, "
          f"{engine.workers} worker(s); store {store_path} ({len(store.records)} runs already done)", flush=True)
    grid_runs = [0]

    def total_hint():
        return grid_runs[0] + n_main

    grid_runs[0] = len(settings["mixers"]) * len(settings["d_models"]) * len(settings["lr_grid"])
    progress = Progress(lambda line: print(line, flush=True))
    t0 = time.perf_counter()
    try:
        chosen, edges, grids = tune(settings, store, engine, progress, total_hint, commit)
        grid_runs[0] = sum(len(g) for g in grids.values())
        main_runs = run_all(tr.recall_main_runs(settings, chosen), store, engine, progress, total_hint, commit)
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    tuning = [store.records[tr.run_key(r)] for r in tr.recall_tuning_runs(settings, grids)]
    baselines = {str(length[0]): tr.recall_baseline(settings, length) for length in settings["lengths"]}
    commits = sorted({str(r.get("commit")) for r in tuning + main_runs})
    result = {
        "settings": settings,
        "chosen_lr": {f"{m}|{d}": lr for (m, d), lr in chosen.items()},
        "lr_grids": {f"{m}|{d}": sorted(g) for (m, d), g in grids.items()},
        "lr_at_edge": {f"{m}|{d}": where for (m, d), where in edges.items()},
        "baselines": baselines,
        "points": summarise(settings, main_runs, baselines),
        "tuning": sorted(tuning, key=lambda r: r["key"]),
        "runs": sorted(main_runs, key=lambda r: r["key"]),
        "provenance": {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "commit": commit, "commits": commits,
            "clean_tree": (not status) if status is not None else None,
            "date": started.isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpu_count": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
            "engine": engine.name, "workers": engine.workers, "scheduler": args.scheduler,
            "seeds": {"sweep": list(settings["seeds"]), "tuning": settings["tune_seed"],
                      "streams": "init default_rng((seed, 0)); training batches default_rng((seed, 1)); test set "
                                 "default_rng((test_seed, n_pairs))"},
            "tuning_grid": list(settings["lr_grid"]), "max_widen": settings["max_widen"],
            "wall_seconds": round(wall, 1),
            "runs_from_earlier_invocations": resumed,
            "threshold": settings["threshold"], "interval": "95% Wilson score interval",
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({wall / 60:.1f} min)", flush=True)


if __name__ == "__main__":
    main()
