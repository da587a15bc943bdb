"""The exercise checks of chap-recall pass the reference answers and name each plausible mistake."""

import numpy as np
import pytest

from fixedstate import recall as rc
from fixedstate.checks import recall as ck


# ----------------------------------------------------------------------------- numeric answers

def test_stored_answers_match_independent_computations():
    rho = ck.CROSSTALK_OVERLAP
    # two unit keys with overlap rho, orthonormal values:
    # additive: v_1 + rho v_2, error rho; delta: first key (1 - rho^2) v_1 + rho v_2, second exact
    assert abs(ck.ANSWERS["ex-rc-crosstalk-additive"]["value"] - rho) < 1e-12
    assert abs(ck.ANSWERS["ex-rc-crosstalk-delta-first"]["value"] - rho * np.sqrt(1 + rho ** 2)) < 1e-12
    assert abs(ck.ANSWERS["ex-rc-crosstalk-delta-second"]["value"]) < 1e-12
    # a 16-wide state has 16 orthonormal directions: the 17th key overlaps earlier ones
    assert ck.ANSWERS["ex-rc-largest-exact"]["value"] == 16
    assert ck.largest_exact_n(5, n_max=10) == 5


@pytest.mark.parametrize("label", sorted(ck.ANSWERS))
def test_check_answer_passes_the_stored_value_and_fails_a_nearby_one(label):
    spec = ck.ANSWERS[label]
    assert ck.check_answer(label, spec["value"]).passed
    bad = ck.check_answer(label, spec["value"] + 0.01 + 2 * spec["tolerance"])
    assert not bad.passed and "too high" in bad.message
    assert not ck.check_answer(label, ...).passed


def test_check_answer_off_by_one_on_the_largest_n():
    res = ck.check_answer("ex-rc-largest-exact", 17)
    assert not res.passed and "17 is too high" in res.message
    assert not ck.check_answer("ex-rc-unknown", 1).passed


# ----------------------------------------------------------------------------- recall accuracy

def reference_accuracy(state, keys, values):
    recalled = keys @ state
    dist = np.linalg.norm(recalled[:, None, :] - values[None, :, :], axis=2)
    return np.mean(np.argmin(dist, axis=1) == np.arange(len(keys)))


def transposed_read(state, keys, values):
    recalled = keys @ state.T
    dist = np.linalg.norm(recalled[:, None, :] - values[None, :, :], axis=2)
    return np.mean(np.argmin(dist, axis=1) == np.arange(len(keys)))


def by_dot_product(state, keys, values):
    return np.mean(np.argmax((keys @ state) @ values.T, axis=1) == np.arange(len(keys)))


def count_not_fraction(state, keys, values):
    return reference_accuracy(state, keys, values) * len(keys)


def unfinished(state, keys, values):
    ...


def test_recall_accuracy_check_passes_the_reference():
    res = ck.check_recall_accuracy(reference_accuracy)
    assert res.passed, res.message


@pytest.mark.parametrize("fn, phrase", [
    (transposed_read, "S^T q"),
    (by_dot_product, "largest dot product"),
    (count_not_fraction, "the fraction"),
    (unfinished, "replace the `...`"),
])
def test_recall_accuracy_check_names_the_mistake(fn, phrase):
    res = ck.check_recall_accuracy(fn)
    assert not res.passed
    assert phrase in res.message, res.message


def test_recall_accuracy_cases_separate_every_mistake():
    # on at least one case each mistake gives a number different from the right one
    for fn in (transposed_read, by_dot_product, count_not_fraction):
        assert any(abs(fn(s, k, v) - reference_accuracy(s, k, v)) > 1e-9
                   for s, k, v, _ in ck.accuracy_cases()), fn.__name__


# ----------------------------------------------------------------------------- crosstalk

def reference_crosstalk(keys, values):
    return (keys @ keys.T) @ values - values


def whole_recall(keys, values):
    return (keys @ keys.T) @ values


def unweighted(keys, values):
    n = len(keys)
    return (np.ones((n, n)) - np.eye(n)) @ values


def off_diagonal_only(keys, values):
    gram = keys @ keys.T
    return (gram - np.diag(np.diag(gram))) @ values


def test_crosstalk_check_passes_the_reference():
    res = ck.check_predicted_crosstalk(reference_crosstalk)
    assert res.passed, res.message
    # and the package's own formula for unit keys agrees on unit-key cases
    keys = rc.make_keys(5, 3, rng=1)
    values = np.random.default_rng(2).standard_normal((5, 4))
    assert np.allclose(rc.crosstalk(keys, values), reference_crosstalk(keys, values), rtol=1e-10,
                       atol=1e-12)


@pytest.mark.parametrize("fn, phrase", [
    (whole_recall, "leaves out the pair's own term"),
    (unweighted, "unweighted"),
    (off_diagonal_only, "not unit length"),
    (lambda keys, values: reference_crosstalk(keys, values).T, "expected shape"),
])
def test_crosstalk_check_names_the_mistake(fn, phrase):
    res = ck.check_predicted_crosstalk(fn)
    assert not res.passed
    assert phrase in res.message, res.message


# ---------------------------------------------------------------- challenge: the experiment at a new state size

def test_recall_curve_check_passes_the_solution_and_names_the_slips():
    from fixedstate.checks.recall import (check_recall_curve, plain_curve, reference_recall_curve,
                                          new_size_draws, NEW_STATE_SIZE, ANSWERS, check_answer)
    assert check_recall_curve(plain_curve).passed
    for kwargs, words in [(dict(write="additive"), "additive writes"), (dict(read="transposed"), "S^T k"),
                          (dict(score="dot"), "dot product"), (dict(among="all"), "all N_max values"),
                          (dict(written="all"), "write only the first N"), (dict(fraction=False), "fraction")]:
        result = check_recall_curve(lambda K, V, n, kw=kwargs: plain_curve(K, V, n, **kw))
        assert not result.passed and words in result.message, (kwargs, result.message)
    per_seed = lambda K, V, n: np.array([plain_curve(K[i:i + 1], V[i:i + 1], n) for i in range(len(K))])
    assert "average over the seeds" in check_recall_curve(per_seed).message
    uses_package = lambda K, V, n: reference_recall_curve(K, V, n)
    assert "the package's own implementation" in check_recall_curve(uses_package).message
    # the numeric answer is what the experiment gives on the stated draws
    keys, values = new_size_draws()
    curve = plain_curve(keys, values, NEW_STATE_SIZE["n_values"])
    reliable = [n for n, a in zip(NEW_STATE_SIZE["n_values"], curve) if a >= 0.9]
    assert check_answer("ex-rc-new-size", ANSWERS["ex-rc-new-size"]["value"]).passed
    assert ANSWERS["ex-rc-new-size"]["value"] == reliable[-1]
    for wrong, hint in ANSWERS["ex-rc-new-size"]["hints"]:
        assert hint in check_answer("ex-rc-new-size", wrong).message
