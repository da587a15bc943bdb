"""Tests for fixedstate.mixers: the table's forms are the cores' own, one token at a time equals the sequence,
and the backward passes match finite differences."""

import numpy as np
import pytest

from _finite_differences import BOUND, check

from fixedstate import blocks as bl
from fixedstate import delta_rule as dr
from fixedstate import layer_ids
from fixedstate import linear_attention as la
from fixedstate import mixers
from fixedstate import softmax_attention as sa
from fixedstate import ssm


def inputs(layer_id, lead=(2,), T=7, d=3, seed=0):
    """Queries, keys, values and the gates the mixer reads, as the book's stacks give them."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(lead + (T, d)) for _ in range(3))
    entry = mixers.mixer(layer_id)
    if entry.normalize_qk:
        q, k = bl.l2_normalize(q), bl.l2_normalize(k)
    shapes = {"beta": lead + (T,), "delta": lead + (T,), "a": (),
              "log_gate": lead + ((T, d) if layer_id == layer_ids.KDA else (T,))}
    values = {"beta": lambda s: rng.uniform(0.1, 0.9, s), "log_gate": lambda s: -rng.uniform(0, 0.5, s),
              "delta": lambda s: rng.uniform(0.05, 0.5, s), "a": lambda s: -rng.uniform(0.5, 2.0, s)}
    return q, k, v, {g: values[g](shapes[g]) for g in entry.gates}


def opts(layer_id):
    """The keyword arguments an entry's ``options`` name: sliding-window attention's window (smaller than T)."""
    return {"window": 3} if "window" in mixers.mixer(layer_id).options else {}


def test_the_table_is_keyed_by_layer_ids_and_refuses_others():
    assert set(mixers.MIXERS) <= set(layer_ids.LAYER_IDS)
    assert all(m.layer_id == key for key, m in mixers.MIXERS.items())
    for bad in ("gated", "deltanet", "hybrid", 3):
        with pytest.raises(ValueError, match="layer_id"):
            mixers.mixer(bad)
    with pytest.raises(ValueError, match="scale"):
        mixers.mixer("ssd").forward(*inputs("ssd"), scale=0.5)


def test_forward_is_the_cores_own_form():
    q, k, v, g = inputs("gated_delta")
    np.testing.assert_array_equal(mixers.mixer("gated_delta").forward(q, k, v, g, scale=0.7, chunk_size=4)[0],
                                  dr.gated_delta_rule_chunkwise(q, k, v, **g, scale=0.7, chunk_size=4)[0])
    q, k, v, g = inputs("softmax")
    np.testing.assert_array_equal(mixers.mixer("softmax").forward(q, k, v, g, scale=0.7)[0],
                                  sa.softmax_attention(q, k, v, causal=True, scale=0.7)[0])
    q, k, v, g = inputs("linear")
    np.testing.assert_array_equal(mixers.mixer("linear").forward(q, k, v, g, chunk_size=4)[0],
                                  la.linear_attention_chunkwise(q, k, v, feature_map=la.identity_feature_map,
                                                                normalize=False, chunk_size=4)[0])
    q, k, v, g = inputs("ssd")                      # q, k, v are Mamba-2's C, B, x
    np.testing.assert_array_equal(mixers.mixer("ssd").forward(q, k, v, g, chunk_size=4)[0],
                                  ssm.ssd_chunkwise(v, g["delta"], g["a"], k, q, chunk_size=4)[0])


@pytest.mark.parametrize("layer_id", sorted(mixers.MIXERS))
def test_one_token_at_a_time_equals_the_sequence(layer_id):
    q, k, v, g = inputs(layer_id, seed=1)
    entry = mixers.mixer(layer_id)
    scale = 0.6 if layer_id != "ssd" else 1.0
    whole, final = entry.forward(q, k, v, g, scale=scale, chunk_size=4, **opts(layer_id))
    cache, steps = None, []
    for t in range(q.shape[-2]):
        g_t = {name: (a if np.ndim(a) == 0 else a[:, t]) for name, a in g.items()}
        out, cache = entry.step(q[:, t], k[:, t], v[:, t], g_t, cache, scale=scale, **opts(layer_id))
        steps.append(out)
    np.testing.assert_allclose(np.stack(steps, axis=-2), whole, rtol=1e-12, atol=1e-12)
    if layer_id in ("softmax", "swa"):              # the KV cache (the window's) holds keys and values
        np.testing.assert_array_equal(cache.keys, final.keys)
        np.testing.assert_array_equal(cache.values, final.values)
    else:
        np.testing.assert_allclose(cache, final, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layer_id", sorted(mixers.MIXERS))
def test_forward_continues_from_the_state_it_returned(layer_id):
    q, k, v, g = inputs(layer_id, T=9, seed=3)
    entry = mixers.mixer(layer_id)
    scale = 0.6 if layer_id != "ssd" else 1.0

    def part(sl, state):
        g_part = {name: (a if np.ndim(a) == 0 else a[:, sl]) for name, a in g.items()}
        return entry.forward(q[:, sl], k[:, sl], v[:, sl], g_part, scale=scale, chunk_size=4, initial_state=state,
                             **opts(layer_id))

    whole, _ = entry.forward(q, k, v, g, scale=scale, chunk_size=4, **opts(layer_id))
    first, state = part(slice(0, 5), None)
    second, _ = part(slice(5, 9), state)
    np.testing.assert_allclose(np.concatenate([first, second], axis=-2), whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layer_id", sorted(mixers.MIXERS))
def test_backward_matches_finite_differences(layer_id):
    q, k, v, g = inputs(layer_id, T=5, seed=2)
    entry = mixers.mixer(layer_id)
    scale = 0.6 if layer_id != "ssd" else 1.0
    names = ("q", "k", "v") + entry.gates
    arrays = dict(zip(names, (q, k, v) + tuple(np.asarray(g[n], dtype=float) for n in entry.gates)))

    def f(**a):
        return entry.forward(a["q"], a["k"], a["v"], {n: a[n] for n in entry.gates}, scale=scale,
                             chunk_size=2, **opts(layer_id))[0]

    def grads(d_out):
        dq, dk, dv, d_gates = entry.backward(q, k, v, g, d_out, scale=scale, **opts(layer_id))
        return {"q": dq, "k": dk, "v": dv, **{n: np.reshape(d_gates[n], np.shape(g[n])) for n in entry.gates}}

    assert check(f, arrays, grads) <= BOUND
