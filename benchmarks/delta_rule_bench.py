"""Time the delta-rule family's forms against each other and against the GEMM limit (``make bench``).

At T = 4096, d_k = d_v = 128, one head, chunk 64, in float64 and float32, for
DeltaNet, Gated DeltaNet and KDA: the recurrence (``*_recurrent``, a numpy loop
over tokens, vectorised over the state), the chunkwise form (``*_chunkwise``)
and the GEMM limit, the time the chunkwise form's matrix products would take at
this machine's rate for large products with one BLAS thread (measured in turns
with the forms, so that other work on the machine falls on both). The FLOPs are
counted by ``fixedstate.costs.delta_rule_chunkwise_flops``, which a test checks
against the products the forms actually call. The same products are also timed
on their own (``fixedstate.timing.products_replay``), which splits a form's
distance from its limit into the cost of products of these sizes and the cost
of everything else. Every configuration runs twice:
under the BLAS threads this process starts with (the library's default; this
script sets no thread variable) and under one thread (threadpoolctl). Each time
is the median over rounds of the fastest of several runs.

When the optional reference environment exists (``make reference-env``: torch
and transformers in ``.venv-reference``), transformers' pure-torch
``torch_chunk_gated_delta_rule`` (Qwen3-Next) and ``chunk_kimi_delta_attention``
(Kimi Linear) run on the same float32 inputs, and their time and output are
compared with the book's chunkwise forms. Last, a run of T = 16384 in float32
with strong decay reports the largest deviation from float64 and any inf or nan.

Options: ``--repeats N`` (runs per round, default 5), ``--rounds R`` (default 3),
``--quick`` (small sizes, a smoke test), ``--reference PYTHON`` (the reference
environment's interpreter), ``--save-figure PATH`` (time against T).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_info

from fixedstate import delta_rule as dr
from fixedstate.timing import best_time, chunkwise_table, format_chunkwise_table, random_layer_inputs, time_forms

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"gated_delta": 3.0, "kda": 2.5}   # chunkwise at least this many times faster than the recurrence
LIMIT_TARGET = 1.6                      # Gated DeltaNet's chunkwise at most this many times its GEMM limit


def blas_description():
    libs = [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]
    if not libs:
        return "BLAS: none that threadpoolctl knows"
    return "BLAS: " + "; ".join(f"{lib['internal_api']} {lib['version']} ({lib.get('architecture')}, "
                                f"{lib['num_threads']} threads by default, {Path(lib['filepath']).name})"
                                for lib in libs)


def median_best(fn, repeats, rounds):
    return float(np.median([best_time(fn, repeats=repeats) for _ in range(rounds)]))


def reference_comparison(python, T, d, repeats, rounds):
    """transformers' pure-torch forms against the book's chunkwise forms, float32, the same inputs."""
    scale = d ** -0.5
    inputs = {}
    for layer in ("gated_delta", "kda"):
        q, k, v, params = random_layer_inputs(T, d, d, layer=layer, dtype=np.float32)
        inputs.update(q=q, k=k, v=v, beta=params["beta"], **{f"g_{layer}": params["log_gate"]})
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "in.npz", **inputs)
        t0 = time.perf_counter()
        run = subprocess.run([str(python), str(ROOT / "benchmarks" / "reference_delta_rule.py"),
                              str(Path(tmp) / "in.npz"), str(Path(tmp) / "out.npz"),
                              "--repeats", str(repeats), "--rounds", str(rounds)],
                             capture_output=True, text=True, check=False)
        if run.returncode != 0:
            print(f"  the reference run failed:\n{run.stderr[-2000:]}")
            return None
        report = json.loads(run.stdout.strip().splitlines()[-1])
        torch_out = dict(np.load(Path(tmp) / "out.npz"))
    print(f"  torch {report['torch']}, {report['default_threads']} threads by default; "
          f"the reference run took {time.perf_counter() - t0:.0f} s")
    fns = {"gated_delta": (dr.gated_delta_rule_chunkwise, "torch_chunk_gated_delta_rule"),
           "kda": (dr.kda_chunkwise, "chunk_kimi_delta_attention")}
    ratios = {}
    for layer, (fn, torch_name) in fns.items():
        args = (inputs["q"], inputs["k"], inputs["v"])
        kw = {"beta": inputs["beta"], "log_gate": inputs[f"g_{layer}"], "scale": scale}
        ours, _ = fn(*args, **kw)
        t_ours = median_best(lambda: fn(*args, **kw), repeats, rounds)
        diff = np.max(np.abs(ours - torch_out[layer])) / np.max(np.abs(torch_out[layer]))
        t_torch = report[layer]
        ratios[layer] = t_ours / t_torch["default"]
        print(f"  {torch_name}: {1e3 * t_torch['default']:.1f} ms (torch's default threads), "
              f"{1e3 * t_torch['one']:.1f} ms (one thread); book's {fn.__name__} float32: {1e3 * t_ours:.1f} ms, "
              f"{ratios[layer]:.2f} times torch's default-threads time; outputs agree to {diff:.1e} "
              f"(relative to the largest)")
    return ratios


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
        "gated_delta": (dr.gated_delta_rule_chunkwise, np.log(rng.uniform(0.05, 0.5, T))),
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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reference", default=str(ROOT / ".venv-reference" / "bin" / "python"))
    parser.add_argument("--save-figure", default=None)
    args = parser.parse_args(argv)
    T = 512 if args.quick else 4096
    d = 32 if args.quick else 128
    thread_vars = {v: os.environ[v] for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
                   if v in os.environ}
    print(f"numpy {np.__version__}, python {platform.python_version()}, {os.cpu_count()} cores; {blas_description()}"
          + (f"; set in the environment: {thread_vars}" if thread_vars else ""))
    table = chunkwise_table(T, d, repeats=args.repeats, rounds=args.rounds)
    rates = table["rates"]
    print("GEMM rate, one BLAS thread, (1024 x 1024) @ (1024 x 1024), measured after every round of every row "
          "(each row's limit uses the median of its own rounds; here the median of all): "
          + ", ".join(f"{name} {rate / 1e9:.1f} GFLOP/s" for name, rate in rates.items())
          + f"; load average {os.getloadavg()[0]:.1f}")
    flops = {r["layer"]: r["flops"] for r in table["rows"]}
    print(f"T = {T}, d_k = d_v = {d}, one head, chunk {table['chunk_size']}; each time is the median of "
          f"{args.rounds} rounds of the fastest of {args.repeats} runs")
    print("FLOPs of the chunkwise forms' matrix products (fixedstate.costs.delta_rule_chunkwise_flops): "
          + ", ".join(f"{layer} {f / 1e9:.3f} G" for layer, f in flops.items()))
    print("GEMM limit = those FLOPs at the one-thread GEMM rate; products = the chunkwise form's own matrix "
          "products, replayed alone (fixedstate.timing.products_replay: same sizes and layouts, nothing between "
          "them), so chunk/limit = prod/limit (what products of these sizes cost here) x chunk/prod (what the rest "
          "of the form adds)\n")
    print(format_chunkwise_table(table))

    print(f"\nTargets (issue #17): chunkwise at least {TARGETS['gated_delta']:g}x faster than the recurrence for "
          f"Gated DeltaNet and {TARGETS['kda']:g}x for KDA; Gated DeltaNet's chunkwise at most "
          f"{LIMIT_TARGET:g}x its GEMM limit.")
    for r in table["rows"]:
        if r["layer"] not in TARGETS:
            continue
        threads = "default threads" if r["threads"] is None else f"{r['threads']} thread"
        checks = [f"{r['speedup']:.2f}x the recurrence "
                  f"({'meets' if r['speedup'] >= TARGETS[r['layer']] else 'misses'} {TARGETS[r['layer']]:g}x)"]
        if r["layer"] == "gated_delta":
            checks.append(f"{r['chunkwise_vs_limit']:.2f}x the GEMM limit "
                          f"({'meets' if r['chunkwise_vs_limit'] <= LIMIT_TARGET else 'misses'} {LIMIT_TARGET:g}x; "
                          f"its products alone take {r['products_vs_limit']:.2f}x"
                          + (": on this machine these products miss it even with nothing between them"
                             if r["chunkwise_vs_limit"] > LIMIT_TARGET and r["products_vs_limit"] > LIMIT_TARGET
                             else "") + ")")
        print(f"  {r['layer']:<13}{r['dtype']:<9}{threads:<16}" + "; ".join(checks))

    print("\nReference: transformers' pure-torch forms, float32, the same inputs:")
    if Path(args.reference).exists():
        reference_comparison(args.reference, T, d, args.repeats, args.rounds)
    else:
        print(f"  no reference environment ({args.reference} is missing; make reference-env creates it)")

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
        rows = [time_forms(t, d, d, repeats=args.repeats) for t in Ts]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.loglog(Ts, [1e3 * r["recurrent"] for r in rows], "o-", label="recurrent (token by token)")
        ax.loglog(Ts, [1e3 * r["chunkwise"] for r in rows], "s-", label="chunkwise (chunk 64)")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("time (ms)")
        ax.legend()
        fig.savefig(args.save_figure, dpi=100)
        print(f"\nfigure saved to {args.save_figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
