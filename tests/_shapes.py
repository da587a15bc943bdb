"""Shapes for the batched-equals-looped tests, shared by the test modules of the cores."""


def thin(lead, mask, n_drop):
    """A shape that broadcasts to ``lead``: the axes where ``mask`` is True set to 1, the first ``n_drop`` dropped."""
    shape = tuple(1 if m else n for n, m in zip(lead, mask))
    return shape[min(n_drop, len(shape)):]
