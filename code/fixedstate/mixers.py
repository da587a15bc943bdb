"""The token mixers a stack can hold: one table, each entry a forward and a backward pass.

Every stack of the book is the same pre-norm residual block
(:func:`fixedstate.blocks.residual_block`) repeated, and the stacks differ in the
core that mixes the tokens. This module names those cores once, under the ids of
:mod:`fixedstate.layer_ids`, with one calling convention, so that a stack chooses
its core by looking it up rather than by a chain of ``if``:

- the toy hybrid stack of chapter 6 (:mod:`fixedstate.toy_stack`) runs ``forward``
  over a sequence and ``step`` over one token against a cache;
- the trainable model of chapter 9 (:mod:`fixedstate.training`) runs ``forward``
  and ``backward``;
- the shipped Gated DeltaNet and KDA layers (:mod:`fixedstate.layers`) run
  ``forward`` (prefill, from a cache) and ``step`` (decode).

An entry (:class:`Mixer`) says which per-token gates its core reads, besides the
queries, keys and values (``gates``: ``"beta"``, ``"log_gate"``, or the SSD's
``"delta"`` and ``"a"``), and whether the stacks L2-normalise queries and keys
before it (``normalize_qk``). Its functions are thin: each calls the core's public
form, so the arithmetic lives in the core's module and nowhere else.

- ``forward(q, k, v, gates, *, scale, chunk_size, initial_state=None) -> (outputs, state)``
  over a sequence ``(..., T, d)``: the chunkwise form where the core has one, else its
  matrix or recurrent form; ``scale`` multiplies the readout (softmax: the logits);
  ``chunk_size`` is the chunk of a chunkwise form (others ignore it); the state (or
  KV cache) carried in and out, as the cores' own signature has it.
- ``backward(q, k, v, gates, d_out, *, scale, chunk_size=BACKWARD_CHUNK) -> (dq, dk, dv, d_gates)``,
  the gradients of ``forward`` (``d_gates`` a dict with one array per gate): the core's chunkwise
  backward where it has one (linear attention, DeltaNet, Gated DeltaNet, the SSD), in chunks of
  ``chunk_size`` tokens, else its token-by-token backward (KDA) or its matrix form (softmax).
- ``options``: the names of keyword arguments besides those above that the
  entry's three forms require, which a stack passes from its configuration
  (sliding-window attention's ``window``; none for the others).
- ``step(q, k, v, gates, cache, *, scale) -> (output, cache)``, one token ``(..., d)``
  against the core's cache (a :class:`fixedstate.softmax_attention.KVCache` for
  softmax attention, a fixed-size state otherwise; ``None`` starts empty).

The SSD reads ``q, k, v`` as Mamba-2's ``C, B, x`` (the book's duality:
``q_t = C_t``, ``k_t = B_t``), with the step ``delta`` per token and the scalar
``a < 0`` per head; its ``scale`` must be 1 (Mamba-2 applies none).

Gradients of the gate forms that produce ``beta``, ``log_gate`` or ``delta``
from a projection are in :mod:`fixedstate.blocks`; a stack composes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import delta_rule as dr
from . import linear_attention as la
from . import softmax_attention as sa
from . import ssm
from .layer_ids import DELTA, GATED_DELTA, KDA, LINEAR, SOFTMAX, SSD, SWA, check_layer_id

__all__ = ["Mixer", "MIXERS", "mixer", "BACKWARD_CHUNK"]

#: The chunk of the chunkwise backward passes when the caller names none (the training model does not:
#: the result does not depend on it, only the time). 32 was the fastest of 16, 32, 64 for a whole training
#: step at benchmarks/training_step_bench.py's default shape (d = 128, T = 256, batch 32), larger than any
#: model chapter 9 trains (d <= 64, T <= 128); it was not re-timed at those smaller shapes.
BACKWARD_CHUNK = 32


@dataclass(frozen=True)
class Mixer:
    """One token mixer: its id, the gates its core reads, and its forward, backward and one-token forms."""

    layer_id: str
    gates: tuple
    normalize_qk: bool
    forward: Callable
    backward: Callable
    step: Callable
    options: tuple = ()


def _unscaled(scale, layer_id):
    if scale not in (None, 1, 1.0):
        raise ValueError(f"scale: expected 1 or None for the {layer_id!r} mixer (its core applies no scale), "
                         f"got {scale!r}")


# ------------------------------------------------------------------------- softmax attention

def _softmax_forward(q, k, v, gates, *, scale=None, chunk_size=None, initial_state=None):
    return sa.softmax_attention(q, k, v, causal=True, scale=scale, initial_state=initial_state)


def _softmax_backward(q, k, v, gates, d_out, *, scale=None, chunk_size=None):
    dq, dk, dv = sa.softmax_attention_backward(q, k, v, d_out, causal=True, scale=scale)
    return dq, dk, dv, {}


def _softmax_step(q, k, v, gates, cache, *, scale=None):
    return sa.softmax_attention_step(q, k, v, scale=scale, initial_state=cache)


# ------------------------------------------------------------------------- linear attention

def _linear_forward(q, k, v, gates, *, scale=1.0, chunk_size=64, initial_state=None):
    return la.linear_attention_chunkwise(q, k, v, feature_map=la.identity_feature_map, normalize=False,
                                         scale=scale, initial_state=initial_state, chunk_size=chunk_size)


def _linear_backward(q, k, v, gates, d_out, *, scale=1.0, chunk_size=BACKWARD_CHUNK):
    dq, dk, dv, _, _ = la.linear_attention_chunkwise_backward(q, k, v, d_out, log_gate=None, scale=scale,
                                                              initial_state=None, d_final_state=None,
                                                              chunk_size=chunk_size)
    return dq, dk, dv, {}


def _linear_step(q, k, v, gates, cache, *, scale=1.0):
    return la.linear_attention_step(q, k, v, feature_map=la.identity_feature_map, normalize=False, scale=scale,
                                    initial_state=cache)


# ------------------------------------------------------------------------- the delta rule family

def _delta_forward(q, k, v, gates, *, scale=1.0, chunk_size=64, initial_state=None):
    return dr.delta_rule_chunkwise(q, k, v, beta=gates["beta"], scale=scale, initial_state=initial_state,
                                   chunk_size=chunk_size)


def _delta_backward(q, k, v, gates, d_out, *, scale=1.0, chunk_size=BACKWARD_CHUNK):
    dq, dk, dv, dbeta, _ = dr.delta_rule_chunkwise_backward(q, k, v, d_out, beta=gates["beta"], scale=scale,
                                                            initial_state=None, d_final_state=None,
                                                            chunk_size=chunk_size)
    return dq, dk, dv, {"beta": dbeta}


def _delta_step(q, k, v, gates, cache, *, scale=1.0):
    return dr.delta_rule_step(q, k, v, beta=gates["beta"], scale=scale, initial_state=cache)


def _gated_delta_forward(q, k, v, gates, *, scale=1.0, chunk_size=64, initial_state=None):
    return dr.gated_delta_rule_chunkwise(q, k, v, beta=gates["beta"], log_gate=gates["log_gate"], scale=scale,
                                         initial_state=initial_state, chunk_size=chunk_size)


def _gated_delta_backward(q, k, v, gates, d_out, *, scale=1.0, chunk_size=BACKWARD_CHUNK):
    dq, dk, dv, dbeta, dlog_gate, _ = dr.gated_delta_rule_chunkwise_backward(
        q, k, v, d_out, beta=gates["beta"], log_gate=gates["log_gate"], scale=scale,
        initial_state=None, d_final_state=None, chunk_size=chunk_size)
    return dq, dk, dv, {"beta": dbeta, "log_gate": dlog_gate}


def _gated_delta_step(q, k, v, gates, cache, *, scale=1.0):
    return dr.gated_delta_rule_step(q, k, v, beta=gates["beta"], log_gate=gates["log_gate"], scale=scale,
                                    initial_state=cache)


def _kda_forward(q, k, v, gates, *, scale=1.0, chunk_size=64, initial_state=None):
    return dr.kda_chunkwise(q, k, v, beta=gates["beta"], log_gate=gates["log_gate"], scale=scale,
                            initial_state=initial_state, chunk_size=chunk_size)


def _kda_backward(q, k, v, gates, d_out, *, scale=1.0, chunk_size=None):
    dq, dk, dv, dbeta, dlog_gate, _ = dr.kda_backward(q, k, v, d_out, beta=gates["beta"],
                                                      log_gate=gates["log_gate"], scale=scale,
                                                      initial_state=None, d_final_state=None)
    return dq, dk, dv, {"beta": dbeta, "log_gate": dlog_gate}


def _kda_step(q, k, v, gates, cache, *, scale=1.0):
    return dr.kda_step(q, k, v, beta=gates["beta"], log_gate=gates["log_gate"], scale=scale, initial_state=cache)


# ------------------------------------------------------------------------- Mamba-2's SSD

def _ssd_forward(q, k, v, gates, *, scale=1.0, chunk_size=64, initial_state=None):
    _unscaled(scale, SSD)
    return ssm.ssd_chunkwise(v, gates["delta"], gates["a"], k, q, initial_state=initial_state,
                             chunk_size=64 if chunk_size is None else chunk_size)


def _ssd_backward(q, k, v, gates, d_out, *, scale=1.0, chunk_size=BACKWARD_CHUNK):
    _unscaled(scale, SSD)
    dx, ddelta, da, dB, dC, _, _ = ssm.ssd_chunkwise_backward(v, gates["delta"], gates["a"], k, q, d_out,
                                                              D=None, initial_state=None, d_final_state=None,
                                                              chunk_size=chunk_size)
    return dC, dB, dx, {"delta": ddelta, "a": da}


def _ssd_step(q, k, v, gates, cache, *, scale=1.0):
    _unscaled(scale, SSD)
    y, state = ssm.ssd_recurrent(v[..., None, :], gates["delta"][..., None], gates["a"], k[..., None, :],
                                 q[..., None, :], initial_state=cache)
    return y[..., 0, :], state


# ------------------------------------------------------------------------- sliding-window attention

def _swa_forward(q, k, v, gates, *, window, scale=None, chunk_size=None, initial_state=None):
    return sa.sliding_window_attention(q, k, v, window=window, scale=scale, initial_state=initial_state)


def _swa_backward(q, k, v, gates, d_out, *, window, scale=None, chunk_size=None):
    return (*sa.sliding_window_attention_backward(q, k, v, d_out, window=window, scale=scale), {})


def _swa_step(q, k, v, gates, cache, *, window, scale=None):
    return sa.sliding_window_attention_step(q, k, v, window=window, scale=scale, initial_state=cache)


#: The table, by layer id (:mod:`fixedstate.layer_ids`).
MIXERS = {
    SOFTMAX: Mixer(SOFTMAX, (), False, _softmax_forward, _softmax_backward, _softmax_step),
    LINEAR: Mixer(LINEAR, (), True, _linear_forward, _linear_backward, _linear_step),
    DELTA: Mixer(DELTA, ("beta",), True, _delta_forward, _delta_backward, _delta_step),
    GATED_DELTA: Mixer(GATED_DELTA, ("beta", "log_gate"), True, _gated_delta_forward, _gated_delta_backward,
                       _gated_delta_step),
    KDA: Mixer(KDA, ("beta", "log_gate"), True, _kda_forward, _kda_backward, _kda_step),
    SSD: Mixer(SSD, ("delta", "a"), False, _ssd_forward, _ssd_backward, _ssd_step),
}
MIXERS[SWA] = Mixer(SWA, (), False, _swa_forward, _swa_backward, _swa_step, options=("window",))


def mixer(layer_id) -> Mixer:
    """The table's entry for ``layer_id``; ``ValueError`` naming the ids it holds for any other."""
    return MIXERS[check_layer_id(layer_id, tuple(MIXERS), "layer_id")]
