"""The hidden cases of chapter 8's newer exercises (initialisation, packing, rollback).

Kept apart from ``chapters.py`` so that chapters' cases can be added side by side;
registered on import from ``__init__.py``, as ``chapters.py`` is.
"""

from __future__ import annotations

import numpy as np

from ..judge import Case
from . import register


@register("layers", "check_dt_bias_for")
def _dt_bias_for(rng):
    from fixedstate.checks.layers import dt_bias_reference
    out = []
    for n in (3, 5):
        decay = np.exp(-rng.uniform(1e-4, 3.0, n))
        A_log = np.log(rng.uniform(0.5, 16.0, n))
        out.append(Case(f"{n} decays in (0.05, 1) with -a in [0.5, 16]", (decay, A_log),
                        expected=dt_bias_reference(decay, A_log), rtol=1e-9, atol=1e-12, what="dt_bias"))
    decay, A_log = np.array([10.0 ** -float(rng.integers(250, 300)), 0.5]), np.array([-float(rng.uniform(1, 2)), 0.0])
    out.append(Case("a decay near 1e-300 with -a below 1 (a step in the thousands), and 0.5", (decay, A_log),
                    expected=dt_bias_reference(decay, A_log), rtol=1e-9, atol=1e-12, what="dt_bias"))
    return out


@register("layers", "check_packed_decode")
def _packed_decode(rng):
    from fixedstate import blocks as bl
    from fixedstate import packing
    out = []
    for lead in ((), (2,)):
        lengths = rng.integers(1, 6, size=int(rng.integers(2, 4))).tolist()
        T = sum(lengths)
        d_k, d_v = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        q = rng.standard_normal(lead + (T, d_k))
        k = bl.l2_normalize(rng.standard_normal(lead + (T, d_k)))
        v = rng.standard_normal(lead + (T, d_v))
        beta, log_gate = rng.uniform(0.1, 0.9, lead + (T,)), -rng.exponential(0.3, lead + (T,))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        expected = packing.varlen_mixer("gated_delta", q, k, v, {"beta": beta, "log_gate": log_gate},
                                        cu_seqlens=cu, form="recurrent")
        out.append(Case(f"sequences of {lengths} tokens" + (", 2 heads" if lead else ""),
                        (q, k, v, beta, log_gate, cu), expected=expected, rtol=1e-9, atol=1e-11,
                        what="(outputs, final_states)"))
    return out


@register("layers", "check_draft_rollback")
def _draft_rollback(rng):
    from fixedstate import layers as fl
    from fixedstate import serving
    out = []
    for _ in range(2):
        n_key = int(rng.integers(1, 3))
        c = fl.GatedDeltaNetConfig(int(rng.integers(4, 8)), n_key * int(rng.integers(1, 3)), n_key,
                                   int(rng.integers(2, 4)), int(rng.integers(2, 4)), conv_kernel=int(rng.integers(2, 5)))
        p = fl.init_gated_deltanet(c, rng)
        _, cache = fl.gated_deltanet(p, rng.standard_normal((int(rng.integers(2, 6)), c.d_model)))
        k = int(rng.integers(2, 6))
        j = int(rng.integers(0, k + 1))
        x = rng.standard_normal((k, c.d_model))
        y, kept = serving.verify_draft(p, x, cache)
        back = serving.rollback(p, kept, j)
        out.append(Case(f"{k} drafted tokens, {j} accepted, kernel {c.conv_kernel}", (p, cache, x, j),
                        expected=(y, {"conv": back["conv"], "state": back["state"]}), rtol=1e-9, atol=1e-11,
                        what="(y_draft, cache)"))
    return out
