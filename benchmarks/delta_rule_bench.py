"""Time the chunkwise delta rule against the token-by-token recurrence (``make bench``).

Prints, for Gated DeltaNet (and DeltaNet and KDA for comparison) at T = 4096,
d_k = d_v = 128, in float32 and float64, the best-of-N time of the recurrence
(`*_recurrent`: a numpy loop over tokens, vectorised over the state) and of the
chunkwise form, and their ratio. Then runs T = 16384 in float32 with strong
decay and reports the largest deviation from a float64 run and whether any inf
or nan appeared.

BLAS threads. This machine has two cores, shared. OpenBLAS's worker threads
spin while they wait, so when another process holds a core, small matrix
products slow down several times over. Unless the environment already says
otherwise, this script runs with one BLAS thread (both forms are timed under
the same setting); set ``OPENBLAS_NUM_THREADS`` yourself to compare.

Options: ``--repeats N`` (default 7), ``--save-figure PATH`` (a plot of time
against T), ``--quick`` (smaller sizes, for a smoke test).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from fixedstate import delta_rule as dr  # noqa: E402
from fixedstate.timing import time_forms  # noqa: E402


def strong_decay_run(T=16384, d=128, chunk_size=64, seed=0):
    """Gated DeltaNet and KDA over T tokens with strong decay, float32 against float64.

    Returns a dict per layer with ``max_abs_dev`` (largest |float32 - float64|
    over all outputs), ``max_rel_dev`` (that divided by the largest |output|),
    ``nonfinite`` (count of inf or nan in the float32 outputs and state),
    ``log_gamma_total`` (sum of the log-decays: the whole-sequence product of
    gates is exp of this) and the seconds taken in float32.
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, d))
    k = rng.standard_normal((T, d))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((T, d))
    betas = rng.uniform(0.1, 0.9, T)
    layers = {
        "gated": (dr.gated_delta_rule_chunkwise, np.log(rng.uniform(0.05, 0.5, T))),
        "kda": (dr.kda_chunkwise, dr.kda_log_gate(rng.standard_normal((T, d)) + 2.0)),
    }
    report = {}
    for name, (fn, log_gate) in layers.items():
        o64, s64 = fn(q, k, v, beta=betas, log_gate=log_gate, chunk_size=chunk_size)
        q32, k32, v32, b32, g32 = (x.astype(np.float32) for x in (q, k, v, betas, log_gate))
        t0 = time.perf_counter()
        o32, s32 = fn(q32, k32, v32, beta=b32, log_gate=g32, chunk_size=chunk_size)
        seconds = time.perf_counter() - t0
        dev = np.abs(o32.astype(np.float64) - o64)
        report[name] = {
            "max_abs_dev": float(dev.max()),
            "max_rel_dev": float(dev.max() / np.abs(o64).max()),
            "nonfinite": int(np.sum(~np.isfinite(o32)) + np.sum(~np.isfinite(s32))),
            "log_gamma_total": float(log_gate.sum(axis=0).max()),
            "seconds": seconds,
        }
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--save-figure", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    T = 512 if args.quick else 4096
    d = 32 if args.quick else 128
    print(f"numpy {np.__version__}, python {platform.python_version()}, {os.cpu_count()} cores, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}")
    print(f"best of {args.repeats} runs; T={T}, d_k=d_v={d}\n")
    print(f"{'layer':<7}{'dtype':<9}{'chunk':>6}{'recurrent ms':>14}{'chunkwise ms':>14}{'ratio':>8}"
          f"{'max rel diff':>14}")
    results = {}
    for layer in ("gated", "delta", "kda"):
        for dtype in (np.float64, np.float32):
            for chunk in (64, 32):
                r = time_forms(T, d, d, dtype=dtype, chunk_size=chunk, repeats=args.repeats, layer=layer)
                results[(layer, np.dtype(dtype).name, chunk)] = r
                print(f"{layer:<7}{np.dtype(dtype).name:<9}{chunk:>6}{1e3 * r['recurrent']:>14.1f}"
                      f"{1e3 * r['chunkwise']:>14.1f}{r['ratio']:>8.2f}{r['max_rel_diff']:>14.2e}")
    head = results[("gated", "float64", 64)]
    print(f"\nGated DeltaNet, float64, chunk 64: chunkwise is {head['ratio']:.2f}x faster than the recurrence "
          f"(target >= 2.5x).")
    best = max((r["ratio"], c) for (lay, dt, c), r in results.items() if lay == "gated" and dt == "float64")
    print(f"Best float64 chunk size for Gated DeltaNet: {best[1]} ({best[0]:.2f}x).")

    T_long = 2048 if args.quick else 16384
    rep = strong_decay_run(T_long, d)
    print(f"\nT={T_long}, float32 against float64, strong decay (chunk 64):")
    for name, r in rep.items():
        print(f"  {name:<6} largest |float32 - float64| = {r['max_abs_dev']:.3g} "
              f"(relative to the largest output {r['max_rel_dev']:.3g}); inf/nan values: {r['nonfinite']}; "
              f"sum of log-decays over the sequence {r['log_gamma_total']:.4g} "
              f"(a whole-sequence 1/Gamma would be exp of minus that); {r['seconds']:.2f} s")

    if args.save_figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        Ts = [256, 512, 1024, 2048, 4096]
        rows = [time_forms(t, d, d, repeats=max(3, args.repeats // 2)) for t in Ts]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.loglog(Ts, [1e3 * r["recurrent"] for r in rows], "o-", label="recurrent (token by token)")
        ax.loglog(Ts, [1e3 * r["chunkwise"] for r in rows], "s-", label="chunkwise (chunk 64)")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("time (ms)")
        ax.legend()
        fig.savefig(args.save_figure, dpi=100)
        print(f"\nfigure saved to {args.save_figure}")


if __name__ == "__main__":
    main()
