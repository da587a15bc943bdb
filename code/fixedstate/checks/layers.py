"""Checks for the exercises of chapter "The layers as they ship" (chap-shipped-layers).

Numeric answers live in :data:`ANSWERS`, each computed by the package (never
typed in) with its tolerance, and are checked by :func:`check_answer`. The
coding exercise is checked by :func:`check_split_qkvz` (Qwen3-Next's
interleaved input projection as the book's matrices, compared with
:func:`fixedstate.layers.split_qwen3_next_projections`).

Three more coding exercises: :func:`check_dt_bias_for` (the step bias that starts a
gate at a chosen decay, as Mamba's initialisation does, without overflow),
:func:`check_packed_decode` (the gated delta rule over packed sequences, the state
reset at each start, against :func:`fixedstate.packing.varlen_mixer`) and
:func:`check_draft_rollback` (verify drafted tokens and return to the cache after
the accepted ones, against :mod:`fixedstate.serving`).

Challenge problem: :func:`check_mamba2_step` for
``mamba2_step(params, x, cache) -> (y, cache)``, one decode step of the Mamba-2
block (equation ``eq-sl-mamba2``) written from the blocks, compared with
:func:`fixedstate.layers.mamba2_block_step`, which the answer may not call
(nor :func:`fixedstate.layers.mamba2_block`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import blocks as bl
from .. import delta_rule as dr
from .. import layers as fl
from .. import packing, serving
from ._core import CheckResult, Failure, call_student, call_without, check_numeric, run_check

__all__ = ["ANSWERS", "check_answer", "check_split_qkvz", "check_mamba2_step", "check_dt_bias_for",
           "check_packed_decode", "check_draft_rollback", "BUDGET_LAYER"]

#: The layer of exercise ex-sl-budget: a Mamba-2 block of width 2560 (inner width 5120 in
#: 80 heads of 64, N = 128, one group, kernel 4).
BUDGET_LAYER = fl.Mamba2Config(d_model=2560, n_heads=80, head_dim=64, d_state=128, n_groups=1, conv_kernel=4)


def _answers() -> dict[str, dict]:
    n = fl.cache_numbers(BUDGET_LAYER)
    c = BUDGET_LAYER
    return {
        "ex-sl-budget/state": dict(
            value=n["state"], tolerance=0, relative=False, what="numbers in the recurrent state of one layer",
            hints=[(c.n_heads * c.head_dim, "that is one number per channel; each head keeps an N x P matrix"),
                   (c.n_heads * c.d_state, "that is one N-vector per head; each head keeps an N x P matrix")]),
        "ex-sl-budget/conv": dict(
            value=n["conv"], tolerance=0, relative=False, what="numbers in the convolution cache of one layer",
            hints=[(c.conv_kernel * c.conv_dim, "the cache keeps the last K - 1 inputs, not K"),
                   ((c.conv_kernel - 1) * c.d_inner, "the convolution also runs over B and C: "
                                                     "d_inner + 2 G N channels")]),
        "ex-sl-budget/kib": dict(
            value=2 * n["total"] / 1024, tolerance=0.005, relative=True,
            what="the decode state of one layer in bfloat16, in KiB", unit="KiB",
            hints=[(4 * n["total"] / 1024, "that is float32 (4 bytes); bfloat16 takes 2"),
                   (2 * n["total"] / 1000, "1 KiB is 1024 bytes"),
                   (2 * n["state"] / 1024, "add the convolution cache")]),
    }


ANSWERS = _answers()


def check_answer(label: str, value) -> CheckResult:
    """Check a numeric answer against :data:`ANSWERS` (computed by the package) within its tolerance."""
    return check_numeric(label, value, ANSWERS)


# ---------------------------------------------------------------------------
# Coding exercise: Qwen3-Next's interleaved projections
# ---------------------------------------------------------------------------

def _qkvz_cases():
    rng = np.random.default_rng(81)
    cases = []
    for c, what in ((fl.GatedDeltaNetConfig(6, 4, 2, 3, 2), "2 key heads, 4 value heads (r = 2), d_k = 3, d_v = 2"),
                    (fl.GatedDeltaNetConfig(5, 3, 3, 2, 4), "3 key heads, 3 value heads (r = 1), d_k = 2, d_v = 4"),
                    (fl.GatedDeltaNetConfig(4, 6, 2, 2, 3), "2 key heads, 6 value heads (r = 3), d_k = 2, d_v = 3")):
        rows = 2 * c.n_key_heads * c.d_k + 2 * c.n_heads * c.d_v
        cases.append((rng.standard_normal((rows, c.d_model)), c, what))
    return cases


def contiguous_split(W, c):
    """The slip :func:`check_split_qkvz` names: four contiguous blocks [all q | all k | all v | all z] (and transposed).

    Not an answer: the check runs it to find the slip it must name, and its tests pass it in.
    """
    kd, vd = c.n_key_heads * c.d_k, c.n_heads * c.d_v
    cuts = np.cumsum([0, kd, kd, vd, vd])
    return tuple(W[cuts[i]:cuts[i + 1]].T for i in range(4))


def check_split_qkvz(split_qkvz) -> CheckResult:
    """Check ``split_qkvz(weight, config) -> (W_q, W_k, W_v, W_z)``, each ``(d_model, width)``."""

    def body():
        for W, c, what in _qkvz_cases():
            case = f"a weight of shape {W.shape}, {what}"
            got = call_without(split_qkvz, [fl.split_qwen3_next_projections], W.copy(), c, case=case)
            expected = fl.split_qwen3_next_projections(W, np.zeros((2 * c.n_heads, c.d_model)), c)
            try:
                got = tuple(np.asarray(g, dtype=float) for g in got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected four arrays (W_q, W_k, W_v, W_z)") from None
            if len(got) != 4:
                raise Failure(f"on {case}: expected four arrays (W_q, W_k, W_v, W_z), got {len(got)}")
            for name, g in zip(("W_q", "W_k", "W_v", "W_z"), got):
                e = expected[name]
                transposed = g.shape != e.shape or (np.array_equal(g, e.T) and not np.array_equal(g, e))
                if g.shape == e.shape[::-1] and transposed:
                    raise Failure(f"on {case}: {name} has shape {g.shape}, the transpose of the expected "
                                  f"{e.shape}: nn.Linear stores (d_out, d_in); the book's matrices are "
                                  "(d_in, d_out)")
                if g.shape != e.shape:
                    raise Failure(f"on {case}: {name} should have shape {e.shape}, got {g.shape}")
                if not np.array_equal(g, e):
                    naive = contiguous_split(W, c)[("W_q", "W_k", "W_v", "W_z").index(name)]
                    if naive.shape == g.shape and np.array_equal(g, naive):
                        raise Failure(f"on {case}: {name} takes a contiguous block of rows; the rows are laid "
                                      "out key head by key head: for each group, its q rows, k rows, then "
                                      "the v rows and z rows of its value heads")
                    raise Failure(f"on {case}: {name} has the right shape but not the right entries (the "
                                  "first mismatch is at column "
                                  f"{int(np.argwhere(~np.isclose(g, e))[0][1])})")
        return "the four matrices are unscrambled group by group and transposed to (d_in, d_out)"

    return run_check("ex-sl-qkvz", body)


# ---------------------------------------------------------------------------
# Coding exercise: the step bias that starts a gate at a chosen decay
# ---------------------------------------------------------------------------

def dt_bias_reference(decay, A_log):
    """``softplus^{-1}(-log(decay) / exp(A_log))``: the bias whose gate starts at ``decay`` (a zero projection)."""
    decay, A_log = np.asarray(decay, dtype=float), np.asarray(A_log, dtype=float)
    return bl.inverse_softplus(-np.log(decay) / np.exp(A_log))


def _dt_bias_cases():
    return [(np.array([0.5, 0.9, 0.99, 0.999]), np.zeros(4), "decays 0.5 to 0.999 with a = -1"),
            (np.array([0.9, 0.9, 0.9]), np.log([1.0, 4.0, 16.0]), "decay 0.9 with -a = 1, 4, 16"),
            (np.array([1e-300, 1 - 1e-12, 0.3]), np.array([-1.0, 2.0, 0.0]),
             "a decay of 1e-300 with -a = exp(-1) (a step of about 1,900), one of 1 - 1e-12, and 0.3")]


def check_dt_bias_for(dt_bias_for) -> CheckResult:
    """Check ``dt_bias_for(decay, A_log) -> dt_bias``: ``exp(-exp(A_log) softplus(dt_bias)) = decay``."""

    def body():
        for decay, A_log, what in _dt_bias_cases():
            case = f"{what}"
            got = call_without(dt_bias_for, [bl.inverse_softplus], decay.copy(), A_log.copy(), case=case)
            try:
                got = np.asarray(got, dtype=float)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected an array of biases") from None
            want = dt_bias_reference(decay, A_log)
            if got.shape != want.shape:
                raise Failure(f"on {case}: expected shape {want.shape}, got {got.shape}")
            if not np.all(np.isfinite(got)):
                raise Failure(f"on {case}: some biases are not finite: log(exp(delta) - 1) overflows for a large "
                              "step; write it as delta + log(1 - exp(-delta)) (np.log(-np.expm1(-delta)))")
            if not np.allclose(got, want, rtol=1e-9, atol=1e-12):
                step = -np.log(decay)
                if np.allclose(got, bl.inverse_softplus(step), rtol=1e-9, atol=1e-12):
                    raise Failure(f"on {case}: the step must be divided by -a = exp(A_log): the decay is "
                                  "exp(a delta), with a = -exp(A_log)")
                if np.allclose(got, np.log(step / np.exp(A_log)), rtol=1e-9, atol=1e-12):
                    raise Failure(f"on {case}: that is log(delta); the bias goes through a softplus, so invert "
                                  "the softplus: log(exp(delta) - 1)")
                raise Failure(f"on {case}: softplus(dt_bias) should be -log(decay) / exp(A_log)")
        return "the biases start every gate at its decay, without overflow"

    return run_check("ex-sl-dt-bias", body)


# ---------------------------------------------------------------------------
# Coding exercise: packed sequences
# ---------------------------------------------------------------------------

def _packed_cases():
    rng = np.random.default_rng(83)
    cases = []
    for lengths, lead, what in (([3, 5], (), "two sequences of 3 and 5 tokens"),
                                ([1, 4, 2], (2,), "three sequences of 1, 4 and 2 tokens, 2 heads"),
                                ([6], (), "one sequence of 6 tokens")):
        T = sum(lengths)
        q = rng.standard_normal(lead + (T, 3))
        k = bl.l2_normalize(rng.standard_normal(lead + (T, 3)))
        v = rng.standard_normal(lead + (T, 2))
        beta, log_gate = rng.uniform(0.1, 0.9, lead + (T,)), -rng.exponential(0.3, lead + (T,))
        cases.append((q, k, v, beta, log_gate, np.concatenate([[0], np.cumsum(lengths)]), what))
    return cases


def _packed_expected(q, k, v, beta, log_gate, cu):
    return packing.varlen_mixer("gated_delta", q, k, v, {"beta": beta, "log_gate": log_gate}, cu_seqlens=cu,
                                form="recurrent")


def check_packed_decode(packed_decode) -> CheckResult:
    """Check ``packed_decode(q, k, v, beta, log_gate, cu_seqlens) -> (outputs, final_states)``."""

    def body():
        for q, k, v, beta, log_gate, cu, what in _packed_cases():
            case = f"{what} (cu_seqlens {cu.tolist()})"
            got = call_without(packed_decode, [packing.varlen_mixer], q.copy(), k.copy(), v.copy(), beta.copy(),
                               log_gate.copy(), cu.copy(), case=case)
            try:
                o, S = (np.asarray(a, dtype=float) for a in got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected (outputs, final_states)") from None
            o_exp, S_exp = _packed_expected(q, k, v, beta, log_gate, cu)
            if o.shape != o_exp.shape:
                raise Failure(f"on {case}: outputs should have shape {o_exp.shape}, got {o.shape}")
            if not np.allclose(o, o_exp, rtol=1e-10, atol=1e-12):
                carried, _ = dr.gated_delta_rule_recurrent(q, k, v, beta=beta, log_gate=log_gate)
                if np.allclose(o, carried, rtol=1e-10, atol=1e-12):
                    raise Failure(f"on {case}: the outputs are those of one long sequence: set the state to zero "
                                  "where each sequence starts (at every offset of cu_seqlens but the last)")
                first = int(np.argwhere(~np.isclose(o, o_exp).all(axis=-1).reshape(-1, o.shape[-2]).all(axis=0))[0][0])
                raise Failure(f"on {case}: the outputs differ first at packed token {first}")
            if S.shape != S_exp.shape:
                raise Failure(f"on {case}: final_states should have shape {S_exp.shape} (one state per sequence, "
                              f"stacked on a new first axis), got {S.shape}")
            if not np.allclose(S, S_exp, rtol=1e-10, atol=1e-12):
                raise Failure(f"on {case}: the outputs are right but the final states are not: keep the state "
                              "each sequence ends with, after its last token")
        return "every sequence starts from a zero state, and each one's final state is kept"

    return run_check("ex-sl-packed", body)


# ---------------------------------------------------------------------------
# Coding exercise: rolling back after rejected speculative tokens
# ---------------------------------------------------------------------------

def _rollback_cases():
    rng = np.random.default_rng(84)
    cases = []
    for c, k, j, what in ((fl.GatedDeltaNetConfig(6, 2, 1, 3, 2), 3, 1, "3 drafted tokens, 1 accepted"),
                          (fl.GatedDeltaNetConfig(6, 4, 2, 2, 2, conv_kernel=3), 4, 0, "4 drafted, none accepted"),
                          (fl.GatedDeltaNetConfig(5, 2, 2, 2, 3), 2, 2, "2 drafted, both accepted")):
        p = fl.init_gated_deltanet(c, rng)
        _, cache = fl.gated_deltanet(p, rng.standard_normal((4, c.d_model)))
        cases.append((p, cache, rng.standard_normal((k, c.d_model)), j, what))
    return cases


def check_draft_rollback(draft_rollback) -> CheckResult:
    """Check ``draft_rollback(params, cache, x_draft, accepted) -> (y_draft, cache_after_accepted)``.

    Both of the chapter's strategies pass (snapshots, or the cache before the draft and
    the accepted tokens run again): the check compares results, not how often the
    layer's step ran, which the hidden grader, seeing only the returned data, could not
    check either.
    """

    def body():
        for p, cache, x, j, what in _rollback_cases():
            case = what
            given = {"conv": cache["conv"].copy(), "state": cache["state"].copy()}
            got = call_without(draft_rollback, [serving.verify_draft, serving.rollback], p, given, x.copy(), j,
                               case=case)
            y_exp, kept = serving.verify_draft(p, x, cache)
            back = serving.rollback(p, kept, j)
            try:
                y, new = got
                y = np.asarray(y, dtype=float)
                conv, state = np.asarray(new["conv"], dtype=float), np.asarray(new["state"], dtype=float)
            except (TypeError, ValueError, KeyError, IndexError):
                raise Failure(f"on {case}: expected (y_draft, cache) with cache a dict of 'conv' and 'state'") from None
            if y.shape != y_exp.shape or not np.allclose(y, y_exp, rtol=1e-10, atol=1e-12):
                raise Failure(f"on {case}: y_draft should be the layer's outputs on the {x.shape[0]} drafted tokens, "
                              f"shape {y_exp.shape}, one decode step each")
            live = serving.rollback(p, kept, x.shape[0])
            for part, got_part in (("state", state), ("conv", conv)):
                if got_part.shape != back[part].shape:
                    raise Failure(f"on {case}: cache['{part}'] should have shape {back[part].shape}, "
                                  f"got {got_part.shape}")
                if not np.allclose(got_part, back[part], rtol=1e-10, atol=1e-12):
                    if j < x.shape[0] and np.allclose(got_part, live[part], rtol=1e-10, atol=1e-12):
                        raise Failure(f"on {case}: cache['{part}'] is the one after all the drafted tokens; roll "
                                      f"it back to the one after the {j} accepted")
                    raise Failure(f"on {case}: cache['{part}'] should be the one after the {j} accepted "
                                  "tokens (the convolution cache too: the last K - 1 inputs up to them)")
        return "the drafted outputs, and the cache after exactly the accepted tokens"

    return run_check("ex-sl-rollback", body)


# ---------------------------------------------------------------------------
# Challenge problem: the Mamba-2 decode step
# ---------------------------------------------------------------------------

def _mamba2_cases():
    rng = np.random.default_rng(82)
    cases = []
    for c, batch, what in ((fl.Mamba2Config(8, 4, 3, 5, n_groups=2), (), "one sequence, 4 heads in 2 groups"),
                           (fl.Mamba2Config(6, 3, 2, 4, n_groups=1, conv_bias=False), (2,),
                            "a batch of 2, 3 heads in 1 group, no convolution bias"),
                           (fl.Mamba2Config(8, 6, 2, 3, n_groups=3, conv_kernel=3), (2,),
                            "a batch of 2, 6 heads in 3 groups, kernel 3")):
        p = fl.init_mamba2(c, rng)
        for key in ("D", "norm_weight"):
            p[key] = p[key] + rng.uniform(-0.5, 0.5, p[key].shape)
        prefix = rng.standard_normal(batch + (5, c.d_model))
        _, cache = fl.mamba2_block(p, prefix)
        cases.append((p, rng.standard_normal(batch + (c.d_model,)), cache, what))
    return cases


def _mamba2_slips(p, x, cache):
    """What the likely slips give: pairs (what went wrong, y)."""
    no_skip = dict(p, D=np.zeros_like(p["D"]))
    one_weight = dict(p, norm_weight=np.ones_like(p["norm_weight"]))
    norm_first = dict(p, config=dataclasses.replace(p["config"], norm_before_gate=True))
    y_norm_first = fl.mamba2_block_step(norm_first, x, cache)[0]
    return [("the skip D x is missing: y = S^T C + D x per head", fl.mamba2_block_step(no_skip, x, cache)[0]),
            ("the norm's weight (params['norm_weight']) is missing", fl.mamba2_block_step(one_weight, x, cache)[0]),
            ("the gate comes after the norm; Mamba-2 gates first: RMSNorm(y * SiLU(z)) per group", y_norm_first)]


def check_mamba2_step(mamba2_step) -> CheckResult:
    """Check ``mamba2_step(params, x, cache) -> (y, cache)`` against :func:`fixedstate.layers.mamba2_block_step`."""

    def body():
        for p, x, cache, what in _mamba2_cases():
            c = p["config"]
            case = f"{what} (x of shape {x.shape})"
            given = {"conv": cache["conv"].copy(), "state": cache["state"].copy()}
            got = call_without(mamba2_step, [fl.mamba2_block_step, fl.mamba2_block], p, x.copy(), given,
                               case=case)
            y_exp, cache_exp = fl.mamba2_block_step(p, x, cache)
            if not np.array_equal(given["conv"], cache["conv"]) or not np.array_equal(given["state"], cache["state"]):
                raise Failure(f"on {case}: your function changed the cache it was given in place; return a new one")
            try:
                y, new = got
                y = np.asarray(y, dtype=float)
                conv, state = np.asarray(new["conv"], dtype=float), np.asarray(new["state"], dtype=float)
            except (TypeError, ValueError, KeyError, IndexError):
                raise Failure(f"on {case}: expected (y, cache) with cache a dict of 'conv' and 'state'") from None
            if state.shape != cache_exp["state"].shape:
                hint = ""
                if state.shape == cache_exp["state"].shape[:-2] + cache_exp["state"].shape[:-3:-1]:
                    hint = (": the transpose; the book's state of a head is N x P (d_k x d_v, read out as "
                            "S^T C), the library's P x N")
                raise Failure(f"on {case}: the new state should have shape {cache_exp['state'].shape}, "
                              f"got {state.shape}{hint}")
            if conv.shape != cache_exp["conv"].shape:
                raise Failure(f"on {case}: the new convolution cache should have shape {cache_exp['conv'].shape} "
                              f"(the last K - 1 inputs of the x, B, C channels), got {conv.shape}")
            if y.shape != y_exp.shape:
                raise Failure(f"on {case}: y should have shape {y_exp.shape}, got {y.shape}")
            if not np.allclose(conv, cache_exp["conv"], rtol=1e-10, atol=1e-12):
                raise Failure(f"on {case}: the convolution cache is wrong: shift it by one token and put the new "
                              "input (the x, B, C part of the projection, before the convolution) last")
            if not np.allclose(state, cache_exp["state"], rtol=1e-10, atol=1e-12):
                raise Failure(f"on {case}: the state is wrong: S = exp(a Delta) S + B (Delta x)^T per head, with "
                              "a = -exp(A_log), Delta = softplus(dt + dt_bias) and head h using group "
                              f"h // (H / G) = h // {c.n_heads // c.n_groups}")
            if not np.allclose(y, y_exp, rtol=1e-10, atol=1e-12):
                for slip, y_slip in _mamba2_slips(p, x, cache):
                    if np.allclose(y, y_slip, rtol=1e-8, atol=1e-10):
                        raise Failure(f"on {case}: the state is right but y is not: {slip}")
                raise Failure(f"on {case}: the state and cache are right but y is not: y = S^T C + D x per head, "
                              "times SiLU(z), RMSNorm per group (the gate first), times norm_weight, then W_out")
        return "one Mamba-2 decode step: convolution cache, SSD state and output all match the package"

    return run_check("ex-sl-mamba2-step", body)
