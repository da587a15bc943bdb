"""Tests of fixedstate.checks.family: right answers pass, starters and the usual wrong answers fail with
the message that names the slip."""

import numpy as np
import pytest

from fixedstate import ssm
from fixedstate.checks import family as F


# --------------------------------------------------------------------------- the table row

@pytest.mark.parametrize("row", [
    {"transition": "diagonal", "gate": "channel", "state_size": 4096},
    {"transition": "Diagonal", "gate": "per-channel", "state_size": 4096.0},
    {"transition": " DIAGONAL ", "gate": "Channel", "state_size": 64 * 64},
])
def test_table_row_right_answers_pass(row):
    assert F.check_table_row(row).passed


@pytest.mark.parametrize("row,phrase", [
    (..., "no answer yet"),
    ({"transition": ..., "gate": ..., "state_size": ...}, "still `...`"),
    ([1, 2], "expected a dict"),
    ({"transition": "diagonal"}, "'gate'"),
    ({"transition": "scalar", "gate": "channel", "state_size": 4096}, "one entry per key channel"),
    ({"transition": "identity plus low rank", "gate": "channel", "state_size": 4096}, "no erase term"),
    ({"transition": "tridiagonal", "gate": "channel", "state_size": 4096}, "not one of the table's"),
    ({"transition": "diagonal", "gate": "token", "state_size": 4096}, "differs per channel"),
    ({"transition": "diagonal", "gate": "nothing", "state_size": 4096}, "computed from the token"),
    ({"transition": "diagonal", "gate": "channel", "state_size": 64}, "d_k x d_v matrix"),
    ({"transition": "diagonal", "gate": "channel", "state_size": 128}, "d_k x d_v matrix"),
    ({"transition": "diagonal", "gate": "channel", "state_size": 8192}, "bonus u is a parameter"),
    ({"transition": "diagonal", "gate": "channel", "state_size": 1000}, "count the entries"),
    ({"transition": "diagonal", "gate": "channel", "state_size": "many"}, "expected a number"),
])
def test_table_row_wrong_answers_are_named(row, phrase):
    result = F.check_table_row(row)
    assert not result.passed and phrase in result.message, result.message


# --------------------------------------------------------------------------- DeltaProduct step

def _product(state, keys, values, betas, order=None, parallel=False, erase=True, use_beta=True):
    S = np.array(state, dtype=float)
    old = S.copy()
    for j in (range(len(betas)) if order is None else order):
        b = betas[j] if use_beta else 1.0
        read = (old if parallel else S).T @ keys[j] if erase else 0.0
        S = S + b * np.outer(keys[j], values[j] - read)
    return S


def test_deltaproduct_step_right_answer_passes():
    assert F.check_deltaproduct_step(_product).passed


@pytest.mark.parametrize("fn,phrase", [
    (lambda S, K, V, b: ..., "replace the `...`"),
    (lambda S, K, V, b: None, "returned None"),
    (lambda S, K, V, b: _product(S, K, V, b, order=range(len(b) - 1, -1, -1)), "reverse order"),
    (lambda S, K, V, b: _product(S, K, V, b, parallel=True), "in parallel"),
    (lambda S, K, V, b: _product(S, K, V, b, erase=False), "additive writes"),
    (lambda S, K, V, b: _product(S, K, V, b, use_beta=False), "betas are ignored"),
    (lambda S, K, V, b: _product(S, K, V, b).T, "the transpose"),
    (lambda S, K, V, b: _product(S, K, V, b) * np.inf, "inf or nan"),
    (lambda S, K, V, b: _product(S, K, V, b) + 1e-3, "largest difference"),
    (lambda S, K, V, b: 1 / 0, "ZeroDivisionError"),
])
def test_deltaproduct_step_wrong_answers_are_named(fn, phrase):
    result = F.check_deltaproduct_step(fn)
    assert not result.passed and phrase in result.message, result.message


# --------------------------------------------------------------------------- one chunk of the chunked SSD

def _chunk(x, delta, a, B, C, S, *, gamma=True, values=True, carry=True):
    b = np.cumsum(a * delta)
    L = np.tril(np.exp(b[:, None] - b[None, :]))
    V = delta[:, None] * x if values else x
    G = np.exp(b) if gamma else np.ones_like(b)
    y = (L * (C @ B.T)) @ V + G[:, None] * (C @ S)
    S_out = (np.exp(b[-1]) * S if carry else 0.0) + B.T @ (np.exp(b[-1] - b)[:, None] * V)
    return y, S_out


def test_ssd_chunk_step_right_answer_passes():
    assert F.check_ssd_chunk_step(_chunk).passed


@pytest.mark.parametrize("fn,phrase", [
    (lambda *args: ..., "replace the `...`"),
    (lambda *args: _chunk(*args)[0], "expected a pair"),
    (lambda x, d, a, B, C, S: (_chunk(x, d, a, B, C, 0 * S)[0], _chunk(x, d, a, B, C, S)[1]), "intra-chunk part only"),
    (lambda *args: _chunk(*args, gamma=False), "lacks the decay"),
    (lambda *args: _chunk(*args, values=False), "not delta_t x_t"),
    (lambda *args: _chunk(*args, carry=False), "forgets the state"),
])
def test_ssd_chunk_step_wrong_answers_are_named(fn, phrase):
    result = F.check_ssd_chunk_step(fn)
    assert not result.passed and phrase in result.message, result.message


# --------------------------------------------------------------------------- challenge: steps 2-4

def _interchunk(x, delta, a, B, C, Q, initial_state=None, *, leaving=False, gamma="through", use_init=True,
                values=True):
    T, P = x.shape
    S = np.zeros((B.shape[1], P)) if initial_state is None or not use_init else np.array(initial_state)
    y = np.empty((T, P))
    V = delta[:, None] * x if values else x
    for start in range(0, T, Q):
        c = slice(start, start + Q)
        b = np.cumsum(a * delta[c])
        S_next = np.exp(b[-1]) * S + B[c].T @ (np.exp(b[-1] - b)[:, None] * V[c])
        G = {"through": np.exp(b), "none": np.ones_like(b), "before": np.exp(b - a * delta[c])}[gamma]
        y[c] = G[:, None] * (C[c] @ (S_next if leaving else S))
        S = S_next
    return y, S


def test_ssd_interchunk_right_answer_passes():
    assert F.check_ssd_interchunk(_interchunk).passed


@pytest.mark.parametrize("fn,phrase", [
    (lambda *args, **kw: ..., "replace the `...`"),
    (lambda *args, **kw: ssm.ssd_chunkwise(*args[:5], chunk_size=args[5], **kw), "package's own implementation"),
    (lambda *args, **kw: (ssm.ssd_recurrent(*args[:5], **kw)[0], _interchunk(*args, **kw)[1]),
     "package's own implementation"),
    (lambda *args, **kw: _interchunk(*args, **kw, leaving=True), "LEAVING"),
    (lambda *args, **kw: _interchunk(*args, **kw, gamma="none"), "lacks the decay"),
    (lambda *args, **kw: _interchunk(*args, **kw, gamma="before"), "Gamma_{t-1}"),
    (lambda *args, **kw: _interchunk(*args, **kw, use_init=False), "initial state is ignored"),
    (lambda *args, **kw: _interchunk(*args, **kw, values=False), "not delta_t x_t"),
    (lambda *args, **kw: (_interchunk(*args, **kw)[0] * np.nan, None), "inf or nan"),
])
def test_ssd_interchunk_wrong_answers_are_named(fn, phrase):
    result = F.check_ssd_interchunk(fn)
    assert not result.passed and phrase in result.message, result.message


def test_ssd_interchunk_whole_output_is_recognised():
    def whole(x, delta, a, B, C, Q, initial_state=None):
        y, S = _interchunk(x, delta, a, B, C, Q, initial_state)
        intra = np.concatenate([_chunk(x[s:s + Q], delta[s:s + Q], a, B[s:s + Q], C[s:s + Q],
                                       np.zeros((B.shape[1], x.shape[1])))[0] for s in range(0, len(x), Q)])
        return y + intra, S
    result = F.check_ssd_interchunk(whole)
    assert not result.passed and "whole output" in result.message, result.message


# --------------------------------------------------------------------------- the implicit step

def _implicit_step(state, key, value, beta):
    """The worked answer: the delta rule with the step beta / (1 + beta |k|^2), column by column."""
    beta = np.broadcast_to(np.asarray(beta, dtype=float), (state.shape[1],))
    eps = beta / (1.0 + beta * (key @ key))
    return state - np.outer(key, eps * (state.T @ key - value))


def _implicit_by_solve(state, key, value, beta):
    """Another right answer: solve (I + beta_j k k^T) s_j = s_j_old + beta_j v_j k for each column."""
    beta = np.broadcast_to(np.asarray(beta, dtype=float), (state.shape[1],))
    cols = [np.linalg.solve(np.eye(len(key)) + b * np.outer(key, key), state[:, j] + b * value[j] * key)
            for j, b in enumerate(beta)]
    return np.stack(cols, axis=1)


@pytest.mark.parametrize("fn", [_implicit_step, _implicit_by_solve])
def test_implicit_step_right_answers_pass(fn):
    result = F.check_implicit_step(fn)
    assert result.passed, result.message


def _explicit(state, key, value, beta):
    beta = np.broadcast_to(np.asarray(beta, dtype=float), (state.shape[1],))
    return state - np.outer(key, beta * (state.T @ key - value))


def _no_norm(state, key, value, beta):
    beta = np.broadcast_to(np.asarray(beta, dtype=float), (state.shape[1],))
    return state - np.outer(key, beta / (1 + beta) * (state.T @ key - value))


def _diagonal(state, key, value, beta):
    beta = np.broadcast_to(np.asarray(beta, dtype=float), (state.shape[1],))
    eps = beta / (1.0 + beta * (key @ key))
    return (1.0 - np.outer(key * key, eps)) * state + np.outer(key, eps * value)


def _first_beta(state, key, value, beta):
    b = float(np.ravel(beta)[0])
    return state - np.outer(key, b / (1 + b * (key @ key)) * (state.T @ key - value))


@pytest.mark.parametrize("fn,phrase", [
    (lambda s, k, v, b: ..., "replace the `...`"),
    (_explicit, "explicit step"),
    (_no_norm, "squared length of the key"),
    (_diagonal, "Longhorn's layer"),
    (_first_beta, "first step size"),
    (lambda s, k, v, b: _implicit_step(s, k, v, b).T, "the transpose"),
    (lambda s, k, v, b: _implicit_step(s, k, v, b) * np.nan, "inf or nan"),
    (lambda s, k, v, b: 1.0001 * _implicit_step(s, k, v, b), "largest difference"),
])
def test_implicit_step_wrong_answers_are_named(fn, phrase):
    result = F.check_implicit_step(fn)
    assert not result.passed and phrase in result.message, result.message
