"""The shared numeric-answer check: specific feedback that does not give the answer away."""

import numpy as np

from fixedstate.checks._core import check_numeric

ANSWERS = {
    "ex-a": dict(value=123.456, tolerance=0.01, relative=True, what="the size", unit="GB",
                 hints=[(123.456 / 2, "half: count keys and values")]),
    "ex-b/part": dict(value=16, tolerance=0, what="the largest N"),
    "ex-c": dict(value=np.array([0.5, -0.25]), tolerance=1e-6, what="the recall"),
}


def test_right_answers_pass_within_their_tolerance():
    assert check_numeric("ex-a", 123.456 * 1.009, ANSWERS).passed
    assert check_numeric("ex-b/part", 16, ANSWERS).passed
    assert check_numeric("ex-c", [0.5, -0.25 + 1e-7], ANSWERS).passed


def test_a_wrong_number_says_how_far_and_which_way_without_the_answer():
    r = check_numeric("ex-a", 130.0, ANSWERS)
    assert not r.passed and "too high by 5.3%" in r.message and "123.456" not in r.message
    r = check_numeric("ex-b/part", 15, ANSWERS)
    assert not r.passed and "too low" in r.message and r.exercise == "ex-b"


def test_a_known_slip_gets_its_hint():
    r = check_numeric("ex-a", 61.728, ANSWERS)
    assert not r.passed and "half: count keys and values" in r.message


def test_arrays_unfinished_cells_bad_types_and_unknown_labels():
    r = check_numeric("ex-c", [0.5, 0.25], ANSWERS)
    assert not r.passed and "entry 1" in r.message
    assert "shape (2,)" in check_numeric("ex-c", [1.0], ANSWERS).message
    assert "`...`" in check_numeric("ex-a", ..., ANSWERS).message
    assert "expected a number" in check_numeric("ex-a", "twelve", ANSWERS).message
    r = check_numeric("ex-zzz", 1, ANSWERS)
    assert not r.passed and "ex-a" in r.message
