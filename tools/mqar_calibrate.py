"""Measure what one training step of chapter 9's model costs, per mixer, width and length (the sweep's budget).

    .venv/bin/python tools/mqar_calibrate.py [--seq-lens 64 128] [--d-models 8 16 32 64] [--out FILE]
    .venv/bin/python tools/mqar_calibrate.py --budget results/mqar_calibration.json   # the budget table only

For every mixer, sequence length and width it times, in this one process with one
BLAS thread (the sweep's workers run that way, one per core):

- ``step``: one training step as the package runs it today (``loss_and_grads``: the
  model's forward and backward with the mixers' backward passes as they stand);
- ``forward``: the model's forward alone (``model_forward``, the cores' chunked or
  matrix forms where the table uses them).

and prints the seconds per step, with ``projected = 3 x forward``: the cost of a step
once every core has a backward about twice its forward (the assumption the budget of
``fixedstate.training.RECALL_SWEEP`` makes for the chunkwise backward passes). Each
time is the median wall-clock time of ``--reps`` calls after one warm-up call; beside
it, ``step_cpu`` and ``forward_cpu`` are the least CPU time of those calls (best of N:
the process's own time, which other programs on a shared machine disturb less than the
wall clock). The machine's other load makes them upper bounds. ``--dtype`` is the
parameters' (float32, the sweep's, or float64). ``--out`` writes them as JSON.
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
    step, step_cpu = _seconds(lambda: tr.loss_and_grads(params, config, tokens, targets), reps)
    forward, forward_cpu = _seconds(lambda: tr.model_forward(params, config, tokens), reps)
    return {"step": step, "forward": forward, "step_cpu": step_cpu, "forward_cpu": forward_cpu}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixers", nargs="+", default=["softmax", "swa", "linear", "delta", "gated_delta", "ssd",
                                                    "hybrid"])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--d-models", nargs="+", type=int, default=[16, 32, 64, 128])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--budget", default=None, help="print the budget table from this calibration file and stop")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=90)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.budget:
        budget(json.loads(open(args.budget).read())["rows"], tr.RECALL_SWEEP, cores=args.cores,
               minutes=args.minutes)
        return
    rows = []
    print(f"{'mixer':>12s} {'T':>4s} {'d':>4s} {'step s':>8s} {'fwd s':>8s} {'3 x fwd':>8s} {'step cpu':>8s}", flush=True)
    for T in args.seq_lens:
        for d in args.d_models:
            for m in args.mixers:
                r = measure(m, T, d, batch_size=args.batch_size, vocab_size=args.vocab_size, n_pairs=T // 4,
                            reps=args.reps, dtype=np.dtype(args.dtype))
                rows.append({"mixer": m, "seq_len": T, "d_model": d, "dtype": args.dtype,
                             **{k: round(v, 5) for k, v in r.items()}, "projected": round(3 * r["forward"], 5)})
                print(f"{m:>12s} {T:4d} {d:4d} {r['step']:8.4f} {r['forward']:8.4f} {3 * r['forward']:8.4f} "
                      f"{r['step_cpu']:8.4f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "machine": platform.platform(), "rows": rows}, f, indent=1)
            f.write("\n")


def budget(rows, settings, *, cores, minutes, print_line=print):
    """Print the sweep's budget from calibration ``rows``; return the steps per run that fit.

    Rows of another dtype than the sweep's float32 (``"dtype"``; rows without one were float32) are left out.
    """
    rows = [r for r in rows if r.get("dtype", "float32") == "float32"]
    speed = {(r["mixer"], r["seq_len"], r["d_model"]): r for r in rows}
    for m in settings["mixers"]:             # a row not measured: the slowest mixer's at that length and width
        for T, _ in settings["lengths"]:
            for d in settings["d_models"]:
                if (m, T, d) not in speed:
                    others = [r for r in rows if (r["seq_len"], r["d_model"]) == (T, d)]
                    speed[(m, T, d)] = {k: max(r[k] for r in others) for k in ("step", "projected")}
                    print_line(f"({m} at T = {T}, d = {d} not measured: the slowest measured mixer's time stands in)")
    longest = tuple(settings["tune_length"])
    print_line(f"{'mixer':>12s} {'T':>4s} {'runs':>5s} {'s/step now':>11s} {'projected':>10s}  (mean over widths)")
    per_step_now = per_step = 0.0
    for m in settings["mixers"]:
        for T, n in settings["lengths"]:
            runs = len(settings["seeds"]) + (len(settings["lr_grid"]) if (T, n) == longest else 0)
            now = [speed[(m, T, d)]["step"] for d in settings["d_models"]]
            proj = [speed[(m, T, d)]["projected"] for d in settings["d_models"]]
            per_step_now += runs * sum(now)
            per_step += runs * sum(proj)
            print_line(f"{m:>12s} {T:4d} {runs * len(now):5d} {sum(now) / len(now):11.3f} {sum(proj) / len(proj):10.3f}")
    seconds = minutes * 60 * cores
    steps = int(seconds // per_step)
    print_line(f"one step of every run: {per_step_now:.0f} core-seconds today, {per_step:.0f} projected; "
               f"{minutes:.0f} min on {cores} cores = {seconds:.0f} core-seconds: {steps} steps per run projected "
               f"({int(seconds // per_step_now)} today); at settings['steps'] = {settings['steps']}: "
               f"{settings['steps'] * per_step / cores / 60:.0f} min projected, "
               f"{settings['steps'] * per_step_now / cores / 60:.0f} min today (the widened grids not counted)")
    return steps


if __name__ == "__main__":
    main()
