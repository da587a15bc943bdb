"""Tests for fixedstate.hybrid: the cost model of a hybrid stack and the toy numpy stack."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import hybrid as hy
from fixedstate import time_model as tm
from fixedstate import toy_stack as ts

FAST = examples(40)


def small_config(**overrides):
    base = dict(n_layers=8, d_model=64, d_ff=128, vocab_size=1000,
                attention_layers=hy.every_nth_layer(8, 4), n_heads=4, n_kv_heads=2, head_dim=16,
                n_linear_heads=4, n_linear_key_heads=2, linear_key_dim=16, linear_value_dim=16)
    base.update(overrides)
    return hy.HybridConfig(**base)


# --- the Qwen3.5-9B estimate of chumba2026beyond -----------------------------------------

# Published by chumba2026beyond: parameters by component and the vocabulary.
PUBLISHED = {"mlp": 4.832e9, "linear_attention": 1.617e9, "full_attention": 0.470e9}
VOCAB, HIDDEN = 248_320, 4096


def test_flops_from_published_parameter_counts_reproduce_13_8_to_15_9_gflop():
    low = hy.flops_from_parameter_counts(**PUBLISHED)
    high = hy.flops_from_parameter_counts(**PUBLISHED, vocab_projection=VOCAB * HIDDEN)
    # independent arithmetic: two FLOPs per parameter, the vocabulary projection added on top
    assert low == pytest.approx(2 * (4.832 + 1.617 + 0.470) * 1e9, rel=1e-12)
    assert high == pytest.approx(low + 2 * 248_320 * 4096, rel=1e-12)
    assert round(low / 1e9, 1) == 13.8
    assert round(high / 1e9, 1) == 15.9


def test_qwen_configuration_reproduces_published_parameter_counts_and_flops():
    c = hy.qwen35_9b_config()
    assert (c.n_layers, c.d_model, c.d_ff, c.vocab_size) == (32, 4096, 12288, 248_320)
    assert c.attention_layers == tuple(range(3, 32, 4)) and c.n_linear_layers == 24
    p = hy.parameter_counts(c)
    # MLP: 32 layers of three 4096 x 12288 SwiGLU matrices, computed here independently
    assert p["mlp"] == 32 * 3 * 4096 * 12288
    for key, published in PUBLISHED.items():
        assert round(p[key] / 1e9, 3) == pytest.approx(published / 1e9, abs=1e-12), key
    low = hy.prefill_flops_per_token(c, include_output_projection=False)
    high = hy.prefill_flops_per_token(c)
    assert 13.8e9 <= low < 13.85e9
    assert 15.85e9 <= high < 15.9e9
    assert high - low == 2 * VOCAB * HIDDEN


def test_parameters_per_layer_match_the_arrays_of_a_toy_stack():
    d, h, ff = 24, 3, 40
    params = ts.init_stack(4, d, h, (1,), d_ff=ff)
    c = hy.HybridConfig(n_layers=4, d_model=d, d_ff=ff, vocab_size=10, attention_layers=(1,),
                        n_heads=h, n_kv_heads=h, head_dim=d // h, n_linear_heads=h,
                        n_linear_key_heads=h, linear_key_dim=d // h, linear_value_dim=d // h,
                        mlp_matrices=2)
    per = hy.parameters_per_layer(c)

    def size(layer, names):
        return sum(layer[n].size for n in names)

    mixer = ["W_q", "W_k", "W_v", "W_o"]
    assert per["full_attention"] == size(params["layers"][1], mixer)
    assert per["linear_attention"] == size(params["layers"][0], mixer + ["W_b", "W_a"])
    assert per["mlp"] == size(params["layers"][0], ["W_1", "W_2"])


def test_output_gates_add_one_query_or_value_projection():
    plain = small_config()
    gated = small_config(attention_output_gate=True, linear_output_gate=True)
    a, b = hy.parameters_per_layer(plain), hy.parameters_per_layer(gated)
    assert b["full_attention"] - a["full_attention"] == 64 * 4 * 16
    assert b["linear_attention"] - a["linear_attention"] == 64 * 4 * 16


# --- memory against context length --------------------------------------------------------

@FAST
@given(contexts=st.lists(st.integers(0, 2_000_000), min_size=1, max_size=6),
       n_kv=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([64, 128, 256]),
       bpe=st.sampled_from([0.5, 1, 2, 4]))
def test_every_fourth_layer_attention_gives_a_kv_cache_four_times_smaller(contexts, n_kv, head_dim, bpe):
    c = hy.HybridConfig(n_layers=32, d_model=4096, d_ff=8192, vocab_size=32000,
                        attention_layers=hy.every_nth_layer(32, 4), n_heads=32, n_kv_heads=n_kv,
                        head_dim=head_dim, n_linear_heads=32, n_linear_key_heads=16,
                        linear_key_dim=128, linear_value_dim=128, bytes_per_element=bpe)
    lengths = np.array(contexts)
    hybrid = hy.stack_kv_cache_bytes(c, lengths)
    full = hy.stack_kv_cache_bytes(hy.all_attention(c), lengths)
    np.testing.assert_array_equal(np.asarray(full), 4 * np.asarray(hybrid))
    # and the absolute size, from the definition: K and V per token, per KV head, per layer
    np.testing.assert_allclose(hybrid, 2 * lengths * 8 * n_kv * head_dim * bpe, rtol=1e-15)


@FAST
@given(contexts=st.lists(st.integers(0, 10**6), min_size=2, max_size=5))
def test_fixed_state_does_not_depend_on_context_and_all_linear_has_no_kv_cache(contexts):
    c = hy.qwen35_9b_config()
    lengths = np.array(contexts)
    lin = hy.all_linear(c)
    np.testing.assert_array_equal(hy.stack_kv_cache_bytes(lin, lengths), 0)
    assert hy.stack_state_bytes(hy.all_attention(c)) == 0
    # 24 linear layers, 32 value heads, 128 x 128 state in float32; the convolution
    # buffers: kernel 4 keeps 3 inputs of 2 * 16 * 128 + 32 * 128 = 8192 channels, bf16
    assert hy.stack_state_bytes(c) == 24 * 32 * 128 * 128 * 4 + 24 * 3 * 8192 * 2
    assert hy.stack_state_bytes(lin) == 32 * 32 * 128 * 128 * 4 + 32 * 3 * 8192 * 2
    # the simpler count: bf16 states, no convolution buffers
    simple = hy.qwen35_9b_config(state_bytes_per_element=2, conv_kernel_size=1)
    assert hy.stack_state_bytes(simple) == 24 * 32 * 128 * 128 * 2
    # decode FLOPs of an all-linear stack are the same at every context length
    flops = hy.decode_flops_per_token(lin, lengths)
    np.testing.assert_array_equal(flops, flops[0])


def test_qwen_configuration_is_the_transformers_qwen3_5_text_default():
    # Qwen3_5Config().text_config in Hugging Face transformers (Qwen3_5TextConfig defaults)
    c = hy.qwen35_9b_config()
    assert (c.n_layers, c.d_model, c.d_ff, c.vocab_size) == (32, 4096, 12288, 248_320)
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (16, 4, 256)
    assert (c.n_linear_key_heads, c.n_linear_heads, c.linear_key_dim, c.linear_value_dim) == (16, 32, 128, 128)
    assert c.attention_layers == tuple(i for i in range(32) if (i + 1) % 4 == 0)
    assert (c.conv_kernel_size, c.conv_dim) == (4, 8192)
    assert (c.bytes_per_element, c.state_bytes_per_element) == (2, 4)


def test_state_memory_parameters():
    c = small_config()
    # defaults: states as wide as the cache numbers, no convolution buffer,
    # conv_dim = the query, key and value channels 2 H_k d_k + H_v d_v
    assert c.state_bytes_per_element == c.bytes_per_element == 2
    assert c.conv_kernel_size == 1 and c.conv_dim == 2 * 2 * 16 + 4 * 16
    assert hy.stack_conv_state_bytes(c) == 0
    assert hy.stack_state_bytes(c) == hy.stack_recurrent_state_bytes(c) == 6 * 4 * 16 * 16 * 2
    # float32 states double the recurrent part only; the buffers are (K - 1) conv_dim per layer
    wide = small_config(state_bytes_per_element=4, conv_kernel_size=4, conv_dim=100, bytes_per_element=2)
    assert hy.stack_recurrent_state_bytes(wide) == 2 * hy.stack_recurrent_state_bytes(c)
    assert hy.stack_conv_state_bytes(wide) == 6 * 3 * 100 * 2
    assert hy.stack_state_bytes(wide) == hy.stack_recurrent_state_bytes(wide) + hy.stack_conv_state_bytes(wide)
    # the KV cache does not see the state's dtype
    assert hy.stack_kv_cache_bytes(wide, 1000) == hy.stack_kv_cache_bytes(c, 1000)
    # a change of layout keeps the memory parameters; an all-attention stack has no state at all
    relaid = hy.with_layout(wide, (0,))
    assert (relaid.state_bytes_per_element, relaid.conv_kernel_size, relaid.conv_dim) == (4, 4, 100)
    assert hy.stack_conv_state_bytes(hy.all_attention(wide)) == 0
    assert hy.stack_state_bytes(hy.all_attention(wide)) == 0


def test_conv_buffer_is_what_the_short_convolution_carries():
    # the decode cache of blocks.short_conv over conv_dim channels is (K - 1, conv_dim) per layer
    from fixedstate.blocks import short_conv
    c = small_config(conv_kernel_size=4)
    x = np.zeros((5, c.conv_dim), dtype=np.float32)
    _, conv_state = short_conv(x, np.ones((c.conv_dim, c.conv_kernel_size), dtype=np.float32))
    assert hy.stack_conv_state_bytes(c) == c.n_linear_layers * conv_state.size * c.bytes_per_element


def test_toy_stack_state_stays_fixed_while_kv_cache_grows():
    params = ts.init_stack(4, 16, 2, (3,), d_ff=0)
    x = np.random.default_rng(0).standard_normal((9, 16))
    _, cache5 = ts.stack_decode(params, x[:5])
    _, cache9 = ts.stack_decode(params, x)
    for layer, c5, c9 in zip(params["layers"], cache5, cache9):
        if layer["layer_id"] == "gated_delta":
            assert c5.shape == c9.shape == (2, 8, 8)
        else:
            assert c5.length == 5 and c9.length == 9
            assert c9.keys.shape == c9.values.shape == (2, 9, 8)


@FAST
@given(l1=st.integers(0, 10**5), extra=st.integers(1, 10**5))
def test_decode_flops_grow_only_through_the_attention_layers(l1, extra):
    c = small_config()
    l2 = l1 + extra
    growth = hy.decode_flops_per_token(c, l2) - hy.decode_flops_per_token(c, l1)
    # 2 attention layers x 4 query heads x (2 extra * (d_k + d_v)) FLOPs per extra cached token
    assert growth == pytest.approx(2 * 4 * 2 * extra * (16 + 16), rel=1e-12)
    assert hy.decode_flops_per_token(c, 0, include_output_projection=False) > \
        hy.prefill_flops_per_token(c, include_output_projection=False)


# --- the two-point time model -------------------------------------------------------------

@FAST
@given(a=st.floats(1e-4, 1e-1), b=st.floats(1e-10, 1e-6),
       l1=st.integers(100, 10**5), extra=st.integers(1, 10**5))
def test_time_model_fit_recovers_the_line(a, b, l1, extra):
    l2 = l1 + extra
    rates = [1 / (a + b * l1), 1 / (a + b * l2)]
    fa, fb = tm.fit_time_model([l1, l2], rates)
    assert fa == pytest.approx(a, rel=1e-8)
    assert fb == pytest.approx(b, rel=1e-6)
    np.testing.assert_allclose(tm.predicted_tokens_per_second(fa, fb, np.array([l1, l2])), rates, rtol=1e-10)
    share = tm.attention_time_share(fa, fb, l2)
    assert share == pytest.approx(b * l2 / (a + b * l2), rel=1e-6)


def test_time_model_on_the_published_throughput():
    a, b = tm.fit_time_model([2500, 16000], [224, 199])
    # slope and intercept from the two reciprocals, done by hand
    slope = (1 / 199 - 1 / 224) / (16000 - 2500)
    assert b == pytest.approx(slope, rel=1e-12)
    assert a == pytest.approx(1 / 224 - 2500 * slope, rel=1e-12)
    assert tm.predicted_tokens_per_second(a, b, 2500) == pytest.approx(224, rel=1e-12)
    assert 0 < tm.attention_time_share(a, b, 2500) < tm.attention_time_share(a, b, 16000) < 1


def test_all_attention_twin_scales_the_context_term_by_the_cache():
    c = hy.qwen35_9b_config()
    a, b = tm.fit_time_model([2500, 16000], [224, 199])
    a_full, b_full = tm.all_attention_time_model(c, a, b)
    assert b_full == pytest.approx(4 * b, rel=1e-12)
    # weights per token: 32 attention layers in place of 24 linear ones (independent count)
    per = hy.parameters_per_layer(c)
    p = hy.parameter_counts(c)
    ratio = (p["total"] - p["embedding"] + 24 * (per["full_attention"] - per["linear_attention"])) / \
        (p["total"] - p["embedding"])
    assert a_full == pytest.approx(a * ratio, rel=1e-12)
    with pytest.raises(ValueError, match="config"):
        tm.all_attention_time_model(hy.all_linear(c), a, b)


# --- the toy stack: the decode step is the same computation as the forward pass --------------

@examples(15)
@given(T=st.integers(1, 30), chunk=st.sampled_from([1, 4, 7, 16]), seed=st.integers(0, 10**6),
       layout=st.sampled_from(["hybrid", "attention", "linear"]), d_ff=st.sampled_from([0, 24]))
def test_decode_steps_equal_the_forward_pass(T, chunk, seed, layout, d_ff):
    n_layers = 8
    attn = {"hybrid": hy.every_nth_layer(n_layers, 4), "attention": range(n_layers), "linear": ()}[layout]
    params = ts.init_stack(n_layers, 12, 2, attn, d_ff=d_ff, seed=seed)
    x = np.random.default_rng(seed + 1).standard_normal((T, 12))
    full = ts.stack_forward(params, x, chunk_size=chunk)
    steps, _ = ts.stack_decode(params, x)
    np.testing.assert_allclose(steps, full, rtol=1e-10, atol=1e-12)


def reference_stack_forward(params, x, chunk_size):
    """The stack written with a Python loop over heads and the cores' reference loops."""
    from fixedstate.delta_rule import gated_delta_rule_loop
    from fixedstate.softmax_attention import softmax_attention_loop

    n_heads = params["n_heads"]
    d_h = params["d_model"] // n_heads
    scale = 1 / np.sqrt(d_h)

    def norm(a):
        return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + 1e-6)

    def unit(a):
        return a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6)

    for layer in params["layers"]:
        h = norm(x)
        q, k, v = (h @ layer[n] for n in ("W_q", "W_k", "W_v"))
        heads = []
        for j in range(n_heads):
            cols = slice(j * d_h, (j + 1) * d_h)
            if layer["layer_id"] == "softmax":
                out, _ = softmax_attention_loop(q[:, cols], k[:, cols], v[:, cols], scale=scale)
            else:
                beta = 1 / (1 + np.exp(-(h @ layer["W_b"])[:, j]))
                gate = 1 / (1 + np.exp(-(h @ layer["W_a"] + layer["b_a"])[:, j]))
                out, _ = gated_delta_rule_loop(unit(q[:, cols]), unit(k[:, cols]), v[:, cols], beta=beta,
                                               log_gate=np.log(gate), scale=scale)
            heads.append(out)
        x = x + np.concatenate(heads, axis=1) @ layer["W_o"]
        if "W_1" in layer:
            u = norm(x) @ layer["W_1"]
            x = x + (u / (1 + np.exp(-u))) @ layer["W_2"]
    return x


@examples(10)
@given(T=st.integers(1, 20), chunk=st.sampled_from([1, 4, 16]), seed=st.integers(0, 10**6),
       layout=st.sampled_from(["hybrid", "attention", "linear"]), d_ff=st.sampled_from([0, 24]))
def test_heads_in_one_call_equal_a_loop_over_heads(T, chunk, seed, layout, d_ff):
    attn = {"hybrid": (1,), "attention": range(3), "linear": ()}[layout]
    params = ts.init_stack(3, 12, 3, attn, d_ff=d_ff, seed=seed)
    x = np.random.default_rng(seed + 1).standard_normal((T, 12))
    np.testing.assert_allclose(ts.stack_forward(params, x, chunk_size=chunk),
                               reference_stack_forward(params, x, chunk), rtol=1e-10, atol=1e-12)


def test_a_float32_stack_computes_in_float32():
    params = ts.init_stack(4, 8, 2, (1, 3), d_ff=8, dtype=np.float32, seed=2)
    x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    full = ts.stack_forward(params, x)
    steps, cache = ts.stack_decode(params, x)
    assert full.dtype == steps.dtype == np.float32
    assert cache[0].dtype == np.float32
    np.testing.assert_allclose(steps, full, rtol=1e-4, atol=1e-5)


def test_decode_continues_a_prefix():
    params = ts.init_stack(8, 16, 2, hy.every_nth_layer(8, 4), d_ff=16, seed=3)
    x = np.random.default_rng(4).standard_normal((20, 16))
    _, cache = ts.stack_decode(params, x[:12])
    tail, _ = ts.stack_decode(params, x[12:], cache)
    np.testing.assert_allclose(tail, ts.stack_forward(params, x)[12:], rtol=1e-10, atol=1e-12)


def test_layers_really_differ_by_kind():
    # the same weights with a different layout give a different output
    x = np.random.default_rng(5).standard_normal((10, 16))
    a = ts.stack_forward(ts.init_stack(4, 16, 2, (), seed=1), x)
    b = ts.stack_forward(ts.init_stack(4, 16, 2, range(4), seed=1), x)
    assert np.abs(a - b).max() > 1e-3


def test_synthetic_cache_has_the_sizes_of_the_context():
    params = ts.init_stack(2, 8, 2, (1,))
    cache = ts.synthetic_cache(params, 64)
    assert cache[0].shape == (2, 4, 4)
    assert cache[1].keys.shape == (2, 64, 4) and cache[1].values.shape == (2, 64, 4)
    # a decode step continues from it: one more token in the attention layer's cache
    _, cache = ts.stack_decode_step(params, np.ones(8), cache)
    assert cache[1].keys.shape == (2, 65, 4)


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, match", [((3, 8), "outside the stack"), ((-1,), "outside the stack"),
                                           ((1, 1), "at most once"), ((1.5,), "integer"),
                                           ("03", "sequence")])
def test_bad_layout_is_refused(layout, match):
    with pytest.raises(ValueError, match="attention_layers") as info:
        small_config(attention_layers=layout)
    assert match in str(info.value)
    with pytest.raises(ValueError, match="attention_layers"):
        ts.init_stack(8, 16, 2, layout)


@pytest.mark.parametrize("field", ["n_layers", "d_model", "d_ff", "vocab_size", "n_heads", "head_dim",
                                   "linear_key_dim", "n_linear_heads"])
@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_non_positive_sizes_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        small_config(**{field: value})


def test_head_counts_must_divide():
    with pytest.raises(ValueError, match="n_heads"):
        ts.init_stack(4, 10, 3, ())
    with pytest.raises(ValueError, match="n_kv_heads"):
        small_config(n_kv_heads=3)
    with pytest.raises(ValueError, match="n_linear_key_heads"):
        small_config(n_linear_key_heads=3)
    with pytest.raises(ValueError, match="n_layers"):
        ts.init_stack(0, 16, 2, ())
    with pytest.raises(ValueError, match="d_model"):
        ts.init_stack(4, 0, 2, ())


def test_other_bad_input():
    with pytest.raises(ValueError, match="bytes_per_element"):
        small_config(bytes_per_element=0)
    with pytest.raises(ValueError, match="^state_bytes_per_element"):
        small_config(state_bytes_per_element=-4)
    with pytest.raises(ValueError, match="^conv_kernel_size"):
        small_config(conv_kernel_size=0)
    with pytest.raises(ValueError, match="^conv_dim"):
        small_config(conv_dim=0)
    with pytest.raises(ValueError, match="context_lengths"):
        tm.fit_time_model([100, 100], [5, 4])
    with pytest.raises(ValueError, match="tokens_per_second"):
        tm.fit_time_model([100, 200], [5, -4])
    with pytest.raises(ValueError, match="config"):
        hy.parameter_counts({"n_layers": 2})
    with pytest.raises(ValueError, match="mlp"):
        hy.flops_from_parameter_counts(-1, 0, 0)
    with pytest.raises(ValueError, match="inputs"):
        ts.stack_forward(ts.init_stack(2, 8, 2, ()), np.zeros((3, 7)))
    with pytest.raises(ValueError, match="every_nth|n"):
        hy.every_nth_layer(32, 0)
    frozen = small_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.n_layers = 3
