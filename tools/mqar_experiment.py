"""Run chapter 9's MQAR sweep and write results/mqar_sweep.json with its provenance (`make experiment-small`).

    .venv/bin/python tools/mqar_experiment.py [--jobs 2] [--out results/mqar_sweep.json]
    .venv/bin/python tools/mqar_experiment.py --ssd-followup [--jobs 2]     # make experiment-ssd

With ``--ssd-followup`` it runs the follow-up the chapter pre-registers instead:
the SSD alone, its step initialised at 0.01, everything else as in the sweep
(``fixedstate.training.SSD_FOLLOWUP``), written to results/mqar_ssd_followup.json.

Every run is printed as it finishes (a plain progress line: runs done, the run,
its test accuracy, the time elapsed and an estimate of the time left). The
settings, seeds and tuning budget are those of ``fixedstate.training.SWEEP``
(or ``SSD_FOLLOWUP``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

from fixedstate import training as tr

ROOT = Path(__file__).resolve().parent.parent

TUNING_BUDGET = ("learning rate only, chosen per mixer from lr_grid on one configuration "
                 "(d_model = tune_d_model, n_pairs = tune_n_pairs, seed = tune_seed, not a sweep seed) "
                 "by test accuracy (ties: lower final training loss), then fixed for every width, pair count "
                 "and seed; the same grid and rule for every mixer; nothing else tuned")

INIT_SWEEP = ("init_model's default: the SSD's step bias dt_bias = 0 (step softplus(0) = ln 2 before the input's "
              "share), A_log = 0 (a = -1)")
INIT_FOLLOWUP = ("as the sweep except the SSD's step bias: dt_bias = softplus^-1(ssd_dt_init) = log(expm1(0.01)), "
                 "so the step starts at 0.01 before the input's share and the per-token decay at exp(-0.01); "
                 "A_log = 0 (a = -1) as in the sweep")


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2, the cores of the book's machine)")
    ap.add_argument("--ssd-followup", action="store_true",
                    help="run the pre-registered follow-up (the SSD with its step initialised at 0.01) instead")
    ap.add_argument("--out", default=None,
                    help="default results/mqar_sweep.json, or results/mqar_ssd_followup.json with --ssd-followup")
    args = ap.parse_args(argv)
    settings = tr.SSD_FOLLOWUP if args.ssd_followup else tr.SWEEP
    name, target = ("SSD follow-up", "experiment-ssd") if args.ssd_followup else ("MQAR sweep", "experiment")
    if args.out is None:
        args.out = str(ROOT / "results" / ("mqar_ssd_followup.json" if args.ssd_followup else "mqar_sweep.json"))
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = _git("rev-parse", "HEAD")              # the code the runs import: record it before they start
    status = _git("status", "--porcelain", "--untracked-files=no")
    print(f"{name}: {len(settings['mixers'])} mixer(s) x {len(settings['d_models'])} widths x "
          f"{len(settings['n_pairs'])} pair counts x {len(settings['seeds'])} seeds, after a learning-rate "
          f"grid of {len(settings['lr_grid'])} per mixer; {args.jobs} worker process(es)", flush=True)
    result = tr.run_sweep(settings, jobs=args.jobs, progress=lambda line: print(line, flush=True))
    result["provenance"] = {
        "command": f"make {target} (" + " ".join([Path(sys.executable).name, *sys.argv]) + ")",
        "commit": commit,
        "uncommitted_changes": bool(status) if status is not None else None,
        "date": started.isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
        "jobs": args.jobs,
        "seeds": {"sweep": list(settings["seeds"]), "tuning": settings["tune_seed"],
                  "streams": "init default_rng((seed, 0)); training batches default_rng((seed, 1)); "
                             "test set default_rng((12345, n_pairs))"},
        "tuning_budget": TUNING_BUDGET,
        "init": INIT_FOLLOWUP if args.ssd_followup else INIT_SWEEP,
        "wall_seconds": result["seconds"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({result['seconds'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
