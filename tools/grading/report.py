"""Write what the grader found: the gradebook, the per-student feedback and the list to grade by hand.

- ``gradebook.csv``: one row per student and exercise part, with the columns
  ``student, exercise, points, max_points, passed, message`` and then
  ``grading`` (``auto`` or ``by hand``), ``chapter`` and ``notebook``. A row
  graded by hand has an empty ``points`` for the instructor to fill in, and the
  rubric as its message; an exercise with a checked part and a part graded by
  hand has one row of each.
- ``totals.csv``: per student and chapter, the points of the checked parts, their
  maximum, and the points still to be graded by hand.
- ``feedback/<student>.md``: what to return to the student: for every exercise
  the check's own message (what failed, on which case, expected versus got),
  the problems met running the notebook, and which parts the instructor grades.
- ``by_hand.md``: for each part graded by hand, its rubric and every student's
  answer (the cells they added inside the exercise), to grade them side by side.
- ``canvas.csv``: Canvas's gradebook import format (:func:`write_canvas`).

Every CSV starts with a UTF-8 byte-order mark, so that Excel opens names such
as Zoë or 李雷 intact. A re-run into a folder whose ``gradebook.csv`` holds points
typed into its ``by hand`` rows keeps them (:func:`grading.course.read_hand_points`).
A feedback file is named after the student's folder; a name that is not already
safe as a file name gets a short hash of the original, so two names never share
a file (``anne marie`` and ``anne_marie``).
"""

from __future__ import annotations

import csv
import hashlib
import re
from pathlib import Path

from .course import read_hand_points
from .grader import Graded, _fmt

__all__ = ["COLUMNS", "gradebook_rows", "write_reports"]

COLUMNS = ["student", "exercise", "points", "max_points", "passed", "message", "grading", "chapter", "notebook"]


def gradebook_rows(graded: list[Graded], hand: dict[tuple[str, str], str] | None = None) -> list[dict[str, str]]:
    hand = hand or {}
    rows = []
    for g in graded:
        nb = g.submission.rel if g.submission else ""
        for r in g.results:
            ex = r.exercise
            if ex.checks:
                review = g.review.get(ex.label)
                message = r.message + (f" [REVIEW BY HAND: {review}]" if review else "")
                rows.append(dict(student=g.student, exercise=ex.label, points=_fmt(r.points),
                                 max_points=_fmt(ex.auto_points), passed=r.passed, message=_flat(message),
                                 grading="auto", chapter=g.chapter.stem, notebook=nb))
            if ex.conceptual:
                rubric = (ex.rubric or "no rubric in the instructor's guide").rstrip(".") + "."
                sol = f" Worked solution: {ex.solution}." if ex.solution else ""
                missing = g.submission is None or g.submission.nb is None
                msg = ("nothing to grade: no readable notebook" if missing else "to grade by hand") \
                    + f". Rubric: {rubric}{sol}"
                kept = hand.get((g.student, ex.label), "")
                rows.append(dict(student=g.student, exercise=ex.label, points="0" if missing else kept,
                                 max_points=_fmt(ex.hand_points), passed="by hand", message=_flat(msg),
                                 grading="by hand", chapter=g.chapter.stem, notebook=nb))
    return rows


def _pts(x: float) -> str:
    return f"{_fmt(x)} point" + ("" if x == 1 else "s")


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _safe(name: str) -> str:
    """A file name for a student's folder name: itself if it is safe, else a cleaned form plus a short
    hash of the original (so ``anne marie`` and ``anne_marie`` never share a file)."""
    clean = re.sub(r"[^\w.@+-]+", "_", name).strip("._") or "student"
    if clean == name:
        return clean
    return f"{clean}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _feedback(student: str, items: list[Graded]) -> str:
    lines = [f"# Feedback for {student}", ""]
    for g in items:
        ch = g.chapter
        where = g.submission.rel if g.submission else "no notebook"
        lines += [f"## Chapter {ch.number}: {ch.title} ({where})", ""]
        lines.append(f"Checked automatically on cases of your own: {_fmt(g.points)} of {_pts(g.auto_max)}."
                     + (f" Graded by your instructor: {_pts(g.hand_max)} more." if g.hand_max else ""))
        if g.penalty:
            lines.append(f"Late: {g.late_days} day{'s' if g.late_days > 1 else ''}, {g.penalty:.0%} of the points "
                         "taken off by the course's late policy.")
        lines.append("")
        if g.notes:
            lines.append("Running your notebook from the top in a fresh kernel:")
            lines += [f"- {n}" for n in g.notes]
            lines.append("")
        for r in g.results:
            ex = r.exercise
            head = f"### {ex.label}" + (f": {ex.title}" if ex.title else "")
            lines += [head, ""]
            if ex.checks:
                mark = {"yes": "passed", "no": "not yet", "partial": "partly"}[r.passed]
                lines.append(f"Checked: {_fmt(r.points)} of {_pts(ex.auto_points)} ({mark}).")
                lines.append("")
                for k, text in enumerate(r.texts):
                    prefix = f"`{ex.checks[k].part}`: " if len(ex.checks) > 1 and k < len(ex.checks) else ""
                    lines.append(f"- {prefix}" + text.strip().replace("\n", "\n  "))
                lines.append("")
            if ex.conceptual:
                lines += [f"{'The conceptual part is' if ex.checks else 'This exercise is'} graded by your "
                          f"instructor ({_pts(ex.hand_points)}).", ""]
    return "\n".join(lines).rstrip() + "\n"


def _by_hand(graded: list[Graded]) -> str:
    lines = ["# Answers to grade by hand", "",
             "For each part graded by hand: its points, the rubric from the instructor's guide, and what",
             "each student wrote inside the exercise (the cells that are not in the book's notebook).", ""]
    chapters = sorted({g.chapter.stem: g.chapter for g in graded}.values(), key=lambda c: c.stem)
    for ch in chapters:
        items = [g for g in graded if g.chapter.stem == ch.stem]
        for ex in ch.exercises:
            if not ex.conceptual:
                continue
            lines += [f"## {ex.label} ({ch.stem}, {_pts(ex.hand_points)} by hand)", ""]
            if ex.title:
                lines += [f"*{ex.title}*", ""]
            lines += [f"**Rubric.** {ex.rubric or 'none in the instructor guide'}", ""]
            if ex.solution:
                lines += [f"**Worked solution.** {ex.solution}", ""]
            for g in items:
                answer = g.answers.get(ex.label)
                lines.append(f"### {g.student}")
                lines.append("")
                if g.submission is None or g.submission.nb is None:
                    lines.append("(no notebook)")
                elif not answer:
                    lines.append("(nothing written in this exercise)")
                else:
                    lines += ["\n\n".join(answer)]
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _total(g: Graded, hand: dict[tuple[str, str], str]) -> tuple[float, bool]:
    """The chapter's points after the late policy, and whether every part graded by hand has points."""
    points, complete = g.points, True
    for ex in g.chapter.exercises:
        if ex.conceptual and ex.hand_points:
            value = hand.get((g.student, ex.label), "")
            try:
                points += float(value)
            except ValueError:
                complete = complete and g.submission is None
    return points * (1.0 - g.penalty), complete


def write_canvas(graded: list[Graded], path: Path, hand: dict[tuple[str, str], str]) -> Path:
    """Canvas's gradebook import: ``Student, ID, SIS User ID, SIS Login ID, Section``, one column per
    chapter, a ``Points Possible`` row, one row per student; a chapter still waiting for hand points
    is left empty (Canvas then keeps what it has)."""
    chapters = sorted({g.chapter.stem: g.chapter for g in graded}.values(), key=lambda c: c.stem)
    head = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
    columns = [f"Chapter {c.number}: {c.title}" for c in chapters]
    by_student: dict[str, dict[str, Graded]] = {}
    for g in graded:
        by_student.setdefault(g.student, {})[g.chapter.stem] = g
    with open(path, "w", newline="", encoding="utf-8-sig") as f:
        w = csv.writer(f)
        w.writerow(head + columns)
        w.writerow(["Points Possible", "", "", "", ""]
                   + [_fmt(sum(e.points for e in c.exercises)) for c in chapters])
        for student, items in sorted(by_student.items()):
            entry = next((g.roster for g in items.values() if g.roster is not None), None)
            row = [entry.name if entry else student, "", entry.id if entry else student,
                   entry.email if entry else "", entry.section if entry else ""]
            for c in chapters:
                g = items.get(c.stem)
                if g is None:
                    row.append("")
                    continue
                total, complete = _total(g, hand)
                row.append(_fmt(round(total, 2)) if complete else "")
            w.writerow(row)
    return path


def write_reports(graded: list[Graded], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"gradebook": out / "gradebook.csv", "totals": out / "totals.csv", "canvas": out / "canvas.csv",
             "by_hand": out / "by_hand.md", "feedback": out / "feedback"}
    hand = read_hand_points(paths["gradebook"])       # the instructor's own points survive a re-run
    with open(paths["gradebook"], "w", newline="", encoding="utf-8-sig") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(gradebook_rows(graded, hand))
    with open(paths["totals"], "w", newline="", encoding="utf-8-sig") as f:
        w = csv.writer(f)
        w.writerow(["student", "chapter", "points", "max_points", "by_hand_max_points", "notebook", "notes",
                    "name", "id", "email", "submitted_at", "late_days", "late_penalty", "total"])
        for g in graded:
            total, complete = _total(g, hand)
            sub = g.submission
            w.writerow([g.student, g.chapter.stem, _fmt(g.points), _fmt(g.auto_max), _fmt(g.hand_max),
                        sub.rel if sub else "", _flat(" / ".join(g.notes)),
                        g.roster.name if g.roster else "", g.roster.id if g.roster else "",
                        g.roster.email if g.roster else "",
                        sub.submitted.isoformat(timespec="seconds") if sub is not None and sub.submitted else "",
                        g.late_days, f"{g.penalty:.0%}", _fmt(round(total, 2)) if complete else ""])
    write_canvas(graded, paths["canvas"], hand)
    paths["feedback"].mkdir(exist_ok=True)
    for old in paths["feedback"].glob("*.md"):
        old.unlink()
    students: dict[str, list[Graded]] = {}
    for g in graded:
        students.setdefault(g.student, []).append(g)
    for student, items in students.items():
        (paths["feedback"] / f"{_safe(student)}.md").write_text(_feedback(student, items), encoding="utf-8")
    paths["by_hand"].write_text(_by_hand(graded), encoding="utf-8")
    return paths
