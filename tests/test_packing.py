"""Tests for fixedstate.packing and the padding masks: packed sequences equal each sequence run alone.

Properties from chapter 8: a fixed-state core over packed sequences (``cu_seqlens``), in its
recurrent form and in its chunkwise form on a grid of chunks that boundaries cut, equals the
core run on each sequence alone, outputs and final states, to float64 precision; the short
convolution over packed sequences equals it per sequence; left padding with a mask leaves a
layer's outputs at the real tokens and its cache those of the sequence alone.
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from _examples import examples

from fixedstate import blocks as bl
from fixedstate import layers as L
from fixedstate import mixers, packing
from fixedstate.layer_ids import KDA, LINEAR

TOL = 1e-12


def rel(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


def inputs(rng, name, lead, T, d_k, d_v):
    q = rng.standard_normal(lead + (T, d_k))
    k = rng.standard_normal(lead + (T, d_k))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal(lead + (T, d_v))
    gates = {}
    if "beta" in mixers.mixer(name).gates:
        gates["beta"] = rng.uniform(0.05, 1.0, lead + (T,))
    if "log_gate" in mixers.mixer(name).gates:
        gates["log_gate"] = -rng.exponential(0.5, lead + ((T, d_k) if name == KDA else (T,)))
    return q, k, v, gates


def alone(name, q, k, v, gates, cu):
    """Each sequence through the core's own chunkwise form (as a layer runs it), from a zero state."""
    outs, finals = [], []
    for s, e in zip(cu[:-1], cu[1:]):
        g = {n: (a[..., s:e, :] if a.ndim == q.ndim else a[..., s:e]) for n, a in gates.items()}
        o, S = mixers.mixer(name).forward(q[..., s:e, :], k[..., s:e, :], v[..., s:e, :], g, scale=0.5,
                                          chunk_size=64, initial_state=None)
        outs.append(o)
        finals.append(S)
    return np.concatenate(outs, axis=-2), np.stack(finals)


@pytest.mark.parametrize("name", packing.VARLEN_MIXERS)
@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4), chunk=st.integers(1, 6),
       lead=st.lists(st.integers(1, 2), max_size=2).map(tuple), d_k=st.integers(1, 4), d_v=st.integers(1, 3),
       seed=st.integers(0, 2 ** 16))
@examples(20)
def test_packed_core_equals_each_sequence_alone(name, form, lengths, chunk, lead, d_k, d_v, seed):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    q, k, v, gates = inputs(rng, name, lead, int(cu[-1]), d_k, d_v)
    o, finals = packing.varlen_mixer(name, q, k, v, gates, cu_seqlens=cu, scale=0.5, form=form, chunk_size=chunk)
    o_ref, finals_ref = alone(name, q, k, v, gates, cu)
    assert o.shape == o_ref.shape and finals.shape == finals_ref.shape == (len(lengths),) + lead + (d_k, d_v)
    assert rel(o, o_ref) < TOL and rel(finals, finals_ref) < TOL


def test_a_boundary_inside_a_chunk_is_cut_there_and_not_carried_across():
    rng = np.random.default_rng(0)
    cu = np.array([0, 3, 8, 10])                             # boundaries at 3 and 8, inside chunks [0, 4) and [8, 12)
    q, k, v, gates = inputs(rng, "gated_delta", (2,), 10, 3, 2)
    o, _ = packing.varlen_mixer("gated_delta", q, k, v, gates, cu_seqlens=cu, scale=0.5, chunk_size=4)
    o_ref, _ = alone("gated_delta", q, k, v, gates, cu)
    assert rel(o, o_ref) < TOL
    carried, _ = mixers.mixer("gated_delta").forward(q, k, v, gates, scale=0.5, chunk_size=4)
    assert rel(carried[..., 3:, :], o_ref[..., 3:, :]) > 1e-3   # without the reset the second sequence differs


@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4), K=st.integers(1, 5), d=st.integers(1, 3),
       lead=st.lists(st.integers(1, 2), max_size=1).map(tuple), bias=st.booleans(), seed=st.integers(0, 2 ** 16))
@example(lengths=[3], K=5, d=1, lead=(), bias=False, seed=0)      # a kernel longer than the whole row
@examples(40)
def test_packed_short_conv_equals_each_sequence_alone(lengths, K, d, lead, bias, seed):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    x = rng.standard_normal(lead + (int(cu[-1]), d))
    w = rng.standard_normal((d, K))
    b = rng.standard_normal(d) if bias else None
    y, states = packing.short_conv_varlen(x, w, cu_seqlens=cu, bias=b)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        y_i, state_i = bl.short_conv(x[..., s:e, :], w, bias=b)
        assert np.max(np.abs(y[..., s:e, :] - y_i)) <= TOL * max(1.0, np.max(np.abs(y_i)))
        assert np.array_equal(states[i], state_i)


LAYER_FORMS = {
    "gdn": (L.GatedDeltaNetConfig(8, 4, 2, 3, 2, chunk_size=3), L.init_gated_deltanet, L.gated_deltanet),
    "kda": (L.KDAConfig(8, 2, 3, 2, chunk_size=3), L.init_kda, L.kda_layer),
    "mamba": (L.MambaConfig(8, 6, 3, 2), L.init_mamba, L.mamba_block),
    "mamba2": (L.Mamba2Config(8, 4, 2, 3, n_groups=2, chunk_size=3), L.init_mamba2, L.mamba2_block),
}


@pytest.mark.parametrize("name", LAYER_FORMS)
@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
@examples(15)
def test_left_padding_with_a_mask_equals_each_sequence_alone(name, lengths, seed):
    config, init, layer = LAYER_FORMS[name]
    rng = np.random.default_rng(seed)
    params = init(config, seed)
    T = max(lengths)
    seqs = [rng.standard_normal((n, config.d_model)) for n in lengths]
    x = np.stack([np.concatenate([rng.standard_normal((T - n, config.d_model)), s]) for n, s in zip(lengths, seqs)])
    mask = np.array([[t >= T - n for t in range(T)] for n in lengths])       # left padding, garbage in the pads
    y, cache = layer(params, x, mask=mask)
    for i, (n, s) in enumerate(zip(lengths, seqs)):
        y_i, cache_i = layer(params, s)
        assert rel(y[i, T - n:], y_i) < TOL
        for part in ("state", "conv"):           # the batch's projections round apart from a single row's
            assert np.max(np.abs(cache[part][i] - cache_i[part])) <= TOL * max(1.0, np.max(np.abs(cache_i[part])))


def test_short_conv_mask_zeroes_the_pads_around_the_convolution():
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((2, 6, 3)), rng.standard_normal((3, 4)), rng.standard_normal(3)
    mask = np.array([[False, False, True, True, True, True], [True] * 6])
    y, state = bl.short_conv(x, w, bias=b, mask=mask)
    assert np.array_equal(y[0, :2], np.zeros((2, 3)))
    y_alone, state_alone = bl.short_conv(x[0, 2:], w, bias=b)
    assert rel(y[0, 2:], y_alone) < TOL and np.array_equal(state[0], state_alone)
    assert np.array_equal(y[1], bl.short_conv(x[1], w, bias=b)[0])
    with pytest.raises(ValueError, match="mask"):
        bl.short_conv(x, w, mask=np.ones((2, 5), dtype=bool))
    with pytest.raises(ValueError, match="mask"):
        bl.short_conv(x, w, mask=np.ones((2, 6)))
    gdn = L.init_gated_deltanet(L.GatedDeltaNetConfig(8, 2, 1, 2, 2), 0)
    with pytest.raises(ValueError, match="mask"):
        L.gated_deltanet(gdn, np.ones((3, 8)), mask=np.ones(2, dtype=bool))

@given(lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4), seed=st.integers(0, 100))
@examples(20)
def test_pack_and_unpack_are_inverse(lengths, seed):
    rng = np.random.default_rng(seed)
    seqs = [rng.standard_normal((2, n, 3)) for n in lengths]
    packed, cu = packing.pack(seqs)
    assert packed.shape == (2, sum(lengths), 3) and cu.tolist() == [0] + np.cumsum(lengths).tolist()
    assert all(np.array_equal(a, b) for a, b in zip(packing.unpack(packed, cu), seqs))
    assert packing.segment_ids(cu).tolist() == sum(([i] * n for i, n in enumerate(lengths)), [])
    gates = [rng.standard_normal((2, n)) for n in lengths]
    g, cu_g = packing.pack(gates, axis=-1)
    assert np.array_equal(cu_g, cu) and all(np.array_equal(a, b) for a, b in zip(packing.unpack(g, cu, axis=-1), gates))


def test_packing_refuses_bad_input_naming_it():
    for bad in ([0, 3, 3, 5], [1, 5], [0], [[0, 5]], np.array([0.0, 5.0]), [0, 5, 4]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            packing.check_cu_seqlens(bad)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packing.check_cu_seqlens([0, 4], 5)
    with pytest.raises(ValueError, match="sequences"):
        packing.pack([np.ones((2, 3)), np.ones((2, 4))])
    with pytest.raises(ValueError, match="sequences"):
        packing.pack([])
    q = np.ones((5, 2))
    with pytest.raises(ValueError, match="layer"):
        packing.varlen_mixer("softmax", q, q, q, {}, cu_seqlens=[0, 5])
    with pytest.raises(ValueError, match="form"):
        packing.varlen_mixer(LINEAR, q, q, q, {}, cu_seqlens=[0, 5], form="parallel")
    with pytest.raises(ValueError, match="gates"):
        packing.varlen_mixer("delta", q, q, q, {}, cu_seqlens=[0, 5])
    with pytest.raises(ValueError, match="cu_seqlens"):
        packing.varlen_mixer(LINEAR, q, q, q, {}, cu_seqlens=[0, 4])
