"""The hidden cases of the book's function exercises, one generator per check.

Each generator draws a few cases of sizes and values of its own (so they differ
from the self-check's fixed cases and from one student to the next) and
computes the expected answers here, in the grader's process, with the package's
reference functions or a direct formula. Challenge problems whose self-check
also forbids calling the package's implementation (or a loop over time) are
judged here on values only; the grader flags the source for review by hand
(:data:`grading.grader.REFERENCE_NAMES`).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from fixedstate import costs, ssm
from fixedstate import delta_rule as dr
from fixedstate import linear_attention as la

from ..judge import Case
from . import register


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _sizes(rng, low=2, high=6):
    """d_k != d_v, so a transposed state has the wrong shape."""
    d_k = int(rng.integers(low, high + 1))
    d_v = int(rng.integers(low, high + 1))
    return d_k, (d_v if d_v != d_k else d_v + 1)


# --------------------------------------------------------------------------- chapter 1

@register("linear", "check_kv_cache_size")
def _kv_cache_size(rng):
    out = []
    for _ in range(4):
        args = (int(rng.integers(1, 200_000)), int(rng.integers(1, 80)), int(rng.integers(1, 16)),
                int(rng.choice([32, 64, 80, 96, 128, 256])), int(rng.choice([1, 2, 4])))
        want = costs.kv_cache_bytes(args[0], n_layers=args[1], n_kv_heads=args[2], head_dim=args[3],
                                    bytes_per_element=args[4])
        out.append(Case(f"context_len={args[0]:,}, n_layers={args[1]}, n_kv_heads={args[2]}, "
                        f"head_dim={args[3]}, bytes_per_element={args[4]}", args, expected=float(want),
                        rtol=0.0, atol=0.5, what="the bytes"))
    return out


def _softmax_rows(scores):
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@register("linear", "check_softmax_decode_step")
def _softmax_decode(rng):
    out = []
    for n in (0, int(rng.integers(1, 4)), int(rng.integers(4, 9))):
        d_k, d_v = _sizes(rng)
        q, k, v = rng.standard_normal(d_k), rng.standard_normal(d_k), rng.standard_normal(d_v)
        cache = None if n == 0 else (rng.standard_normal((n, d_k)), rng.standard_normal((n, d_v)))
        keys = k[None] if cache is None else np.vstack([cache[0], k])
        values = v[None] if cache is None else np.vstack([cache[1], v])
        o = _softmax_rows(keys @ q / np.sqrt(d_k)) @ values
        out.append(Case(f"a cache of {n} tokens (d_k={d_k}, d_v={d_v})", (q, k, v, cache),
                        expected=(o, (keys, values)), what="(output, (keys, values))"))
    return out


@register("linear", "check_gqa_decode_step")
def _gqa_decode(rng):
    out = []
    for n in (0, int(rng.integers(1, 6))):
        H_kv = int(rng.integers(1, 4))
        G = int(rng.integers(2, 4))
        H = H_kv * G
        d_k, d_v = _sizes(rng)
        q, k, v = rng.standard_normal((H, d_k)), rng.standard_normal((H_kv, d_k)), rng.standard_normal((H_kv, d_v))
        cache = None if n == 0 else (rng.standard_normal((H_kv, n, d_k)), rng.standard_normal((H_kv, n, d_v)))
        keys = k[:, None] if cache is None else np.concatenate([cache[0], k[:, None]], axis=1)
        values = v[:, None] if cache is None else np.concatenate([cache[1], v[:, None]], axis=1)
        o = np.stack([_softmax_rows(keys[h // G] @ q[h] / np.sqrt(d_k)) @ values[h // G] for h in range(H)])
        out.append(Case(f"H={H} query heads, H_kv={H_kv} KV heads, a cache of {n} tokens (d_k={d_k}, d_v={d_v})",
                        (q, k, v, cache), expected=(o, (keys, values)), what="(o, (keys, values))"))
    return out


# --------------------------------------------------------------------------- chapter 2

@register("linear", "check_linear_decode_step")
def _linear_decode(rng):
    out = []
    phi = la.elu_plus_one
    for first in (True, False, False):
        d_k, d_v = _sizes(rng)
        if first:
            S, z = np.zeros((d_k, d_v)), np.zeros(d_k)
        else:
            ks = rng.standard_normal((int(rng.integers(1, 6)), d_k))
            S, z = phi(ks).T @ rng.standard_normal((len(ks), d_v)), phi(ks).sum(axis=0)
        q, k, v = rng.standard_normal(d_k), rng.standard_normal(d_k), rng.standard_normal(d_v)
        S2, z2 = S + np.outer(phi(k), v), z + phi(k)
        o = S2.T @ phi(q) / (phi(q) @ z2)
        out.append(Case(("the first token" if first else "a later token") + f" (d_k={d_k}, d_v={d_v})",
                        (S, z, q, k, v), expected=(o, S2, z2), what="(output, state, normalizer)"))
    return out


@register("linear", "check_causal_linear_attention")
def _causal_linear(rng):
    out = []
    for T in (1, int(rng.integers(3, 12))):
        d_k, d_v = _sizes(rng)
        q, k, v = rng.standard_normal((T, d_k)), rng.standard_normal((T, d_k)), rng.standard_normal((T, d_v))
        out.append(Case(f"T={T} tokens (d_k={d_k}, d_v={d_v})", (q, k, v),
                        expected=la.linear_attention_parallel(q, k, v)[0], what="the outputs"))
    return out


def _decayed_loop(q, k, v, log_gate):
    S = np.zeros((k.shape[1], v.shape[1]))
    o = np.empty((len(q), v.shape[1]))
    for t in range(len(q)):
        S = np.exp(log_gate[t]) * S + np.outer(k[t], v[t])
        o[t] = S.T @ q[t]
    return o, S


@register("linear", "check_chunkwise_decayed_attention")
def _chunkwise_decayed(rng):
    out = []
    for kind in ("random", "random", "strong"):
        C = int(rng.integers(2, 5))
        T = C * int(rng.integers(2, 4)) + int(rng.integers(0, C))
        d_k, d_v = _sizes(rng)
        q, k, v = rng.standard_normal((T, d_k)), rng.standard_normal((T, d_k)), rng.standard_normal((T, d_v))
        log_gate = -rng.uniform(0.0, 1.5, T) if kind == "random" else np.full(T, -200.0)
        out.append(Case(f"T={T}, chunk_size={C}, " + ("random decays" if kind == "random" else "log_gate = -200")
                        + f" (d_k={d_k}, d_v={d_v})", (q, k, v, log_gate, C),
                        expected=_decayed_loop(q, k, v, log_gate), rtol=1e-8, atol=1e-10, what="(o, S)"))
    return out


# --------------------------------------------------------------------------- chapter 3

def _delta_cases(rng, gate: bool):
    out = []
    for unit in (True, True, False):
        d_k, d_v = _sizes(rng)
        S = rng.standard_normal((d_k, d_v))
        k = _unit(rng, d_k) * (1.0 if unit else float(rng.uniform(0.4, 0.8)))
        v = rng.standard_normal(d_v)
        beta = float(rng.uniform(0.2, 0.95))
        args = (S, k, v, beta)
        desc = f"a {d_k}x{d_v} state, beta={beta:.3f}"
        if gate:
            g = float(rng.uniform(0.3, 0.95))
            args += (g,)
            desc += f", gate={g:.3f}"
            want = dr.gated_delta_rule_step(k, k, v, beta=beta, log_gate=np.log(g), initial_state=S)[1]
        else:
            want = dr.delta_rule_step(k, k, v, beta=beta, initial_state=S)[1]
        out.append(Case(desc + ("" if unit else ", a short key"), args, expected=want, what="the new state"))
    return out


register("delta", "check_delta_step")(lambda rng: _delta_cases(rng, False))
register("delta", "check_gated_delta_step")(lambda rng: _delta_cases(rng, True))


@register("delta", "check_exact_beta")
def _exact_beta(rng):
    out = []
    for _ in range(3):
        length = float(rng.uniform(0.5, 2.5))
        key = _unit(rng, int(rng.integers(2, 7))) * length
        out.append(Case(f"a key of length {length:.3f}", (key,), expected=1.0 / float(key @ key), what="beta"))
    return out


@register("delta", "check_kda_chunk")
def _kda_chunk(rng):
    out = []
    for C, state, gate in ((int(rng.integers(2, 6)), "zero", "random"), (int(rng.integers(3, 8)), "random", "random"),
                           (1, "random", "random"), (int(rng.integers(3, 7)), "random", "strong")):
        d_k, d_v = _sizes(rng)
        q, k, v = rng.standard_normal((C, d_k)), _unit(rng, C, d_k), rng.standard_normal((C, d_v))
        beta = rng.uniform(0.2, 0.9, C)
        log_gate = -rng.uniform(0.05, 1.5, (C, d_k))
        if gate == "strong":
            log_gate[:, ::2] = -200.0
        S0 = np.zeros((d_k, d_v)) if state == "zero" else rng.standard_normal((d_k, d_v))
        want = dr.kda_loop(q, k, v, beta=beta, log_gate=log_gate, initial_state=S0)
        out.append(Case(f"a chunk of {C} tokens, {state} incoming state" + (", log_gate = -200 in every other "
                        "channel" if gate == "strong" else "") + f" (d_k={d_k}, d_v={d_v})",
                        (q, k, v, beta, log_gate, S0), expected=want, rtol=1e-8, atol=1e-10, what="(O, S_out)"))
    return out


# --------------------------------------------------------------------------- chapter 4

def _stable(rng, n):
    M = rng.normal(size=(n, n))
    return M - (np.max(np.linalg.eigvals(M).real) + float(rng.uniform(0.3, 1.0))) * np.eye(n)


@register("ssm", "check_discretize_zoh")
def _zoh(rng):
    out = []
    for n in (int(rng.integers(2, 5)), int(rng.integers(3, 6))):
        A, B, delta = _stable(rng, n), rng.normal(size=n), float(rng.uniform(0.05, 0.9))
        out.append(Case(f"a random stable {n} x {n} A, delta={delta:.3f}", (A, B, delta),
                        expected=tuple(ssm.discretize_zoh(A, B, delta)), rtol=1e-8, atol=1e-10,
                        what="(A_bar, B_bar)"))
    return out


@register("ssm", "check_ssm_kernel")
def _ssm_kernel(rng):
    out = []
    for n in (int(rng.integers(2, 5)), 1):
        A_bar = rng.normal(size=(n, n)) * 0.5
        B_bar, C, L = rng.normal(size=n), rng.normal(size=n), int(rng.integers(3, 15))
        out.append(Case(f"a random {n} x {n} A_bar, length {L}", (A_bar, B_bar, C, L),
                        expected=ssm.ssm_kernel(A_bar, B_bar, C, L), what="K"))
    return out


@register("ssm", "check_selective_step")
def _selective_step(rng):
    out = []
    for i in range(3):
        d, N = int(rng.integers(2, 5)), int(rng.integers(2, 6))
        A = -np.exp(rng.normal(size=(d, N)))
        state = np.zeros((d, N)) if i == 0 else rng.normal(size=(d, N))
        delta = ssm.selective_delta(rng.normal(size=(1, d)), float(rng.uniform(0.0, 2.0)))[0]
        x, B, C, D = rng.normal(size=d), rng.normal(size=N), rng.normal(size=N), rng.normal(size=d)
        want = ssm.selective_scan_step(x, delta, A, B, C, D=D, initial_state=state)
        out.append(Case(("a zero" if i == 0 else "a random") + f" state (d={d}, N={N})",
                        (state, x, delta, A, B, C, D), expected=tuple(want), what="(y_t, new_state)"))
    return out


def _scan_loop(a, b):
    h = np.empty_like(b)
    h[0] = b[0]
    for t in range(1, len(b)):
        h[t] = a[t] * h[t - 1] + b[t]
    return h


@register("ssm", "check_parallel_scan")
def _parallel_scan(rng):
    out = []
    for T, tail in ((1, ()), (int(rng.integers(5, 40)), ()), (int(rng.integers(3, 20)), (int(rng.integers(2, 4)),))):
        a = rng.uniform(0.3, 1.0, (T, *tail))
        b = rng.normal(size=(T, *tail))
        out.append(Case(f"T={T}" + (f" with a trailing axis of {tail[0]}" if tail else ""), (a, b),
                        expected=_scan_loop(a, b), what="h"))
    return out


# --------------------------------------------------------------------------- chapter 5

@register("recall", "check_recall_accuracy")
def _recall_accuracy(rng):
    from fixedstate import recall as rc
    out = []
    for n, d_k, d_v, noise in ((int(rng.integers(4, 9)), 6, 5, 0.8), (int(rng.integers(3, 7)), 8, 3, 0.3)):
        keys = rc.make_keys(n, d_k, rng=rng)
        values = rc.make_values(n, d_v, rng=rng) * rng.uniform(0.3, 3.0, (n, 1))
        state = rc.write_memory("delta", keys, values) + noise * rng.standard_normal((d_k, d_v))
        want = float(np.mean(rc.nearest_value(rc.read_memory("linear", state, keys), values) == np.arange(n)))
        out.append(Case(f"a {d_k} x {d_v} state with noise, {n} pairs", (state, keys, values), expected=want,
                        rtol=0.0, atol=1e-12, what="the accuracy"))
    return out


@register("recall", "check_predicted_crosstalk")
def _crosstalk(rng):
    from fixedstate import recall as rc
    out = []
    for unit in (True, False):
        n, d_k, d_v = int(rng.integers(2, 7)), int(rng.integers(3, 7)), int(rng.integers(2, 5))
        keys = rc.make_keys(n, d_k, rng=rng) if unit else rng.standard_normal((n, d_k))
        values = rng.standard_normal((n, d_v))
        want = rc.read_memory("linear", rc.write_memory("linear", keys, values), keys) - values
        out.append(Case(f"{n} {'unit' if unit else 'non-unit'} keys of width {d_k}, values of width {d_v}",
                        (keys, values), expected=want, what="the crosstalk"))
    return out


@register("recall", "check_recall_curve")
def _recall_curve(rng):
    from fixedstate.checks.recall import reference_recall_curve
    seeds, n_max, d_k, d_v = int(rng.integers(2, 4)), int(rng.integers(6, 10)), 4, 3
    keys = rng.standard_normal((seeds, n_max, d_k))
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    values = rng.standard_normal((seeds, n_max, d_v)) * rng.uniform(0.3, 3.0, (seeds, n_max, 1))
    n_values = tuple(sorted({1, int(rng.integers(2, n_max)), n_max}))
    return [Case(f"{seeds} seeds, N_max={n_max}, d_k={d_k}, d_v={d_v}, N in {n_values}", (keys, values, n_values),
                 expected=reference_recall_curve(keys, values, n_values), rtol=0.0, atol=1e-12,
                 what="the mean accuracy for each N")]


# --------------------------------------------------------------------------- chapter 6

def _small_stack(rng):
    from fixedstate import hybrid as hy
    n_layers = int(rng.integers(6, 16))
    attention = tuple(sorted(rng.choice(n_layers, size=int(rng.integers(1, 4)), replace=False).tolist()))
    n_kv = int(rng.choice([1, 2, 4]))
    return hy.HybridConfig(n_layers=n_layers, d_model=512, d_ff=1408, vocab_size=32_000, attention_layers=attention,
                           n_heads=4 * n_kv, n_kv_heads=n_kv, head_dim=int(rng.choice([32, 64])),
                           n_linear_heads=8, n_linear_key_heads=4, linear_key_dim=32, linear_value_dim=64,
                           bytes_per_element=int(rng.choice([2, 4])), name="a random stack")


@register("hybrid", "check_kv_cache_at")
def _kv_cache_at(rng):
    from fixedstate import hybrid as hy
    out = []
    for _ in range(3):
        c, n = _small_stack(rng), int(rng.integers(1, 40_000))
        out.append(Case(f"{c.n_layers} layers, attention in {list(c.attention_layers)}, {n:,} tokens", (c, n),
                        expected=float(hy.stack_kv_cache_bytes(c, n)), rtol=1e-9, atol=0.5, what="the bytes"))
    return out


@register("hybrid", "check_fit_time_model")
def _fit_time(rng):
    from fixedstate import time_model as tm
    out = []
    for _ in range(2):
        lengths = sorted(int(x) for x in rng.choice(np.arange(500, 64_000, 250), 2, replace=False))
        rates = [float(rng.uniform(150, 300)), float(rng.uniform(60, 149))]
        out.append(Case(f"{lengths[0]:,} tokens at {rates[0]:.1f} tok/s, {lengths[1]:,} at {rates[1]:.1f}",
                        (list(lengths), list(rates)), expected=tuple(tm.fit_time_model(lengths, rates)),
                        rtol=1e-9, atol=1e-15, what="(a, b)"))
    return out


@register("hybrid", "check_decode_cost")
def _decode_cost(rng):
    from fixedstate import hybrid as hy
    out = []
    for _ in range(2):
        c, n = _small_stack(rng), int(rng.integers(100, 30_000))
        out.append(Case(f"{c.n_layers} layers, attention in {list(c.attention_layers)}, {n:,} tokens", (c, n),
                        expected=(float(hy.decode_flops_per_token(c, n)),
                                  float(hy.stack_kv_cache_bytes(c, n) + hy.stack_state_bytes(c))),
                        rtol=1e-9, atol=0.5, what="(flops_per_token, memory_bytes)"))
    return out


# --------------------------------------------------------------------------- chapter 7

@register("family", "check_table_row", kind="value")
def _table_row(rng):
    from fixedstate.checks import family
    row = family.FINCH_ROW
    return [Case("the table's row for RWKV-6", expected={"transition": row["transition"], "gate": row["gate"],
                                                        "state_size": float(row["state_size"])},
                 rtol=0.0, atol=0.0, what="the row", relative=False,
                 normalise={"['transition']": family._transition, "['gate']": family._gate})]


@register("family", "check_deltaproduct_step")
def _deltaproduct(rng):
    from fixedstate import delta_family as df
    out = []
    for n_h in (1, 2, 3):
        d_k, d_v = _sizes(rng)
        S = rng.standard_normal((d_k, d_v))
        keys = _unit(rng, n_h, d_k) * rng.uniform(0.5, 1.0, (n_h, 1))
        values = rng.standard_normal((n_h, d_v))
        betas = rng.uniform(0.2, 1.9, n_h)
        want = df.deltaproduct_step(np.zeros(d_k), keys, values, beta=betas, initial_state=S)[1]
        out.append(Case(f"n_h={n_h} on a {d_k}x{d_v} state", (S, keys, values, betas), expected=want,
                        what="the new state"))
    return out


@register("family", "check_implicit_step")
def _implicit_step(rng):
    from fixedstate import delta_family as df
    out = []
    for per_column, big in ((False, False), (True, False), (True, True)):
        d_k, d_v = _sizes(rng)
        S = rng.standard_normal((d_k, d_v))
        key = _unit(rng, d_k) * rng.uniform(0.4, 2.5)
        value = rng.standard_normal(d_v)
        beta = rng.uniform(0.1, 1.5, d_v) if per_column else float(rng.uniform(0.1, 1.5))
        if big:
            beta = beta * 30.0                            # an explicit step would overshoot
        want = df.implicit_regression_step(S, key, value, beta=beta)
        out.append(Case(f"a {d_k}x{d_v} state, |key| = {np.linalg.norm(key):.3f}, "
                        + ("beta per column" if per_column else "one beta") + (", large steps" if big else ""),
                        (S, key, value, beta), expected=want, what="the new state"))
    return out


def _interchunk(x, delta, a, B, C, Q, S0):
    from fixedstate.checks.family import _interchunk as steps_2_to_4      # the check's own reference
    return steps_2_to_4(x, delta, a, B, C, Q, S0)


@register("family", "check_ssd_interchunk")
def _ssd_interchunk(rng):
    out = []
    for T, Q, with_state in ((int(rng.integers(2, 4)) * 4, 4, False), (int(rng.integers(9, 15)), 4, True),
                             (int(rng.integers(2, 5)), 6, True)):
        N, P = int(rng.integers(2, 5)), int(rng.integers(2, 4))
        x, delta = rng.standard_normal((T, P)), rng.uniform(0.05, 0.8, T)
        a = -float(rng.uniform(0.3, 2.0))
        B, C = rng.standard_normal((T, N)), rng.standard_normal((T, N))
        S0 = rng.standard_normal((N, P)) if with_state else None
        out.append(Case(f"T={T}, chunk_size={Q}, N={N}, P={P}" + (", an initial state" if with_state else ""),
                        (x, delta, a, B, C, Q), {"initial_state": S0} if with_state else {},
                        expected=_interchunk(x, delta, a, B, C, Q, S0), rtol=1e-8, atol=1e-10,
                        what="(y_state, final_state)"))
    return out


# --------------------------------------------------------------------------- chapter 8

@register("layers", "check_split_qkvz")
def _split_qkvz(rng):
    from fixedstate import layers as fl
    out = []
    for _ in range(2):
        n_key = int(rng.integers(1, 4))
        c = fl.GatedDeltaNetConfig(int(rng.integers(3, 8)), n_key * int(rng.integers(1, 4)), n_key,
                                   int(rng.integers(2, 5)), int(rng.integers(2, 5)))
        W = rng.standard_normal((2 * c.n_key_heads * c.d_k + 2 * c.n_heads * c.d_v, c.d_model))
        e = fl.split_qwen3_next_projections(W, np.zeros((2 * c.n_heads, c.d_model)), c)
        out.append(Case(f"{c.n_key_heads} key heads, {c.n_heads} value heads, d_k={c.d_k}, d_v={c.d_v}", (W, c),
                        expected=(e["W_q"], e["W_k"], e["W_v"], e["W_z"]), rtol=0.0, atol=0.0,
                        what="(W_q, W_k, W_v, W_z)"))
    return out


@register("layers", "check_mamba2_step")
def _mamba2_step(rng):
    from fixedstate import layers as fl
    out = []
    for batch in ((), (2,)):
        groups = int(rng.integers(1, 3))
        c = fl.Mamba2Config(8, 2 * groups, 2, int(rng.integers(3, 6)), n_groups=groups)
        p = fl.init_mamba2(c, rng)
        for key in ("D", "norm_weight"):
            p[key] = p[key] + rng.uniform(-0.5, 0.5, p[key].shape)
        _, cache = fl.mamba2_block(p, rng.standard_normal(batch + (int(rng.integers(2, 7)), c.d_model)))
        x = rng.standard_normal(batch + (c.d_model,))
        y, new = fl.mamba2_block_step(p, x, cache)
        out.append(Case(f"{c.n_heads} heads in {groups} group(s)" + (", a batch of 2" if batch else ""),
                        (p, x, cache), expected=(y, {"conv": new["conv"], "state": new["state"]}),
                        rtol=1e-9, atol=1e-11, what="(y, cache)"))
    return out


# --------------------------------------------------------------------------- chapter 9

@register("training", "check_mean_accuracy")
def _mean_accuracy(rng):
    from fixedstate.checks.training import _reference_mean
    runs = []
    for mixer in ("gdn", "mamba2", "softmax"):
        for d in (32, 64):
            for n in (4, 8):
                for seed in range(int(rng.integers(2, 5))):
                    diverged = bool(rng.random() < 0.2)
                    runs.append({"mixer": mixer, "d_model": d, "n_pairs": n, "seed": seed, "diverged": diverged,
                                 "test_accuracy": None if diverged else float(rng.uniform(0, 1))})
    out = []
    for _ in range(3):
        r = runs[int(rng.integers(len(runs)))]
        m, d, n = r["mixer"], r["d_model"], r["n_pairs"]
        out.append(Case(f"made-up records, mixer {m!r}, d_model={d}, n_pairs={n}", (runs, m, d, n),
                        expected=float(_reference_mean(runs, m, d, n)), what="the mean accuracy"))
    return out


@register("training", "check_step_backward")
def _step_backward(rng):
    out = []
    for _ in range(2):
        d_k, d_v = _sizes(rng)
        q, k, v = rng.standard_normal(d_k), rng.standard_normal(d_k), rng.standard_normal(d_v)
        S_prev, d_o, d_S = rng.standard_normal((d_k, d_v)), rng.standard_normal(d_v), rng.standard_normal((d_k, d_v))
        S = S_prev + np.outer(k, v)
        dS = d_S + np.outer(q, d_o)
        out.append(Case(f"d_k={d_k}, d_v={d_v}", (q, k, v, S_prev, d_o, d_S),
                        expected=(S @ d_o, dS @ v, dS.T @ k, dS), what="(dq, dk, dv, dS_prev)"))
    return out
