"""Training tiny models on MQAR, in numpy: the loss, Adam, the model and the experiment.

Chapter 9 ("Train it yourself") derives every gradient used here. This module
composes them; it redefines no layer and no block:

- :func:`cross_entropy`, :func:`cross_entropy_backward`: the loss at the query
  positions of an MQAR batch (targets ``-1`` elsewhere are ignored);
- :func:`adam_init`, :func:`adam_step`: Adam, with the global gradient norm
  clipped;
- :func:`init_model`, :func:`model_forward`, :func:`model_backward`,
  :func:`loss_and_grads`: a two-layer pre-norm model whose token mixer is a
  parameter (``MODEL_LAYERS``, by the ids of :mod:`fixedstate.layer_ids`); every
  mixer sits in the same block (:func:`fixedstate.blocks.residual_block`:
  RMSNorm, three projections, a short causal convolution on each, the core, an
  output projection, then an MLP), so the mixers differ in the core alone, which
  the model takes from the table :data:`fixedstate.mixers.MIXERS`;
- :func:`train`, :func:`evaluate`: the training loop on
  :func:`fixedstate.recall.make_mqar` batches (fresh seeded batches at every
  step, a held-out test set drawn from a separate stream);
- :func:`run_sweep`: the chapter's first, small experiment (``SWEEP``, stored in
  results/mqar_sweep.json);
- ``RECALL_SWEEP``, ``RECALL_QUICK``: the recall-against-state sweep at the scale of
  the papers (issue 30; ``make experiment``, ``make experiment-quick``), as a list
  of independent runs (:func:`recall_tuning_runs`, :func:`recall_main_runs`,
  :func:`recall_run`) that tools/mqar_sweep.py schedules, each a model trained on a
  mixture of lengths and tested at each (:func:`train_mixture`); its statistics are in
  :mod:`fixedstate.mqar_stats`.

Parameter names (one scheme with :mod:`fixedstate.hybrid` and :mod:`fixedstate.layers`,
after the names ``transformers`` gives the shipped layers): matrices ``W_<role>``
(``(d_in, d_out)``), a projection's bias ``b_<role>``, convolution taps
``conv_weight_<q|k|v>``, RMSNorm weights ``norm_<where>``; each layer's under the
prefix ``layers.<i>.``:

- ``norm_mixer``, ``W_q``, ``W_k``, ``W_v``, ``conv_weight_q|k|v``, ``W_o``; then
  ``norm_mlp``, ``W_1``, ``W_2`` (the MLP);
- the gates (one head, so each projection is a vector ``(d_model,)``):
  ``W_b``, ``b_b`` for ``beta = sigmoid(u W_b + b_b)`` and ``W_a``, ``b_a`` for the
  decay ``g = sigmoid(u W_a + b_a)`` (Qwen3-Next's letters ``b`` and ``a``); the SSD's
  ``W_dt``, ``dt_bias`` for ``delta = softplus(u W_dt + dt_bias)`` and ``A_log``
  for ``a = -exp(A_log)`` (Mamba-2's names);

and ``embedding``, ``norm_final``, ``W_head`` (the vocabulary projection) outside the layers.

The cores' backward passes live beside their forward passes, in
:mod:`fixedstate.softmax_attention`, :mod:`fixedstate.linear_attention`,
:mod:`fixedstate.delta_rule` and :mod:`fixedstate.ssm`; the blocks' in
:mod:`fixedstate.blocks`.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

import numpy as np

from . import blocks as bl
from . import kernels as kn
from . import mixers
from ._heap import keep_freed_memory
from ._threads import one_blas_thread
from ._validate import as_float_array, check_positive_int
from .layer_ids import DELTA, GATED_DELTA, HYBRID, LINEAR, SOFTMAX, SSD, SWA, check_layer_id
from .recall import make_mqar

__all__ = [
    "MODEL_LAYERS",
    "ModelConfig",
    "cross_entropy",
    "cross_entropy_backward",
    "adam_init",
    "adam_step",
    "init_model",
    "model_forward",
    "model_backward",
    "loss_and_grads",
    "evaluate",
    "train",
    "train_mixture",
    "mqar_data",
    "SWEEP",
    "SSD_FOLLOWUP",
    "run_config",
    "choose_lr",
    "run_sweep",
    "RECALL_SWEEP",
    "RECALL_QUICK",
    "swa_window",
    "recall_tuning_runs",
    "recall_main_runs",
    "run_key",
    "recall_run",
    "recall_baseline",
]

# The models of the chapter, by the id of their mixer (fixedstate.layer_ids), each the
# list of its two layers' mixers (keys of fixedstate.mixers.MIXERS). The hybrid puts its
# one attention layer last.
MODEL_LAYERS = {
    SOFTMAX: (SOFTMAX, SOFTMAX),
    SWA: (SWA, SWA),
    LINEAR: (LINEAR, LINEAR),
    DELTA: (DELTA, DELTA),
    GATED_DELTA: (GATED_DELTA, GATED_DELTA),
    SSD: (SSD, SSD),
    HYBRID: (GATED_DELTA, SOFTMAX),
}


# ---------------------------------------------------------------------------- the loss

def _targets(targets, shape):
    t = np.asarray(targets)
    if t.dtype == bool or t.dtype.kind not in "iu":
        raise ValueError(f"targets: expected an integer array of token ids (-1 where no answer is asked), "
                         f"got dtype {t.dtype}")
    if t.shape != shape[:-1]:
        raise ValueError(f"targets: expected shape {shape[:-1]} (the leading axes of logits), got {t.shape}")
    if t.size and (t.min() < -1 or t.max() >= shape[-1]):
        raise ValueError(f"targets: expected ids in [-1, {shape[-1]}) (-1: no answer asked), got values in "
                         f"[{int(t.min())}, {int(t.max())}]")
    if not (t >= 0).any():
        raise ValueError("targets: expected at least one position with an answer (an id >= 0), got none")
    return t


def _log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def cross_entropy(logits, targets) -> float:
    """Mean cross-entropy over the positions with a target (``eq-tr-xent``).

    ``L = -(1/M) sum_{t: y_t >= 0} log softmax(z_t)[y_t]`` with ``M`` the number
    of such positions. ``logits`` ``(..., V)``; ``targets`` ``(...)`` integers in
    ``[-1, V)``, ``-1`` where no answer is asked. Returns a float.
    """
    return _cross_entropy(logits, targets, grad=False)[0]


def _cross_entropy(logits, targets, *, grad=True):
    """Check once; ``(loss, d_logits)`` from one log-softmax of the rows with a target (``d_logits`` None
    unless ``grad``): what :func:`cross_entropy` and :func:`cross_entropy_backward` return."""
    z = as_float_array(logits, "logits")
    t = _targets(targets, z.shape)
    mask = t >= 0
    logp = _log_softmax(z[mask])
    rows, answers = np.arange(logp.shape[0]), t[mask]
    loss = float(-np.mean(logp[rows, answers]))
    if not grad:
        return loss, None
    g = np.zeros_like(z)
    p = np.exp(logp)
    p[rows, answers] -= 1
    g[mask] = p / mask.sum()
    return loss, g


def cross_entropy_backward(logits, targets):
    """Gradient of :func:`cross_entropy` with respect to the logits (``eq-tr-xent-grad``).

    ``(softmax(z_t) - onehot(y_t)) / M`` at a position with a target, zero
    elsewhere. Same shape and dtype as ``logits``.
    """
    return _cross_entropy(logits, targets)[1]


# ---------------------------------------------------------------------------- Adam

def adam_init(params) -> dict:
    """Adam's state for a dict of parameter arrays: zero moments and step 0."""
    return {"step": 0,
            "m": {name: np.zeros_like(p) for name, p in params.items()},
            "v": {name: np.zeros_like(p) for name, p in params.items()}}


def _nonneg(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return float(value)


def adam_step(params, grads, state, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, clip=None):
    """One Adam step (``eq-tr-adam``), in place on ``params``; returns the gradient norm before clipping.

    ``m <- beta1 m + (1 - beta1) g``, ``v <- beta2 v + (1 - beta2) g^2``,
    ``p <- p - lr * m_hat / (sqrt(v_hat) + eps)`` with the bias corrections
    ``m_hat = m / (1 - beta1^n)``, ``v_hat = v / (1 - beta2^n)`` at step ``n``.
    With ``clip``, the gradients are first scaled so that their global norm is at
    most ``clip``.

    Parameters
    ----------
    params, grads : dicts of arrays with the same keys and shapes
    state : from :func:`adam_init`, updated in place
    lr : learning rate >= 0; beta1, beta2 in [0, 1); eps > 0; clip > 0 or None
    """
    lr = _nonneg(lr, "lr")
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not (isinstance(b, numbers.Real) and 0 <= b < 1):
            raise ValueError(f"{name}: expected a number in [0, 1), got {b!r}")
    if not (isinstance(eps, numbers.Real) and eps > 0):
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    if set(grads) != set(params):
        raise ValueError(f"grads: expected the keys of params {sorted(params)}, got {sorted(grads)}")
    for name, p in params.items():
        if np.shape(grads[name]) != p.shape:
            raise ValueError(f"grads: expected shape {p.shape} for {name!r}, got {np.shape(grads[name])}")
    norm = math.sqrt(sum(float(np.sum(np.square(g))) for g in grads.values()))
    factor = 1.0
    if clip is not None:
        if not (isinstance(clip, numbers.Real) and clip > 0):
            raise ValueError(f"clip: expected a positive number or None, got {clip!r}")
        factor = min(1.0, clip / max(norm, 1e-300))
    state["step"] += 1
    n = state["step"]
    c1, c2 = 1 - beta1 ** n, 1 - beta2 ** n
    for name, p in params.items():
        g = grads[name] * factor
        m, v = state["m"][name], state["v"][name]
        m *= beta1
        m += (1 - beta1) * g
        v *= beta2
        v += (1 - beta2) * g * g
        p -= lr * (m / c1) / (np.sqrt(v / c2) + eps)
    return norm


# ---------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class ModelConfig:
    """The shape of a tiny model: its mixer (a key of ``MODEL_LAYERS``) and sizes.

    ``d_model`` is the width; each mixer has one head with ``d_k = d_v = d_model``
    (the fixed-state layers' state is ``d_model x d_model``); the MLP is
    ``d_model -> d_ff -> d_model``; the short convolution has ``conv_size`` taps;
    the chunkwise cores run in chunks of ``chunk_size`` tokens; ``window`` is
    sliding-window attention's window (required by ``"swa"``, ignored by the others).
    """

    mixer: str
    vocab_size: int
    d_model: int
    d_ff: int | None = None
    conv_size: int = 4
    chunk_size: int = 16
    window: int | None = None
    layers: tuple = field(init=False)

    def __post_init__(self):
        check_layer_id(self.mixer, tuple(MODEL_LAYERS), "mixer")
        check_positive_int(self.vocab_size, "vocab_size", minimum=2)
        check_positive_int(self.d_model, "d_model")
        check_positive_int(self.conv_size, "conv_size")
        check_positive_int(self.chunk_size, "chunk_size")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 2 * self.d_model)
        check_positive_int(self.d_ff, "d_ff")
        object.__setattr__(self, "layers", MODEL_LAYERS[self.mixer])
        if any("window" in mixers.mixer(m).options for m in self.layers) or self.window is not None:
            if self.window is None:
                raise ValueError(f"window: expected a window (an integer >= 1) for the {self.mixer!r} mixer, "
                                 "got None")
            check_positive_int(self.window, "window")

    def options(self, layer_id) -> dict:
        """The keyword arguments beyond the common ones that ``layer_id``'s mixer reads (its ``options``)."""
        return {name: getattr(self, name) for name in mixers.mixer(layer_id).options}


def _ssd_dt_bias(ssd_dt_init) -> float:
    """The SSD's step bias ``dt_bias``: 0 for ``None`` (the step starts at ``softplus(0) = ln 2``), else
    ``softplus^{-1}(ssd_dt_init)``, so that the step starts at ``ssd_dt_init`` where ``u W_dt = 0``."""
    if ssd_dt_init is None:
        return 0.0
    if (isinstance(ssd_dt_init, bool) or not isinstance(ssd_dt_init, numbers.Real)
            or not math.isfinite(ssd_dt_init) or ssd_dt_init <= 0):
        raise ValueError(f"ssd_dt_init: expected a finite number > 0 (the SSD's initial step) or None, "
                         f"got {ssd_dt_init!r}")
    return float(bl.inverse_softplus(float(ssd_dt_init)))


@dataclass(frozen=True)
class _TokenGate:
    """How the model computes one per-token gate from the layer's normalised input ``u`` (one head):
    ``gate = form(u W + b)`` with ``W`` ``(d_model,)`` and ``b`` ``(1,)``, and the gradient of ``form``."""

    weight: str
    bias: str
    form: object
    form_backward: object


# The per-token gates of the cores (mixers.MIXERS[...].gates), each a named gate form of fixedstate.blocks.
_TOKEN_GATES = {
    "beta": _TokenGate("W_b", "b_b", bl.sigmoid, bl.sigmoid_backward),
    "log_gate": _TokenGate("W_a", "b_a", bl.sigmoid_log_gate, bl.sigmoid_log_gate_backward),
    "delta": _TokenGate("W_dt", "dt_bias", bl.softplus, bl.softplus_backward),
}
# The SSD's a = -exp(A_log) < 0, one per layer (Mamba-2's parametrisation): a per-layer gate, not per token.
_LAYER_GATES = {"a": "A_log"}
# The model scales softmax attention's logits by 1/sqrt(d); the fixed-state cores read out unscaled.
_SCALED = frozenset({SOFTMAX, SWA})


#: The SSD's initialisations: ``"unit"`` (A_log = 0, so a = -1; dt_bias from ``ssd_dt_init``) and
#: ``"mamba2"``, the shipped Mamba-2 layer's (:mod:`fixedstate.layers`, chapter 8): ``A = exp(A_log)``
#: uniform in [1, 16] and the step ``softplus(dt_bias)`` log-uniform in [1e-3, 0.1].
SSD_INITS = ("unit", "mamba2")


def init_model(config: ModelConfig, rng, *, dtype=np.float64, ssd_dt_init=None, ssd_init="unit") -> dict:
    """Random parameters of the model ``config`` describes, as a dict name -> array of ``dtype``.

    ``dtype`` is float64 (for gradient checks) or float32 (for training: twice
    as fast in numpy, and precise enough for Adam's steps). The names are listed
    in the module's docstring.

    Projections are drawn with standard deviation ``1/sqrt(d_in)``; the two
    projections that write into the residual stream (``W_o``, ``W_2``) are scaled
    down by ``sqrt(2 * n_layers)``; the convolution starts as the identity (its
    last tap 1, the others small); gates start open (``beta`` near 0.5, the
    decay near 0.95, the SSM step near 0.7).

    ``ssd_dt_init`` changes only the SSD's step bias: ``None`` (the default, the
    sweep's initialisation) sets ``dt_bias = 0``, so the step starts at
    ``softplus(0) = ln 2``; a number ``Delta0 > 0`` sets
    ``dt_bias = softplus^{-1}(Delta0) = log(expm1(Delta0))``, so the step starts at
    ``Delta0`` (before the input's share ``u W_dt``) and, with ``a = -1``, the
    per-token decay at ``exp(-Delta0)``. Other mixers ignore it.

    ``ssd_init="mamba2"`` draws the SSD's ``A_log`` and ``dt_bias`` as the shipped
    Mamba-2 layer does (``SSD_INITS``; the draws come after the layer's projections
    from the same generator), and then ``ssd_dt_init`` must be None.
    """
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config: expected a ModelConfig, got {type(config).__name__}")
    if ssd_init not in SSD_INITS:
        raise ValueError(f"ssd_init: expected one of {SSD_INITS}, got {ssd_init!r}")
    if ssd_init == "mamba2" and ssd_dt_init is not None:
        raise ValueError(f"ssd_dt_init: expected None with ssd_init='mamba2' (it draws the step), got {ssd_dt_init!r}")
    first_bias = {"b_b": 0.0, "b_a": 3.0, "dt_bias": _ssd_dt_bias(ssd_dt_init)}
    rng = np.random.default_rng(rng)
    d, V, K, F = config.d_model, config.vocab_size, config.conv_size, config.d_ff
    out_scale = 1 / math.sqrt(2 * len(config.layers))

    def proj(d_in, d_out, scale=1.0):
        return rng.standard_normal((d_in, d_out)) * scale / math.sqrt(d_in)

    p = {"embedding": rng.standard_normal((V, d))}
    for i, layer_id in enumerate(config.layers):
        L = f"layers.{i}."
        p[L + "norm_mixer"] = np.ones(d)
        for name in ("W_q", "W_k", "W_v"):
            p[L + name] = proj(d, d)
        for name in ("conv_weight_q", "conv_weight_k", "conv_weight_v"):
            c = rng.standard_normal((d, K)) * 0.1
            c[:, -1] += 1.0
            p[L + name] = c
        for gate in mixers.mixer(layer_id).gates:
            if gate in _TOKEN_GATES:
                spec = _TOKEN_GATES[gate]
                p[L + spec.weight] = proj(d, 1)[:, 0]
                p[L + spec.bias] = np.full(1, first_bias[spec.bias])
            else:
                p[L + _LAYER_GATES[gate]] = np.zeros(1)
        if ssd_init == "mamba2" and L + "A_log" in p:     # one head: one A and one step per layer
            p[L + "A_log"] = np.log(rng.uniform(1.0, 16.0, size=1))
            p[L + "dt_bias"] = bl.inverse_softplus(np.exp(rng.uniform(math.log(1e-3), math.log(0.1), size=1)))
        p[L + "W_o"] = proj(d, d, out_scale)
        p[L + "norm_mlp"] = np.ones(d)
        p[L + "W_1"] = proj(d, F)
        p[L + "W_2"] = proj(F, d, out_scale)
    p["norm_final"] = np.ones(d)
    p["W_head"] = proj(d, V)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
    return {name: a.astype(dtype) for name, a in p.items()}


def _mixer_forward(layer_id, p, L, config, u, zero_core=False):
    """One layer's token mixer on its normalised input ``u`` ``(B, T, d)``: projections, short
    convolutions, gates, the core (from the table :data:`fixedstate.mixers.MIXERS`), ``W_o``.
    With ``zero_core`` the core's output is replaced by zeros (the ablation of :func:`evaluate`).
    Returns its output and what :func:`_mixer_backward` needs.

    The parameters were checked by :func:`model_forward`; the projections, convolutions and
    normalisations run the blocks' arithmetic (:mod:`fixedstate.kernels`, what
    :func:`fixedstate.blocks.linear`, :func:`~fixedstate.blocks.short_conv` and
    :func:`~fixedstate.blocks.l2_normalize` compute) without checking again, and keep what
    the backward reuses."""
    entry = mixers.mixer(layer_id)
    s = {"u": u}
    for name in "qkv":
        pre = u @ p[L + "W_" + name]                                    # bl.linear
        w = p[L + "conv_weight_" + name]                                # bl.short_conv from a zero state:
        s["padded_" + name] = np.concatenate(                           # K - 1 zeros, then the sequence
            [np.zeros(pre.shape[:-2] + (w.shape[1] - 1, pre.shape[-1]), dtype=np.result_type(pre, w)), pre],
            axis=-2)
        s[name] = kn.conv_taps(w, s["padded_" + name], pre.shape[-2])
    gates, s["z"] = {}, {}
    for gate in entry.gates:
        if gate in _TOKEN_GATES:
            spec = _TOKEN_GATES[gate]
            s["z"][gate] = u @ p[L + spec.weight] + p[L + spec.bias][0]
            gates[gate] = spec.form(s["z"][gate])
        else:
            gates[gate] = -np.exp(p[L + _LAYER_GATES[gate]][0])
    s["gates"] = gates
    q, k = s["q"], s["k"]
    if entry.normalize_qk:                                              # bl.l2_normalize, its r kept
        (q, s["r_q"]), (k, s["r_k"]) = kn.l2_normalize_parts(q, _L2_EPS), kn.l2_normalize_parts(k, _L2_EPS)
    s["q_core"], s["k_core"] = q, k                                     # what the core read, for the backward
    scale = 1 / math.sqrt(q.shape[-1]) if layer_id in _SCALED else 1.0
    s["options"] = config.options(layer_id)
    s["o"], _ = entry.forward(q, k, s["v"], gates, scale=scale, chunk_size=config.chunk_size, **s["options"])
    if zero_core:
        s["o"] = np.zeros_like(s["o"])
    return s["o"] @ p[L + "W_o"], s


_L2_EPS = 1e-6          # bl.l2_normalize's default eps, which the model uses


def _backward_chunk(d):
    """The chunk of the cores' chunkwise backward passes at width ``d`` (the gradients do not depend on it,
    only the time and the rounding): 16 up to ``d = 32``, where the delta rules' backward in chunks of 16 took
    0.4 to 0.8 times as long as in chunks of 32 (batch 64, T = 64 and 128, float32, one BLAS thread), and
    mixers.BACKWARD_CHUNK (32) above, where 16 was no faster (d = 64) or slower (d = 128, T = 256)."""
    return 16 if d <= 32 else mixers.BACKWARD_CHUNK


def _mixer_backward(layer_id, p, L, s, d_m, grads):
    """The gradient of :func:`_mixer_forward` with respect to ``u``; the layer's weight gradients go to ``grads``."""
    entry = mixers.mixer(layer_id)
    do, grads[L + "W_o"] = kn.linear_grad(s["o"], p[L + "W_o"], d_m)          # bl.linear_backward
    q, k, v, gates = s["q_core"], s["k_core"], s["v"], s["gates"]
    scale = 1 / math.sqrt(q.shape[-1]) if layer_id in _SCALED else 1.0
    dq, dk, dv, d_gates = entry.backward(q, k, v, gates, do, scale=scale, chunk_size=_backward_chunk(q.shape[-1]),
                                         **s["options"])
    if entry.normalize_qk:
        dq, dk = kn.l2_normalize_grad(q, s["r_q"], dq), kn.l2_normalize_grad(k, s["r_k"], dk)
    u = s["u"]
    du = np.zeros_like(u)
    for gate in reversed(entry.gates):
        if gate in _TOKEN_GATES:
            spec = _TOKEN_GATES[gate]
            dz = spec.form_backward(s["z"][gate], d_gates[gate])
            grads[L + spec.weight] = np.einsum("btd,bt->d", u, dz)
            grads[L + spec.bias] = np.array([dz.sum()])
            du += dz[..., None] * p[L + spec.weight]
    for gate in entry.gates:
        if gate in _LAYER_GATES:                           # a = -exp(A_log): da/dA_log = a
            grads[L + _LAYER_GATES[gate]] = np.array([float(np.sum(d_gates[gate])) * gates[gate]])
    for name, dconv in zip("qkv", (dq, dk, dv)):                       # bl.short_conv_backward, bl.linear_backward
        w = p[L + "conv_weight_" + name]
        d_padded, grads[L + "conv_weight_" + name] = kn.conv_grad(w, s["padded_" + name], dconv, dconv.shape[-2])
        dpre = np.ascontiguousarray(d_padded[..., w.shape[1] - 1:, :])
        dui, grads[L + "W_" + name] = kn.linear_grad(u, p[L + "W_" + name], dpre)
        du = du + dui
    return du


def model_forward(params, config: ModelConfig, tokens, *, zero_cores=()):
    """Logits ``(B, T, V)`` of the model for ``tokens`` ``(B, T)`` (``eq-tr-model``), and the cache for the backward.

    Each layer is :func:`fixedstate.blocks.residual_block` around its mixer:
    ``u = rms_norm(x)``; ``q, k, v = conv(u W_q), conv(u W_k), conv(u W_v)``;
    ``x <- x + core(q, k, v) W_o``; then ``x <- x + mlp(rms_norm(x))``. After the
    layers, ``logits = rms_norm(x) W_head``. ``cache["layers"][i]`` is the block's
    saved dict; its ``"mixer"`` entry holds ``q, k, v`` (after the convolutions),
    the ``gates`` the core read and its output ``o``.

    ``zero_cores`` lists layer indices whose core output is set to zero (the
    ablation of chapter 9: the layer keeps its MLP and residual path, and its
    mixer writes nothing); for evaluation, not for training.
    """
    zero_cores = _layer_indices(zero_cores, len(config.layers))
    params = _check_params(params, config)
    x = bl.embedding(tokens, params["embedding"])
    cache = {"tokens": tokens, "layers": []}
    for i, layer_id in enumerate(config.layers):
        L = f"layers.{i}."
        x, saved = bl.residual_block(
            x, lambda u, layer_id=layer_id, L=L, i=i: _mixer_forward(layer_id, params, L, config, u,
                                                                      zero_core=i in zero_cores),
            params[L + "W_1"], params[L + "W_2"], norm_mixer=params[L + "norm_mixer"],
            norm_mlp=params[L + "norm_mlp"])
        cache["layers"].append(saved)
    cache["x_final"] = x
    cache["h_final"] = bl.rms_norm(x, params["norm_final"])
    return bl.linear(cache["h_final"], params["W_head"]), cache


def param_shapes(config: ModelConfig) -> dict:
    """The name and shape of every parameter of the model ``config`` describes, in :func:`init_model`'s order.

    Internal (outside ``__all__``): :func:`model_forward` checks its ``params`` against it once per call.
    """
    d, V, K, F = config.d_model, config.vocab_size, config.conv_size, config.d_ff
    shapes = {"embedding": (V, d)}
    for i, layer_id in enumerate(config.layers):
        L = f"layers.{i}."
        shapes[L + "norm_mixer"] = (d,)
        shapes.update({L + name: (d, d) for name in ("W_q", "W_k", "W_v")})
        shapes.update({L + name: (d, K) for name in ("conv_weight_q", "conv_weight_k", "conv_weight_v")})
        for gate in mixers.mixer(layer_id).gates:
            if gate in _TOKEN_GATES:
                shapes[L + _TOKEN_GATES[gate].weight] = (d,)
                shapes[L + _TOKEN_GATES[gate].bias] = (1,)
            else:
                shapes[L + _LAYER_GATES[gate]] = (1,)
        shapes.update({L + "W_o": (d, d), L + "norm_mlp": (d,), L + "W_1": (d, F), L + "W_2": (F, d)})
    shapes.update({"norm_final": (d,), "W_head": (d, V)})
    return shapes


def _check_params(params, config) -> dict:
    """Check once per pass what the model's blocks then run unchecked: every parameter present, a finite
    float array of its shape. Returns them as arrays (a list becomes one, as the blocks' checks made it)."""
    if not isinstance(params, dict):
        raise ValueError(f"params: expected a dict name -> array (init_model's), got {type(params).__name__}")
    checked = {}
    for name, shape in param_shapes(config).items():
        if name not in params:
            raise ValueError(f"params: expected a parameter {name!r} for the {config.mixer!r} model, got none")
        checked[name] = as_float_array(params[name], f"params[{name!r}]", shape=shape)
    return checked


def _layer_indices(indices, n_layers) -> frozenset:
    try:
        out = frozenset(indices)
    except TypeError:
        raise ValueError(f"zero_cores: expected a collection of layer indices, got {indices!r}") from None
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"zero_cores: expected layer indices in [0, {n_layers}), got {sorted(out, key=str)}")
    return out


def model_backward(params, config: ModelConfig, cache, d_logits) -> dict:
    """Gradients of a loss with respect to every parameter, given ``d_logits`` (``eq-tr-model``).

    The layers of :func:`model_forward` in reverse order, each through
    :func:`fixedstate.blocks.residual_block_backward` and the mixer's backward
    pass (the table's, :data:`fixedstate.mixers.MIXERS`).
    """
    params = _check_params(params, config)
    g = {}
    dh, g["W_head"], _ = bl.linear_backward(cache["h_final"], params["W_head"], d_logits)
    dx, g["norm_final"] = bl.rms_norm_backward(cache["x_final"], dh, params["norm_final"])
    for i in reversed(range(len(config.layers))):
        layer_id, L = config.layers[i], f"layers.{i}."
        for name in ("W_1", "W_2", "norm_mlp"):   # the MLP's gradients first, as the pass computes them
            g[L + name] = None                    # (the order of the dict is the order Adam's norm sums in)
        dx, block = bl.residual_block_backward(
            cache["layers"][i], dx, lambda s, d_m, layer_id=layer_id, L=L: _mixer_backward(layer_id, params, L,
                                                                                           s, d_m, g),
            params[L + "W_1"], params[L + "W_2"], norm_mixer=params[L + "norm_mixer"],
            norm_mlp=params[L + "norm_mlp"])
        for name, grad in block.items():
            g[L + name] = grad
    g["embedding"] = bl.embedding_backward(cache["tokens"], params["embedding"], dx)
    return g


def loss_and_grads(params, config: ModelConfig, tokens, targets):
    """The cross-entropy of the model on a batch, and its gradient with respect to every parameter.

    Like every training function here, it first keeps freed memory in the process
    (:func:`fixedstate._heap.keep_freed_memory`, once per process): a step then
    reuses the pages the last one freed instead of faulting in fresh ones.
    """
    keep_freed_memory()
    logits, cache = model_forward(params, config, tokens)
    loss, d_logits = _cross_entropy(logits, targets)       # cross_entropy and cross_entropy_backward, in one
    return loss, model_backward(params, config, cache, d_logits)


# ---------------------------------------------------------------------------- data, training, evaluation

def mqar_data(n_sequences, *, vocab_size, n_pairs, seq_len, rng, distinct_values=False):
    """A batch of MQAR sequences from :func:`fixedstate.recall.make_mqar`: ``(tokens, targets)``."""
    batch = make_mqar(n_sequences, vocab_size, n_pairs, seq_len, rng=rng, distinct_values=distinct_values)
    return batch.tokens, batch.targets


def evaluate(params, config: ModelConfig, tokens, targets, *, batch_size=256, zero_cores=()) -> float:
    """Accuracy at the query positions: the fraction whose most likely token is the target.

    ``zero_cores``: layers whose core output is zeroed (:func:`model_forward`), the ablation.
    """
    keep_freed_memory()
    right = total = 0
    for s in range(0, len(tokens), batch_size):
        logits, _ = model_forward(params, config, tokens[s:s + batch_size], zero_cores=zero_cores)
        t = targets[s:s + batch_size]
        mask = t >= 0
        right += int(np.sum(np.argmax(logits[mask], axis=-1) == t[mask]))
        total += int(mask.sum())
    return right / total


def _lr_at(step, steps, lr, warmup):
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _adam_loop(params, config, lengths, *, steps, lr, warmup, clip, batch_size, vocab_size, data_rng,
               distinct_values, callback):
    """Train ``params`` in place: Adam for ``steps`` steps, one fresh MQAR batch a step, its
    (seq_len, n_pairs) taken from ``lengths`` in turn. Returns ``(losses, seconds)``; a
    non-finite loss stops the loop and leaves NaN from that step on."""
    state = adam_init(params)
    warmup = max(1, steps // 10) if warmup is None else warmup
    losses = np.empty(steps)
    start = time.perf_counter()
    for step in range(steps):
        seq_len, n_pairs = lengths[step % len(lengths)]
        tokens, targets = mqar_data(batch_size, vocab_size=vocab_size, n_pairs=n_pairs, seq_len=seq_len,
                                    rng=data_rng, distinct_values=distinct_values)
        loss, grads = loss_and_grads(params, config, tokens, targets)
        if not math.isfinite(loss):
            losses[step:] = np.nan
            break
        adam_step(params, grads, state, lr=_lr_at(step, steps, lr, warmup), clip=clip)
        losses[step] = loss
        if callback is not None:
            callback(step, loss)
    return losses, time.perf_counter() - start


def train(mixer, *, d_model, n_pairs, steps, lr, seed, vocab_size=64, seq_len=64, batch_size=32,
          n_test=256, clip=1.0, warmup=None, dtype=np.float32, callback=None, ssd_dt_init=None, window=None,
          ssd_init="unit", distinct_values=False, test_seed=12345):
    """Train one model on MQAR and return a dict with its parameters, losses and test accuracy.

    Training batches are fresh at every step, drawn from the stream
    ``default_rng((seed, 1))``; the model's initial parameters from
    ``default_rng((seed, 0))``; the test set (``n_test`` sequences) from
    ``default_rng((test_seed, n_pairs))``, the same for every mixer, width and seed,
    and disjoint from training in its random stream. Adam (``eq-tr-adam``) with
    the global gradient norm clipped at ``clip``, the learning rate warmed up
    linearly over ``warmup`` steps (default a tenth) and then decayed to 0 on a
    cosine. ``ssd_dt_init`` is passed to :func:`init_model` (the SSD's initial
    step; ``None``, the default, keeps ``dt_bias = 0``), and ``ssd_init`` its
    initialisation (``SSD_INITS``); ``window`` is sliding-window attention's
    (:class:`ModelConfig`); ``distinct_values`` draws each sequence's values
    without repeats, as Zoology does (:func:`fixedstate.recall.make_mqar`).

    Returns
    -------
    dict with ``params``, ``config``, ``losses`` (one per step), ``test_accuracy``,
    ``seconds`` (wall-clock time of the training loop) and ``seconds_per_step``
    """
    steps = check_positive_int(steps, "steps")
    config = ModelConfig(mixer, vocab_size, d_model, window=window)
    params = init_model(config, np.random.default_rng((seed, 0)), dtype=dtype, ssd_dt_init=ssd_dt_init,
                        ssd_init=ssd_init)
    data_rng = np.random.default_rng((seed, 1))
    test_tokens, test_targets = mqar_data(n_test, vocab_size=vocab_size, n_pairs=n_pairs, seq_len=seq_len,
                                          rng=np.random.default_rng((test_seed, n_pairs)),
                                          distinct_values=distinct_values)
    losses, seconds = _adam_loop(params, config, [(seq_len, n_pairs)], steps=steps, lr=lr, warmup=warmup,
                                 clip=clip, batch_size=batch_size, vocab_size=vocab_size, data_rng=data_rng,
                                 distinct_values=distinct_values, callback=callback)
    finite = all(np.isfinite(p).all() for p in params.values())
    acc = evaluate(params, config, test_tokens, test_targets) if finite else float("nan")
    return {"params": params, "config": config, "losses": losses, "test_accuracy": acc,
            "test_set": (test_tokens, test_targets), "seconds": seconds, "seconds_per_step": seconds / steps}


# ---------------------------------------------------------------------------- the experiment

# The sweep of chapter 9 (``make experiment-small``). Every mixer gets the same budget:
# the learning rate is chosen from ``lr_grid`` on one tuning configuration
# (``tune_d_model``, ``tune_n_pairs``, seed ``tune_seed``, which is not a sweep seed),
# by test accuracy there (ties: lower final training loss), and then used for
# every width, pair count and seed. Nothing else is tuned.
SWEEP = {
    "mixers": (SOFTMAX, LINEAR, DELTA, GATED_DELTA, SSD, HYBRID),
    "d_models": (8, 16),
    "n_pairs": (4, 8),
    "seeds": (0, 1, 2),
    "steps": 300,
    "batch_size": 16,
    "seq_len": 32,
    "vocab_size": 32,
    "n_test": 256,
    "clip": 1.0,
    "lr_grid": (3e-3, 1e-2, 3e-2),
    "tune_d_model": 16,
    "tune_n_pairs": 8,
    "tune_seed": 100,
}

# The follow-up that chapter 9 pre-registers (``make experiment-ssd``): the SSD alone,
# with its step initialised at 0.01 (dt_bias = softplus^{-1}(0.01)) instead of ln 2, and
# everything else (a = -1, sizes, steps, seeds, learning-rate grid and rule) as in SWEEP.
SSD_FOLLOWUP = {**SWEEP, "mixers": ("ssd",), "ssd_dt_init": 0.01}


@one_blas_thread
def run_config(mixer, d_model, n_pairs, seed, lr, settings=None) -> dict:
    """Train one configuration of the sweep and return its record (no parameters).

    ``settings`` is the sweep's dict (default ``SWEEP``): the steps, batch size,
    sequence length, vocabulary, test-set size and clipping it names, and the
    SSD's initial step ``ssd_dt_init`` if it names one (``SSD_FOLLOWUP``).
    One BLAS thread, as a run of the sweep (:func:`recall_run`): the sweep runs its
    configurations side by side, one per worker.
    """
    s = SWEEP if settings is None else settings
    r = train(mixer, d_model=d_model, n_pairs=n_pairs, steps=s["steps"], lr=lr, seed=seed,
              vocab_size=s["vocab_size"], seq_len=s["seq_len"], batch_size=s["batch_size"],
              n_test=s["n_test"], clip=s["clip"], ssd_dt_init=s.get("ssd_dt_init"))
    losses = r["losses"]
    tail = losses[-max(1, len(losses) // 10):]
    diverged = not np.all(np.isfinite(losses))
    return {"mixer": mixer, "d_model": int(d_model), "n_pairs": int(n_pairs), "seed": int(seed), "lr": float(lr),
            "test_accuracy": None if diverged else round(float(r["test_accuracy"]), 6),
            "final_loss": None if diverged else round(float(np.mean(tail)), 6),
            "first_loss": round(float(losses[0]), 6), "diverged": diverged,
            "seconds": round(r["seconds"], 3), "seconds_per_step": round(r["seconds_per_step"], 5)}


def _run_task(task):
    return run_config(*task)


def choose_lr(records) -> float:
    """The sweep's tuning rule: the ``lr`` of the best of ``records`` (run records of one mixer).

    Best means highest test accuracy, then lowest final loss; diverged runs come last.
    """
    def key(r):
        if r["diverged"]:
            return (1, 0.0, 0.0)
        return (0, -r["test_accuracy"], r["final_loss"])
    return min(records, key=key)["lr"]


def run_sweep(settings=None, *, jobs=1, progress=print) -> dict:
    """Run the tuning stage and the sweep; return ``{"settings", "chosen_lr", "tuning", "runs", "seconds"}``.

    ``jobs`` worker processes train configurations side by side (each with one
    BLAS thread). ``progress(line)`` is called after every finished run with a
    line that counts runs done, names the run and its accuracy, and estimates
    the time left.
    """
    s = dict(SWEEP if settings is None else settings)
    jobs = check_positive_int(jobs, "jobs")
    tune_tasks = [(m, s["tune_d_model"], s["tune_n_pairs"], s["tune_seed"], lr, s)
                  for m in s["mixers"] for lr in s["lr_grid"]]
    n_main = len(s["mixers"]) * len(s["d_models"]) * len(s["n_pairs"]) * len(s["seeds"])
    total = len(tune_tasks) + n_main
    start = time.perf_counter()
    done = [0]

    def report(r):
        done[0] += 1
        elapsed = time.perf_counter() - start
        eta = elapsed / done[0] * (total - done[0])
        acc = "diverged" if r["diverged"] else f"acc {r['test_accuracy']:.3f}"
        progress(f"[{done[0]:3d}/{total}] {r['mixer']:>14s} d={r['d_model']:<2d} pairs={r['n_pairs']:<2d} "
                 f"seed={r['seed']:<3d} lr={r['lr']:.0e}: {acc} ({r['seconds']:.0f} s); "
                 f"elapsed {elapsed / 60:.1f} min, about {eta / 60:.1f} min left")

    def run_all(tasks):
        out = []
        if jobs == 1:
            for t in tasks:
                out.append(_run_task(t))
                report(out[-1])
            return out
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for r in pool.imap_unordered(_run_task, tasks):
                out.append(r)
                report(r)
        return out

    tuning = run_all(tune_tasks)
    chosen = {m: choose_lr([r for r in tuning if r["mixer"] == m]) for m in s["mixers"]}
    # the most expensive runs first, so that the workers finish together
    main_tasks = [(m, d, n, seed, chosen[m], s) for d in sorted(s["d_models"], reverse=True)
                  for m in s["mixers"] for n in s["n_pairs"] for seed in s["seeds"]]
    runs = run_all(main_tasks)
    order = {m: i for i, m in enumerate(s["mixers"])}
    runs.sort(key=lambda r: (order[r["mixer"]], r["d_model"], r["n_pairs"], r["seed"]))
    tuning.sort(key=lambda r: (order[r["mixer"]], r["lr"]))
    settings_out = {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()}
    return {"settings": settings_out, "chosen_lr": chosen, "tuning": tuning, "runs": runs,
            "seconds": round(time.perf_counter() - start, 1)}


# ---------------------------------------------------------------------------- the recall-against-state sweep

def swa_window(d_model) -> int:
    """Sliding-window attention's window in the recall sweep: ``d_model / 2 + 1`` tokens.

    Its window cache then holds ``d_model / 2`` keys and values of width ``d_model``,
    ``d_model^2`` numbers: the size of a fixed-state layer's ``d_k x d_v`` state at
    the same width, so the two meet on the state axis.
    """
    d = check_positive_int(d_model, "d_model", minimum=2)
    return d // 2 + 1


# The sweep of issue 30 (make experiment): MQAR sized as in Zoology (a vocabulary of 128,
# keys and values distinct within a sequence, 32 pairs at the longest length), seven
# mixers at four widths each, five seeds. As in Zoology, every run trains on a mixture of
# lengths (``train_lengths``, one batch per step, cycled in this order: train_mixture) and
# is tested at each of ``lengths``; the learning rate is tuned per mixer and width on its
# own seed by the accuracy at ``tune_length``, the longest (mqar_stats.choose_lr), on a
# grid widened where the choice sits at an edge.
#
# Budget (tools/mqar_calibrate.py, which times one training step per mixer, training length
# and width at batch 64 and vocabulary 128, and `--budget FILE`, which prints this table).
# Measured on the training step as of the merge of the branch `fast`, on the shared two-core
# machine, one process with one BLAS thread, median of 3 after a warm-up, at a load average
# of 0.2-0.9 from other sessions: upper bounds. A run cycles through T = 32, 64, 128, so its
# seconds per step are the mean of the three steps:
#
#     mixer        d=8    d=16   d=32   d=64    seconds per step of the mixture
#     softmax      0.034  0.044  0.067  0.128
#     swa          0.033  0.043  0.067  0.125
#     linear       0.020  0.032  0.061  0.128
#     delta        0.027  0.042  0.075  0.160
#     gated_delta  0.030  0.046  0.081  0.166
#     ssd          0.022  0.035  0.067  0.136
#     hybrid       0.032  0.045  0.074  0.134
#
# Whole runs of this protocol (recall_run, two at a time as the two workers run them)
# agreed: 600 steps at d = 64 took 0.160 s per step (Gated DeltaNet, 97 s in all) and 0.131
# (the SSD, 79 s). The test stage (n_test sequences at each length, and the hybrid's two
# ablations) adds about 1% to a run at these steps. Each mixer and width has 5 sweep runs
# and 3 tuning runs: 7 x 4 x 8 = 224 runs, and one step of every run costs 8 x (the sum of
# the table) = 15.6 core-seconds. 90 minutes on 2 cores are 10,800 core-seconds: 691 steps
# per run. The 600 steps of the pilots take 600 x 15.6 / 2 = 4,680 s, 78 minutes, about 79
# with the test stage. A grid widened at its edge adds one run to its mixer and width (an
# eighth of that pair's cost); were every grid widened twice (max_widen), the sweep would
# take 98 minutes. (Before the merge of `fast` the same table summed to 20.4 core-seconds,
# 102 minutes at 600 steps.) What the steps buy, on tuning runs of this sweep (seed 100,
# lr 1e-2): at 600 steps Gated DeltaNet at d = 64 reached 0.93 / 0.92 / 0.92 (T = 32 / 64 /
# 128) and the SSD at d = 64 0.32 / 0.23 / 0.11; at 510 steps softmax attention and the
# hybrid at d = 32 reached 1.0 at every length, Gated DeltaNet at d = 64 only 0.88 / 0.85 /
# 0.78, at d = 32 0.17 / 0.11 / 0.07, and linear attention at d = 64 0.12 / 0.07 / 0.04.
# The pilots (batch 64, lr 1e-2, 600 steps on this mixture, seed 0) had softmax attention
# (d = 32) at 1.0 at every length by step 240, the hybrid (d = 32) by step 360, Gated
# DeltaNet 1.0 / 1.0 / 0.988 at d = 64 and 0.67 / 0.61 / 0.53 at d = 32 (capacity-limited);
# training on T = 128 alone stayed on the plateau (loss ln 64) for 500-600 steps.
# Measured: the stored sweep (results/mqar_recall.json) is `make experiment` run from scratch on a
# fresh clone at commit 62d04c4, on this two-core machine with fixedstate._heap keeping freed memory
# in the process: 238 runs (14 of them from widened grids) in 56 minutes. An earlier store of the
# same sweep, assembled over three commits, had every run's accuracy and loss identical to it.
RECALL_SWEEP = {
    "name": "recall",
    "mixers": (SOFTMAX, SWA, LINEAR, DELTA, GATED_DELTA, SSD, HYBRID),
    "d_models": (8, 16, 32, 64),
    "train_lengths": ((32, 8), (64, 16), (128, 32)),   # (seq_len, n_pairs): T/4 pairs fill the first half
    "lengths": ((32, 8), (64, 16), (128, 32)),         # tested at each, with its own test set
    "seeds": (0, 1, 2, 3, 4),
    "steps": 600,
    "batch_size": 64,
    "vocab_size": 128,
    "distinct_values": True,
    "n_test": 128,
    "test_seed": 54321,
    "clip": 1.0,
    "ssd_init": "mamba2",
    "lr_grid": (3e-3, 1e-2, 3e-2),
    "max_widen": 2,
    "tune_seed": 100,
    "tune_length": (128, 32),
    "threshold": 0.9,
    "margin": 3.0,
}

# The quick subset (make experiment-quick): three mixers (attention, its window, the hybrid
# with its ablation) at two widths, five seeds, the same protocol on a shorter mixture,
# T = 16 with 4 pairs and T = 32 with 8, tested at both. Pilots (one seed, batch 64) on
# this machine: after 600 steps softmax attention and the hybrid reached accuracy 1.0 at
# both lengths at d = 8 (lr 1e-2 and 3e-2) and d = 16 (lr 1e-2), and sliding-window
# attention, whose window of d / 2 + 1 tokens reaches only the nearest pairs, 0.02 at
# d = 8 and 0.74 / 0.20 (T = 16 / 32) at d = 16; after 400 steps d = 8 was still on its
# way (0.15-0.96) and the hybrid at d = 16 solved one seed of two; after 150 steps of the
# longer mixture (32, 8), (64, 16) nothing had left the plateau, and after 300 only
# softmax attention. Cost: 18 tuning runs (and up to 6 more where a grid is widened) and
# 30 sweep runs. Measured (results/mqar_quick.json, every grid widened once, so 54 runs):
# 5.3 minutes on the two-core machine, 610 core-seconds of training, while other sessions
# raised its load average from 1 to 6-10 midway: the fastest runs took 0.009 s per step at
# d = 8 and 0.013 at d = 16 (6-8 s a run), the slowest 0.076 and 0.023; 4.0 minutes before
# the merge of `fast`, at a load of about 1.
RECALL_QUICK = {
    "name": "recall-quick",
    "mixers": (SOFTMAX, SWA, HYBRID),
    "d_models": (8, 16),
    "train_lengths": ((16, 4), (32, 8)),
    "lengths": ((16, 4), (32, 8)),
    "seeds": (0, 1, 2, 3, 4),
    "steps": 600,
    "batch_size": 64,
    "vocab_size": 128,
    "distinct_values": True,
    "n_test": 64,
    "test_seed": 54321,
    "clip": 1.0,
    "ssd_init": "mamba2",
    "lr_grid": (3e-3, 1e-2, 3e-2),
    "max_widen": 1,
    "tune_seed": 100,
    "tune_length": (32, 8),
    "threshold": 0.9,
    "margin": 3.0,
}


def _run(settings, stage, mixer, d_model, seed, lr):
    return {"stage": stage, "mixer": mixer, "d_model": int(d_model), "seed": int(seed), "lr": float(lr),
            "train_lengths": [[int(t), int(n)] for t, n in settings["train_lengths"]],
            "lengths": [[int(t), int(n)] for t, n in settings["lengths"]],
            **{k: settings[k] for k in ("steps", "batch_size", "vocab_size", "distinct_values", "n_test",
                                        "test_seed", "clip", "ssd_init")}}


def run_key(run) -> str:
    """The key that names a run in a sweep's store: its stage, mixer, width, seed and rate.

    (The lengths it trains on and is tested at are the sweep's, which the store's header fixes.)
    """
    return f"{run['stage']}|{run['mixer']}|d{run['d_model']}|s{run['seed']}|lr{run['lr']:.6g}"


def recall_tuning_runs(settings, lrs=None) -> list:
    """The tuning runs: every mixer and width on ``tune_seed``, one per rate, with the sweep's protocol.

    A tuning run trains on ``train_lengths`` and is tested at every one of
    ``lengths``, as a sweep run is; the rule that reads it
    (:func:`fixedstate.mqar_stats.choose_lr`) ranks by the accuracy at
    ``tune_length``. ``lrs`` maps ``(mixer, d_model)`` to the rates to run
    (default: ``lr_grid`` for every pair).
    """
    out = []
    for m in settings["mixers"]:
        for d in settings["d_models"]:
            for lr in (settings["lr_grid"] if lrs is None else lrs[(m, d)]):
                out.append(_run(settings, "tune", m, d, settings["tune_seed"], lr))
    return out


def recall_main_runs(settings, chosen) -> list:
    """The sweep's runs: every mixer, width and seed, at the rate ``chosen[(mixer, d_model)]``.

    Each run is tested at every length, so a point of the sweep (mixer, width,
    length) takes its seeds' accuracies at that length from the same runs. The
    widest models come first, so that the workers finish together.
    """
    out = []
    for d in sorted(settings["d_models"], reverse=True):
        for m in settings["mixers"]:
            for seed in settings["seeds"]:
                out.append(_run(settings, "main", m, d, seed, chosen[(m, d)]))
    return out


@one_blas_thread
def recall_run(run) -> dict:
    """Train the model one run of the recall sweep describes and return its record (no parameters).

    ``run`` as :func:`recall_tuning_runs` and :func:`recall_main_runs` make them:
    the model trains on the mixture ``run["train_lengths"]`` (:func:`train_mixture`)
    and is tested at every one of ``run["lengths"]``. The record repeats the run
    and adds ``key``; ``test_accuracy``, a dict from the sequence length (its
    decimal string, as JSON keys are) to the test accuracy there, and
    ``final_loss`` (both None when the run diverged); ``diverged``;
    ``state_bytes``, by length (:func:`fixedstate.costs.model_state_bytes`,
    float32: attention's KV cache grows with the length, a fixed state does
    not); the window of sliding-window attention; ``ablation`` (for a model of
    more than one kind of layer, the hybrid: by layer index, the test accuracy
    by length with that layer's core output zeroed; else None); ``seconds`` and
    ``seconds_per_step``. Deterministic given the run.

    The run uses one BLAS thread, whatever the caller's setting (restored on
    return): a sweep runs many runs at once, one per core, and threads within a
    run would compete with the other runs for the cores. (Called alone, the
    training functions give the model's large products the caller's threads.)
    """
    from .costs import model_state_bytes

    m, d = run["mixer"], run["d_model"]
    lengths = [tuple(x) for x in run["lengths"]]
    window = swa_window(d) if SWA in MODEL_LAYERS[m] else None
    r = train_mixture(m, d_model=d, train_lengths=[tuple(x) for x in run["train_lengths"]], lengths=lengths,
                      steps=run["steps"], lr=run["lr"], seed=run["seed"], vocab_size=run["vocab_size"],
                      batch_size=run["batch_size"], n_test=run["n_test"], clip=run["clip"], window=window,
                      ssd_init=run["ssd_init"] if SSD in MODEL_LAYERS[m] else "unit",
                      distinct_values=run["distinct_values"], test_seed=run["test_seed"])
    losses = r["losses"]
    diverged = not np.all(np.isfinite(losses))
    ablation = None
    if len(set(MODEL_LAYERS[m])) > 1 and not diverged:
        ablation = {str(i): {str(t): round(float(evaluate(r["params"], r["config"], *r["test_sets"][t],
                                                           zero_cores=(i,))), 6) for t, _ in lengths}
                    for i in range(len(MODEL_LAYERS[m]))}
    return {**run, "key": run_key(run), "window": window,
            "state_bytes": {str(t): model_state_bytes(MODEL_LAYERS[m], seq_len=t, d_k=d, d_v=d, window=window)
                            for t, _ in lengths},
            "test_accuracy": None if diverged else {str(t): round(float(r["test_accuracy"][t]), 6)
                                                    for t, _ in lengths},
            "final_loss": None if diverged else round(float(r["final_loss"]), 6),
            "diverged": diverged, "ablation": ablation,
            "seconds": round(r["seconds"], 3), "seconds_per_step": round(r["seconds_per_step"], 5)}


def recall_baseline(settings, length) -> dict:
    """The exact no-retrieval baseline at ``length = (seq_len, n_pairs)``: over the task's draws
    (:func:`fixedstate.recall.no_retrieval_accuracy`) and on the sweep's test set (its score and
    standard error, :func:`fixedstate.recall.no_retrieval_score`, :func:`fixedstate.recall.no_retrieval_se`)."""
    from .recall import no_retrieval_accuracy, no_retrieval_score, no_retrieval_se

    seq_len, n_pairs = length
    batch = make_mqar(settings["n_test"], settings["vocab_size"], n_pairs, seq_len,
                      rng=np.random.default_rng((settings["test_seed"], n_pairs)),
                      distinct_values=settings["distinct_values"])
    return {"seq_len": int(seq_len), "n_pairs": int(n_pairs),
            "expected": no_retrieval_accuracy(settings["vocab_size"], n_pairs,
                                              distinct_values=settings["distinct_values"]),
            "test_set": no_retrieval_score(batch), "test_set_se": no_retrieval_se(batch)}


def _mqar_lengths(lengths, name) -> list:
    """``lengths`` as a list of ``(seq_len, n_pairs)`` int pairs, at least one, no sequence length twice."""
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise ValueError(f"{name}: expected a sequence of (seq_len, n_pairs) pairs, got {lengths!r}")
    out = []
    for x in lengths:
        if isinstance(x, (str, bytes)) or not hasattr(x, "__len__") or len(x) != 2:
            raise ValueError(f"{name}: expected a sequence of (seq_len, n_pairs) pairs, got the item {x!r}")
        out.append((check_positive_int(x[0], f"{name} (seq_len)"), check_positive_int(x[1], f"{name} (n_pairs)")))
    if not out:
        raise ValueError(f"{name}: expected at least one (seq_len, n_pairs) pair, got none")
    if len({t for t, _ in out}) != len(out):
        raise ValueError(f"{name}: expected each sequence length once, got {out}")
    return out


def train_mixture(mixer, *, d_model, train_lengths, lengths, steps, lr, seed, vocab_size=64, batch_size=32,
                  n_test=256, clip=1.0, warmup=None, dtype=np.float32, callback=None, ssd_dt_init=None,
                  window=None, ssd_init="unit", distinct_values=False, test_seed=12345) -> dict:
    """Train one model on a mixture of MQAR lengths, as Zoology does, and test it at each of several.

    Step ``s`` trains on one batch of ``batch_size`` sequences of the length
    ``train_lengths[s % len(train_lengths)]`` (a ``(seq_len, n_pairs)`` pair): the
    mixture is cycled one batch per step in its order, so every length gets the
    same number of steps (to within one) and the same share of every stretch of
    the learning-rate schedule. Everything else is :func:`train`'s: the initial
    parameters from ``default_rng((seed, 0))``, the batches drawn in turn from the
    one stream ``default_rng((seed, 1))``, Adam (``eq-tr-adam``) with the global
    gradient norm clipped at ``clip``, a linear warm-up over ``warmup`` steps
    (default a tenth) and then a cosine decay to 0. After training, the model is
    tested at every ``(seq_len, n_pairs)`` of ``lengths`` on ``n_test`` sequences
    from ``default_rng((test_seed, n_pairs))``, the test set :func:`train` uses
    at that length. With a single training length, this is :func:`train` (the
    same losses, parameters and accuracy; a test checks it).

    Parameters
    ----------
    train_lengths, lengths : sequences of ``(seq_len, n_pairs)`` pairs of positive
        ints, each sequence length at most once
    the others : as :func:`train`

    Returns
    -------
    dict with ``params``, ``config``, ``losses`` (one per step, NaN from a step whose
    loss is not finite on), ``test_accuracy`` and ``test_sets`` (dicts keyed by the
    sequence lengths of ``lengths``: the accuracy, NaN if the parameters are not
    finite, and the ``(tokens, targets)`` tested on), ``final_loss`` (the mean
    training loss over the last tenth of the steps, rounded down to whole cycles of
    the mixture and at least one, so that every length weighs the same in it),
    ``seconds`` (wall-clock time of the training loop) and ``seconds_per_step``
    """
    steps = check_positive_int(steps, "steps")
    mix = _mqar_lengths(train_lengths, "train_lengths")
    tested = _mqar_lengths(lengths, "lengths")
    config = ModelConfig(mixer, vocab_size, d_model, window=window)
    params = init_model(config, np.random.default_rng((seed, 0)), dtype=dtype, ssd_dt_init=ssd_dt_init,
                        ssd_init=ssd_init)
    data_rng = np.random.default_rng((seed, 1))
    test_sets = {t: mqar_data(n_test, vocab_size=vocab_size, n_pairs=n, seq_len=t,
                              rng=np.random.default_rng((test_seed, n)), distinct_values=distinct_values)
                 for t, n in tested}
    losses, seconds = _adam_loop(params, config, mix, steps=steps, lr=lr, warmup=warmup, clip=clip,
                                 batch_size=batch_size, vocab_size=vocab_size, data_rng=data_rng,
                                 distinct_values=distinct_values, callback=callback)
    finite = all(np.isfinite(p).all() for p in params.values())
    accuracy = {t: evaluate(params, config, *test_sets[t]) if finite else float("nan") for t, _ in tested}
    cycle = len(mix)
    tail = min(steps, max(cycle, (steps // 10) // cycle * cycle))
    return {"params": params, "config": config, "losses": losses, "test_accuracy": accuracy,
            "test_sets": test_sets, "final_loss": float(np.mean(losses[-tail:])), "seconds": seconds,
            "seconds_per_step": seconds / steps}
