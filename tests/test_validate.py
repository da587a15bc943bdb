"""fixedstate._validate.prepare_layer_args: the one argument check of the sequence layers.

The delta-rule family, GLA and its special cases, DeltaProduct, RWKV-7 and
Longhorn all validate through it; these tests pin down what it promises:
shared axis sizes, errors that name the argument, leading axes that
broadcast, one dtype, and the options of the one-token and reference forms.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _examples import examples

from fixedstate import delta_family as fam
from fixedstate import delta_rule as dr
from fixedstate import gated_linear_attention as gla
from fixedstate import layers as fl
from fixedstate import recall as rc
from fixedstate._validate import Arg, as_generator, check_log_gate, prepare_layer_args


def _args(q, k, v, g=None):
    return [Arg("q", q, ("T", "d_k")), Arg("k", k, ("T", "d_k")), Arg("v", v, ("T", "d_v")),
            Arg("log_gate", g, ("T",), check_log_gate, allow_nonfinite=True)]


@examples(40)
@given(lead_q=st.sampled_from([(), (3,), (2, 3)]), lead_k=st.sampled_from([(), (3,), (1, 3)]),
       T=st.integers(1, 5), d_k=st.integers(1, 4), d_v=st.integers(1, 4), with_state=st.booleans())
def test_leading_axes_broadcast_and_every_array_gets_them(lead_q, lead_k, T, d_k, d_v, with_state):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal(lead_q + (T, d_k)), rng.standard_normal(lead_k + (T, d_k))
    v, g = rng.standard_normal((T, d_v)), -rng.uniform(0, 1, (T,))
    S0 = rng.standard_normal((d_k, d_v)) if with_state else None
    lead, (q2, k2, v2, g2), S, scale = prepare_layer_args(_args(q, k, v, g), initial_state=S0, scale=2)
    assert lead == np.broadcast_shapes(lead_q, lead_k)
    assert q2.shape == k2.shape == lead + (T, d_k) and v2.shape == lead + (T, d_v) and g2.shape == lead + (T,)
    np.testing.assert_array_equal(np.broadcast_to(q, q2.shape), q2)
    assert (S is None) == (not with_state) and (S is None or S.shape == lead + (d_k, d_v))
    assert scale == 2.0 and type(scale) is float


@pytest.mark.parametrize("dtypes, expected", [((np.float32,) * 4, np.float32), ((np.float64,) * 4, np.float64),
                                              ((np.float32, np.float32, np.float64, np.float32), np.float64),
                                              ((np.float16,) * 4, np.float32), ((np.int64,) * 4, np.float64)])
def test_every_array_comes_back_in_the_common_dtype(dtypes, expected):
    arrays = [np.ones((3, 2)).astype(dtypes[0]), np.ones((3, 2)).astype(dtypes[1]), np.ones((3, 4)).astype(dtypes[2]),
              -np.ones(3).astype(dtypes[3])]
    _, out, _, _ = prepare_layer_args(_args(*arrays))
    assert {x.dtype for x in out} == {np.dtype(expected)}


def test_an_axis_seen_before_must_keep_its_size_and_the_error_names_the_argument():
    q, v = np.zeros((5, 3)), np.zeros((5, 2))
    with pytest.raises(ValueError, match=r"k: expected shape \(\.\.\., T=5, d_k=3\), got shape \(5, 4\)"):
        prepare_layer_args(_args(q, np.zeros((5, 4)), v))
    with pytest.raises(ValueError, match=r"v: expected shape \(\.\.\., T=5, d_v\), got shape \(4, 2\)"):
        prepare_layer_args(_args(q, q, np.zeros((4, 2))))
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(\.\.\., d_k=3, d_v=2\)"):
        prepare_layer_args(_args(q, q, v), initial_state=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="k: expected leading axes that broadcast"):
        prepare_layer_args(_args(np.zeros((2, 5, 3)), np.zeros((3, 5, 3)), v))
    with pytest.raises(ValueError, match="scale: expected a finite real number"):
        prepare_layer_args(_args(q, q, v), scale=float("nan"))


def test_checks_run_on_their_argument_and_nonfinite_values_are_found():
    q, v = np.zeros((4, 2)), np.zeros((4, 2))
    with pytest.raises(ValueError, match="log_gate: expected log-decays <= 0"):
        prepare_layer_args(_args(q, q, v, np.full(4, 0.5)))
    with pytest.raises(ValueError, match="log_gate: expected finite values"):
        prepare_layer_args(_args(q, q, v, np.array([0.0, -np.inf, 0.0, 0.0])))
    with pytest.raises(ValueError, match="q: expected finite values"):
        prepare_layer_args(_args(np.array([[np.nan, 0.0]] * 4), q, v))
    _, (_, _, _, g), _, _ = prepare_layer_args(_args(q, q, v))
    assert g is None                                               # an argument not given stays None


def test_one_token_forms_drop_the_token_axis_and_length_and_one_sequence_options_hold():
    lead, (q, k, v, g), _, _ = prepare_layer_args(_args(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 4)),
                                                        -np.ones(2)), tokens=False)
    assert lead == (2,) and q.shape == (2, 3) and v.shape == (2, 4) and g.shape == (2,)
    with pytest.raises(ValueError, match=r"q: expected at least 1 token\(s\), got shape \(0, 3\)"):
        prepare_layer_args(_args(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 2))), min_length=1)
    with pytest.raises(ValueError, match=r"k: the reference functions take one sequence .*\(use this\)"):
        prepare_layer_args(_args(np.zeros((4, 3)), np.zeros((2, 4, 3)), np.zeros((4, 2))), one_sequence="use this")


@pytest.mark.parametrize("call", [
    lambda q, k, v, g: dr.gated_delta_rule_recurrent(q, k, v, beta=np.full(4, 0.5), log_gate=g),
    lambda q, k, v, g: gla.gla_recurrent(q, k, v, log_gate=np.broadcast_to(g[:, None], q.shape)),
    lambda q, k, v, g: fam.deltaproduct_recurrent(q, k[:, None], v[:, None], beta=np.full((4, 1), 0.5), log_gate=g),
    lambda q, k, v, g: fam.rwkv7_recurrent(q, k, v, log_gate=np.broadcast_to(g[:, None], q.shape), a=k, b=k),
    lambda q, k, v, g: fam.longhorn_recurrent(q, k, v, beta=np.full(v.shape, 0.5)),
])
def test_every_layer_that_uses_it_names_a_wrong_value_argument(call):
    rng = np.random.default_rng(1)
    q, k, g = rng.standard_normal((4, 3)), rng.standard_normal((4, 3)), -rng.uniform(0, 1, 4)
    call(q, k, rng.standard_normal((4, 2)), g)                               # the right shapes run
    with pytest.raises(ValueError, match=r"^v: expected shape"):
        call(q, k, rng.standard_normal((5, 2)), g)


# ---------------------------------------------------------------------------- as_generator: the one rng check

def test_as_generator_takes_a_generator_a_seed_and_none_only_with_a_default():
    g = np.random.default_rng(5)
    assert as_generator(g) is g
    assert as_generator(7).random() == np.random.default_rng(7).random()
    assert as_generator(np.int64(7)).random() == np.random.default_rng(7).random()
    assert as_generator(None, default_seed=3).random() == np.random.default_rng(3).random()
    with pytest.raises(ValueError, match=r"^rng: expected a numpy Generator or an integer seed, got NoneType None$"):
        as_generator(None)
    with pytest.raises(ValueError, match=r"^seed: expected a numpy Generator, an integer seed or None, got bool True$"):
        as_generator(True, "seed", default_seed=0)


def test_the_layers_and_recall_give_the_same_rng_error():
    # both modules check their rng with as_generator: one message, naming the argument and what it got
    with pytest.raises(ValueError, match=r"^rng: expected a numpy Generator or an integer seed, got str 'seed'$"):
        fl.init_mamba(fl.MambaConfig(8, 4, 2, 1), "seed")
    with pytest.raises(ValueError, match=r"^rng: expected a numpy Generator, an integer seed or None, got str 'seed'$"):
        rc.make_keys(3, 4, rng="seed")
    with pytest.raises(ValueError, match=r"^rng: expected a numpy Generator, an integer seed or None, got float 1.5$"):
        rc.make_mqar(2, 16, 2, 8, rng=1.5)
    assert np.array_equal(rc.make_keys(3, 4, rng=None), rc.make_keys(3, 4, rng=0))
