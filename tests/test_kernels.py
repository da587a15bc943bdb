"""Tests for fixedstate.kernels, the internal layer under the cores, where the public forms do not reach.

The kernels are tested through the public forms in the tests of each core (test_delta_rule,
test_gla, test_delta_family, test_linear_attention, test_recall); here: the one group-size
formula, and the states at several prefixes that the scans hand the recall lab.
"""

import numpy as np
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import kernels

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
