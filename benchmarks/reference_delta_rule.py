"""Time transformers' pure-torch Gated DeltaNet and KDA on given inputs (run by ``delta_rule_bench.py``).

Runs in the optional reference environment (``make reference-env``: torch and
transformers in ``.venv-reference``), never in the book's. Usage::

    .venv-reference/bin/python benchmarks/reference_delta_rule.py INPUTS.npz OUTPUTS.npz [--repeats N] [--rounds R]

``INPUTS.npz`` holds one head's ``q, k, v`` (T, d), ``beta`` (T,), the log-gates
``g_gated_delta`` (T,) and ``g_kda`` (T, d). Both functions take ``(batch, T, heads, d)``
tensors and scale the queries by ``d^-1/2`` themselves; they compute in float32
whatever they are given. Writes their outputs (T, d) to ``OUTPUTS.npz`` (so the
caller can check that they compute what the book's forms compute) and prints one
JSON line: for each function, the seconds of one call under torch's default
number of threads and under one thread (the median over ``rounds`` of the
fastest of ``repeats`` calls), and the thread counts.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule


def seconds(fn, repeats, rounds):
    fn()
    bests = []
    for _ in range(rounds):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        bests.append(best)
    return float(np.median(bests))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs")
    parser.add_argument("outputs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    data = np.load(args.inputs)
    heads = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None, :, None]  # (1, T, 1, ...)
    q, k, v, beta = heads(data["q"]), heads(data["k"]), heads(data["v"]), heads(data["beta"])
    calls = {
        "gated_delta": lambda: torch_chunk_gated_delta_rule(q, k, v, g=heads(data["g_gated_delta"]), beta=beta, chunk_size=64),
        "kda": lambda: chunk_kimi_delta_attention(q, k, v, g=heads(data["g_kda"]), beta=beta, chunk_size=64),
    }
    default_threads = torch.get_num_threads()
    report = {"torch": torch.__version__, "default_threads": default_threads}
    outputs = {}
    with torch.no_grad():
        for name, call in calls.items():
            outputs[name] = call()[0][0, :, 0].numpy()
            torch.set_num_threads(default_threads)
            t_default = seconds(call, args.repeats, args.rounds)
            torch.set_num_threads(1)
            t_one = seconds(call, args.repeats, args.rounds)
            torch.set_num_threads(default_threads)
            report[name] = {"default": t_default, "one": t_one}
    np.savez(args.outputs, **outputs)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
