"""The two hypothesis profiles of the suite.

``make test`` (and CI) runs every property test with its full number of examples,
the profile ``full``. ``make test-quick``, the inner loop of a contributor, sets
``FIXEDSTATE_TEST_PROFILE=quick``: each property test then draws a tenth of its
examples (at least three), and nothing else changes. Test modules ask for their
counts through :func:`examples`, never through ``settings(max_examples=...)``
directly, so that one switch scales them all.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("FIXEDSTATE_TEST_PROFILE", "full")
if PROFILE not in ("full", "quick"):
    raise ValueError(f"FIXEDSTATE_TEST_PROFILE: expected 'full' or 'quick', got {PROFILE!r}")


def examples(n: int) -> settings:
    """Hypothesis settings with ``n`` examples in the full profile (a tenth, at least 3, in ``quick``); no deadline."""
    count = n if PROFILE == "full" else max(3, n // 10)
    return settings(max_examples=count, deadline=None)
