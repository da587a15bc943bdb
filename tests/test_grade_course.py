"""The gradebook workflow of a course (issue #28): roster, Canvas import, hand points kept across
re-runs, late policy, duplicates, feedback names, the assignment's chapters, a misspelt make
variable, CSVs Excel opens, no MissingIDFieldWarning, the otter export's requirements.

Fast: no kernel starts (the notebooks that reach the grader are unreadable, or the reports are
written from grades made here).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import warnings
import zipfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import grade  # noqa: E402
from grading import book, course, report  # noqa: E402
from grading.grader import Graded, Options, Submission, _not_graded, _pick_latest, assignment, grade_all  # noqa: E402
from grading.grader import identify, read_submission  # noqa: E402
from grading.sandbox import Sandbox  # noqa: E402

CHAPTER = "03_delta_rule"
NEXT = "04_state_space_models"


@pytest.fixture(scope="module")
def chapters():
    return book.read_book(ROOT)


def _read(path):
    with open(path, newline="", encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


def _graded(chapters, student, points_fraction=1.0, roster=None):
    ch = chapters[CHAPTER]
    results = _not_graded(ch, "made here")
    for r in results:
        r.points = r.exercise.auto_points * points_fraction
    g = Graded(student, ch, Submission(student, Path(f"{student}.ipynb"), f"{student}/{CHAPTER}.ipynb",
                                       nb=object()), results, [])
    g.roster = roster
    return g


def _corrupt_class(folder: Path, students):
    for s in students:
        (folder / s).mkdir(parents=True)
        (folder / s / f"{CHAPTER}.ipynb").write_bytes(b"")


NO_KERNEL = Sandbox("none", "no kernel starts in these tests")


def test_every_roster_row_gets_a_grade_with_or_without_a_notebook(tmp_path, chapters):
    roster_path = tmp_path / "roster.csv"
    roster_path.write_text("name,id,email\nZoë Müller,1001,zoe@uni.edu\n李雷,1002,lilei@uni.edu\n"
                           "Ann Lee,1003,ann@uni.edu\n", encoding="utf-8")
    roster = course.read_roster(roster_path)
    _corrupt_class(tmp_path / "subs", ["zoe", "stranger"])                # zoe by e-mail; stranger on no row
    graded = grade_all(tmp_path / "subs", chapters, Options(chapters=[CHAPTER]), NO_KERNEL, roster=roster)
    by_student = {g.student: g for g in graded}
    assert set(by_student) == {"zoe", "stranger", "1002", "1003"}
    assert by_student["zoe"].roster.name == "Zoë Müller"
    assert by_student["1002"].submission is None and "not submitted" in by_student["1002"].notes[0]
    assert any("matches no one on the roster" in n for n in by_student["stranger"].notes)
    bad = tmp_path / "bad.csv"
    bad.write_text("name,email\nx,y\n")
    with pytest.raises(ValueError, match="missing id"):
        course.read_roster(bad)


def test_the_canvas_file_has_one_column_per_assignment_and_the_points_possible(tmp_path, chapters):
    entry = course.RosterEntry("Zoë Müller", "1001", "zoe@uni.edu", "A")
    g = _graded(chapters, "zoe", 1.0, entry)
    hand = {("zoe", e.label): str(e.hand_points) for e in chapters[CHAPTER].exercises if e.conceptual}
    path = report.write_canvas([g, _graded(chapters, "bob", 0.5)], tmp_path / "canvas.csv", hand)
    rows = list(csv.reader(open(path, encoding="utf-8-sig")))
    ch = chapters[CHAPTER]
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", f"Chapter 03: {ch.title}"]
    assert rows[1][0] == "Points Possible" and float(rows[1][5]) == sum(e.points for e in ch.exercises)
    zoe = next(r for r in rows if r[0] == "Zoë Müller")
    assert zoe[2:5] == ["1001", "zoe@uni.edu", "A"] and float(zoe[5]) == sum(e.points for e in ch.exercises)
    bob = next(r for r in rows if r[0] == "bob")
    assert bob[5] == ""                         # hand points still missing: Canvas keeps what it has


def test_hand_points_survive_a_re_run(tmp_path, chapters):
    out = tmp_path / "out"
    report.write_reports([_graded(chapters, "ann")], out)
    rows = _read(out / "gradebook.csv")
    hand_rows = [r for r in rows if r["grading"] == "by hand"]
    assert hand_rows and all(r["points"] == "" for r in hand_rows)
    for k, r in enumerate(hand_rows):
        r["points"] = str(k + 1)
    with open(out / "gradebook.csv", "w", newline="", encoding="utf-8-sig") as f:
        w = csv.DictWriter(f, fieldnames=report.COLUMNS)
        w.writeheader()
        w.writerows(rows)
    report.write_reports([_graded(chapters, "ann", 0.0)], out)          # the re-run: new automatic points
    again = _read(out / "gradebook.csv")
    assert [r["points"] for r in again if r["grading"] == "by hand"] == [str(k + 1) for k in range(len(hand_rows))]
    assert all(r["points"] == "0" for r in again if r["grading"] == "auto")
    totals = _read(out / "totals.csv")
    assert float(totals[0]["total"]) == sum(range(1, len(hand_rows) + 1))


def test_the_late_policy_counts_started_days_after_the_grace_period(tmp_path):
    policy = course.LatePolicy.parse("2026-03-01T23:59+00:00", 10, 15, 3)
    deadline = policy.deadline
    assert policy.late_days(deadline + timedelta(minutes=14)) == 0
    assert policy.late_days(deadline + timedelta(minutes=16)) == 1
    assert policy.late_days(deadline + timedelta(days=1, minutes=16)) == 2
    assert policy.penalty(2) == pytest.approx(0.2) and policy.penalty(4) == 1.0
    with pytest.raises(ValueError, match="--deadline"):
        course.LatePolicy.parse("next friday", 10, 0, None)
    with pytest.raises(ValueError, match="--late-penalty"):
        course.LatePolicy.parse(None, 120, 0, None)
    nb = tmp_path / "s" / f"{CHAPTER}.ipynb"
    nb.parent.mkdir()
    nb.write_text("{}")
    stamp = datetime(2026, 3, 2, 10, 0, tzinfo=timezone.utc).timestamp()
    os.utime(nb, (stamp, stamp))
    assert course.submitted_at(nb) == (datetime(2026, 3, 2, 10, 0, tzinfo=timezone.utc), "the notebook's timestamp")
    (nb.parent / "submitted_at.txt").write_text("2026-03-01T23:00:00Z\n")
    when, source = course.submitted_at(nb)
    assert when == datetime(2026, 3, 1, 23, 0, tzinfo=timezone.utc) and source == "submitted_at.txt"


def test_a_late_notebook_loses_the_policy_s_share_in_totals_and_canvas(tmp_path, chapters):
    _corrupt_class(tmp_path / "subs", ["late"])
    (tmp_path / "subs" / "late" / "submitted_at.txt").write_text("2026-03-03T12:00:00Z")
    policy = course.LatePolicy.parse("2026-03-01T23:59:00Z", 25, 0, None)
    [g] = grade_all(tmp_path / "subs", chapters, Options(chapters=[CHAPTER]), NO_KERNEL, policy=policy)
    assert g.late_days == 2 and g.penalty == pytest.approx(0.5)
    assert any("2 days late" in n and "50% of the points" in n for n in g.notes)


def test_duplicates_follow_the_stated_policy(tmp_path):
    subs = []
    for k, name in enumerate(["a/03_delta_rule.ipynb", "a/03_delta_rule (1).ipynb"]):
        s = Submission("a", tmp_path / name, name, nb=object(), chapter=CHAPTER)
        s.submitted = datetime(2026, 3, 1, 12 - k, tzinfo=timezone.utc)     # the first one is the later
        subs.append(s)
    keep, notes = _pick_latest(subs)
    assert [s.rel for s in keep] == ["a/03_delta_rule.ipynb"]
    assert "handed in last" in notes[("a", CHAPTER)][0] and "duplicate policy: latest" in notes[("a", CHAPTER)][0]


def test_feedback_file_names_never_collide(tmp_path, chapters):
    report.write_reports([_graded(chapters, "anne marie"), _graded(chapters, "anne_marie", 0.0),
                          _graded(chapters, "李雷")], tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out" / "feedback").glob("*.md"))
    assert len(files) == 3 and "anne_marie.md" in files
    texts = {p.read_text(encoding="utf-8").splitlines()[0] for p in (tmp_path / "out" / "feedback").glob("*.md")}
    assert texts == {"# Feedback for anne marie", "# Feedback for anne_marie", "# Feedback for 李雷"}


def test_the_assignment_comes_from_the_class_not_from_one_misfiled_notebook(tmp_path, chapters):
    nb03 = nbformat.read(chapters[CHAPTER].path, as_version=4)
    nb04 = nbformat.read(chapters[NEXT].path, as_version=4)
    subs = []
    for student, nb in (("a", nb03), ("b", nb03), ("c", nb04)):        # c handed chapter 4 in as chapter 3
        path = tmp_path / student / f"{CHAPTER}.ipynb"
        path.parent.mkdir()
        nbformat.write(nb, path)
        s = Submission(student, path, f"{student}/{path.name}")
        read_submission(s)
        identify(s, chapters)
        subs.append(s)
    assert assignment(subs, chapters) == [CHAPTER]
    assert assignment(subs[2:], chapters) == [NEXT]           # alone, a notebook is graded as what it holds


def test_a_misspelt_make_variable_is_an_error_not_the_fake_class():
    run = subprocess.run(["make", "-n", "grade", "SUBMISSION=somewhere"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0
    assert "unknown variable SUBMISSION" in run.stderr and "SUBMISSIONS=<folder>" in run.stderr
    ok = subprocess.run(["make", "-n", "grade", "SUBMISSIONS=somewhere"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and "make_grade_fixtures" not in ok.stdout


def test_the_csvs_open_in_excel_with_names_intact(tmp_path, chapters):
    out = tmp_path / "out"
    report.write_reports([_graded(chapters, "Zoë"), _graded(chapters, "李雷")], out)
    for name in ("gradebook.csv", "totals.csv", "canvas.csv"):
        raw = (out / name).read_bytes()
        assert raw.startswith(b"\xef\xbb\xbf"), name
        text = raw.decode("utf-8-sig")
        assert "Zoë" in text and "李雷" in text


def test_a_notebook_without_cell_ids_reads_without_a_warning(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    raw = nbformat.writes(nb)
    import json
    data = json.loads(raw)
    data["nbformat_minor"] = 5
    for cell in data["cells"]:
        cell.pop("id", None)
    path = tmp_path / "old.ipynb"
    path.write_text(json.dumps(data))
    s = Submission("s", path, "old.ipynb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_submission(s)
    assert s.nb is not None and s.nb.cells[0]["id"]


def test_readme_names_make_grade():
    assert "make grade SUBMISSIONS=<folder>" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_otter_export_requires_fixedstate(tmp_path, chapters):
    from grading.export import export_otter
    wheel = tmp_path / "fixedstate-9.9.9-py3-none-any.whl"
    wheel.write_bytes(b"not a real wheel")
    [zip_path] = export_otter({CHAPTER: chapters[CHAPTER]}, tmp_path / "otter", "9.9.9", wheel)
    z = zipfile.ZipFile(zip_path)
    requirements = z.read("requirements.txt").decode()
    assert "fixedstate==9.9.9" in requirements.splitlines()
    assert f"files/{wheel.name}" in z.namelist()


def test_grade_refuses_a_bad_roster_and_deadline_with_a_clear_message(tmp_path, capsys):
    (tmp_path / "subs").mkdir()
    with pytest.raises(SystemExit):
        grade.main([str(tmp_path / "subs"), "--out", str(tmp_path / "o"), "--deadline", "soon"])
    assert "--deadline: expected an ISO 8601 time" in capsys.readouterr().err
