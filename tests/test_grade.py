"""The grader (tools/grade.py): fake submissions of one chapter, graded end to end, get what they deserve.

The fake submissions are generated into a temporary folder by
tools/make_grade_fixtures.py from the current exercise and solution notebooks,
so the test follows the exercises; its manifest says, for every fixture and
checked exercise, the share of its checks that must pass. The whole fake class
(ten students) is graded in one run with short time limits; one more run grades the misplaced
notebook of another chapter without an assignment. The rest are fast unit
tests of the parts.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import grade  # noqa: E402
import make_grade_fixtures  # noqa: E402
from grading import book  # noqa: E402
from grading.grader import Submission, identify  # noqa: E402
from grading.report import COLUMNS  # noqa: E402

CHAPTER = "03_delta_rule"
CELL_TIMEOUT = 6


def _read(path):
    with open(path, newline="", encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module", autouse=True)
def sandbox_tool():
    """The grader seals every notebook with bubblewrap: install it as make grade does, if it is missing."""
    import shutil
    import subprocess
    if shutil.which("bwrap") is None:
        subprocess.run(["bash", str(ROOT / "tools" / "system_deps.sh"), "bwrap"], check=True)


@pytest.fixture(scope="module")
def graded(tmp_path_factory, sandbox_tool):
    base = tmp_path_factory.mktemp("grade")
    subs, out = base / "submissions", base / "out"
    manifest = make_grade_fixtures.make_fixtures(subs, [CHAPTER])
    # a student's own checkpoint copy must be ignored
    (subs / "correct" / ".ipynb_checkpoints").mkdir()
    (subs / "correct" / ".ipynb_checkpoints" / f"{CHAPTER}-checkpoint.ipynb").write_text("{}")
    code = grade.main([str(subs), "--out", str(out), "--chapters", CHAPTER[:2], "--timeout", "40",
                       "--cell-timeout", str(CELL_TIMEOUT), "--jobs", "2", "--quiet"])
    assert code == 0
    return {"manifest": manifest, "subs": subs, "out": out, "rows": _read(out / "gradebook.csv"),
            "totals": _read(out / "totals.csv"), "book": book.read_book(ROOT)}


def _auto(rows, student):
    return {r["exercise"]: r for r in rows if r["student"] == student and r["grading"] == "auto"}


def test_the_gradebook_has_the_columns_and_one_row_per_student_and_exercise_part(graded):
    with open(graded["out"] / "gradebook.csv", encoding="utf-8-sig") as f:
        assert f.readline().strip().split(",")[:6] == ["student", "exercise", "points", "max_points", "passed",
                                                       "message"]
    ch = graded["book"][CHAPTER]
    students = set(graded["manifest"]["students"])
    assert {r["student"] for r in graded["rows"]} == students
    parts = sum(bool(e.checks) + e.conceptual for e in ch.exercises)
    for s in students:
        assert len([r for r in graded["rows"] if r["student"] == s]) == parts, s
    assert list(graded["rows"][0]) == COLUMNS


@pytest.mark.parametrize("student", [s for s in make_grade_fixtures.STUDENTS if s != "other_chapter"])
def test_each_fixture_gets_the_points_it_deserves(graded, student):
    expected = graded["manifest"]["students"][student][CHAPTER]
    rows = _auto(graded["rows"], student)
    ch = graded["book"][CHAPTER]
    assert set(rows) == {e.label for e in ch.exercises if e.checks}
    for label, fraction in expected["expect"].items():
        row = rows[label]
        got, top = float(row["points"]), float(row["max_points"])
        assert top == pytest.approx(ch.exercise(label).auto_points)
        assert got == pytest.approx(fraction * top, abs=0.01), (student, label, row["message"])
        assert row["passed"] == {1.0: "yes", 0.0: "no"}.get(fraction, "partial"), (student, label)
        assert expected["phrase"][label] in row["message"], (student, label, row["message"])


def test_the_points_come_from_the_exercise_badges(graded):
    ch = graded["book"][CHAPTER]
    for ex in ch.exercises:
        badge = book.points_in(ex.title, "") or book.points_in(*[
            book.cell_source(c) for c in json.loads(ch.path.read_text())["cells"]
            if f":label: {ex.label}" in book.cell_source(c)])
        if badge is not None:
            assert ex.points == badge and ex.points_source == "badge"
        assert ex.auto_points + ex.hand_points == pytest.approx(ex.points)
    total = {r["student"]: r for r in graded["totals"]}
    assert float(total["correct"]["points"]) == sum(e.auto_points for e in ch.exercises)
    assert float(total["empty"]["points"]) == 0


def test_a_crash_costs_only_its_own_exercise_and_a_dead_kernel_is_replayed(graded):
    notes = {r["student"]: r["notes"] for r in graded["totals"]}
    assert "raised ValueError" in notes["crash"]
    assert "crashed the kernel" in notes["crash"] and "re-run without this cell" in notes["crash"]
    # cells are named as a student finds them: by exercise label and rank, never by a 0-based index
    assert re.search(r"the \d+(st|nd|rd|th) code cell of ex-", notes["crash"])
    assert not re.search(r"\bcell \d+\b", notes["crash"])


def test_an_infinite_loop_is_stopped_and_the_rest_graded(graded):
    notes = {r["student"]: r["notes"] for r in graded["totals"]}
    assert re.search(r"(was stopped after|still running after) \d+ s", notes["loop"])
    looping = [r for r in _auto(graded["rows"], "loop").values() if "did not return" in r["message"]]
    assert len(looping) == 1 and f"stopped after {CELL_TIMEOUT} s" in looping[0]["message"]
    assert looping[0]["passed"] in ("no", "partial")


def test_edited_checks_tampering_and_stored_outputs_are_not_trusted(graded):
    nb = nbformat.read(graded["subs"] / "edited_check" / f"{CHAPTER}.ipynb", as_version=4)
    stored = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert stored and all("PASSED" in o.get("text", "") for o in stored)
    for student in ("edited_check", "tamper"):
        assert any(r["passed"] == "no" for r in _auto(graded["rows"], student).values())
    notes = {r["student"]: r["notes"] for r in graded["totals"]}
    assert "raised" in notes["tamper"]                   # the network cell fails: the sandbox has none


def test_a_renamed_function_is_named_in_the_message(graded):
    row = next(r for r in _auto(graded["rows"], "renamed").values() if r["passed"] != "yes")
    assert "was the function renamed?" in row["message"]


def test_a_notebook_of_another_chapter_is_not_graded_as_the_assigned_one(graded):
    rows = [r for r in graded["rows"] if r["student"] == "other_chapter"]
    holds = graded["manifest"]["students"]["other_chapter"][CHAPTER]["holds"]
    assert rows and all(r["points"] in ("", "0") for r in rows)
    assert all("not submitted" in r["message"] for r in rows if r["grading"] == "auto")
    assert all(holds in r["message"] for r in rows if r["grading"] == "auto")


def test_without_an_assignment_a_misplaced_notebook_is_graded_as_what_it_holds(graded, tmp_path):
    holds = graded["manifest"]["students"]["other_chapter"][CHAPTER]["holds"]
    subs = tmp_path / "subs" / "other_chapter"
    subs.mkdir(parents=True)
    (subs / f"{CHAPTER}.ipynb").write_bytes((graded["subs"] / "other_chapter" / f"{CHAPTER}.ipynb").read_bytes())
    assert grade.main([str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--cell-timeout",
                       str(CELL_TIMEOUT), "--quiet"]) == 0
    rows = [r for r in _read(tmp_path / "out" / "gradebook.csv") if r["grading"] == "auto"]
    assert rows and {r["chapter"] for r in rows} == {holds}
    assert all(r["passed"] == "yes" for r in rows), [r["message"] for r in rows if r["passed"] != "yes"]
    totals = _read(tmp_path / "out" / "totals.csv")
    assert f"is named {CHAPTER}.ipynb but holds the exercises of chapter" in totals[0]["notes"]


def test_parts_graded_by_hand_are_listed_with_their_rubric(graded):
    ch = graded["book"][CHAPTER]
    hand = [r for r in graded["rows"] if r["student"] == "correct" and r["grading"] == "by hand"]
    assert {r["exercise"] for r in hand} == {e.label for e in ch.exercises if e.conceptual}
    for r in hand:
        assert r["points"] == "" and r["passed"] == "by hand" and "Rubric:" in r["message"]
    listing = (graded["out"] / "by_hand.md").read_text()
    for ex in ch.exercises:
        if ex.conceptual:
            assert f"## {ex.label} " in listing
    assert "**My answer.**" in listing                          # the student's own cells are quoted


def test_every_student_gets_a_feedback_file_with_the_checks_messages(graded):
    folder = graded["out"] / "feedback"
    assert {p.stem for p in folder.glob("*.md")} == set(graded["manifest"]["students"])
    text = (folder / "wrong.md").read_text()
    assert "NOT YET" in text and "### ex-" in text
    assert "graded by your instructor" in text


# --------------------------------------------------------------------------- fast unit tests

def test_every_check_call_of_the_book_resolves_to_a_function_of_the_package():
    import importlib
    from unittest.mock import MagicMock
    for stem, ch in book.read_book(ROOT).items():
        assert ch.exercises, stem
        for ex in ch.exercises:
            for check in ex.checks:
                module = importlib.import_module(check.module)
                assert callable(getattr(module, check.function)), (ex.label, check.call)
                args = eval(check.thunk, {n: MagicMock() for n in check.names})()   # noqa: S307 - the book's code
                assert isinstance(args, tuple) and len(args) == 2


def test_every_part_graded_by_hand_has_a_rubric_in_the_guide():
    rubrics = book.read_rubrics(ROOT / "appendix" / "instructors.md")
    missing = [ex.label for ch in book.read_book(ROOT).values() for ex in ch.exercises
               if ex.conceptual and ex.label not in rubrics]
    assert not missing, f"add a rubric to the Grading section of appendix/instructors.md for {missing}"


def test_points_badges_and_defaults():
    assert book.points_in("Implement it **(★★, 3 points)**") == 3
    assert book.points_in("(1 point)") == 1 and book.points_in("(conceptual, 2.5 points)") == 2.5
    assert book.points_in("the published points (224 tokens/s at 2,500 tokens)") is None
    assert book.points_in("Fit the two-point model") is None


def test_exercise_regions_and_check_calls():
    cells = [nbformat.v4.new_markdown_cell("```{exercise-start} A\n:label: ex-a\n```\ntext\n```{exercise-end}\n```"),
             nbformat.v4.new_markdown_cell("```{exercise-start} B (2 points)\n:label: ex-b\n```"),
             nbformat.v4.new_code_cell("x = ...\nprint(check_answer('ex-b/x', x))"),
             nbformat.v4.new_markdown_cell("```{exercise-end}\n```")]
    assert book.exercise_spans(cells) == [("ex-a", "A", 0, 0), ("ex-b", "B (2 points)", 1, 3)]
    calls, rest = book.check_calls(book.parse_code(book.cell_source(cells[2])))
    assert len(calls) == 1 and len(rest) == 1
    check = book._thunk(calls[0])
    assert eval(check, {"x": 7})() == (("ex-b/x", 7), {})            # noqa: S307


def test_a_notebook_is_identified_by_its_labels_before_its_name(tmp_path):
    chapters = book.read_book(ROOT)
    stems = list(chapters)
    nb = nbformat.read(chapters[stems[1]].path, as_version=4)
    path = tmp_path / f"{stems[0]}.ipynb"
    nbformat.write(nb, path)
    sub = Submission("s", path, path.name, nb=nb)
    identify(sub, chapters)
    assert sub.chapter == stems[1] and "but holds the exercises of chapter" in sub.notes[0]
    empty = Submission("s", tmp_path / f"{stems[2]}.ipynb", "x")
    identify(empty, chapters)
    assert empty.chapter == stems[2]


def test_the_exports_for_otter_grader_and_nbgrader_hold_every_check(tmp_path):
    import zipfile
    from grading.export import export_nbgrader, export_otter
    chapters = book.read_book(ROOT)
    ch = chapters[CHAPTER]
    n_checks = sum(len(e.checks) for e in ch.exercises)
    [zip_path] = export_otter({CHAPTER: ch}, tmp_path / "otter")
    names = zipfile.ZipFile(zip_path).namelist()
    tests = [n for n in names if n.startswith("tests/")]
    assert "otter_config.json" in names and len(tests) == n_checks
    points = 0.0
    for name in tests:
        spec = {}
        exec(zipfile.ZipFile(zip_path).read(name).decode(), spec)             # noqa: S102 - our own output
        code = spec["test"]["suites"][0]["cases"][0]["code"]
        assert code.startswith(">>> from fixedstate.checks.") and "assert _result.passed" in code
        points += spec["test"]["points"]
    assert points == pytest.approx(sum(e.auto_points for e in ch.exercises), abs=0.01)

    [path] = export_nbgrader({CHAPTER: ch}, tmp_path / "nbgrader", ROOT, "week3")
    assert path == tmp_path / "nbgrader" / "source" / "week3" / f"{CHAPTER}.ipynb"
    nb = nbformat.read(path, as_version=4)
    graded = [c.metadata["nbgrader"] for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    tests = [m for m in graded if not m["solution"]]
    answers = [m for m in graded if m["solution"]]
    assert len(tests) == n_checks and all(m["locked"] for m in tests)
    assert len(answers) == sum(1 for e in ch.exercises if e.conceptual)
    assert sum(m["points"] for m in graded) == pytest.approx(sum(e.points for e in ch.exercises), abs=0.01)
    assert len({m["grade_id"] for m in graded}) == len(graded)
