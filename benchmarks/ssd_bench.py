"""Time Mamba-2's chunked SSD algorithm against its quadratic and recurrent forms (``make bench``).

One head, T = 4096 tokens, state N = 64, head width P = 64, chunk 64, float64
and float32: :func:`fixedstate.ssm.ssd_chunkwise` (the chunked algorithm),
:func:`fixedstate.ssm.ssd_quadratic` (the T x T semiseparable matrix) and
:func:`fixedstate.ssm.ssd_recurrent` (a numpy loop over tokens). Each time is
the median over rounds of the fastest of several runs with one BLAS thread
(:func:`fixedstate.timing.best_time`). Prints the times, the ratios and the
largest relative difference between the forms; exits with status 1 if the
chunked form is not faster than the quadratic one.

Options: ``--T``, ``--N``, ``--P``, ``--chunk``, ``--repeats`` (default 3),
``--rounds`` (default 3), ``--quick`` (T = 512, a smoke test).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from fixedstate import ssm
from fixedstate.timing import best_time


def inputs(T, N, P, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, P)).astype(dtype)
    delta = rng.uniform(0.001, 0.1, T).astype(dtype)      # Mamba-2's usual step sizes
    a = dtype(-rng.uniform(1.0, 16.0))
    B = (rng.standard_normal((T, N)) / np.sqrt(N)).astype(dtype)
    C = (rng.standard_normal((T, N)) / np.sqrt(N)).astype(dtype)
    return x, delta, a, B, C


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--N", type=int, default=64)
    parser.add_argument("--P", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    T = 512 if args.quick else args.T
    print(f"Mamba-2 SSD, one head: T = {T}, N = {args.N}, P = {args.P}, chunk {args.chunk}; "
          f"median of {args.rounds} rounds of the best of {args.repeats} runs, one BLAS thread")
    ok = True
    for dtype in (np.float64, np.float32):
        x, delta, a, B, C = inputs(T, args.N, args.P, dtype)
        forms = {
            "chunked": lambda: ssm.ssd_chunkwise(x, delta, a, B, C, chunk_size=args.chunk),
            "quadratic": lambda: ssm.ssd_quadratic(x, delta, a, B, C),
            "recurrent": lambda: ssm.ssd_recurrent(x, delta, a, B, C),
        }
        times = {name: float(np.median([best_time(fn, repeats=args.repeats) for _ in range(args.rounds)]))
                 for name, fn in forms.items()}
        y_c = forms["chunked"]()[0]
        diff = {name: float(np.max(np.abs(forms[name]()[0] - y_c)) / np.max(np.abs(y_c)))
                for name in ("quadratic", "recurrent")}
        print(f"  {np.dtype(dtype).name}: chunked {times['chunked'] * 1e3:.1f} ms, "
              f"quadratic {times['quadratic'] * 1e3:.1f} ms, recurrent {times['recurrent'] * 1e3:.1f} ms; "
              f"quadratic / chunked = {times['quadratic'] / times['chunked']:.1f}x, "
              f"recurrent / chunked = {times['recurrent'] / times['chunked']:.1f}x; "
              f"max relative difference {max(diff.values()):.1e}")
        ok &= times["chunked"] < times["quadratic"]
    if not ok:
        print("FAIL: the chunked form is not faster than the quadratic one")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
