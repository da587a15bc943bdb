"""Serving the shipped layers: speculative decoding's rollback, and heads split over devices.

Chapter {ref}`chap-shipped-layers`. Two things a server does with a fixed-state layer
that a prefill and a decode step alone do not show.

**Rollback after rejected speculative tokens.** In speculative decoding a cheap draft
model proposes ``k`` tokens and the served model checks them in one pass; it keeps
the first ``j`` that agree with its own choice and discards the rest
([Leviathan et al., 2023]; [Chen et al., 2023]). Attention discards a rejected token by
forgetting its row of the KV cache. A fixed-state layer has folded every token into
its state, so it must be able to return to the cache after token ``j``. Two ways:

- ``"snapshots"``: keep the recurrent state after each drafted token (``k`` states
  besides the live one), and pick the ``j``-th;
- ``"recompute"``: keep only the state before the draft, and run the ``j`` accepted
  tokens again from it.

The convolution cache needs neither: its window after ``j`` tokens is the last ``K - 1``
rows of the old window followed by the ``j`` accepted inputs, so keeping ``K - 1 + k``
rows suffices. :func:`verify_draft` runs the drafted tokens through a layer's decode
step and returns what each strategy keeps; :func:`rollback` returns the cache after
``j`` accepted tokens; :func:`rollback_numbers` counts what each strategy holds.

**Tensor parallelism.** A layer's heads are independent up to the output projection:
each head has its own state, gates and (in Gated DeltaNet and KDA) its own output norm;
Mamba-2 normalises per group of heads. So a layer splits over devices by heads (whole
key-head groups, whole ``B``/``C`` groups), every device holds its heads' weights and
states, computes a partial output ``y_r = o_r W_o[rows of r]``, and one all-reduce
(a sum over devices) of the ``(T, d_model)`` partial outputs gives the layer's output,
as Megatron-LM splits attention [Shoeybi et al., 2019]. :func:`split_heads` splits a
layer's parameters; :func:`all_reduce_numbers` counts what the all-reduce moves.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import layers
from ._validate import check_positive_int

__all__ = ["ROLLBACK_STRATEGIES", "verify_draft", "rollback", "rollback_numbers", "split_heads",
           "all_reduce_numbers"]

#: The two ways :func:`rollback` returns to the cache after the accepted tokens.
ROLLBACK_STRATEGIES = ("snapshots", "recompute")

_STEPS = {layers.GatedDeltaNetConfig: layers.gated_deltanet_step, layers.KDAConfig: layers.kda_layer_step,
          layers.MambaConfig: layers.mamba_block_step, layers.Mamba2Config: layers.mamba2_block_step}


def _layer_step(params):
    config = params.get("config") if isinstance(params, dict) else None
    step = _STEPS.get(type(config))
    if step is None:
        raise ValueError(f"params: expected a layer's params dict (from fixedstate.layers.init_*), got "
                         f"{type(params).__name__ if not isinstance(params, dict) else type(config).__name__}")
    return config, step


def _check_strategy(strategy):
    if strategy not in ROLLBACK_STRATEGIES:
        raise ValueError(f"strategy: expected one of {ROLLBACK_STRATEGIES}, got {strategy!r}")
    return strategy


def verify_draft(params, x_draft, cache, *, strategy="snapshots"):
    """Run ``k`` drafted tokens through a layer's decode step, keeping what a rollback needs.

    ``params`` a layer's parameters (any of :mod:`fixedstate.layers`); ``x_draft``
    ``(..., k, d_model)``, the drafted tokens' inputs to the layer; ``cache`` the cache
    before the draft (None: empty). Returns ``(y, kept)``: ``y`` ``(..., k, d_model)`` the
    layer's outputs, exactly those of :func:`fixedstate.layers.gated_deltanet_step` (or
    the layer's own step) called token by token; ``kept`` a dict with the strategy, the
    inputs, the widened convolution window ``"conv"`` ``(..., K-1+k, conv_dim)`` and
    ``"states"``: the state after each of tokens ``0..k`` (``k + 1`` arrays; token 0 is the
    state before the draft) for ``"snapshots"``, only the state before the draft for
    ``"recompute"``.
    """
    config, step = _layer_step(params)
    _check_strategy(strategy)
    x_draft = np.asarray(x_draft)
    if x_draft.ndim < 2 or x_draft.shape[-1] != config.d_model or x_draft.shape[-2] < 1:
        raise ValueError(f"x_draft: expected shape (..., k, d_model) with k >= 1 and d_model={config.d_model}, "
                         f"got shape {x_draft.shape}")
    if cache is None:
        cache = layers.empty_cache(config, x_draft.shape[:-2], dtype=np.result_type(x_draft, np.float32))
    window, states, ys = [cache["conv"]], [cache["state"]], []
    for t in range(x_draft.shape[-2]):
        y, cache = step(params, x_draft[..., t, :], cache)
        ys.append(y)
        window.append(cache["conv"][..., -1:, :] if config.conv_kernel > 1 else None)
        if strategy == "snapshots":
            states.append(cache["state"])
    conv = np.concatenate([w for w in window if w is not None], axis=-2) if config.conv_kernel > 1 else window[0]
    return np.stack(ys, axis=-2), {"strategy": strategy, "x": x_draft, "conv": conv, "states": states}


def rollback(params, kept, accepted: int) -> dict:
    """The layer's cache after the first ``accepted`` drafted tokens (0 to ``k``), from :func:`verify_draft`'s ``kept``.

    ``"snapshots"`` picks the stored state; ``"recompute"`` runs the accepted tokens
    again from the state before the draft with the layer's decode step (so the cache
    is exactly the plain decode's). The convolution cache is the last ``K - 1`` rows
    of the window up to the accepted tokens, in both.
    """
    config, step = _layer_step(params)
    if not isinstance(kept, dict) or set(kept) != {"strategy", "x", "conv", "states"}:
        raise ValueError("kept: expected the dict verify_draft returns (strategy, x, conv, states), got "
                         f"{sorted(kept) if isinstance(kept, dict) else type(kept).__name__}")
    k = kept["x"].shape[-2]
    if isinstance(accepted, bool) or not isinstance(accepted, numbers.Integral) or not 0 <= accepted <= k:
        raise ValueError(f"accepted: expected an integer from 0 to the {k} drafted tokens, got {accepted!r}")
    K1 = config.conv_kernel - 1
    conv = kept["conv"][..., accepted:accepted + K1, :]
    if kept["strategy"] == "snapshots":
        return {"conv": conv.copy(), "state": kept["states"][accepted].copy()}
    cache = {"conv": kept["conv"][..., :K1, :].copy(), "state": kept["states"][0].copy()}
    for t in range(accepted):
        _, cache = step(params, kept["x"][..., t, :], cache)
    return cache


def rollback_numbers(config, k: int) -> dict[str, int]:
    """Numbers one sequence's layer holds to roll back ``k`` drafted tokens, per strategy.

    ``{"snapshots": k n_state + (K-1+k) C, "recompute": n_state + (K-1+k) C,
    "plain": n_state + (K-1) C}``: the states kept (``k`` before the live one, or the one
    before the draft) plus the widened convolution window (none when ``K = 1``); ``"plain"`` is the decode
    cache alone (:func:`fixedstate.layers.cache_numbers`). ``"recompute"`` also re-runs
    up to ``k`` tokens of the layer.
    """
    n = layers.cache_numbers(config)
    k = check_positive_int(k, "k")
    window = n["conv"] + k * config.conv_dim if config.conv_kernel > 1 else 0     # K = 1: no window at all
    return {"snapshots": k * n["state"] + window, "recompute": n["state"] + window, "plain": n["total"]}


def _ranges(n, parts):
    size = n // parts
    return [range(r * size, (r + 1) * size) for r in range(parts)]


def split_heads(params, n_devices: int) -> list[dict]:
    """A Gated DeltaNet or Mamba-2 layer's parameters split by heads over ``n_devices`` devices.

    Device ``r`` gets the ``r``-th block of key heads (Gated DeltaNet: with the value
    heads they serve) or of ``B``/``C`` groups (Mamba-2: with their heads): the columns
    of the input projections and the rows of the convolution that make its heads'
    inputs, its heads' ``A_log``, ``dt_bias`` (and ``D``), its channels of a per-channel
    norm weight, and its rows of the output projection. Each part is a layer's params
    dict of its own (a configuration with ``1/n_devices`` of the heads), so the layer's
    functions run it unchanged; the sum of the parts' outputs is the layer's output.

    ``n_devices`` must divide ``n_key_heads`` (Gated DeltaNet) or ``n_groups`` (Mamba-2):
    a group's heads share its keys (``B``, ``C``), and Mamba-2's output norm runs over a
    group's channels, so a group cannot be cut without communication inside the layer.
    """
    config = params.get("config") if isinstance(params, dict) else None
    n = check_positive_int(n_devices, "n_devices")
    if isinstance(config, layers.GatedDeltaNetConfig):
        c = config
        if c.n_key_heads % n:
            raise ValueError(f"n_devices: expected a divisor of n_key_heads={c.n_key_heads} (each device takes whole "
                             f"key heads with the value heads they serve), got {n}")
        part = layers.GatedDeltaNetConfig(c.d_model, c.n_heads // n, c.n_key_heads // n, c.d_k, c.d_v,
                                          conv_kernel=c.conv_kernel, norm_eps=c.norm_eps, chunk_size=c.chunk_size)
        kd = c.n_key_heads * c.d_k
        out = []
        for keys, values in zip(_ranges(c.n_key_heads, n), _ranges(c.n_heads, n)):
            kc = np.concatenate([np.arange(h * c.d_k, (h + 1) * c.d_k) for h in keys])
            vc = np.concatenate([np.arange(h * c.d_v, (h + 1) * c.d_v) for h in values])
            hv = np.array(values)
            conv_rows = np.concatenate([kc, kd + kc, 2 * kd + vc])
            out.append({"config": part, "W_q": params["W_q"][:, kc], "W_k": params["W_k"][:, kc],
                        "W_v": params["W_v"][:, vc], "W_z": params["W_z"][:, vc], "W_b": params["W_b"][:, hv],
                        "W_a": params["W_a"][:, hv], "conv_weight": params["conv_weight"][conv_rows],
                        "A_log": params["A_log"][hv], "dt_bias": params["dt_bias"][hv],
                        "norm_weight": params["norm_weight"], "W_o": params["W_o"][vc]})
        return out
    if isinstance(config, layers.Mamba2Config):
        c = config
        if c.n_groups % n:
            raise ValueError(f"n_devices: expected a divisor of n_groups={c.n_groups} (each device takes whole groups: "
                             f"their heads share B and C, and the output norm runs over a group's channels), got {n}")
        part = layers.Mamba2Config(c.d_model, c.n_heads // n, c.head_dim, c.d_state, n_groups=c.n_groups // n,
                                   conv_kernel=c.conv_kernel, conv_bias=c.conv_bias, norm_eps=c.norm_eps,
                                   chunk_size=c.chunk_size, norm_before_gate=c.norm_before_gate)
        di, GN, N, P = c.d_inner, c.n_groups * c.d_state, c.d_state, c.head_dim
        out = []
        for groups, heads in zip(_ranges(c.n_groups, n), _ranges(c.n_heads, n)):
            xc = np.concatenate([np.arange(h * P, (h + 1) * P) for h in heads])
            gc = np.concatenate([np.arange(g * N, (g + 1) * N) for g in groups])
            hv = np.array(heads)
            conv_rows = np.concatenate([xc, di + gc, di + GN + gc])               # x, B, C channels of xBC
            in_cols = np.concatenate([xc, di + conv_rows, di + c.conv_dim + hv])  # z, xBC, dt of W_in
            part_params = {"config": part, "W_in": params["W_in"][:, in_cols],
                           "conv_weight": params["conv_weight"][conv_rows], "dt_bias": params["dt_bias"][hv],
                           "A_log": params["A_log"][hv], "D": params["D"][hv],
                           "norm_weight": params["norm_weight"][xc], "W_out": params["W_out"][xc]}
            if c.conv_bias:
                part_params["conv_bias"] = params["conv_bias"][conv_rows]
            out.append(part_params)
        return out
    raise ValueError(f"params: expected a Gated DeltaNet or Mamba-2 layer's params dict, got "
                     f"{type(config).__name__ if isinstance(params, dict) else type(params).__name__}")


def all_reduce_numbers(d_model: int, tokens: int, n_devices: int) -> dict[str, float]:
    """What one layer's all-reduce of its partial outputs moves, for ``tokens`` tokens over ``n_devices``.

    The partial outputs are ``tokens x d_model`` numbers on every device; a ring
    all-reduce sends ``2 (n - 1) / n`` of them from each device (a reduce-scatter then
    an all-gather). Returns ``{"per_device": ..., "payload": tokens * d_model}``.
    """
    d_model, tokens, n = (check_positive_int(v, name) for v, name in ((d_model, "d_model"), (tokens, "tokens"),
                                                                       (n_devices, "n_devices")))
    payload = tokens * d_model
    return {"payload": payload, "per_device": 2 * (n - 1) / n * payload}
