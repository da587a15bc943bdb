"""The exercise checks of chapter "The layers as they ship": pass on the reference, fail with a
specific message on each plausible wrong answer."""

import numpy as np
import pytest

from fixedstate import blocks as bl
from fixedstate import layers as fl
from fixedstate.checks import layers as ch


# --- numeric answers ----------------------------------------------------------------------

def test_stored_answers_match_independent_arithmetic():
    a = ch.ANSWERS
    state, conv = 80 * 128 * 64, 3 * (80 * 64 + 2 * 1 * 128)     # H N P; (K - 1)(d_inner + 2 G N)
    assert a["ex-sl-budget/state"]["value"] == state
    assert a["ex-sl-budget/conv"]["value"] == conv
    assert a["ex-sl-budget/kib"]["value"] == pytest.approx(2 * (state + conv) / 1024, rel=1e-12)


@pytest.mark.parametrize("label", sorted(ch.ANSWERS))
def test_check_answer_accepts_the_stored_value_and_refuses_a_wrong_one(label):
    value = ch.ANSWERS[label]["value"]
    assert ch.check_answer(label, value).passed
    assert not ch.check_answer(label, value * 1.5 + 2).passed
    assert not ch.check_answer(label, ...).passed


@pytest.mark.parametrize("label, wrong, words", [
    ("ex-sl-budget/state", 80 * 64, "one number per channel"),
    ("ex-sl-budget/conv", 4 * (80 * 64 + 256), "K - 1"),
    ("ex-sl-budget/conv", 3 * 80 * 64, "B and C"),
    ("ex-sl-budget/kib", 4 * (80 * 128 * 64 + 3 * (80 * 64 + 256)) / 1024, "float32"),
    ("ex-sl-budget/kib", 2 * 80 * 128 * 64 / 1024, "convolution cache"),
])
def test_budget_slips_are_named(label, wrong, words):
    result = ch.check_answer(label, wrong)
    assert not result.passed and words in result.message


# --- Qwen3-Next's interleaved projections -------------------------------------------------

def split_qkvz(weight, c):
    r = c.n_heads // c.n_key_heads
    sizes = [c.d_k, c.d_k, r * c.d_v, r * c.d_v]
    groups = np.asarray(weight).reshape(c.n_key_heads, sum(sizes), c.d_model)
    cuts = np.cumsum([0] + sizes)
    return tuple(groups[:, cuts[i]:cuts[i + 1]].reshape(-1, c.d_model).T for i in range(4))


def test_split_check_passes_the_solution_and_names_the_slips():
    assert ch.check_split_qkvz(split_qkvz).passed
    result = ch.check_split_qkvz(lambda w, c: tuple(m.T for m in split_qkvz(w, c)))
    assert not result.passed and "transpose" in result.message
    result = ch.check_split_qkvz(ch.contiguous_split)
    assert not result.passed and "contiguous block" in result.message
    result = ch.check_split_qkvz(lambda w, c: ...)
    assert not result.passed
    result = ch.check_split_qkvz(lambda w, c: fl.split_qwen3_next_projections(w, np.zeros((2 * c.n_heads, c.d_model)), c))
    assert not result.passed


# --- the Mamba-2 decode step ---------------------------------------------------------------

def mamba2_step(params, x, cache, *, gate_first=True, skip=True):
    c = params["config"]
    H, P, N, G = c.n_heads, c.head_dim, c.d_state, c.n_groups
    di = H * P
    proj = bl.linear(x, params["W_in"])
    z, xbc, dt = proj[..., :di], proj[..., di:di + c.conv_dim], proj[..., di + c.conv_dim:]
    u, conv = bl.short_conv_step(xbc, params["conv_weight"], initial_state=cache["conv"], bias=params.get("conv_bias"))
    u = bl.silu(u)
    xi = u[..., :di].reshape(u.shape[:-1] + (H, P))
    B = np.repeat(u[..., di:di + G * N].reshape(u.shape[:-1] + (G, N)), H // G, axis=-2)
    C = np.repeat(u[..., di + G * N:].reshape(u.shape[:-1] + (G, N)), H // G, axis=-2)
    delta = bl.softplus(dt + params["dt_bias"])
    decay = np.exp(-np.exp(params["A_log"]) * delta)[..., None, None]
    state = decay * cache["state"] + B[..., :, None] * (delta[..., None] * xi)[..., None, :]
    y = np.einsum("...np,...n->...p", state, C) + (params["D"][:, None] * xi if skip else 0)
    y = y.reshape(y.shape[:-2] + (di,))
    groups = y.shape[:-1] + (G, di // G)
    y = bl.gated_rms_norm(y.reshape(groups), z.reshape(groups), eps=c.norm_eps,
                          norm_before_gate=not gate_first).reshape(y.shape)
    return bl.linear(y * params["norm_weight"], params["W_out"]), {"conv": conv, "state": state}


def test_mamba2_check_passes_the_solution():
    assert ch.check_mamba2_step(mamba2_step).passed


@pytest.mark.parametrize("wrong, words", [
    (lambda p, x, c: mamba2_step(p, x, c, gate_first=False), "the gate comes after the norm"),
    (lambda p, x, c: mamba2_step(p, x, c, skip=False), "the skip D x is missing"),
    (lambda p, x, c: (lambda y, k: (y, dict(k, state=np.swapaxes(k["state"], -1, -2))))(*mamba2_step(p, x, c)),
     "the transpose"),
    (lambda p, x, c: fl.mamba2_block_step(p, x, c), "the package's own implementation"),
    (lambda p, x, c: ..., "replace the `...`"),
])
def test_mamba2_check_names_the_slips(wrong, words):
    result = ch.check_mamba2_step(wrong)
    assert not result.passed and words in result.message


def test_mamba2_check_refuses_a_step_that_changes_the_cache_in_place():
    def in_place(p, x, cache):
        y, new = mamba2_step(p, x, cache)
        cache["state"][...] = new["state"]
        return y, new

    result = ch.check_mamba2_step(in_place)
    assert not result.passed and "in place" in result.message
