"""Time one training step of chapter 9's model: the book's numpy against the same model in torch (``make bench``).

The model is ``fixedstate.training``'s (``init_model``, ``loss_and_grads``): embedding, two
pre-norm layers (RMSNorm, the projections ``W_q, W_k, W_v``, a short causal convolution on
each, the core, ``W_o``, then an MLP), RMSNorm and the vocabulary head, with the
cross-entropy of an MQAR batch. One step is the forward, the loss and the gradient of
every parameter. The book's step is numpy (its cores' chunkwise forward and backward
passes), timed as a reader calls it: the model's large products with numpy's default
number of BLAS threads, the cores' sequential products with one (``fixedstate._threads``),
and, for the record, the whole step with one thread, as a run of the sweep trains; the
peer is the same model in torch on the CPU (``benchmarks/reference_training_step.py``):
autograd through transformers' pure-torch chunked Gated DeltaNet (``torch_chunk_gated_delta_rule``) and torch's
``scaled_dot_product_attention``, under torch's default number of threads (and, for the
record, one thread), loaded with the SAME parameters and batch. Before any time is taken,
the loss and every gradient of the two are compared (largest difference relative to the
largest entry, per parameter); a configuration whose gradients disagree is reported and
not timed.

Configurations: the mixers ``gated_delta``, ``softmax`` and ``hybrid`` (Gated DeltaNet,
then softmax attention), each in float64 and float32. transformers' Gated DeltaNet
computes in float32 whatever it is given, so in float64 the torch model's Gated DeltaNet
layers are float32 inside and the agreement there is float32's.

The ratio is the book's step over torch's, each with its default threads; the target
of issue #30 is a ratio of at most 1. Both sides take the fastest of ``--repeats`` steps per round, the
median over ``--rounds`` rounds; the book's rounds are split before and after torch's run,
so that other work on the shared machine falls on both. The load average is printed.

Options: ``--seq-len`` (256), ``--vocab`` (256), ``--batch`` (32), ``--d-model`` (128),
``--pairs`` (32), ``--chunk-size`` (the forward's chunk, ``ModelConfig``'s default),
``--mixers``, ``--dtypes``, ``--repeats`` (3), ``--rounds`` (3), ``--reference PYTHON``
(the reference environment's interpreter, default ``.venv-reference/bin/python``),
``--quick`` (a small setting, a smoke test).
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

from fixedstate import training as tr
from fixedstate.timing import best_time

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"float64": 1e-10, "float32": 1e-3}     # relative to the largest entry of each gradient
TOLERANCE_GDN_FLOAT64 = 1e-4                        # transformers' Gated DeltaNet computes in float32


def configurations(args):
    """The (name, mixer, dtype, ModelConfig, params) of the run, every parameter drawn with one seed."""
    out = []
    for mixer in args.mixers:
        for dtype in args.dtypes:
            kw = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
            config = tr.ModelConfig(mixer, vocab_size=args.vocab, d_model=args.d_model, **kw)
            params = tr.init_model(config, 0, dtype=np.dtype(dtype))
            out.append((f"{mixer}-{dtype}", mixer, dtype, config, params))
    return out


def relative(a, b):
    scale = float(np.max(np.abs(a)))
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - b))) / (scale if scale > 0 else 1.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--mixers", type=lambda s: s.split(","), default=["gated_delta", "softmax", "hybrid"])
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float64", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reference", default=str(ROOT / ".venv-reference" / "bin" / "python"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.vocab, args.batch, args.d_model, args.pairs = 64, 64, 4, 32, 8
        args.repeats, args.rounds = 1, 1
    from threadpoolctl import threadpool_info

    blas = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    print(f"numpy {np.__version__}, python {platform.python_version()}, {os.cpu_count()} cores, "
          f"BLAS threads by default {max(blas) if blas else 'unknown'}; "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    print(f"chapter 9's model, 2 layers, d_model {args.d_model}, d_ff {2 * args.d_model}, vocabulary {args.vocab}; "
          f"a batch of {args.batch} MQAR sequences of {args.seq_len} tokens, {args.pairs} pairs")
    tokens, targets = tr.mqar_data(args.batch, vocab_size=args.vocab, n_pairs=args.pairs, seq_len=args.seq_len,
                                   rng=1)
    configs = configurations(args)
    steps, results = {}, {}
    for name, mixer, dtype, config, params in configs:
        steps[name] = (lambda params=params, config=config: tr.loss_and_grads(params, config, tokens, targets))
        results[name] = steps[name]()

    def numpy_rounds(n):
        for _ in range(n):                       # in turns over the configurations
            for name, step in steps.items():
                numpy_times.setdefault(name, []).append(best_time(step, repeats=args.repeats, blas_threads=None))
                numpy_one.setdefault(name, []).append(best_time(step, repeats=args.repeats, blas_threads=1))

    numpy_times, numpy_one = {}, {}
    first = (args.rounds + 1) // 2
    numpy_rounds(first)

    reference = Path(args.reference)
    torch_report, torch_out = None, None
    if not reference.exists():
        print(f"no reference environment ({reference} is missing; make reference-env creates it): "
              "the book's steps alone")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            arrays = {"tokens": tokens, "targets": targets,
                      "configs": json.dumps([{"name": name, "layers": list(config.layers)}
                                             for name, _, _, config, _ in configs])}
            for name, _, _, _, params in configs:
                arrays.update({f"{name}/{p}": a for p, a in params.items()})
            np.savez(Path(tmp) / "in.npz", **arrays)
            t0 = time.perf_counter()
            run = subprocess.run([str(reference), str(ROOT / "benchmarks" / "reference_training_step.py"),
                                  str(Path(tmp) / "in.npz"), str(Path(tmp) / "out.npz"),
                                  "--repeats", str(args.repeats), "--rounds", str(args.rounds)],
                                 capture_output=True, text=True, check=False)
            if run.returncode != 0:
                print(f"the reference run failed:\n{run.stderr[-3000:]}")
            else:
                torch_report = json.loads(run.stdout.strip().splitlines()[-1])
                torch_out = dict(np.load(Path(tmp) / "out.npz"))
                print(f"torch {torch_report['torch']}, {torch_report['default_threads']} threads by default; "
                      f"the reference run took {time.perf_counter() - t0:.0f} s")
    numpy_rounds(args.rounds - first)
    print(f"load average {os.getloadavg()[0]:.1f} at the end of the timing")

    print("\nSame function? loss and every gradient, book (numpy) against torch, the largest difference relative "
          "to the largest entry (worst parameter):")
    agree = {}
    for name, mixer, dtype, config, params in configs:
        if torch_out is None:
            break
        loss, grads = results[name]
        loss_err = abs(loss - float(torch_out[f"{name}/loss"])) / abs(loss)
        errs = {p: relative(g, torch_out[f"{name}/{p}"]) for p, g in grads.items()}
        worst = max(errs, key=errs.get)
        tol = TOLERANCE_GDN_FLOAT64 if dtype == "float64" and "gated_delta" in config.layers else TOLERANCE[dtype]
        agree[name] = loss_err <= tol and errs[worst] <= tol
        print(f"  {name:<20} loss {loss:.6f}, relative difference {loss_err:.1e}; gradients of "
              f"{len(errs)} parameters, worst {errs[worst]:.1e} ({worst}); "
              f"{'agree' if agree[name] else 'DISAGREE'} within {tol:g}")

    print(f"\nOne training step (forward, loss, backward), the median of {args.rounds} rounds of the fastest of "
          f"{args.repeats}:")
    print(f"  {'model':<20}{'numpy, default':>16}{'numpy, 1 thread':>17}{'torch, default':>16}"
          f"{'torch, 1 thread':>17}{'ratio':>8}  target")
    met = []
    for name in steps:
        t_np = float(np.median(numpy_times[name]))
        line = f"  {name:<20}{1e3 * t_np:>13.0f} ms{1e3 * float(np.median(numpy_one[name])):>14.0f} ms"
        if torch_report is not None and agree.get(name):
            t = torch_report["seconds"][name]
            ratio = t_np / t["default"]
            met.append(ratio <= 1.0)
            line += (f"{1e3 * t['default']:>13.0f} ms{1e3 * t['one']:>14.0f} ms{ratio:>8.2f}  "
                     f"{'met' if ratio <= 1.0 else 'missed'} (numpy / torch <= 1)")
        elif torch_report is not None:
            line += "   (not timed against torch: the gradients disagree)"
        print(line)
    if met:
        print(f"\nTarget (issue #30, the book's step no slower than torch's): met in {sum(met)} of {len(met)} "
              "configurations.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
