"""Checks for the exercises of "Train it yourself" (chapter 9).

- :func:`check_answer` (``ex-tr-xent-grad``): the gradient of the cross-entropy
  for one position, against :func:`fixedstate.training.cross_entropy_backward`.
- :func:`check_mean_accuracy` (``ex-tr-first-failure``): the mean test accuracy
  over seeds of one configuration of the stored sweep, against the records
  themselves (and on a small made-up list of records, with a diagnosis of the
  usual slips: a median, a sum, runs of another width or pair count let in).
- :func:`check_step_backward` (``ex-tr-step-backward``, the challenge problem):
  the backward pass of one recurrent step of linear attention. The check runs a
  gradient check of the student's step against central finite differences, then
  chains it backwards over a sequence and compares with
  :func:`fixedstate.linear_attention.linear_attention_backward`, and refuses a
  function that calls the package's backward pass.
"""

from __future__ import annotations

import numpy as np

from .. import gradcheck as gc
from .. import linear_attention as la
from .. import training as tr
from ._core import (CheckResult, Failure, call_student, call_without, check_numeric, compare_arrays,
                    has_nonfinite, run_check)

__all__ = ["check_answer", "check_mean_accuracy", "check_step_backward", "ANSWERS", "XENT_LOGITS",
           "XENT_TARGET"]

# ------------------------------------------------------------------ ex-tr-xent-grad

XENT_LOGITS = np.array([2.0, 0.0, -1.0])
XENT_TARGET = 1


def _answers() -> dict:
    z, t = XENT_LOGITS[None, :], np.array([XENT_TARGET])
    grad = tr.cross_entropy_backward(z, t)[0]
    return {
        "ex-tr-xent-grad": {
            "value": grad, "tolerance": 1e-3, "what": "the gradient of the loss with respect to the three logits",
        },
    }


ANSWERS = _answers()


def check_answer(label: str, value) -> CheckResult:
    """Check a numeric answer against :data:`ANSWERS` (computed by the package) within its tolerance."""
    return check_numeric(label, value, ANSWERS)


# ------------------------------------------------------------------ ex-tr-first-failure

def made_up_runs():
    """Hand-made sweep records (two mixers, some diverged) on which :func:`check_mean_accuracy` tries an answer."""
    rows = []
    accs = {("a", 8, 4): [0.9, 0.5, 0.7], ("a", 8, 8): [0.2, 0.3, 0.1], ("a", 16, 4): [1.0, 1.0, 0.4],
            ("b", 8, 4): [0.6, 0.6, 0.0]}
    for (mixer, d, n), values in accs.items():
        rows += [{"mixer": mixer, "d_model": d, "n_pairs": n, "seed": s, "test_accuracy": a, "diverged": False}
                 for s, a in enumerate(values)]
    rows.append({"mixer": "b", "d_model": 8, "n_pairs": 4, "seed": 3, "test_accuracy": None, "diverged": True})
    return rows


def _reference_mean(runs, mixer, d_model, n_pairs):
    accs = [0.0 if r["diverged"] else r["test_accuracy"] for r in runs
            if r["mixer"] == mixer and r["d_model"] == d_model and r["n_pairs"] == n_pairs]
    return float(np.mean(accs))


def check_mean_accuracy(mean_accuracy, runs=None) -> CheckResult:
    """Check ``mean_accuracy(runs, mixer, d_model, n_pairs) -> float``.

    The mean of ``test_accuracy`` over the seeds of one configuration, a
    diverged run (``test_accuracy`` None) counting as accuracy 0. Checked on a
    made-up list of records (with a diverged run) and, when given, on ``runs``
    (the stored sweep's records).
    """
    exercise = "ex-tr-first-failure"

    def body():
        cases = [("a", 8, 4), ("a", 8, 8), ("a", 16, 4), ("b", 8, 4)]
        made_up = made_up_runs()
        for mixer, d, n in cases:
            case = f"the made-up records, mixer {mixer!r}, d_model={d}, n_pairs={n}"
            got = call_student(mean_accuracy, [dict(r) for r in made_up], mixer, d, n, case=case)
            want = _reference_mean(made_up, mixer, d, n)
            picked = [r for r in made_up if r["mixer"] == mixer and r["d_model"] == d and r["n_pairs"] == n]
            finite = [r["test_accuracy"] for r in picked if not r["diverged"]]
            slips = [(float(np.median(finite)), "that is the median; the table reports the mean over seeds"),
                     (float(np.sum(finite)), "that is the sum; divide by the number of seeds"),
                     (float(np.mean(finite)), "the diverged run was left out: count it as accuracy 0 (a run "
                                              "that diverged did not learn), so the mean is over every seed"),
                     (float(np.mean([r["test_accuracy"] or 0.0 for r in made_up if r["mixer"] == mixer])),
                      "runs of other widths or pair counts were let in: select mixer, d_model AND n_pairs")]
            try:
                value = float(got)
            except (TypeError, ValueError):
                raise Failure(f"on {case}: expected a number, got {got!r}") from None
            if abs(value - want) > 1e-12:
                for wrong, why in slips:
                    if abs(value - wrong) <= 1e-12:
                        raise Failure(f"on {case}: got {value:.4g}: {why}")
                raise Failure(f"on {case}: expected {want:.4g}, got {value:.4g}")
        if runs is not None:
            configs = sorted({(r["mixer"], r["d_model"], r["n_pairs"]) for r in runs})
            for mixer, d, n in configs:
                case = f"the stored sweep, mixer {mixer!r}, d_model={d}, n_pairs={n}"
                got = call_student(mean_accuracy, [dict(r) for r in runs], mixer, d, n, case=case)
                want = _reference_mean(runs, mixer, d, n)
                if not abs(float(got) - want) <= 1e-12:
                    raise Failure(f"on {case}: expected {want:.4g}, got {float(got):.4g}")
            return f"the means of {len(configs)} configurations of the stored sweep, and of the made-up records, agree."
        return "the means of the made-up records agree."

    return run_check(exercise, body)


# ------------------------------------------------------------------ ex-tr-step-backward

def _step_forward(q, k, v, S_prev):
    """One recurrent step of un-normalised linear attention: ``S = S_prev + k v^T``, ``o = S^T q``."""
    o, S = la.linear_attention_step(q, k, v, feature_map=la.identity_feature_map, normalize=False,
                                    initial_state=S_prev)
    return o, S


def check_step_backward(step_backward) -> CheckResult:
    """Check ``step_backward(q, k, v, S_prev, d_o, d_S) -> (dq, dk, dv, dS_prev)``.

    The step is ``S = S_prev + k v^T``, ``o = S^T q`` (``eq-la-recurrent``); ``d_o`` is
    the gradient of the loss with respect to ``o`` and ``d_S`` with respect to ``S``
    (what the later tokens send back). First a gradient check: the student's
    gradients against central differences of the step, relative error at most
    1e-6; then the step chained backwards over a 6-token sequence must reproduce
    :func:`fixedstate.linear_attention.linear_attention_backward`. Diagnoses
    reading the old state, forgetting ``d_S`` or the output's own term, and
    transposes.
    """
    exercise = "ex-tr-step-backward"
    d_k, d_v = 3, 2
    rng = np.random.default_rng(90)
    forbidden = [la.linear_attention_backward]

    def body():
        q, k, S_prev = rng.standard_normal(d_k), rng.standard_normal(d_k), rng.standard_normal((d_k, d_v))
        v = rng.standard_normal(d_v)
        d_o, d_S = rng.standard_normal(d_v), rng.standard_normal((d_k, d_v))
        case = f"one step with d_k={d_k}, d_v={d_v}"
        out = call_without(step_backward, forbidden, q.copy(), k.copy(), v.copy(), S_prev.copy(), d_o.copy(),
                           d_S.copy(), case=case)
        if not isinstance(out, (tuple, list)) or len(out) != 4:
            raise Failure(f"on {case}: expected a tuple (dq, dk, dv, dS_prev), got {type(out).__name__}")
        if any(has_nonfinite(x) for x in out):
            raise Failure(f"on {case}: a gradient holds NaN or infinity")
        dq, dk, dv, dS_prev = (np.asarray(x, dtype=float) for x in out)
        S = S_prev + np.outer(k, v)
        dS = d_S + np.outer(q, d_o)
        slips = {
            "dq": [(S_prev @ d_o, "dq uses the state before this token's write: o = S^T q reads the NEW state "
                                  "S = S_prev + k v^T")],
            "dk": [(np.outer(q, d_o) @ v, "dk leaves out d_S, the gradient the later tokens send back "
                                          "through the state: dk = (d_S + q d_o^T) v"),
                   (d_S @ v, "dk leaves out this token's own output: add q d_o^T to d_S first")],
            "dv": [(np.outer(q, d_o).T @ k, "dv leaves out d_S: dv = (d_S + q d_o^T)^T k"),
                   (d_S.T @ k, "dv leaves out this token's own output: add q d_o^T to d_S first")],
            "dS_prev": [(d_S, "dS_prev leaves out this token's output: the old state reaches o through S, so "
                              "dS_prev = d_S + q d_o^T"),
                        (np.outer(q, d_o), "dS_prev leaves out d_S: the old state also reaches every later token")],
        }
        inputs = {"q": q, "k": k, "v": v, "S_prev": S_prev}
        weights = (d_o, d_S)
        grads = {"q": dq, "k": dk, "v": dv, "S_prev": dS_prev}
        for name, g in grads.items():
            if g.shape != inputs[name].shape:
                raise Failure(f"on {case}: d{name if name != 'S_prev' else 'S_prev'} has shape {g.shape}, "
                              f"expected {inputs[name].shape}, the shape of {name}"
                              + (" (a transpose?)" if g.shape == inputs[name].shape[::-1] else ""))
        errors = gc.relative_errors(_step_forward, inputs, grads, weights)
        worst = max(errors, key=errors.get)
        if errors[worst] > 1e-6:
            got = grads[worst]
            for wrong, why in slips["dS_prev" if worst == "S_prev" else "d" + worst]:
                if got.shape == wrong.shape and np.allclose(got, wrong, rtol=1e-8, atol=1e-10):
                    raise Failure(f"gradient check on {case}: {why}")
            raise Failure(f"gradient check on {case}: the gradient with respect to {worst} differs from "
                          f"central finite differences by {errors[worst]:.2g} relative (at most 1e-6 allowed)")
        T = 6
        Q, K, V, dO = (rng.standard_normal((T, d)) for d in (d_k, d_k, d_v, d_v))
        S0 = rng.standard_normal((d_k, d_v))
        want = la.linear_attention_backward(Q, K, V, dO, initial_state=S0)
        states = [S0]
        for t in range(T):
            states.append(states[-1] + np.outer(K[t], V[t]))
        dS_t = np.zeros((d_k, d_v))
        got = {"dq": np.zeros((T, d_k)), "dk": np.zeros((T, d_k)), "dv": np.zeros((T, d_v))}
        for t in reversed(range(T)):
            case_t = f"token {t + 1} of a {T}-token sequence, chained backwards"
            out = call_without(step_backward, forbidden, Q[t].copy(), K[t].copy(), V[t].copy(), states[t].copy(),
                               dO[t].copy(), dS_t.copy(), case=case_t)
            got["dq"][t], got["dk"][t], got["dv"][t] = (np.asarray(x, dtype=float) for x in out[:3])
            dS_t = np.asarray(out[3], dtype=float)
        seq_case = f"a {T}-token sequence with an initial state"
        for i, name in enumerate(("dq", "dk", "dv")):
            compare_arrays(got[name], want[i], what=name, case=seq_case, rtol=1e-9, atol=1e-11)
        compare_arrays(dS_t, want[4], what="the gradient reaching the initial state", case=seq_case,
                       rtol=1e-9, atol=1e-11)
        return (f"gradient check passed (every relative error below 1e-6), and chained over {T} tokens "
                "your step reproduces linear_attention_backward.")

    return run_check(exercise, body)
