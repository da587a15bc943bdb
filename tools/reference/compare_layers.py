"""The book's layers and cores against transformers' own: same weights in, same outputs out.

Run by ``make test-reference`` in the reference environment (``.venv-reference``:
pinned CPU torch and transformers, apart from the book's environment). For each
of Qwen3-Next's Gated DeltaNet, Kimi Linear's KDA, Mamba's mixer and Mamba-2's
mixer it builds the library layer from a small configuration with random
weights (every parameter drawn, norms and gates included), copies the weights
into the book's numpy layer (:mod:`fixedstate.layers`), and compares

- the prefill of a whole sequence (the library's chunkwise or scan path), and
- prefill then step-by-step decode with the library's cache
  (``DynamicCache``) against the book's cache,

then compares the cores one to one: the chunk and recurrent gated delta rule,
the chunk and recurrent KDA, the selective scan and the SSD chunk scan.

Precision: the libraries compute these layers in float32 whatever they are
given (their delta-rule and scan paths cast to float32), so the library runs
in float32 and the book in float64 on the same float32 weights and inputs; the
error measured is the library's float32 rounding. The measure is the largest
absolute difference divided by the largest absolute value of the book's
output; the tolerance, float32 level, is 1e-5.

Writes a JSON file with the table and its provenance (versions, date, command,
commit, machine, time taken) and exits 1 if any comparison is outside its
tolerance. ``make test-reference`` writes it under ``_build/`` and, with
``--stored``, also exits 1 when the tracked table the appendix shows makes other
comparisons than this run (see ``stored_table.py``): the run leaves the work tree
as committed. ``make update-reference`` rewrites the tracked table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "code"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache, KimiLinearConfig, Mamba2Config, MambaConfig, Qwen3NextConfig  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as kimi  # noqa: E402
from transformers.models.mamba import modeling_mamba as mamba  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as mamba2  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as qwen  # noqa: E402

from fixedstate import blocks, delta_rule, layers, ssm  # noqa: E402
from stored_table import stale_rows  # noqa: E402  (this folder is on sys.path as the script's own)

TOLERANCE = 1e-5
BATCH, T, T_PREFILL = 2, 100, 70        # 100 tokens: two library chunks of 64, the second padded


def lib_name(obj) -> str:
    return f"{obj.__module__.replace('transformers.models.', '')}.{obj.__name__}"


def rel_error(reference: np.ndarray, other) -> float:
    other = other.detach().double().numpy() if isinstance(other, torch.Tensor) else np.asarray(other)
    return float(f"{np.max(np.abs(reference - other)) / np.max(np.abs(reference)):.3g}")


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def randomize(module, gen, scales):
    """Draw every parameter: N(0, 1/fan_in) for matrices, the named scale otherwise."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            key = name.split(".")[-1] if name.split(".")[0] not in scales else name.split(".")[0]
            if key in scales or name in scales:
                low, high = scales.get(name, scales.get(key))
                p.copy_(torch.empty(p.shape).uniform_(low, high, generator=gen))
            else:
                fan_in = p.shape[-1] if p.ndim >= 2 else 1
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)


def T_(w: torch.Tensor) -> np.ndarray:
    """nn.Linear's (d_out, d_in) weight as the book's (d_in, d_out) matrix."""
    return to_np(w).T.copy()


def conv_weight(conv) -> np.ndarray:
    return to_np(conv.weight[:, 0, :])           # (channels, K), the last tap on the current token


def run_library(layer, config, x):
    """Prefill of the whole of x, and prefill of T_PREFILL tokens then one token at a time, with a cache."""
    with torch.no_grad():
        full = layer(x)
        cache = DynamicCache(config=config)
        outs = [layer(x[:, :T_PREFILL], cache=cache)]
        for t in range(T_PREFILL, x.shape[1]):
            outs.append(layer(x[:, t:t + 1], cache=cache))
    return full, torch.cat(outs, dim=1)


def run_book(f, f_step, params, x):
    full, _ = f(params, x)
    part, cache = f(params, x[:, :T_PREFILL])
    outs = [part]
    for t in range(T_PREFILL, x.shape[1]):
        y, cache = f_step(params, x[:, t], cache)
        outs.append(y[:, None])
    return full, np.concatenate(outs, axis=1)


def layer_rows(name, cls, lib_layer, lib_config, book, params, gen, d_model):
    x = torch.randn(BATCH, T, d_model, generator=gen)
    lib_full, lib_dec = run_library(lib_layer, lib_config, x)
    f, f_step = book
    book_full, book_dec = run_book(f, f_step, params, to_np(x))
    return [dict(kind="layer", name=name, what="prefill", library=lib_name(cls), book=f"fixedstate.layers.{f.__name__}",
                 max_rel_error=rel_error(book_full, lib_full)),
            dict(kind="layer", name=name, what=f"prefill {T_PREFILL} + decode {T - T_PREFILL}", library=lib_name(cls),
                 book=f"fixedstate.layers.{f.__name__} + {f_step.__name__}",
                 max_rel_error=rel_error(book_dec, lib_dec))]


# ---------------------------------------------------------------------------- layers

def gated_deltanet_rows(gen):
    cfg = Qwen3NextConfig(hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                          linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                          layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    lib = qwen.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    randomize(lib, gen, {"A_log": (-1.0, 2.5), "dt_bias": (-2.0, 1.0), "norm": (0.5, 1.5), "conv1d": (-0.5, 0.5)})
    c = layers.GatedDeltaNetConfig(d_model=32, n_heads=4, n_key_heads=2, d_k=8, d_v=6, conv_kernel=4,
                                   norm_eps=cfg.rms_norm_eps)
    params = {"config": c, **layers.split_qwen3_next_projections(to_np(lib.in_proj_qkvz.weight),
                                                                  to_np(lib.in_proj_ba.weight), c),
              "conv_weight": conv_weight(lib.conv1d),
              "A_log": to_np(lib.A_log), "dt_bias": to_np(lib.dt_bias), "norm_weight": to_np(lib.norm.weight),
              "W_o": T_(lib.out_proj.weight)}
    return layer_rows("Gated DeltaNet (Qwen3-Next)", qwen.Qwen3NextGatedDeltaNet, lib, cfg,
                      (layers.gated_deltanet, layers.gated_deltanet_step), params, gen, 32)


def kda_rows(gen):
    cfg = KimiLinearConfig(hidden_size=32, linear_num_heads=3, linear_head_dim=8, linear_conv_kernel_dim=4,
                           num_hidden_layers=1, layer_types=["linear_attention"])
    lib = kimi.KimiLinearDeltaAttention(cfg, 0).eval()
    randomize(lib, gen, {"A_log": (-1.0, 1.5), "dt_bias": (-2.0, 1.0), "o_norm": (0.5, 1.5),
                         "conv1d": (-0.5, 0.5)})
    c = layers.KDAConfig(d_model=32, n_heads=3, d_k=8, d_v=8, conv_kernel=4, norm_eps=cfg.rms_norm_eps)
    fg = lib.forget_gate
    params = {"config": c, "W_q": T_(lib.q_proj.weight), "W_k": T_(lib.k_proj.weight), "W_v": T_(lib.v_proj.weight),
              "conv_weight": conv_weight(lib.conv1d), "W_f_down": T_(fg.f_a_proj.weight),
              "W_f_up": T_(fg.f_b_proj.weight), "dt_bias": to_np(fg.dt_bias), "A_log": to_np(fg.A_log).reshape(-1),
              "W_b": T_(lib.b_proj.weight), "W_g_down": T_(lib.g_a_proj.weight), "W_g_up": T_(lib.g_b_proj.weight),
              "norm_weight": to_np(lib.o_norm.weight), "W_o": T_(lib.o_proj.weight)}
    return layer_rows("KDA (Kimi Linear)", kimi.KimiLinearDeltaAttention, lib, cfg,
                      (layers.kda_layer, layers.kda_layer_step), params, gen, 32)


def mamba_rows(gen):
    cfg = MambaConfig(hidden_size=16, state_size=8, expand=2, conv_kernel=4, time_step_rank=3, num_hidden_layers=1)
    lib = mamba.MambaMixer(cfg, 0).eval()
    randomize(lib, gen, {"A_log": (-0.5, 2.0), "D": (0.5, 1.5), "dt_proj.bias": (-4.0, -1.0),
                         "conv1d": (-0.5, 0.5)})
    c = layers.MambaConfig(d_model=16, d_inner=cfg.intermediate_size, d_state=8, dt_rank=3, conv_kernel=4)
    params = {"config": c, "W_in": T_(lib.in_proj.weight), "conv_weight": conv_weight(lib.conv1d),
              "conv_bias": to_np(lib.conv1d.bias), "W_x": T_(lib.x_proj.weight), "W_dt": T_(lib.dt_proj.weight),
              "dt_bias": to_np(lib.dt_proj.bias), "A_log": to_np(lib.A_log), "D": to_np(lib.D),
              "W_out": T_(lib.out_proj.weight)}
    return layer_rows("Mamba block", mamba.MambaMixer, lib, cfg,
                      (layers.mamba_block, layers.mamba_block_step), params, gen, 16)


def mamba2_rows(gen):
    cfg = Mamba2Config(hidden_size=16, state_size=8, expand=2, num_heads=4, head_dim=8, n_groups=2, conv_kernel=4,
                       chunk_size=32, num_hidden_layers=1)
    lib = mamba2.Mamba2Mixer(cfg, 0).eval()
    randomize(lib, gen, {"A_log": (-1.0, 1.5), "D": (0.5, 1.5), "dt_bias": (-4.0, -1.0), "norm": (0.5, 1.5),
                         "conv1d": (-0.5, 0.5)})
    c = layers.Mamba2Config(d_model=16, n_heads=4, head_dim=8, d_state=8, n_groups=2, conv_kernel=4,
                            norm_eps=cfg.layer_norm_epsilon, chunk_size=32)
    params = {"config": c, "W_in": T_(lib.in_proj.weight), "conv_weight": conv_weight(lib.conv1d),
              "conv_bias": to_np(lib.conv1d.bias), "dt_bias": to_np(lib.dt_bias), "A_log": to_np(lib.A_log),
              "D": to_np(lib.D), "norm_weight": to_np(lib.norm.weight), "W_out": T_(lib.out_proj.weight)}
    return layer_rows("Mamba-2 block", mamba2.Mamba2Mixer, lib, cfg,
                      (layers.mamba2_block, layers.mamba2_block_step), params, gen, 16)


# ---------------------------------------------------------------------------- cores

def core_row(name, lib_fn, book_fn, ref_out, ref_state, out, state):
    err = max(rel_error(ref_out, out), rel_error(ref_state, state))
    return dict(kind="core", name=name, what="outputs and final state", library=lib_name(lib_fn),
                book=f"fixedstate.{book_fn.__module__.split('.')[-1]}.{book_fn.__name__}", max_rel_error=err)


def delta_rule_rows(gen):
    B, H, L, dk, dv = 2, 3, 100, 16, 12
    q, k = (torch.randn(B, L, H, dk, generator=gen) for _ in range(2))
    v = torch.randn(B, L, H, dv, generator=gen)
    beta = torch.rand(B, L, H, generator=gen)
    g = -torch.rand(B, L, H, generator=gen) * 0.5
    gk = -torch.rand(B, L, H, dk, generator=gen) * torch.rand(1, 1, H, 1, generator=gen) * 3   # per channel
    S0 = torch.randn(B, H, dk, dv, generator=gen) * 0.1
    heads = lambda t: np.moveaxis(to_np(t), 1, 2)       # (B, L, H, ...) -> (B, H, L, ...)  # noqa: E731
    qn, kn = blocks.l2_normalize(heads(q)), blocks.l2_normalize(heads(k))
    gate_args = dict(beta=np.moveaxis(to_np(beta), 1, 2), scale=dk ** -0.5, initial_state=to_np(S0))
    rows = []
    with torch.no_grad():
        for lib_fn, book_fn, extra in ((qwen.torch_chunk_gated_delta_rule, delta_rule.gated_delta_rule_chunkwise,
                                        dict(chunk_size=64)),
                                       (qwen.torch_recurrent_gated_delta_rule, delta_rule.gated_delta_rule_recurrent,
                                        {})):
            o, s = lib_fn(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, **extra)
            bo, bs = book_fn(qn, kn, heads(v), log_gate=np.moveaxis(to_np(g), 1, 2), **gate_args)
            rows.append(core_row("gated delta rule, " + ("chunkwise" if extra else "recurrent"), lib_fn, book_fn,
                                 bo, bs, heads(o), s))
        for lib_fn, book_fn, extra in ((kimi.chunk_kimi_delta_attention, delta_rule.kda_chunkwise,
                                        dict(chunk_size=64)),
                                       (kimi.recurrent_kimi_delta_attention, delta_rule.kda_recurrent, {})):
            o, s = lib_fn(q, k, v, g=gk, beta=beta, initial_state=S0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, **extra)
            bo, bs = book_fn(qn, kn, heads(v), log_gate=heads(gk), **gate_args)
            rows.append(core_row("KDA, " + ("chunkwise" if extra else "recurrent"), lib_fn, book_fn,
                                 bo, bs, heads(o), s))
    return rows


def scan_rows(gen):
    rows = []
    # Mamba's selective scan: x, dt (B, D, L); A (D, N); B, C (B, N, L); the state (B, D, N) in both.
    Bt, D, N, L = 2, 12, 6, 100
    x, dt = torch.randn(Bt, D, L, generator=gen), torch.randn(Bt, D, L, generator=gen) - 2
    A = -torch.exp(torch.rand(D, N, generator=gen) * 2)
    Bm, Cm = torch.randn(Bt, N, L, generator=gen), torch.randn(Bt, N, L, generator=gen)
    Dv, bias = torch.rand(D, generator=gen), torch.rand(D, generator=gen) - 0.5
    with torch.no_grad():
        y, h = mamba.mamba_selective_scan(x, dt, A, Bm, Cm, D=Dv, delta_bias=bias, delta_softplus=True,
                                          return_last_state=True)
    tl = lambda t: np.swapaxes(to_np(t), 1, 2)           # (B, ., L) -> (B, L, .)  # noqa: E731
    delta = ssm.selective_delta(tl(dt), to_np(bias))
    by, bh = ssm.selective_scan_sequential(tl(x), delta, to_np(A), tl(Bm), tl(Cm), D=to_np(Dv))
    rows.append(core_row("selective scan (Mamba)", mamba.mamba_selective_scan, ssm.selective_scan_sequential,
                         by, bh, tl(y), h))
    # Mamba-2's chunk scan: x (B, L, H, P), dt (B, L, H), A (H,), B, C (B, L, G, N); state (B, H, P, N) there,
    # (B, H, N, P) in the book.
    H, P, G, N = 4, 8, 2, 6
    x = torch.randn(Bt, L, H, P, generator=gen)
    dt = torch.randn(Bt, L, H, generator=gen) - 2
    A = -torch.exp(torch.rand(H, generator=gen) * 2)
    Bm, Cm = torch.randn(Bt, L, G, N, generator=gen), torch.randn(Bt, L, G, N, generator=gen)
    Dv, bias = torch.rand(H, generator=gen), torch.rand(H, generator=gen) - 0.5
    S0 = torch.randn(Bt, H, P, N, generator=gen) * 0.1
    with torch.no_grad():
        y, s = mamba2.mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk_size=32, D=Dv, dt_bias=bias, initial_states=S0,
                                        dt_softplus=True, return_final_states=True)
    heads = lambda a: np.moveaxis(a, 2, 1)               # (B, L, H, ...) -> (B, H, L, ...)  # noqa: E731
    groups = lambda a: np.repeat(heads(to_np(a)), H // G, axis=1)   # noqa: E731
    delta = np.swapaxes(blocks.softplus(to_np(dt) + to_np(bias)), 1, 2)
    by, bs = ssm.ssd_quadratic(heads(to_np(x)), delta, to_np(A),
                               groups(Bm), groups(Cm), D=to_np(Dv), initial_state=np.swapaxes(to_np(S0), -1, -2))
    rows.append(core_row("SSD chunk scan (Mamba-2)", mamba2.mamba2_chunk_scan, ssm.ssd_quadratic,
                         by, bs, heads(to_np(y)), np.swapaxes(to_np(s), -1, -2)))
    return rows


def git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "_build" / "reference" / "reference_equivalence.json"))
    parser.add_argument("--stored", default=None,
                        help="the tracked table to check against (fails when it makes other comparisons)")
    parser.add_argument("--command", default="make test-reference", help="recorded as the table's command")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    rows = []
    for build in (gated_deltanet_rows, kda_rows, mamba_rows, mamba2_rows, delta_rule_rows, scan_rows):
        rows.extend(build(gen))
    seconds = time.perf_counter() - t0
    for row in rows:
        row["tolerance"] = TOLERANCE
        row["passed"] = bool(row["max_rel_error"] <= TOLERANCE)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
                "python": platform.python_version()}
    dirty = bool(git("status", "--porcelain", "--", "code", "tools"))
    result = {
        "title": "The book's layers and cores against transformers' (same weights in)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": args.command,
        "commit": git("rev-parse", "--short=12", "HEAD") + (" (with uncommitted changes)" if dirty else ""),
        "machine": {"system": f"{platform.system()} {platform.machine()}", "cpu": cpu_model(),
                    "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": versions,
        "precision": "library float32 (its paths cast to float32), book float64 on the same float32 weights and "
                     "inputs",
        "error_measure": "max |book - library| / max |book|, over outputs (and final states for the cores)",
        "sizes": {"batch": BATCH, "tokens": T, "prefill_before_decode": T_PREFILL},
        "seed": args.seed,
        "seconds": round(seconds, 1),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    width = max(len(r["name"]) for r in rows)
    lw = max(len(r["library"].split(".")[-1]) for r in rows)
    print(f"{'comparison':<{width}}  {'what':<24}  {'library function':<{lw}}  {'max rel. error':>14}  "
          f"{'tolerance':>9}  ok")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['what']:<24}  {r['library'].split('.')[-1]:<{lw}}  "
              f"{r['max_rel_error']:>14.1e}  "
              f"{r['tolerance']:>9.0e}  {'yes' if r['passed'] else 'NO'}")
    print(f"transformers {versions['transformers']}, torch {versions['torch']}, numpy {versions['numpy']}; "
          f"{seconds:.1f} s; written to {out}")
    ok = all(r["passed"] for r in rows)
    if args.stored:
        reasons = stale_rows(rows, json.loads(Path(args.stored).read_text())["rows"])
        for reason in reasons:
            print(f"stored table {args.stored}: {reason}")
        if reasons:
            print("The stored table is stale: run make update-reference and commit it.")
        else:
            print(f"The stored table {args.stored} makes the same comparisons, each within tolerance; "
                  "left as committed.")
        ok = ok and not reasons
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
