"""``make test-reference`` leaves the work tree as committed; the stored table's check (no torch needed).

The comparison with transformers runs only in its own environment (never in ``make test``);
what is tested here is the wiring around it: the tracked table that the appendix page reads
is never the target of ``make test-reference``, and the check that tells a stale stored table
from a fresh run (``tools/reference/stored_table.py``) catches each way of going stale.
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "reference"))

from stored_table import stale_rows  # noqa: E402

STORED = json.loads((ROOT / "results" / "reference_equivalence.json").read_text())


def recipe(target: str) -> str:
    """The commands make would run for ``target`` (the reference venv taken as built)."""
    out = subprocess.run(["make", "-n", "-o", ".venv-reference/.installed", "-o", ".venv/.installed", target],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout


def test_test_reference_writes_only_under_build_and_checks_the_stored_table():
    commands = recipe("test-reference")
    assert "compare_layers.py" in commands
    assert "--out _build/" in commands and "--stored results/reference_equivalence.json" in commands
    assert "--out results/" not in commands


def test_update_reference_is_the_step_that_rewrites_the_stored_table():
    commands = recipe("update-reference")
    lines = commands.splitlines()
    run = next(i for i, line in enumerate(lines) if "compare_layers.py" in line)
    copy = next(i for i, line in enumerate(lines) if line.startswith("cp ") and "results/reference_equivalence.json" in line)
    page = next(i for i, line in enumerate(lines) if "appendix/equivalence.ipynb" in line)
    # the run writes under _build/; make stops at a failed run, so the stored table is replaced only by a passing one
    assert "--out _build/" in commands and run < copy < page


def test_the_stored_table_is_consistent_with_itself():
    assert STORED["rows"] and stale_rows(STORED["rows"], STORED["rows"]) == []


@pytest.mark.parametrize("change", ["added", "removed", "renamed", "failed"])
def test_a_stale_stored_table_is_caught(change):
    fresh, stored = copy.deepcopy(STORED["rows"]), copy.deepcopy(STORED["rows"])
    if change == "added":
        fresh.append(dict(fresh[0], what="a new comparison"))
    elif change == "removed":
        fresh.pop()
    elif change == "renamed":
        fresh[0]["library"] += "V2"
    else:
        stored[1]["passed"] = False
    reasons = stale_rows(fresh, stored)
    assert len(reasons) == (2 if change == "renamed" else 1), reasons


def test_errors_that_differ_in_their_last_digits_are_not_staleness():
    fresh = copy.deepcopy(STORED["rows"])
    for row in fresh:
        row["max_rel_error"] *= 1.01
    assert stale_rows(fresh, STORED["rows"]) == []
