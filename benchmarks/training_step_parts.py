"""Where one training step of chapter 9's model spends its time, per mixer (issue #30's profile).

    .venv/bin/python benchmarks/training_step_parts.py [--shapes 64:8 128:16 128:64] [--dtype float32]

For each mixer of ``fixedstate.training.RECALL_SWEEP`` and each ``T:d`` shape (batch 64,
vocabulary 128, ``T / 4`` pairs, the sweep's data), three calls of ``loss_and_grads`` run
under cProfile after a warm-up call, and the step is split by the profile's cumulative
times into: the core's forward and backward (the ``mixers`` table's functions), the rest
of the token mixer (projections, short convolutions, L2 normalisation, gates, ``W_o``),
the residual block's norms and MLP, and the rest (embedding, head and loss). The
profiler's own overhead falls mostly on the small calls, so the shares are approximate
and the printed milliseconds are above an unprofiled step's.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import numpy as np

from fixedstate import training as tr


def parts(mixer, seq_len, d_model, dtype=np.float32):
    """``(seconds per profiled step, {part: share of the step})``."""
    config = tr.ModelConfig(mixer, 128, d_model, window=tr.swa_window(d_model) if mixer == "swa" else None)
    params = tr.init_model(config, np.random.default_rng(0), dtype=dtype,
                           ssd_init="mamba2" if mixer == "ssd" else "unit")
    tokens, targets = tr.mqar_data(64, vocab_size=128, n_pairs=seq_len // 4, seq_len=seq_len,
                                   rng=np.random.default_rng(1), distinct_values=True)
    tr.loss_and_grads(params, config, tokens, targets)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        tr.loss_and_grads(params, config, tokens, targets)
    profile.disable()
    stats = pstats.Stats(profile).stats

    def cumulative(file, pred):
        return sum(v[3] for (f, _, name), v in stats.items() if f.endswith(file) and pred(name))

    total = cumulative("training.py", lambda n: n == "loss_and_grads")
    core_f = cumulative("mixers.py", lambda n: n.endswith("_forward"))
    core_b = cumulative("mixers.py", lambda n: n.endswith("_backward"))
    mix_f = cumulative("training.py", lambda n: n == "_mixer_forward")
    mix_b = cumulative("training.py", lambda n: n == "_mixer_backward")
    block_f = cumulative("blocks.py", lambda n: n == "residual_block")
    block_b = cumulative("blocks.py", lambda n: n == "residual_block_backward")
    shares = {"core fwd": core_f, "core bwd": core_b, "mixer rest": mix_f - core_f + mix_b - core_b,
              "norms+MLP": block_f - mix_f + block_b - mix_b, "embedding+head+loss": total - block_f - block_b}
    return total / 3, {k: v / total for k, v in shares.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["64:8", "128:16", "128:64"])
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = ap.parse_args(argv)
    for shape in args.shapes:
        T, d = (int(x) for x in shape.split(":"))
        for mixer in tr.RECALL_SWEEP["mixers"]:
            seconds, shares = parts(mixer, T, d, np.dtype(args.dtype))
            print(f"T={T:3d} d={d:2d} {mixer:12s} ({seconds * 1e3:6.1f} ms profiled)  "
                  + "  ".join(f"{k} {100 * v:4.1f}%" for k, v in shares.items()), flush=True)


if __name__ == "__main__":
    main()
