"""Tests for fixedstate.kernels, the internal layer under the cores, where the public forms do not reach.

The kernels are tested through the public forms in the tests of each core (test_delta_rule,
test_gla, test_delta_family, test_linear_attention, test_recall); here: the one group-size
formula and the chunked kernels' independence of it, and the states at several prefixes that
the scans hand the recall lab.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import delta_family as df
from fixedstate import gated_linear_attention as gla
from fixedstate import kernels
from fixedstate import ssm

SETTINGS = examples(40)


@SETTINGS
@given(chunk=st.sampled_from([1, 2, 8, 64, 128]), width=st.integers(1, 300), itemsize=st.sampled_from([4, 8]),
       sequences=st.integers(1, 9), group_bytes=st.integers(1, 1 << 22))
def test_a_group_is_at_least_one_chunk_and_about_group_bytes(chunk, width, itemsize, sequences, group_bytes):
    g = kernels.chunks_per_group(chunk, width, itemsize, sequences=sequences, group_bytes=group_bytes)
    assert g >= 1
    row = width * itemsize                                   # bytes of one token
    if g > 1:                                                # more than one chunk only if they fit
        assert g * chunk * sequences * row <= max(group_bytes, chunk * row)
    # one more chunk per sequence would not fit (unless one chunk alone is already more than the size)
    assert (g + 1) * chunk * sequences * row > group_bytes or chunk * row > group_bytes
    # one sequence: the same count as dividing the bytes by a chunk's bytes (GLA's way of saying it)
    one = kernels.chunks_per_group(chunk, width, itemsize, group_bytes=group_bytes)
    assert one == max(1, group_bytes // (chunk * row))


def test_the_default_group_size_is_group_bytes():
    assert kernels.chunks_per_group(64, 128, 8) == kernels.GROUP_BYTES // (64 * 128 * 8)


@SETTINGS
@given(B=st.integers(1, 3), T=st.integers(1, 9), gated=st.booleans(), data=st.data())
def test_the_delta_scan_hands_the_states_at_the_marks(B, T, gated, data):
    # the states at the marks are those after that many tokens, whether or not the scan reads
    marks = sorted(data.draw(st.lists(st.integers(0, T), min_size=1, max_size=4)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    q, k = rng.standard_normal((2, B, T, 4))
    v = rng.standard_normal((B, T, 3))
    beta = rng.uniform(0, 1, (B, T))
    lg = np.log(rng.uniform(0.5, 1, (B, T))) if gated else None
    S0 = rng.standard_normal((B, 4, 3))
    out, states = kernels.delta_scan(None, k, v, beta, lg, S0, 1.0, False, marks=marks)
    assert out is None and len(states) == len(marks)
    for m, S in zip(marks, states):
        _, want = kernels.delta_scan(q[:, :m], k[:, :m], v[:, :m], beta[:, :m], None if lg is None else lg[:, :m],
                                     S0, 1.0, False)
        assert np.array_equal(S, want)


@SETTINGS
@given(T=st.integers(1, 9), data=st.data())
def test_the_additive_scan_hands_the_states_at_the_marks(T, data):
    marks = sorted(data.draw(st.lists(st.integers(0, T), min_size=1, max_size=4)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    k, v = rng.standard_normal((2, 2, T, 3))
    _, states = kernels.additive_scan(None, k, v, None, marks=marks)
    for m, S in zip(marks, states):
        assert np.allclose(S, np.swapaxes(k[:, :m], -1, -2) @ v[:, :m], rtol=1e-13, atol=1e-13)


def _driver_inputs(rng, layer, lead, T, d_k, d_v):
    """Inputs of the chunked kernels of GLA and RWKV-7 (decays in RWKV-7's range, unit removal keys)."""
    q, k = rng.standard_normal((2,) + lead + (T, d_k))
    v = rng.standard_normal(lead + (T, d_v))
    log_gate = np.log(rng.uniform(0.3, 1.0, lead + (T, d_k)))
    if layer == "gla":
        return q, k, v, log_gate
    kappa = rng.standard_normal(lead + (T, d_k))
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    eta = rng.uniform(0.0, 1.0, lead + (T, d_k))
    return q, k, v, log_gate, -kappa, eta * kappa


@pytest.mark.parametrize("layer", ["gla", "rwkv7"])
@pytest.mark.parametrize("group_bytes", [1, 3 * 16 * 5 * 8, 1 << 30])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_the_chunked_forms_do_not_depend_on_how_chunks_are_grouped(layer, group_bytes, lead):
    # GLA's and RWKV-7's kernels (gla_chunks, rwkv7_chunks) go through groups of kernels.chunks_per_group
    # chunks: with 1 byte every group is one chunk; with 3 chunks' worth, groups of 3 and a shorter last one
    # (one sequence; of 1 for three); with 1 GiB, one group. The grouping changes no bit, and the result is
    # the recurrence's to float64 precision.
    rng = np.random.default_rng(16)
    args = _driver_inputs(rng, layer, lead, 150, 5, 4)
    S0 = rng.standard_normal(lead + (5, 4))
    kernel, recurrent = {"gla": (gla.gla_chunks, gla.gla_recurrent),
                         "rwkv7": (df.rwkv7_chunks, df.rwkv7_recurrent)}[layer]
    batch = lambda x: x.reshape((-1,) + x.shape[len(lead):])             # the leading axes as one
    flat_args = [batch(x) for x in args] + [batch(S0)]
    o_one, S_one = kernel(*flat_args, 1.0, 16, group_bytes=1)
    o, S = kernel(*flat_args, 1.0, 16, group_bytes=group_bytes)
    assert np.array_equal(o, o_one) and np.array_equal(S, S_one)
    names = ["log_gate"] if layer == "gla" else ["log_gate", "a", "b"]
    o_ref, S_ref = recurrent(*args[:3], **dict(zip(names, args[3:])), initial_state=S0)
    err = max(np.max(np.abs(o.reshape(o_ref.shape) - o_ref)) / np.max(np.abs(o_ref)),
              np.max(np.abs(S.reshape(S_ref.shape) - S_ref)) / np.max(np.abs(S_ref)))
    assert err <= 1e-13


# ---------------------------------------------------------------------------- the SSD's state, one kernel

@SETTINGS
@given(T=st.integers(1, 20), N=st.integers(1, 4), P=st.integers(1, 4), heads=st.integers(1, 3),
       seed=st.integers(0, 10**6))
def test_the_ssd_forms_take_their_state_and_mask_from_the_kernels(T, N, P, heads, seed):
    # ssd_quadratic's final state is kernels.ssd_state and ssd_mask is kernels.ssd_decay_mask, bit for
    # bit, so the recall lab's SSM memory (which calls ssd_state) and the layer share one arithmetic;
    # the kernel's state is the recurrence S <- g_t S + B_t v_t^T, token by token, to rounding
    rng = np.random.default_rng(seed)
    x, delta = rng.standard_normal((heads, T, P)), rng.uniform(0.05, 1.0, (heads, T))
    a, B, C = -rng.uniform(0.0, 2.0, heads), rng.standard_normal((heads, T, N)), rng.standard_normal((heads, T, N))
    S0 = rng.standard_normal((heads, N, P))
    log_gate, V = a[:, None] * delta, delta[..., None] * x
    _, S = ssm.ssd_quadratic(x, delta, a, B, C, initial_state=S0)
    state = kernels.ssd_state(log_gate, B, V, S0)
    assert S.tobytes() == state.tobytes()
    assert ssm.ssd_mask(delta, a).tobytes() == kernels.ssd_decay_mask(log_gate).tobytes()
    loop = S0.copy()
    for t in range(T):
        loop = np.exp(log_gate[:, t, None, None]) * loop + B[:, t, :, None] * V[:, t, None, :]
    assert np.max(np.abs(state - loop)) <= 1e-12 * max(1.0, np.max(np.abs(loop)))
    written = kernels.ssd_state(log_gate, B, V, None)          # no initial state: only what was written
    assert np.max(np.abs(written - kernels.ssd_state(log_gate, B, V, np.zeros_like(S0)))) == 0.0
