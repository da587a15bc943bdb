"""fixedstate.prose: glued numbers carry exactly the precision the text shows."""

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import prose
from fixedstate.prose import below, glue_bound, glue_number, round_to_format

FORMATS = [".0f", ".1f", ".2f", ".3f", ".4f", ",.0f", ",.1f", ".0%", ".1%", ".0e", ".1e", ".2g", ".3g", ".4g", ","]


@examples(100)                       # hypothesis's default count, with no deadline
@given(st.floats(min_value=-1e12, max_value=1e12, allow_nan=False), st.sampled_from(FORMATS))
def test_rounding_keeps_the_displayed_text(x, fmt):
    shown = format(x, fmt if fmt != "," else ",g")
    r = round_to_format(x, fmt)
    assert format(r, fmt if fmt != "," else ",g") == shown
    assert round_to_format(r, fmt) == r          # rounding again changes nothing


def test_rounding_examples():
    assert round_to_format(0.25338456270911375, ".3f") == 0.253
    assert format(round_to_format(0.1234567, ".1%"), ".1%") == "12.3%"
    assert round_to_format(2481.0649554974784, ".2g") == 2500.0
    assert round_to_format(12345, ",") == 12345 and isinstance(round_to_format(12345, ","), int)


@pytest.mark.parametrize("bad, arg", [(("x", ".3f"), "value"), ((float("nan"), ".3f"), "value"),
                                      ((0.5, "3f"), "fmt"), ((0.5, 3), "fmt")])
def test_round_to_format_rejects_bad_input(bad, arg):
    with pytest.raises(ValueError, match=arg):
        round_to_format(*bad)


def test_bounds_hold_or_fail_loudly(monkeypatch):
    assert below(3.9e-16) == "below 1e-12"
    assert below(2e-14, 1e-13) == "below 1e-13"
    with pytest.raises(AssertionError, match="2.000e-12"):
        below(2e-12)
    with pytest.raises(AssertionError, match="not below"):
        glue_bound("x", 5e-10)
    with pytest.raises(ValueError, match="bound"):
        below(1e-16, -1.0)
    glued = {}
    monkeypatch.setattr(prose, "glue", lambda name, value, display=True: glued.update({name: value}))
    assert glue_bound("x", 1e-16) is None and math.isclose(glued["x"], 1e-12)


def test_glue_number_glues_the_shown_value_and_returns_none(monkeypatch):
    # None, so that a cell ending with it shows no stray number on the page
    glued = {}
    monkeypatch.setattr(prose, "glue", lambda name, value, display=True: glued.update({name: (value, display)}))
    assert glue_number("a", 0.123456, ".2f") is None and glue_number("n", np.int64(7), None) is None
    assert glued == {"a": (0.12, False), "n": (7, False)} and type(glued["n"][0]) is int
