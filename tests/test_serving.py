"""Tests for fixedstate.serving: speculative rollback and heads split over devices.

Properties from chapter 8: a drafted run of k tokens, rolled back to its j accepted tokens
and resumed, equals the plain decode exactly (the same floating-point operations), with
either strategy; the numbers kept are those rollback_numbers counts; a layer split by heads
over devices gives, summed over the devices (the all-reduce), the layer's output, prefill
and decode, to float64 precision.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _examples import examples

from fixedstate import layers as L
from fixedstate import serving as sv

LAYERS = {
    "gdn": (L.GatedDeltaNetConfig(8, 4, 2, 3, 2, chunk_size=3), L.init_gated_deltanet, L.gated_deltanet,
            L.gated_deltanet_step),
    "kda": (L.KDAConfig(8, 2, 3, 2, chunk_size=3), L.init_kda, L.kda_layer, L.kda_layer_step),
    "mamba": (L.MambaConfig(8, 6, 3, 2), L.init_mamba, L.mamba_block, L.mamba_block_step),
    "mamba2": (L.Mamba2Config(8, 4, 2, 3, n_groups=2, chunk_size=3), L.init_mamba2, L.mamba2_block,
               L.mamba2_block_step),
}


def rel(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("strategy", sv.ROLLBACK_STRATEGIES)
@given(k=st.integers(1, 5), data=st.data(), K=st.integers(1, 4), lead=st.lists(st.integers(1, 2), max_size=1).map(tuple),
       seed=st.integers(0, 2 ** 16))
@examples(10)
def test_draft_reject_rollback_resume_equals_the_plain_decode(name, strategy, k, data, K, lead, seed):
    config, init, prefill, step = LAYERS[name]
    config = type(config)(**{**config.__dict__, "conv_kernel": K})
    params = init(config, seed)
    rng = np.random.default_rng(seed)
    accepted = data.draw(st.integers(0, k))
    prompt, draft, after = (rng.standard_normal(lead + (n, config.d_model)) for n in (5, k, 3))
    _, cache = prefill(params, prompt)
    y, kept = sv.verify_draft(params, draft, cache, strategy=strategy)
    plain_cache, plain_y = cache, []
    for t in range(k):
        y_t, plain_cache = step(params, draft[..., t, :], plain_cache)
        plain_y.append(y_t)
        if t + 1 == accepted:
            accepted_cache = plain_cache
    if accepted == 0:
        accepted_cache = cache
    assert np.array_equal(y, np.stack(plain_y, axis=-2))
    back = sv.rollback(params, kept, accepted)
    assert all(np.array_equal(back[part], accepted_cache[part]) for part in ("conv", "state"))
    c1, c2 = back, accepted_cache                                   # resume: the same tokens from both caches
    for t in range(after.shape[-2]):
        y1, c1 = step(params, after[..., t, :], c1)
        y2, c2 = step(params, after[..., t, :], c2)
        assert np.array_equal(y1, y2)
    kept_numbers = sum(s.size for s in kept["states"][:-1 if strategy == "snapshots" else None]) + kept["conv"].size
    assert kept_numbers == sv.rollback_numbers(config, k)[strategy] * int(np.prod(lead, dtype=int))


@pytest.mark.parametrize("name", ["gdn", "mamba2"])
@given(devices=st.sampled_from([1, 2]), T=st.integers(1, 9), seed=st.integers(0, 2 ** 16), data=st.data())
@examples(15)
def test_heads_split_over_devices_and_summed_give_the_layer(name, devices, T, seed, data):
    if name == "gdn":
        hk = data.draw(st.sampled_from([2, 4]))
        config = L.GatedDeltaNetConfig(6, hk * data.draw(st.integers(1, 2)), hk, 3, 2, chunk_size=4)
    else:
        g = data.draw(st.sampled_from([2, 4]))
        config = L.Mamba2Config(6, g * data.draw(st.integers(1, 2)), 2, 3, n_groups=g, chunk_size=4,
                                norm_before_gate=data.draw(st.booleans()))
    init, prefill, step = LAYERS[name][1:]
    params = init(config, seed)
    x = np.random.default_rng(seed).standard_normal((2, T, config.d_model))
    y, cache = prefill(params, x)
    parts = sv.split_heads(params, devices)
    outs = [prefill(p, x) for p in parts]
    assert rel(sum(o for o, _ in outs), y) < 1e-12                     # the all-reduce: a sum over devices
    states = np.concatenate([c["state"] for _, c in outs], axis=1)      # each device holds its heads' states
    assert rel(states, cache["state"]) < 1e-12
    x_t = np.random.default_rng(seed + 1).standard_normal((2, config.d_model))
    y_t, _ = step(params, x_t, cache)
    assert rel(sum(step(p, x_t, c)[0] for p, (_, c) in zip(parts, outs)), y_t) < 1e-12


def test_a_group_cannot_be_cut_and_bad_input_is_refused():
    gdn = L.init_gated_deltanet(L.GatedDeltaNetConfig(6, 4, 2, 3, 2), 0)
    with pytest.raises(ValueError, match="n_devices"):
        sv.split_heads(gdn, 4)
    m2 = L.init_mamba2(L.Mamba2Config(6, 4, 2, 3, n_groups=1), 0)
    with pytest.raises(ValueError, match="n_devices"):
        sv.split_heads(m2, 2)
    with pytest.raises(ValueError, match="params"):
        sv.split_heads(L.init_mamba(L.MambaConfig(8, 6, 3, 2), 0), 1)
    with pytest.raises(ValueError, match="strategy"):
        sv.verify_draft(gdn, np.ones((2, 6)), None, strategy="replay")
    with pytest.raises(ValueError, match="x_draft"):
        sv.verify_draft(gdn, np.ones((2, 5)), None)
    _, kept = sv.verify_draft(gdn, np.ones((2, 6)), None)
    with pytest.raises(ValueError, match="accepted"):
        sv.rollback(gdn, kept, 3)
    with pytest.raises(ValueError, match="kept"):
        sv.rollback(gdn, {}, 0)
    with pytest.raises(ValueError, match="k"):
        sv.rollback_numbers(gdn["config"], 0)
    assert sv.all_reduce_numbers(16, 10, 4) == {"payload": 160, "per_device": 240.0}
    assert sv.all_reduce_numbers(16, 10, 1)["per_device"] == 0
