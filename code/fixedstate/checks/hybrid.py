"""Checks for the exercises of chapter "Hybrid models" (chap-hybrids).

Numeric answers live in :data:`ANSWERS`, each computed by the package (never
typed in) with its tolerance, and are checked by :func:`check_answer`. The two
coding exercises are checked by :func:`check_kv_cache_at` (the KV cache of a
configuration at a given context) and :func:`check_fit_time_model` (the
two-point model of time per token).

Challenge problem: :func:`check_decode_cost` for
``decode_cost(config, context_len) -> (flops_per_token, memory_bytes)``, the
decode-time cost model of a hybrid from its configuration (equations
``eq-hy-params``, ``eq-hy-decode-flops``, ``eq-hy-kv``, ``eq-hy-state``), compared
with :func:`fixedstate.hybrid.decode_flops_per_token` and the ``stack_*_bytes``
functions, which the answer may not call.
"""

from __future__ import annotations


import numpy as np

from .. import costs
from .. import hybrid as hy
from .. import time_model as tm
from ._core import check_numeric, CheckResult, Failure, call_student, call_without, compare_number, failed, run_check

__all__ = ["ANSWERS", "check_answer", "check_kv_cache_at", "check_fit_time_model",
           "PUBLISHED_THROUGHPUT", "check_decode_cost"]

#: The published measurement (chumba2026beyond): context lengths and tokens per second.
PUBLISHED_THROUGHPUT = ((2500, 16000), (224.0, 199.0))


def _answers() -> dict[str, dict]:
    qwen = hy.qwen35_9b_config()
    # exercise ex-hy-128k: a grouped-query model (28 layers, 4 KV heads of 128, bf16) at
    # 128,000 tokens, against Mamba-2 states (28 layers of 112 heads, N = 128, P = 64, float32).
    kv_128k = costs.kv_cache_bytes(128_000, n_layers=28, n_kv_heads=4, head_dim=128, bytes_per_element=2)
    state_m2 = costs.linear_state_bytes(n_layers=28, n_heads=112, d_k=128, d_v=64, bytes_per_element=4)
    a, b = tm.fit_time_model(*PUBLISHED_THROUGHPUT)
    qwen_all = hy.all_attention(qwen)
    a_all, b_all = tm.all_attention_time_model(qwen, a, b)
    return {
        "ex-hy-kv-factor": dict(
            value=hy.stack_kv_cache_bytes(qwen_all, 128_000) / hy.stack_kv_cache_bytes(qwen, 128_000),
            tolerance=1e-9, relative=False, what="the factor by which the hybrid's KV cache is smaller"),
        "ex-hy-crossover": dict(
            value=costs.crossover_length(96, 64, 64), tolerance=1, relative=False,
            what="the shortest sequence at which linear attention's core is cheaper (r = 96, d = 64)"),
        "ex-hy-128k-kv-gb": dict(
            value=kv_128k / 1e9, tolerance=0.01, relative=True,
            what="the KV cache at 128,000 tokens, in GB (1 GB = 1e9 bytes)"),
        "ex-hy-128k-state-mb": dict(
            value=state_m2 / 1e6, tolerance=0.01, relative=True,
            what="the Mamba-2 states of all 28 layers, in MB (1 MB = 1e6 bytes)"),
        "ex-hy-128k-ratio": dict(
            value=kv_128k / state_m2, tolerance=0.01, relative=True,
            what="how many times larger the KV cache is than the fixed state"),
        "ex-hy-share-16k": dict(
            value=tm.attention_time_share(a, b, 16_000), tolerance=0.005, relative=False,
            what="the share of the time per token that grows with the context, at 16k"),
        "ex-hy-predict-128k": dict(
            value=tm.predicted_tokens_per_second(a, b, 128_000), tolerance=0.02, relative=True,
            what="the predicted throughput of the hybrid at 128k tokens, in tokens/s"),
        "ex-hy-all-attention-16k": dict(
            value=tm.predicted_tokens_per_second(a_all, b_all, 16_000), tolerance=0.02, relative=True,
            what="the predicted throughput of an all-attention model of the same shape at 16k"),
    }


ANSWERS = _answers()


def check_answer(label: str, value) -> CheckResult:
    """Check a numeric answer against :data:`ANSWERS` (computed by the package) within its tolerance."""
    return check_numeric(label, value, ANSWERS)


# ---------------------------------------------------------------------------
# Coding exercise: the KV cache of a configuration
# ---------------------------------------------------------------------------

def _kv_cases():
    qwen = hy.qwen35_9b_config()
    small = hy.HybridConfig(n_layers=12, d_model=768, d_ff=2048, vocab_size=50_000,
                            attention_layers=(2, 5, 11), n_heads=12, n_kv_heads=4, head_dim=64,
                            n_linear_heads=12, n_linear_key_heads=6, linear_key_dim=64,
                            linear_value_dim=64, bytes_per_element=4, name="small GQA stack")
    return [(qwen, 16_000, "the Qwen3.5-9B-style configuration at 16,000 tokens"),
            (small, 4096, "a 12-layer stack with attention in layers 2, 5 and 11, fp32, 4,096 tokens"),
            (hy.all_linear(small), 4096, "the same stack with no attention layer, 4,096 tokens"),
            (qwen, 0, "the Qwen3.5-9B-style configuration with an empty context")]


def _kv_wrong_answers(config, n):
    """Plausible wrong answers and what each one means."""
    per_token = lambda layers, heads, factor, bpe: factor * n * layers * heads * config.head_dim * bpe
    na, h, hkv, bpe = config.n_attention_layers, config.n_heads, config.n_kv_heads, config.bytes_per_element
    return [
        (per_token(config.n_layers, hkv, 2, bpe),
         "it matches a KV cache in every layer: only the full-attention layers "
         "(config.attention_layers) keep one; the linear layers keep a fixed state instead"),
        (per_token(na, hkv, 1, bpe), "it is half the expected value: the cache stores a key AND a "
                                     "value per token, per KV head, per layer (the factor 2)"),
        (per_token(na, h, 2, bpe), "it counts the query heads (config.n_heads): the cache holds one key and "
                                   "value per KV head (config.n_kv_heads), shared by a group of query heads"),
        (per_token(na, hkv, 2, 1), "it counts stored numbers, not bytes: multiply by "
                                   "config.bytes_per_element"),
    ]


def check_kv_cache_at(kv_cache_at) -> CheckResult:
    """Check ``kv_cache_at(config, context_len) -> bytes`` against equation ``eq-hy-kv``."""

    def body():
        results = []
        for config, n, case in _kv_cases():
            got = call_student(kv_cache_at, config, n, case=case)
            try:
                value = float(got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected a number of bytes, got {type(got).__name__}") from None
            results.append((config, n, case, value, float(hy.stack_kv_cache_bytes(config, n))))

        def close(x, y):
            return abs(x - y) <= 1e-9 * max(1.0, abs(y))

        wrong = [r for r in results if not close(r[3], r[4])]
        if not wrong:
            return ("the KV cache is counted in the attention layers only, keys and values, "
                    "per KV head, in bytes")
        # a mistake is named only when it explains every case (the cases are chosen so
        # that the mistakes give different numbers on at least one of them)
        n_variants = len(_kv_wrong_answers(results[0][0], results[0][1]))
        for i in range(n_variants):
            meaning = _kv_wrong_answers(results[0][0], results[0][1])[i][1]
            if all(close(value, _kv_wrong_answers(config, n)[i][0])
                   for config, n, _, value, _ in results):
                config, n, case, value, expected = wrong[0]
                raise Failure(f"on {case}: got {value:.6g} bytes, expected {expected:.6g}; {meaning}")
        config, n, case, value, expected = wrong[0]
        raise Failure(f"on {case}: expected {expected:.6g} bytes, got {value:.6g}")

    return run_check("ex-hy-kv-cache", body)


# ---------------------------------------------------------------------------
# Coding exercise: the two-point time model
# ---------------------------------------------------------------------------

def _time_cases():
    return [(PUBLISHED_THROUGHPUT, "the published points (2,500 tokens: 224 tok/s; 16,000: 199 tok/s)"),
            (((16000, 2500), (199.0, 224.0)), "the same two points in the other order"),
            (((1000, 9000), (50.0, 40.0)), "1,000 tokens: 50 tok/s; 9,000 tokens: 40 tok/s")]


def check_fit_time_model(fit_time_model) -> CheckResult:
    """Check ``fit_time_model(context_lengths, tokens_per_second) -> (a, b)`` (``eq-hy-time-model``)."""

    def body():
        for (lengths, rates), case in _time_cases():
            got = call_student(fit_time_model, list(lengths), list(rates), case=case)
            try:
                a, b = (float(x) for x in got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected a pair (a, b) of numbers, got {got!r}") from None
            ea, eb = tm.fit_time_model(lengths, rates)
            if np.isclose(a, ea, rtol=1e-9, atol=0) and np.isclose(b, eb, rtol=1e-9, atol=0):
                continue
            (l1, l2), (r1, r2) = lengths, rates
            slope_rate = (r2 - r1) / (l2 - l1)
            if np.isclose(b, slope_rate, rtol=1e-9) and np.isclose(a, r1 - slope_rate * l1, rtol=1e-9):
                raise Failure(f"on {case}: you fitted a line to the throughput (tokens/s); the model is "
                              "linear in the time per token, t = 1 / throughput")
            if np.isclose(a, eb, rtol=1e-9) and np.isclose(b, ea, rtol=1e-9):
                raise Failure(f"on {case}: the two numbers are swapped: return (a, b), the fixed "
                              "time first, then the time per token of context")
            if np.isclose(a, 1000 * ea, rtol=1e-9) and np.isclose(b, 1000 * eb, rtol=1e-9):
                raise Failure(f"on {case}: the values are in milliseconds; return seconds")
            if np.isclose(a, ea + eb * l1, rtol=1e-6) and not np.isclose(eb * l1, 0):
                raise Failure(f"on {case}: a is the time at the first length; a is the time at "
                              "context length 0, a = t_1 - b L_1")
            raise Failure(f"on {case}: expected a = {ea:.6g} s and b = {eb:.6g} s per token of "
                          f"context, got a = {a:.6g}, b = {b:.6g}")
        return "t(L) = a + b L goes through both measured times per token"

    return run_check("ex-hy-fit-time", body)


# ---------------------------------------------------------------------------
# Challenge problem: the decode-time cost model of a configuration
# ---------------------------------------------------------------------------

_COST_FORMS = (hy.decode_flops_per_token, hy.prefill_flops_per_token, hy.parameter_counts, hy.parameters_per_layer,
               hy.flops_from_parameter_counts, hy.stack_kv_cache_bytes, hy.stack_recurrent_state_bytes,
               hy.stack_conv_state_bytes, hy.stack_state_bytes)


def _cost_configs():
    qwen = hy.qwen35_9b_config()
    small = hy.HybridConfig(n_layers=10, d_model=512, d_ff=1408, vocab_size=32_000, attention_layers=(3, 7),
                            n_heads=8, n_kv_heads=2, head_dim=64, n_linear_heads=8, n_linear_key_heads=4,
                            linear_key_dim=64, linear_value_dim=96, attention_output_gate=True,
                            linear_output_gate=True, bytes_per_element=2, state_bytes_per_element=4,
                            conv_kernel_size=4, name="a 10-layer stack with gates and a short convolution")
    return [(qwen, 16_000, "the Qwen3.5-9B-style configuration at 16,000 tokens"),
            (small, 5_000, "a 10-layer stack (attention in layers 3 and 7, 8 query heads on 2 KV heads, "
                           "output gates, fp32 states, a 4-tap convolution) at 5,000 tokens"),
            (hy.all_linear(small), 5_000, "the same stack with no attention layer, 5,000 tokens"),
            (hy.all_attention(small), 5_000, "the same stack with attention in every layer, 5,000 tokens"),
            (small, 0, "the 10-layer stack with an empty context")]


def _flops_slips(c, L):
    """Plausible wrong FLOP counts and what each means."""
    right = hy.decode_flops_per_token(c, L)
    attn_core = c.n_attention_layers * c.n_heads * costs.softmax_decode_flops(L, c.head_dim, c.head_dim)
    delta = c.n_linear_layers * c.n_linear_heads * 2 * c.linear_key_dim * c.linear_value_dim
    vocab = 2 * c.vocab_size * c.d_model
    kv_core = c.n_attention_layers * c.n_kv_heads * costs.softmax_decode_flops(L, c.head_dim, c.head_dim)
    return [
        (right - delta, "the linear layers' core misses the recall S^T k that the delta correction needs: "
                        "2 d_k d_v per value head besides the write and the readout (4 d_k d_v)"),
        (right - attn_core + kv_core, "the attention core is counted per KV head; every QUERY head scores the "
                                      "whole cache (n_heads, not n_kv_heads)"),
        (right - vocab, "the output projection over the vocabulary is missing: 2 vocab_size d_model FLOPs per "
                        "token"),
        (right + vocab, "the input embedding is counted: it is a lookup, not a matrix product"),
        (right / 2, "half: a multiply-add counts 2 FLOPs, so each weight costs 2 FLOPs per token"),
        (right - attn_core, "the attention core is missing: each query head costs 2 L (d_k + d_v) with L the "
                            "context (the new token included)"),
        (right + attn_core * c.n_linear_layers / max(c.n_attention_layers, 1) if c.n_attention_layers else None,
         "the attention core is counted in every layer; the linear layers have a fixed-state core instead"),
    ]


def _memory_slips(c, L):
    kv = hy.stack_kv_cache_bytes(c, L)
    rec = hy.stack_recurrent_state_bytes(c)
    conv = hy.stack_conv_state_bytes(c)
    per_layer_kv = kv / c.n_attention_layers if c.n_attention_layers else 0
    rec_at_kv_width = rec * c.bytes_per_element / c.state_bytes_per_element
    return [
        (kv + rec, "the short-convolution buffers are missing: each linear layer keeps the last K - 1 inputs "
                   "of its conv_dim channels"),
        (kv / 2 + rec + conv, "the KV cache is half: every KV head stores a key AND a value per token"),
        (kv + rec_at_kv_width + conv, "the recurrent states are counted at bytes_per_element; they are kept at "
                                      "state_bytes_per_element"),
        (per_layer_kv * c.n_layers + rec + conv, "the KV cache is counted in every layer; only the "
                                                 "attention layers keep one"),
        (kv, "the fixed states of the linear layers are missing (recurrent states and convolution buffers)"),
        (kv * c.n_heads / c.n_kv_heads + rec + conv, "the KV cache is counted per query head; grouped-query "
                                                     "attention keeps one per KV head"),
    ]


def check_decode_cost(decode_cost) -> CheckResult:
    """Check ``decode_cost(config, context_len) -> (flops_per_token, memory_bytes)``.

    ``flops_per_token``: the FLOPs to generate one token at context ``L``
    (:func:`fixedstate.hybrid.decode_flops_per_token`, ``eq-hy-decode-flops``);
    ``memory_bytes``: what the stack holds for the sequence while generating, the
    KV cache plus the fixed states (``eq-hy-kv`` plus ``eq-hy-state``). Cases: the
    Qwen3.5-9B-style configuration, a small stack with gates, fp32 states and a
    short convolution, its all-linear and all-attention variants, an empty context.
    """

    def body():
        for c, L, case in _cost_configs():
            got = call_without(decode_cost, _COST_FORMS, c, L, case=case)
            try:
                flops, memory = (float(x) for x in got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected a pair (flops_per_token, memory_bytes) of numbers, got "
                              f"{got!r}") from None
            want_f = float(hy.decode_flops_per_token(c, L))
            want_m = float(hy.stack_kv_cache_bytes(c, L) + hy.stack_state_bytes(c))

            def close(x, y):
                return y is not None and abs(x - y) <= 1e-9 * max(1.0, abs(y))

            if not close(flops, want_f):
                for wrong, meaning in _flops_slips(c, L):
                    if close(flops, wrong) and not close(wrong, want_f):
                        raise Failure(f"the FLOPs on {case}: got {flops:.6g}, expected {want_f:.6g}; {meaning}")
                raise Failure(f"the FLOPs on {case}: expected {want_f:.6g} per token, got {flops:.6g} "
                              f"({(flops - want_f) / want_f:+.2%})")
            if not close(memory, want_m):
                for wrong, meaning in _memory_slips(c, L):
                    if close(memory, wrong) and not close(wrong, want_m):
                        raise Failure(f"the memory on {case}: got {memory:.6g} bytes, expected {want_m:.6g}; "
                                      f"{meaning}")
                raise Failure(f"the memory on {case}: expected {want_m:.6g} bytes, got {memory:.6g}")
        return ("FLOPs per generated token and the memory held while decoding agree with the package for "
                "grouped-query, gated, all-linear and all-attention stacks and an empty context")

    return run_check("ex-hy-decode-cost", body)
