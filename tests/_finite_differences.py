"""The finite-difference check the gradient tests share (test_blocks.py, test_training.py)."""

from fixedstate import gradcheck as gc

#: The bound chapter 9 states for a backward pass against central finite differences (float64).
BOUND = 1e-6


def check(f, inputs, backward, seed=12345):
    """Max relative error of ``backward(weights) -> {name: grad}`` against finite differences of ``f``."""
    weights = gc.random_weights(f(**inputs), seed=seed)
    # step 1e-5, not gradcheck's 1e-6: for these small float64 problems it balances the rounding of the two
    # evaluations (about 1e-16 |L| / h) against the truncation (about h^2), so that an input whose gradient is
    # small by chance (one entry, a near-cancelling sum) is still checked well below BOUND
    return gc.max_relative_error(f, inputs, backward(*weights), weights, step=1e-5)
