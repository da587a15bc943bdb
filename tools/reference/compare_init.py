"""The book's reference initialisations against transformers' own ``_init_weights``.

Run in the reference environment (``.venv-reference``), as ``compare_layers.py`` is:

    .venv-reference/bin/python tools/reference/compare_init.py

For each of Qwen3-Next's Gated DeltaNet, Kimi Linear's KDA, Mamba's mixer and Mamba-2's
mixer it builds the library model (one layer, wide enough that every parameter has a few
hundred entries), lets ``transformers`` initialise it, and draws the book's parameters with
``fixedstate.layers.init_*(..., scheme="transformers")`` at the same sizes. Then, parameter
by parameter (the library's weights mapped to the book's names as ``compare_layers.py`` maps
them):

- a parameter the library draws the same under two seeds is deterministic (``A_log`` of
  Mamba, ``D``, ``dt_bias = 1`` of Qwen3-Next, norm weights, zero biases): the book's must
  equal it, to float32 rounding;
- a random one must have the same law: a two-sample Kolmogorov-Smirnov test between the
  library's entries and the book's must not reject at the 1e-3 level, and the two standard
  deviations must agree within 15%.

Exits 1 on any failure. ``make test-reference`` runs it after ``compare_layers.py``; it is not
part of ``make test`` (it needs torch).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "code"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.stats import ks_2samp  # noqa: E402
from transformers import (KimiLinearConfig, KimiLinearModel, Mamba2Config, Mamba2Model, MambaConfig,  # noqa: E402
                          MambaModel, Qwen3NextConfig, Qwen3NextModel)
from transformers.utils import logging as hf_logging  # noqa: E402

from fixedstate import layers  # noqa: E402
from compare_layers import T_, conv_weight, to_np  # noqa: E402  (this folder is on sys.path)

P_MIN = 1e-3


def qwen(seed):
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(hidden_size=64, linear_num_value_heads=256, linear_num_key_heads=32, linear_key_head_dim=8,
                          linear_value_head_dim=4, linear_conv_kernel_dim=4, num_hidden_layers=1, vocab_size=16,
                          intermediate_size=16, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                          num_experts=2, num_experts_per_tok=1, layer_types=["linear_attention"],
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0)
    lib = Qwen3NextModel(cfg).layers[0].linear_attn
    c = layers.GatedDeltaNetConfig(d_model=64, n_heads=256, n_key_heads=32, d_k=8, d_v=4)
    p = {**layers.split_qwen3_next_projections(to_np(lib.in_proj_qkvz.weight), to_np(lib.in_proj_ba.weight), c),
         "conv_weight": conv_weight(lib.conv1d), "A_log": to_np(lib.A_log), "dt_bias": to_np(lib.dt_bias),
         "norm_weight": to_np(lib.norm.weight), "W_o": T_(lib.out_proj.weight)}
    return c, layers.init_gated_deltanet, p


def kimi(seed):
    torch.manual_seed(seed)
    cfg = KimiLinearConfig(hidden_size=64, linear_num_heads=256, linear_head_dim=4, linear_conv_kernel_dim=4,
                           vocab_size=16, intermediate_size=16, num_hidden_layers=1, pad_token_id=0,
                           bos_token_id=None, eos_token_id=None, layer_types=["linear_attention"])
    lib = KimiLinearModel(cfg).layers[0].self_attn
    c = layers.KDAConfig(d_model=64, n_heads=256, d_k=4, d_v=4)
    fg = lib.forget_gate
    p = {"W_q": T_(lib.q_proj.weight), "W_k": T_(lib.k_proj.weight), "W_v": T_(lib.v_proj.weight),
         "conv_weight": conv_weight(lib.conv1d), "W_f_down": T_(fg.f_a_proj.weight), "W_f_up": T_(fg.f_b_proj.weight),
         "dt_bias": to_np(fg.dt_bias), "A_log": to_np(fg.A_log).reshape(-1), "W_b": T_(lib.b_proj.weight),
         "W_g_down": T_(lib.g_a_proj.weight), "W_g_up": T_(lib.g_b_proj.weight),
         "norm_weight": to_np(lib.o_norm.weight), "W_o": T_(lib.o_proj.weight)}
    return c, layers.init_kda, p


def mamba(seed):
    torch.manual_seed(seed)
    cfg = MambaConfig(hidden_size=128, state_size=8, expand=2, conv_kernel=4, time_step_rank=3, num_hidden_layers=1,
                      vocab_size=16)
    lib = MambaModel(cfg).layers[0].mixer
    c = layers.MambaConfig(d_model=128, d_inner=256, d_state=8, dt_rank=3)
    p = {"W_in": T_(lib.in_proj.weight), "conv_weight": conv_weight(lib.conv1d), "conv_bias": to_np(lib.conv1d.bias),
         "W_x": T_(lib.x_proj.weight), "W_dt": T_(lib.dt_proj.weight), "dt_bias": to_np(lib.dt_proj.bias),
         "A_log": to_np(lib.A_log), "D": to_np(lib.D), "W_out": T_(lib.out_proj.weight)}
    return c, layers.init_mamba, p


def mamba2(seed):
    torch.manual_seed(seed)
    cfg = Mamba2Config(hidden_size=64, state_size=8, expand=8, num_heads=256, head_dim=2, n_groups=2, conv_kernel=4,
                       num_hidden_layers=1, vocab_size=16)
    lib = Mamba2Model(cfg).layers[0].mixer
    c = layers.Mamba2Config(d_model=64, n_heads=256, head_dim=2, d_state=8, n_groups=2)
    p = {"W_in": T_(lib.in_proj.weight), "conv_weight": conv_weight(lib.conv1d), "conv_bias": to_np(lib.conv1d.bias),
         "dt_bias": to_np(lib.dt_bias), "A_log": to_np(lib.A_log), "D": to_np(lib.D),
         "norm_weight": to_np(lib.norm.weight), "W_out": T_(lib.out_proj.weight)}
    return c, layers.init_mamba2, p


def compare(name, build) -> list[str]:
    c, init, lib = build(0)
    _, _, lib_other = build(1)
    book = init(c, np.random.default_rng(0), scheme="transformers")
    failures = []
    assert set(lib) == set(layers.parameter_shapes(c)), (name, sorted(lib))
    for key, a in lib.items():
        b = book[key]
        assert a.shape == b.shape, (name, key, a.shape, b.shape)
        if np.array_equal(a, lib_other[key]):
            ok = np.allclose(a, b, rtol=1e-6, atol=1e-7)
            what = f"deterministic, equal: {ok}"
        else:
            p = ks_2samp(a.ravel(), b.ravel()).pvalue
            ratio = float(b.std() / a.std())
            ok = p > P_MIN and abs(ratio - 1) < 0.15
            what = f"random: KS p = {p:.3f}, std book/lib {ratio:.3f}, range lib [{a.min():.3g}, {a.max():.3g}]"

        print(f"{name:16s} {key:12s} {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(f"{name} {key}")
    return failures


def main() -> int:
    hf_logging.set_verbosity_error()
    failures = []
    for name, build in (("Qwen3-Next GDN", qwen), ("Kimi Linear KDA", kimi), ("Mamba", mamba), ("Mamba-2", mamba2)):
        failures += compare(name, build)
    print("all parameters agree in law" if not failures else f"FAILED: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
