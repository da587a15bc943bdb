"""The package's mixer names: one list, and a check that names the argument."""

import pytest

from fixedstate import layer_ids as ids
from fixedstate.prose import max_relative_error

import numpy as np


def test_ids_are_distinct_strings_in_chapter_order():
    assert len(set(ids.LAYER_IDS)) == len(ids.LAYER_IDS)
    assert ids.LAYER_IDS[0] == "softmax" and ids.LAYER_IDS[-1] == "hybrid"


def test_check_layer_id_accepts_an_allowed_id_and_names_the_argument_otherwise():
    assert ids.check_layer_id("kda", (ids.DELTA, ids.KDA)) == "kda"
    with pytest.raises(ValueError, match=r"mixer must be one of \('delta', 'kda'\), got 'gated'"):
        ids.check_layer_id("gated", (ids.DELTA, ids.KDA), "mixer")
    with pytest.raises(ValueError, match="allowed must hold ids"):
        ids.check_layer_id("delta", ("deltanet",))


def test_max_relative_error_is_the_largest_difference_over_the_largest_entry():
    b = np.array([[1.0, -4.0], [0.0, 2.0]])
    a = b + np.array([[0.5, 0.0], [0.0, -1.0]])
    assert max_relative_error(a, b) == 0.25
    assert max_relative_error(b, b) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        max_relative_error(a[0], b)
    with pytest.raises(ValueError, match="nonzero entry"):
        max_relative_error(a, np.zeros_like(b))
