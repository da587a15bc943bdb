"""The stored comparison table against a fresh run: what ``make test-reference`` checks.

``make test-reference`` writes its fresh table under ``_build/`` and leaves the tracked
``results/reference_equivalence.json`` (which the appendix page shows) as committed;
``make update-reference`` is the explicit step that rewrites the stored table. This
module holds the one check between them, with no torch import, so that the unit
tests can exercise it: the stored table is stale when a fresh run makes other
comparisons, or when a stored row did not pass.
"""

from __future__ import annotations

KEY = ("kind", "name", "what", "library", "book")


def stale_rows(fresh_rows: list[dict], stored_rows: list[dict]) -> list[str]:
    """Reasons the stored table no longer describes a fresh run (empty when it does).

    A row is identified by ``KEY``; the errors themselves may differ in their last
    digits between machines and are not compared, only that each passed its tolerance.
    """
    fresh = {tuple(r[k] for k in KEY): r for r in fresh_rows}
    stored = {tuple(r[k] for k in KEY): r for r in stored_rows}
    reasons = [f"only in the fresh run: {' | '.join(key)}" for key in fresh if key not in stored]
    reasons += [f"only in the stored table: {' | '.join(key)}" for key in stored if key not in fresh]
    reasons += [f"did not pass in the stored table: {' | '.join(key)}"
                for key, row in stored.items() if not row.get("passed")]
    return reasons
