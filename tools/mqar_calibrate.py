"""Measure what one training step of chapter 9's model costs, per mixer, width and length (the sweep's budget).

    .venv/bin/python tools/mqar_calibrate.py [--d-models 8 64] [--out FILE]
    .venv/bin/python tools/mqar_calibrate.py --budget FILE     # the budget table of RECALL_SWEEP from FILE

For every mixer, training length of ``fixedstate.training.RECALL_SWEEP`` (its
``train_lengths``: sequence length and pairs) and width it times, in this one
process with one BLAS thread (the sweep's workers run that way, one per core),
at the sweep's batch size and vocabulary:

- ``step``: one training step (``loss_and_grads``: the model's forward and its
  backward, the cores' chunkwise backward passes where the mixer table uses them);
- ``forward``: the model's forward alone (``model_forward``).

Each time is the median wall-clock time of ``--reps`` calls after one warm-up call;
beside it, ``step_cpu`` and ``forward_cpu`` are the least CPU time of those calls
(best of N: the process's own time, which other programs on a shared machine
disturb less than the wall clock). The machine's other load makes them upper
bounds. ``--dtype`` is the parameters' (float32, the sweep's, or float64).
``--out`` writes them as JSON. A run of the sweep cycles through the training
lengths one batch per step, so its seconds per step are the mean of ``step`` over
them (:func:`budget`); the test stage (a forward of ``n_test`` sequences at each
tested length) adds about 1% at the sweep's steps and is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):   # one BLAS thread, as a worker
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from fixedstate import training as tr  # noqa: E402


def _seconds(fn, reps):
    """``(median wall-clock seconds, least CPU seconds)`` of ``reps`` calls after one warm-up call."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), min(cpu)


def measure(mixer, seq_len, d_model, *, batch_size, vocab_size, n_pairs, reps, dtype=np.float32):
    """``{"step", "forward", "step_cpu", "forward_cpu"}``: median seconds of one training step and of one
    forward pass, and the least CPU seconds of each."""
    config = tr.ModelConfig(mixer, vocab_size, d_model, window=tr.swa_window(d_model) if mixer == "swa" else None)
    params = tr.init_model(config, np.random.default_rng(0), dtype=dtype,
                           ssd_init="mamba2" if mixer == "ssd" else "unit")
    tokens, targets = tr.mqar_data(batch_size, vocab_size=vocab_size, n_pairs=n_pairs, seq_len=seq_len,
                                   rng=np.random.default_rng(1), distinct_values=True)
    with threadpool_limits(1, user_api="blas"):      # one BLAS thread, as a run of the sweep trains
        step, step_cpu = _seconds(lambda: tr.loss_and_grads(params, config, tokens, targets), reps)
        forward, forward_cpu = _seconds(lambda: tr.model_forward(params, config, tokens), reps)
    return {"step": step, "forward": forward, "step_cpu": step_cpu, "forward_cpu": forward_cpu}


def main(argv=None):
    sweep = tr.RECALL_SWEEP
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixers", nargs="+", default=list(sweep["mixers"]))
    ap.add_argument("--d-models", nargs="+", type=int, default=list(sweep["d_models"]))
    ap.add_argument("--batch-size", type=int, default=sweep["batch_size"])
    ap.add_argument("--vocab-size", type=int, default=sweep["vocab_size"])
    ap.add_argument("--budget", default=None, help="print the budget table from this calibration file and stop")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=90)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.budget:
        budget(json.loads(open(args.budget).read())["rows"], sweep, cores=args.cores, minutes=args.minutes)
        return
    rows = []
    print(f"{'mixer':>12s} {'T':>4s} {'d':>4s} {'step s':>8s} {'fwd s':>8s} {'step cpu':>8s}", flush=True)
    for T, n_pairs in sweep["train_lengths"]:
        for d in args.d_models:
            for m in args.mixers:
                r = measure(m, T, d, batch_size=args.batch_size, vocab_size=args.vocab_size, n_pairs=n_pairs,
                            reps=args.reps, dtype=np.dtype(args.dtype))
                rows.append({"mixer": m, "seq_len": T, "d_model": d, "dtype": args.dtype,
                             **{k: round(v, 5) for k, v in r.items()}})
                print(f"{m:>12s} {T:4d} {d:4d} {r['step']:8.4f} {r['forward']:8.4f} {r['step_cpu']:8.4f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "machine": platform.platform(), "rows": rows}, f, indent=1)
            f.write("\n")


def budget(rows, settings, *, cores, minutes, print_line=print):
    """Print the sweep's budget from calibration ``rows``; return the steps per run that fit.

    A run of mixer ``m`` at width ``d`` costs, per step, the mean of the measured
    ``step`` over the training lengths (it cycles through them one batch per
    step). Each mixer and width has ``len(seeds)`` sweep runs and ``len(lr_grid)``
    tuning runs, and up to ``max_widen`` more where its grid is widened: the steps
    returned fit the first two in ``minutes`` on ``cores``; the table also says what
    the widened grids would cost at most. Rows of another dtype than the sweep's
    float32 (``"dtype"``; rows without one were float32) are left out.
    """
    rows = [r for r in rows if r.get("dtype", "float32") == "float32"]
    speed = {(r["mixer"], r["seq_len"], r["d_model"]): r["step"] for r in rows}
    lengths = [T for T, _ in settings["train_lengths"]]
    for m in settings["mixers"]:             # a row not measured: the slowest mixer's at that length and width
        for T in lengths:
            for d in settings["d_models"]:
                if (m, T, d) not in speed:
                    others = [r["step"] for r in rows if (r["seq_len"], r["d_model"]) == (T, d)]
                    if not others:
                        raise ValueError(f"rows: no mixer measured at T = {T}, d = {d}; calibrate the sweep's "
                                         f"training lengths {lengths} and widths {list(settings['d_models'])}")
                    speed[(m, T, d)] = max(others)
                    print_line(f"({m} at T = {T}, d = {d} not measured: the slowest measured mixer's time stands in)")
    runs = len(settings["seeds"]) + len(settings["lr_grid"])
    widen = settings.get("max_widen", 0)
    print_line(f"{'mixer':>12s} " + " ".join(f"{'d=' + str(d):>7s}" for d in settings["d_models"])
               + "   seconds per step of the mixture")
    per_step = 0.0
    for m in settings["mixers"]:
        mean = [sum(speed[(m, T, d)] for T in lengths) / len(lengths) for d in settings["d_models"]]
        per_step += runs * sum(mean)
        print_line(f"{m:>12s} " + " ".join(f"{x:7.3f}" for x in mean))
    seconds = minutes * 60 * cores
    steps = int(seconds // per_step)
    worst = per_step * (runs + widen) / runs
    print_line(f"{runs} runs per mixer and width ({len(settings['seeds'])} seeds, {len(settings['lr_grid'])} rates): "
               f"one step of every run {per_step:.1f} core-seconds ({worst:.1f} if every grid were widened "
               f"{widen} times); {minutes:.0f} min on {cores} cores = {seconds:.0f} core-seconds: {steps} steps "
               f"per run ({int(seconds // worst)} with every grid widened); settings['steps'] = {settings['steps']} takes "
               f"{settings['steps'] * per_step / cores / 60:.0f} min ({settings['steps'] * worst / cores / 60:.0f} "
               f"at most with the widened grids)")
    return steps


if __name__ == "__main__":
    main()
