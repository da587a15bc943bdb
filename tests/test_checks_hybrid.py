"""The exercise checks of chapter "Hybrid models": pass on the reference, fail with a
specific message on each plausible wrong answer."""

import numpy as np
import pytest

from fixedstate import costs
from fixedstate import hybrid as hy
from fixedstate import time_model as tm
from fixedstate.checks import hybrid as ch


# --- numeric answers ----------------------------------------------------------------------

def test_stored_answers_match_independent_arithmetic():
    a = ch.ANSWERS
    assert a["ex-hy-kv-factor"]["value"] == 4.0            # 32 attention layers against 8
    assert a["ex-hy-crossover"]["value"] == 96 + 1         # 4 T^2 d > 4 T r d  <=>  T > r
    kv = 2 * 128_000 * 28 * 4 * 128 * 2            # K and V, tokens, layers, KV heads, head width, bytes
    state = 28 * 112 * 128 * 64 * 4                 # layers, heads, N, P, bytes (float32)
    assert a["ex-hy-128k-kv-gb"]["value"] == pytest.approx(kv / 1e9, rel=1e-12)
    assert a["ex-hy-128k-state-mb"]["value"] == pytest.approx(state / 1e6, rel=1e-12)
    assert a["ex-hy-128k-ratio"]["value"] == pytest.approx(kv / state, rel=1e-12)
    t1, t2 = 1 / 224, 1 / 199
    b = (t2 - t1) / 13_500
    assert a["ex-hy-share-16k"]["value"] == pytest.approx(b * 16_000 / t2, rel=1e-9)
    assert a["ex-hy-predict-128k"]["value"] == pytest.approx(1 / (t1 + b * (128_000 - 2500)), rel=1e-9)
    assert 0 < a["ex-hy-all-attention-16k"]["value"] < 199


@pytest.mark.parametrize("label", sorted(ch.ANSWERS))
def test_check_answer_accepts_the_stored_value_and_refuses_a_wrong_one(label):
    spec = ch.ANSWERS[label]
    assert ch.check_answer(label, spec["value"]).passed
    wrong = spec["value"] * 1.5 + 2
    result = ch.check_answer(label, wrong)
    assert not result.passed and "too high" in result.message


def test_check_answer_on_unknown_label_and_unfinished_cell():
    assert not ch.check_answer("ex-hy-nope", 1).passed
    result = ch.check_answer("ex-hy-kv-factor", ...)
    assert not result.passed and "`...`" in result.message


def test_plausible_slips_on_the_128k_exercise_are_refused():
    a = ch.ANSWERS["ex-hy-128k-state-mb"]["value"]
    assert not ch.check_answer("ex-hy-128k-state-mb", a / 2).passed        # 2-byte states
    assert not ch.check_answer("ex-hy-128k-state-mb", a / 28).passed       # one layer
    kv = ch.ANSWERS["ex-hy-128k-kv-gb"]["value"]
    assert not ch.check_answer("ex-hy-128k-kv-gb", kv / 2).passed          # keys only
    assert not ch.check_answer("ex-hy-128k-kv-gb", kv * 7).passed          # 28 query heads, not 4 KV heads


# --- KV cache of a configuration -------------------------------------------------------------

def kv_reference(config, context_len):
    return costs.kv_cache_bytes(context_len, n_layers=len(config.attention_layers),
                                n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                                bytes_per_element=config.bytes_per_element) if config.attention_layers else 0


def test_kv_check_passes_on_the_reference():
    result = ch.check_kv_cache_at(kv_reference)
    assert result.passed, result.message
    assert ch.check_kv_cache_at(hy.stack_kv_cache_bytes).passed


@pytest.mark.parametrize("wrong, message", [
    (lambda c, n: 2 * n * c.n_layers * c.n_kv_heads * c.head_dim * c.bytes_per_element,
     "only the full-attention layers"),
    (lambda c, n: n * len(c.attention_layers) * c.n_kv_heads * c.head_dim * c.bytes_per_element,
     "key AND a value"),
    (lambda c, n: 2 * n * len(c.attention_layers) * c.n_heads * c.head_dim * c.bytes_per_element,
     "query heads"),
    (lambda c, n: 2 * n * len(c.attention_layers) * c.n_kv_heads * c.head_dim, "not bytes"),
    (lambda c, n: 3 * n, "expected"),
    (lambda c, n: None, "replace the `...`"),
    (lambda c, n: "many", "number of bytes"),
])
def test_kv_check_names_the_mistake(wrong, message):
    result = ch.check_kv_cache_at(wrong)
    assert not result.passed
    assert message in result.message


# --- the two-point time model ---------------------------------------------------------------

def fit_reference(context_lengths, tokens_per_second):
    (l1, l2), (r1, r2) = context_lengths, tokens_per_second
    b = (1 / r2 - 1 / r1) / (l2 - l1)
    return 1 / r1 - b * l1, b


def test_time_check_passes_on_the_reference():
    result = ch.check_fit_time_model(fit_reference)
    assert result.passed, result.message
    assert ch.check_fit_time_model(tm.fit_time_model).passed


def fit_throughput_line(lengths, rates):
    (l1, l2), (r1, r2) = lengths, rates
    slope = (r2 - r1) / (l2 - l1)
    return r1 - slope * l1, slope


@pytest.mark.parametrize("wrong, message", [
    (fit_throughput_line, "fitted a line to the throughput"),
    (lambda L, r: fit_reference(L, r)[::-1], "swapped"),
    (lambda L, r: tuple(1000 * x for x in fit_reference(L, r)), "milliseconds"),
    (lambda L, r: (1 / r[0], fit_reference(L, r)[1]), "context length 0"),
    (lambda L, r: (0.0, 0.0), "expected a ="),
    (lambda L, r: 3.0, "pair"),
    (lambda L, r: ..., "replace the `...`"),
])
def test_time_check_names_the_mistake(wrong, message):
    result = ch.check_fit_time_model(wrong)
    assert not result.passed
    assert message in result.message


def test_time_check_reports_a_crash():
    def broken(lengths, rates):
        raise ZeroDivisionError("boom")
    result = ch.check_fit_time_model(broken)
    assert not result.passed and "ZeroDivisionError" in result.message
    assert np.isfinite(ch.ANSWERS["ex-hy-share-16k"]["value"])


# ---------------------------------------------------------------- challenge: the decode-time cost model

def _decode_cost(config, context_len, *, slip=None):
    c, L = config, context_len
    d = c.d_model
    n_full = len(c.attention_layers)
    n_lin = c.n_layers - n_full
    q_width = c.n_heads * c.head_dim
    full = d * q_width * (2 if c.attention_output_gate else 1) + 2 * d * c.n_kv_heads * c.head_dim + q_width * d
    v_width = c.n_linear_heads * c.linear_value_dim
    lin = (2 * d * c.n_linear_key_heads * c.linear_key_dim + d * v_width * (2 if c.linear_output_gate else 1)
           + 2 * d * c.n_linear_heads + v_width * d)
    weights = c.mlp_matrices * d * c.d_ff * c.n_layers + full * n_full + lin * n_lin + c.vocab_size * d
    heads = c.n_kv_heads if slip == "kv_heads_core" else c.n_heads
    attn = n_full * heads * 2 * L * 2 * c.head_dim
    per_state = 4 if slip == "no_recall" else 6
    flops = 2 * weights + attn + n_lin * c.n_linear_heads * per_state * c.linear_key_dim * c.linear_value_dim
    kv = 2 * L * n_full * c.n_kv_heads * c.head_dim * c.bytes_per_element
    state_bytes = c.bytes_per_element if slip == "state_width" else c.state_bytes_per_element
    state = n_lin * c.n_linear_heads * c.linear_key_dim * c.linear_value_dim * state_bytes
    conv = 0 if slip == "no_conv" else n_lin * (c.conv_kernel_size - 1) * c.conv_dim * c.bytes_per_element
    return flops, kv + state + conv


def test_decode_cost_check_passes_the_solution_and_names_the_slips():
    assert ch.check_decode_cost(_decode_cost).passed
    for slip, words in [("kv_heads_core", "every QUERY head"), ("no_recall", "recall S^T k"),
                        ("state_width", "state_bytes_per_element"), ("no_conv", "short-convolution buffers")]:
        result = ch.check_decode_cost(lambda c, L, s=slip: _decode_cost(c, L, slip=s))
        assert not result.passed and words in result.message, (slip, result.message)
    package = lambda c, L: (hy.decode_flops_per_token(c, L), hy.stack_kv_cache_bytes(c, L) + hy.stack_state_bytes(c))
    assert "the package's own implementation" in ch.check_decode_cost(package).message
