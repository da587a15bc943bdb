"""The attack class (tools/grading/attack_class.py) graded next to honest students: the sandbox holds.

Marked ``grade_attack``: it runs in ``make grade-attack-test``, which .ci/run
calls, and the unit runs deselect it: it grades eleven notebooks in sandboxes and then waits 30 s for the
attackers' detached processes, too long for the unit tests. Checks, for issue
#28: every honest student gets exactly their points and every attacker exactly
what its honest cells earn; a canary outside the submissions, every submission,
``code/``, ``solutions/``, ``results/`` and the output folder are byte for byte
unchanged after the run and 30 s later; no process started by a notebook is
alive after the grader exits; and no feedback carries an exception's text, the
grader's environment or a solution.
"""

from __future__ import annotations

import csv
import hashlib
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from grading.attack_class import MARKER, make_attack_class  # noqa: E402
from grading.sandbox import MAX_SLOTS, UID_BASE  # noqa: E402

# The attack class runs in `make grade-attack-test` (about two minutes, with a 30 s wait), which
# `.ci/run` calls after `make test`; the unit runs deselect the marker rather than skip it.
pytestmark = pytest.mark.grade_attack

CHAPTER = "03_delta_rule"
JOBS = 2


def _tree(path: Path) -> dict[str, str]:
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def _suspects() -> list[str]:
    """Processes that a notebook started: the attackers' marker in the command line, or a sandbox uid."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
            uid = next(int(line.split()[1]) for line in (proc / "status").read_text().splitlines()
                       if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError):
            continue
        if MARKER in cmd or UID_BASE <= uid < UID_BASE + MAX_SLOTS:
            found.append(f"{proc.name} uid={uid} {cmd[:120]}")
    return found


@pytest.fixture(scope="module")
def attack(tmp_path_factory):
    base = tmp_path_factory.mktemp("attack")
    canary = base / "canary.txt"
    canary.write_text(secrets.token_hex(32))
    out = base / "out"
    manifest = make_attack_class(base / "class", canary=canary, grade_out=out, chapter=CHAPTER)
    subs = base / "class" / "submissions"
    guarded = {"canary": canary, "submissions": subs, "code": ROOT / "code", "solutions": ROOT / "solutions",
               "results": ROOT / "results"}
    before = {name: _tree(path) for name, path in guarded.items()}
    secret = "LMS-TOKEN-" + secrets.token_hex(8)
    env = dict(os.environ, FSATTACK_SECRET=secret)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "grade.py"), str(subs), "--out", str(out),
                           "--chapters", CHAPTER[:2], "--jobs", str(JOBS), "--timeout", "120",
                           "--cell-timeout", "30"], env=env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    right_after = {"out": _tree(out), "suspects": _suspects()}
    time.sleep(30)
    later = {name: _tree(path) for name, path in guarded.items()}
    return dict(manifest=manifest, out=out, before=before, later=later, right_after=right_after,
                out_later=_tree(out), suspects_later=_suspects(), secret=secret, console=proc.stdout,
                seconds=seconds, rows=list(csv.DictReader(open(out / "gradebook.csv", encoding="utf-8-sig"))))


def test_every_student_gets_exactly_the_points_of_their_honest_cells(attack):
    for student, expect in attack["manifest"]["students"].items():
        rows = {r["exercise"]: r for r in attack["rows"] if r["student"] == student and r["grading"] == "auto"}
        assert set(rows) == set(expect), student
        for label, points in expect.items():
            assert float(rows[label]["points"]) == pytest.approx(points), (student, label, rows[label]["message"])


def test_nothing_outside_the_sandbox_changed_after_the_run_and_30_s_later(attack):
    for name, tree in attack["before"].items():
        assert attack["later"][name] == tree, f"{name} changed"
    assert attack["out_later"] == attack["right_after"]["out"], "the output folder changed after the grader exited"
    assert not any("pwned" in p for p in attack["out_later"])


def test_no_process_started_by_a_notebook_outlives_the_grader(attack):
    assert attack["right_after"]["suspects"] == []
    assert attack["suspects_later"] == []


def test_feedback_carries_no_exception_text_environment_or_solution(attack):
    texts = [p.read_text(encoding="utf-8") for p in (attack["out"] / "feedback").glob("*.md")]
    texts += [(attack["out"] / name).read_text(encoding="utf-8-sig") for name in ("gradebook.csv", "totals.csv")]
    leak = next(t for t in texts if "# Feedback for attack_leak" in t)
    assert "an exception of the notebook's own class" in leak and "ValueError" in leak
    for text in texts:
        assert "LEAKMARK" not in text and attack["secret"] not in text and "uid=" not in text
        assert "solution-start" not in text
