"""Cost and memory accounting (fixedstate.costs).

Properties from the chapters:
- the FLOP counters equal 2 x (multiply-adds) of the matrix products the
  implementations actually perform, counted from the shapes of those products;
- the worked figures of the sources come out of the functions: a d_k = d_v = 128
  state holds 16,384 numbers, a 100,000-token KV cache of one such head 25.6
  million; the 128k-token KV cache of a d = 4096, 32-layer fp16 model is about
  67 GB (s = 128,000) or exactly 64 GiB (s = 131,072);
- the crossover: linear attention's core is cheaper than softmax's exactly when
  s > r (d_k = d_v, full-square count), found by searching the counters;
- the KV cache grows linearly with the context, the state does not depend on it;
- bad input raises ValueError naming the argument.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import costs

SETTINGS = examples(50)


def _matmul_flops(a_shape, b_shape):
    """2 FLOPs per multiply-add of an (m, n) @ (n, p) product."""
    (m, n), (n2, p) = a_shape, b_shape
    assert n == n2
    return 2 * m * n * p


def test_source_state_vs_cache_numbers():
    # source 000, exercise "apply": d_k = d_v = 128, 100,000 tokens
    assert costs.linear_state_numbers(d_k=128, d_v=128) == 16_384
    assert costs.kv_cache_numbers(100_000, head_dim=128) == 25_600_000
    # with the normalizer the state grows by d_k numbers, still independent of the length
    assert costs.linear_state_numbers(d_k=128, d_v=128, include_normalizer=True) == 16_384 + 128


def test_source_128k_kv_cache():
    # source 004: d = 4096 (one KV "head" of width 4096, or 32 heads of 128), 32 layers, fp16
    b = costs.kv_cache_bytes(128_000, n_layers=32, head_dim=4096, bytes_per_element=2)
    assert b == 67_108_864_000                       # about 67 GB, as the source says
    assert b == costs.kv_cache_bytes(128_000, n_layers=32, n_kv_heads=32, head_dim=128)
    b2 = costs.kv_cache_bytes(131_072, n_layers=32, head_dim=4096)
    assert b2 == 64 * 2**30                          # 128k read as 131,072: exactly 64 GiB


def test_source_mamba_state_figure_is_4_mb_not_0_17_gb():
    # source 004 claims 16 * 4096 * 32 * 2 bytes ~ 0.17 GB; the product is ~4.2 MB
    b = costs.linear_state_bytes(n_layers=32, d_k=16, d_v=4096, bytes_per_element=2)
    assert b == 4_194_304
    assert abs(b - 0.17e9) > 0.1e9


@SETTINGS
@given(t=st.integers(0, 300), d_k=st.integers(1, 64), d_v=st.integers(1, 64), r=st.integers(1, 64))
def test_flop_counters_equal_the_products_performed(t, d_k, d_v, r):
    # softmax prefill: (T, d_k) @ (d_k, T) then (T, T) @ (T, d_v)
    assert costs.softmax_attention_flops(t, d_k, d_v) == (
        _matmul_flops((t, d_k), (d_k, t)) + _matmul_flops((t, t), (t, d_v)))
    # causal: only the visible pairs, one (1, d_k) @ (d_k, j) and one (1, j) @ (j, d_v) per row j
    assert costs.softmax_attention_flops(t, d_k, d_v, causal=True) == sum(
        _matmul_flops((1, d_k), (d_k, j)) + _matmul_flops((1, j), (j, d_v)) for j in range(1, t + 1))
    # linear attention: phi(K)^T V is (r, T) @ (T, d_v); phi(Q) S is (T, r) @ (r, d_v)
    assert costs.linear_attention_flops(t, r, d_v) == (
        _matmul_flops((r, t), (t, d_v)) + _matmul_flops((t, r), (r, d_v)))
    assert costs.linear_attention_flops(t, r, d_v, normalize=True) == (
        _matmul_flops((r, t), (t, d_v + 1)) + _matmul_flops((t, r), (r, d_v + 1)))
    # one decode step: outer product write (r*d_v multiplies + r*d_v adds) and (1, r) @ (r, d_v)
    assert costs.linear_decode_flops(r, d_v) == 2 * r * d_v + _matmul_flops((1, r), (r, d_v))
    assert costs.softmax_decode_flops(t, d_k, d_v) == (
        _matmul_flops((1, d_k), (d_k, t)) + _matmul_flops((1, t), (t, d_v)))


@SETTINGS
@given(r=st.integers(1, 600), d=st.integers(1, 256))
def test_crossover_is_s_greater_than_r(r, d):
    s = costs.crossover_length(r, d, d)
    assert s == r + 1
    # the defining property, checked on both sides of the crossover
    assert costs.linear_attention_flops(s, r, d) < costs.softmax_attention_flops(s, d, d)
    assert costs.linear_attention_flops(s - 1, r, d) >= costs.softmax_attention_flops(s - 1, d, d)
    assert costs.decode_crossover_length(r, d, d) == r + 1


@SETTINGS
@given(r=st.integers(1, 300), d_k=st.integers(1, 64), d_v=st.integers(1, 64),
       causal=st.booleans(), normalize=st.booleans())
def test_crossover_matches_brute_force(r, d_k, d_v, causal, normalize):
    s = costs.crossover_length(r, d_k, d_v, causal=causal, normalize=normalize)
    lengths = np.arange(1, s + 1)
    lin = costs.linear_attention_flops(lengths, r, d_v, normalize=normalize)
    soft = costs.softmax_attention_flops(lengths, d_k, d_v, causal=causal)
    cheaper = lin < soft
    assert cheaper[-1] and not cheaper[:-1].any()


def test_causal_count_moves_the_crossover_to_about_2r():
    # counting only the visible half of the causal square halves softmax's cost
    for r in (16, 64, 128, 256):
        assert costs.crossover_length(r, r, r, causal=True) == 2 * r


def test_arrays_of_context_lengths():
    lengths = np.array([0, 1, 1000, 128_000])
    kv = costs.kv_cache_bytes(lengths, n_layers=32, head_dim=4096)
    assert kv.shape == lengths.shape and kv.dtype == np.int64
    np.testing.assert_array_equal(kv, [costs.kv_cache_bytes(int(s), n_layers=32, head_dim=4096)
                                       for s in lengths])
    # linear in the context: bytes per token is constant
    np.testing.assert_array_equal(np.diff(costs.kv_cache_numbers(np.arange(10), head_dim=8)), 16)
    dec = costs.softmax_decode_flops(lengths, 128, 128)
    assert dec.shape == lengths.shape


def test_conv_buffer_keeps_kernel_minus_one_inputs_per_channel():
    from fixedstate.blocks import short_conv
    for kernel, conv_dim in [(1, 7), (2, 3), (4, 8192)]:
        _, state = short_conv(np.zeros((6, conv_dim)), np.ones((conv_dim, kernel)))
        assert costs.conv_state_numbers(kernel_size=kernel, conv_dim=conv_dim) == state.size
    # 24 Gated DeltaNet layers of Qwen3.5: kernel 4 over 8192 channels, bf16 and float32
    assert costs.conv_state_numbers(n_layers=24, kernel_size=4, conv_dim=8192) == 24 * 3 * 8192
    assert costs.conv_state_bytes(n_layers=24, kernel_size=4, conv_dim=8192) == 24 * 3 * 8192 * 2
    assert costs.conv_state_bytes(n_layers=24, kernel_size=4, conv_dim=8192, bytes_per_element=4) \
        == 24 * 3 * 8192 * 4


def test_bytes_per_element_scales_and_accepts_fractions():
    assert costs.kv_cache_bytes(10, head_dim=4, bytes_per_element=4) == 2 * costs.kv_cache_bytes(10, head_dim=4)
    assert costs.linear_state_bytes(d_k=4, d_v=4, bytes_per_element=0.5) == 8.0
    assert isinstance(costs.kv_cache_bytes(10, head_dim=4), int)


@pytest.mark.parametrize("call, name", [
    (lambda: costs.kv_cache_bytes(-1, head_dim=4), "context_len"),
    (lambda: costs.kv_cache_bytes(1.5, head_dim=4), "context_len"),
    (lambda: costs.kv_cache_bytes(np.array([1.0, 2.0]), head_dim=4), "context_len"),
    (lambda: costs.kv_cache_bytes(10, head_dim=0), "head_dim"),
    (lambda: costs.kv_cache_bytes(10, head_dim=4, n_layers=True), "n_layers"),
    (lambda: costs.kv_cache_bytes(10, head_dim=4, bytes_per_element=0), "bytes_per_element"),
    (lambda: costs.linear_state_bytes(d_k=4, d_v="4"), "d_v"),
    (lambda: costs.conv_state_numbers(kernel_size=0, conv_dim=4), "kernel_size"),
    (lambda: costs.conv_state_bytes(kernel_size=4, conv_dim=0), "conv_dim"),
    (lambda: costs.conv_state_bytes(kernel_size=4, conv_dim=4, bytes_per_element=-2), "bytes_per_element"),
    (lambda: costs.softmax_attention_flops(10, 0, 4), "d_k"),
    (lambda: costs.linear_attention_flops(10, 4, 4, normalize="yes"), "normalize"),
    (lambda: costs.crossover_length(np.array([4, 8]), 4, 4), "r"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match="^" + name):
        call()


# --------------------------------------------------------------------------- the chunkwise delta rule

@pytest.mark.parametrize("layer", ["delta", "gated_delta", "kda"])
@pytest.mark.parametrize("T,d_k,d_v,chunk,lead", [(4096, 128, 128, 64, ()), (300, 8, 5, 64, ()), (130, 6, 7, 48, ()),
                                                  (50, 4, 3, 1, ()), (37, 5, 4, 8, (3,)), (0, 3, 2, 16, ())])
def test_chunkwise_flops_count_the_products_the_forms_call(layer, T, d_k, d_v, chunk, lead):
    # every matrix product of the chunkwise forms goes through kernels.matmul or matmul_add: record and count them
    from fixedstate import delta_rule as dr
    from fixedstate import kernels
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2,) + lead + (T, d_k))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal(lead + (T, d_v))
    beta = rng.uniform(0, 1, lead + (T,))
    fn = {"delta": dr.delta_rule_chunkwise, "gated_delta": dr.gated_delta_rule_chunkwise, "kda": dr.kda_chunkwise}[layer]
    gate = {} if layer == "delta" else {"log_gate": -rng.uniform(0, 1, lead + ((T, d_k) if layer == "kda" else (T,)))}
    with kernels.recording_products() as steps:
        fn(q, k, v, beta=beta, **gate, chunk_size=chunk)
    counted = []
    for kind, a, b, out, keep, sign in steps:
        if kind == "matmul":
            batch = int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2])))
            counted.append(2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1])
        else:                                                 # out <- keep * out + sign * (a @ b), a 2-D product
            counted.append(2 * a.shape[0] * a.shape[1] * b.shape[1])
    batch = int(np.prod(lead))
    assert sum(counted) == costs.delta_rule_chunkwise_flops(T, d_k, d_v, chunk_size=chunk, layer=layer, batch=batch)


def test_chunkwise_flops_of_the_benchmark_case():
    # T = 4096, d_k = d_v = 128, chunk 64: about 0.75 GFLOP for Gated DeltaNet (11.7 million per chunk)
    flops = costs.delta_rule_chunkwise_flops(4096, 128, 128)
    assert flops == 64 * 11_708_416 and 0.74e9 < flops < 0.76e9
    assert costs.delta_rule_chunkwise_flops(4096, 128, 128, layer="kda") < flops
    for other in ("mamba", "gated", "ssd"):          # only the delta rule's ids of fixedstate.layer_ids
        with pytest.raises(ValueError, match="layer"):
            costs.delta_rule_chunkwise_flops(10, 2, 2, layer=other)
    with pytest.raises(ValueError, match="chunk_size"):
        costs.delta_rule_chunkwise_flops(10, 2, 2, chunk_size=0)


# --------------------------------------------------------------------------- state-space models (chapter 4)

def test_state_bytes_and_the_worked_problem():
    # 16 * 4096 * 32 * 2 bytes, counted independently
    assert costs.ssm_state_bytes(4096, 32, 16) == 16 * 4096 * 32 * 2
    assert costs.ssm_state_bytes(4096, 32, 16, expand=2, batch=3) == 3 * 2 * 16 * 4096 * 32 * 2


def test_flop_counts_scale_as_stated():
    assert costs.selective_scan_flops(2000, 64, 16) == 2 * costs.selective_scan_flops(1000, 64, 16)
    assert costs.ssm_decode_flops(64, 16) * 1000 == costs.selective_scan_flops(1000, 64, 16)
    f1, f2 = costs.s4_fft_conv_flops(1024, 8, 16), costs.s4_fft_conv_flops(2048, 8, 16)
    assert 2.0 < f2 / f1 < 2.5            # n log n: a little more than doubling


# --------------------------------------------------------------------------- Mamba-2's chunked algorithm (#16)


# ----------------------------------------------------------------- the state at the end of a sequence (chapter 9)

def test_layer_state_bytes_per_kind_of_layer():
    from fixedstate.costs import layer_state_bytes, model_state_bytes

    for layer in ("linear", "delta", "gated_delta", "kda", "ssd", "ssm"):
        assert layer_state_bytes(layer, seq_len=128, d_k=16, d_v=8, n_heads=2) == 2 * 16 * 8 * 4
        assert layer_state_bytes(layer, seq_len=1, d_k=16, d_v=8) == layer_state_bytes(layer, seq_len=999, d_k=16,
                                                                                       d_v=8)
    assert layer_state_bytes("softmax", seq_len=128, d_k=16, d_v=8, bytes_per_element=2) == 128 * 24 * 2
    assert layer_state_bytes("softmax", seq_len=128, d_k=16, d_v=8) == costs.kv_cache_bytes(
        128, head_dim=16, bytes_per_element=4) - 128 * 8 * 4            # values of width 8, not 16
    # the window cache: the last window - 1 tokens, never more than the sequence
    assert layer_state_bytes("swa", seq_len=128, d_k=16, d_v=16, window=9) == 8 * 32 * 4
    assert layer_state_bytes("swa", seq_len=4, d_k=16, d_v=16, window=9) == 4 * 32 * 4
    assert layer_state_bytes("swa", seq_len=4, d_k=16, d_v=16, window=1) == 0
    # the swa width rule of the sweep gives it the fixed state's size
    from fixedstate.training import swa_window
    for d in (8, 16, 32, 64):
        assert layer_state_bytes("swa", seq_len=128, d_k=d, d_v=d, window=swa_window(d)) == \
            layer_state_bytes("gated_delta", seq_len=128, d_k=d, d_v=d)
    assert model_state_bytes(("gated_delta", "softmax"), seq_len=64, d_k=8, d_v=8) == (64 + 64 * 16) * 4
    assert model_state_bytes(("swa", "swa"), seq_len=64, d_k=8, d_v=8, window=3) == 2 * 2 * 16 * 4


@pytest.mark.parametrize("kw, name", [
    ({"layer_id": "hybrid"}, "layer_id"), ({"layer_id": "lstm"}, "layer_id"),
    ({"layer_id": "swa"}, "window"), ({"layer_id": "softmax", "window": 4}, "window"),
    ({"layer_id": "swa", "window": 0}, "window"), ({"layer_id": "linear", "d_k": 0}, "d_k"),
    ({"layer_id": "linear", "bytes_per_element": -2}, "bytes_per_element"),
    ({"layer_id": "linear", "seq_len": [1, 2]}, "seq_len")])
def test_layer_state_bytes_bad_input_names_the_argument(kw, name):
    from fixedstate.costs import layer_state_bytes

    args = {"seq_len": 8, "d_k": 4, "d_v": 4, **kw}
    with pytest.raises(ValueError, match=name):
        layer_state_bytes(args.pop("layer_id"), **args)


def test_model_state_bytes_wants_layers():
    from fixedstate.costs import model_state_bytes

    for bad in ("softmax", [], None):
        with pytest.raises(ValueError, match="layers"):
            model_state_bytes(bad, seq_len=8, d_k=4, d_v=4)


# --------------------------------------------------------------------------- diagonal plus low rank (chapter 7)

def _recorded_flops(steps):
    counted = 0
    for kind, a, b, out, keep, sign in steps:
        if kind == "matmul":
            batch = int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2])))
            counted += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        else:
            counted += 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return counted


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("T,d_k,d_v,chunk,lead", [(300, 8, 5, 64, ()), (130, 6, 7, 48, ()), (50, 4, 3, 1, ()),
                                                  (37, 5, 4, 8, (3,)), (0, 3, 2, 16, ()), (129, 16, 16, 32, (2,))])
def test_dplr_flops_count_the_products_the_forms_call(tied, T, d_k, d_v, chunk, lead):
    from fixedstate import delta_family as df
    from fixedstate import delta_rule as dr
    from fixedstate import kernels
    rng = np.random.default_rng(1)
    q, k, a, b = rng.standard_normal((4,) + lead + (T, d_k)) / np.sqrt(max(d_k, 1))
    v = rng.standard_normal(lead + (T, d_v))
    lg = -rng.uniform(0, 1, lead + (T, d_k))
    with kernels.recording_products() as steps:
        if tied:
            k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
            dr.kda_chunkwise(q, k, v, beta=rng.uniform(0, 1, lead + (T,)), log_gate=lg, chunk_size=chunk)
        else:
            df.rwkv7_chunkwise(q, k, v, log_gate=lg, a=a, b=b, chunk_size=chunk)
    parts = costs.dplr_chunkwise_flops(T, d_k, d_v, chunk_size=chunk, tied=tied, batch=int(np.prod(lead)))
    assert _recorded_flops(steps) == parts["total"]
    assert parts["total"] == parts["pairs"] + parts["inverse"] + parts["intra"] + parts["state"]
    if tied:
        assert parts["total"] == costs.delta_rule_chunkwise_flops(T, d_k, d_v, chunk_size=chunk, layer="kda",
                                                                  batch=int(np.prod(lead)))


def test_tying_halves_the_pair_products_and_saves_less_elsewhere():
    general = costs.dplr_chunkwise_flops(4096, 128, 128, chunk_size=64)
    tied = costs.dplr_chunkwise_flops(4096, 128, 128, chunk_size=64, tied=True)
    assert tied["pairs"] * 2 == general["pairs"] and tied["inverse"] == general["inverse"]
    assert tied["state"] * 8 == general["state"] * 6
    assert 0.5 < tied["total"] / general["total"] < 0.75
    with pytest.raises(ValueError, match="^tied"):
        costs.dplr_chunkwise_flops(10, 2, 2, tied="yes")
    with pytest.raises(ValueError, match="^chunk_size"):
        costs.dplr_chunkwise_flops(10, 2, 2, chunk_size=0)


# --------------------------------------------------------------------------- the hardware view (chapter 7)

def test_chunkwise_profile_of_a_small_case_counted_by_hand():
    # T = 4, one chunk of 4, d_k = 2, d_v = 3: elementwise 2*4 + 5*16 + 4*4*2 + 3*4*3 + 2*2*3 = 168;
    # bytes: 4 tokens * (2*2 + 3 + 2 + 3) numbers * 2 bytes + 2 * 6 state numbers * 4 bytes = 144
    p = costs.chunkwise_profile(4, 2, 3, chunk_size=4)
    assert p["matmul_flops"] == costs.delta_rule_chunkwise_flops(4, 2, 3, chunk_size=4)
    assert p["elementwise_flops"] == 168 and p["bytes"] == 144
    assert p["exponentials"] == 4 + 16                        # the decays of 4 tokens, the 4 x 4 mask
    assert p["chunk_state_bytes"] == 2 * 3 * 4                # one float32 state for the one chunk
    total = p["matmul_flops"] + 168
    assert p["matmul_fraction"] == p["matmul_flops"] / total and p["intensity"] == total / 144


@examples(40)
@given(T=st.integers(1, 5000), d=st.integers(1, 300), chunk=st.integers(1, 256), batch=st.integers(1, 8))
def test_chunkwise_profile_scales_as_stated(T, d, chunk, batch):
    one = costs.chunkwise_profile(T, d, d, chunk_size=chunk)
    many = costs.chunkwise_profile(T, d, d, chunk_size=chunk, batch=batch)
    for key in ("matmul_flops", "elementwise_flops", "bytes", "exponentials", "chunk_state_bytes"):
        assert many[key] == batch * one[key]
    assert 0 < one["exponentials"] < one["elementwise_flops"]   # a part of the elementwise work
    n_chunks = -(-T // chunk)
    assert one["chunk_state_bytes"] == n_chunks * d * d * 4       # d_k d_v float32 numbers per chunk boundary
    assert 0.0 < one["matmul_fraction"] < 1.0
    assert many["matmul_fraction"] == pytest.approx(one["matmul_fraction"], rel=1e-12)
    wider = costs.chunkwise_profile(T, 2 * d, 2 * d, chunk_size=chunk)
    assert wider["matmul_fraction"] > one["matmul_fraction"]    # products grow as C d^2, the rest as C^2 + C d + d^2


def test_chunkwise_profile_bad_input_names_the_argument():
    for kw, name in (({"chunk_size": 0}, "chunk_size"), ({"bytes_per_element": 0}, "bytes_per_element"),
                     ({"batch": 1.5}, "batch")):
        with pytest.raises(ValueError, match="^" + name):
            costs.chunkwise_profile(10, 2, 2, **kw)
    with pytest.raises(ValueError, match="^seq_len"):
        costs.chunkwise_profile(0, 2, 2)
