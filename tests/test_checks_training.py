"""The exercise checks of chap-training pass the reference answers and name each plausible mistake."""

import numpy as np

from fixedstate import linear_attention as la
from fixedstate.checks import training as ck


def test_the_cross_entropy_answer_is_softmax_minus_one_hot():
    z = ck.XENT_LOGITS
    p = np.exp(z) / np.exp(z).sum()
    want = p - np.eye(3)[ck.XENT_TARGET]
    np.testing.assert_allclose(ck.ANSWERS["ex-tr-xent-grad"]["value"], want, rtol=1e-12)
    assert ck.check_answer("ex-tr-xent-grad", np.round(want, 3)).passed
    assert not ck.check_answer("ex-tr-xent-grad", -want).passed
    assert not ck.check_answer("ex-tr-xent-grad", ...).passed


def _mean(runs, mixer, d_model, n_pairs):
    a = [0.0 if r["diverged"] else r["test_accuracy"] for r in runs
         if r["mixer"] == mixer and r["d_model"] == d_model and r["n_pairs"] == n_pairs]
    return float(np.mean(a))


def test_mean_accuracy_check_passes_the_mean_and_names_the_slips():
    runs = ck.made_up_runs()
    assert ck.check_mean_accuracy(_mean, runs).passed

    def skips_diverged(runs, mixer, d_model, n_pairs):
        return float(np.mean([r["test_accuracy"] for r in runs if not r["diverged"] and r["mixer"] == mixer
                              and r["d_model"] == d_model and r["n_pairs"] == n_pairs]))

    res = ck.check_mean_accuracy(skips_diverged)
    assert not res.passed and "diverged" in res.message

    def median(runs, mixer, d_model, n_pairs):
        return float(np.median([0.0 if r["diverged"] else r["test_accuracy"] for r in runs if r["mixer"] == mixer
                                and r["d_model"] == d_model and r["n_pairs"] == n_pairs]))

    res = ck.check_mean_accuracy(median)
    assert not res.passed and "median" in res.message
    assert not ck.check_mean_accuracy(lambda *a: None).passed


def _right(q, k, v, S_prev, d_o, d_S):
    dS = d_S + np.outer(q, d_o)
    return (S_prev + np.outer(k, v)) @ d_o, dS @ v, dS.T @ k, dS


def test_step_backward_check_passes_the_solution_and_diagnoses_mistakes():
    assert ck.check_step_backward(_right).passed

    def old_state(q, k, v, S_prev, d_o, d_S):
        dq, dk, dv, dS = _right(q, k, v, S_prev, d_o, d_S)
        return S_prev @ d_o, dk, dv, dS

    res = ck.check_step_backward(old_state)
    assert not res.passed and "before this token's write" in res.message

    def forgets_later(q, k, v, S_prev, d_o, d_S):
        return _right(q, k, v, S_prev, d_o, 0 * d_S)

    res = ck.check_step_backward(forgets_later)
    assert not res.passed and "d_S" in res.message

    def transposed(q, k, v, S_prev, d_o, d_S):
        dq, dk, dv, dS = _right(q, k, v, S_prev, d_o, d_S)
        return dq, dk, dv, dS.T

    res = ck.check_step_backward(transposed)
    assert not res.passed and "shape" in res.message


def test_step_backward_check_refuses_the_package_backward():
    def via_package(q, k, v, S_prev, d_o, d_S):
        dq, dk, dv, _, dS0 = la.linear_attention_backward(q[None], k[None], v[None], d_o[None],
                                                          initial_state=S_prev, d_final_state=d_S)
        return dq[0], dk[0], dv[0], dS0

    res = ck.check_step_backward(via_package)
    assert not res.passed and "package's own implementation" in res.message
