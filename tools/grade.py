"""Grade a folder of submitted exercise notebooks: ``make grade SUBMISSIONS=<folder>``.

Usage: python tools/grade.py SUBMISSIONS [--out DIR] [--chapters 03 06] [--roster FILE]
                             [--deadline ISO] [--grace MIN] [--late-penalty PCT] [--duplicates latest|best]
                             [--timeout S] [--cell-timeout S] [--memory MB] [--disk MB] [--jobs N]
       python tools/grade.py --export-otter DIR [--chapters 03]       (otter-grader tests)
       python tools/grade.py --export-nbgrader DIR [--chapters 03]    (nbgrader source notebooks)

Each notebook runs from the top in a fresh kernel sealed in a bubblewrap
sandbox (tools/grading/sandbox.py: own PID, network and user namespaces, the
system and package read-only, nothing else of the machine visible, a private
tmpfs, kernel-enforced limits); the stored outputs are ignored. Then the
grader, outside the sandbox, has the student's functions called on hidden
cases drawn for that student (tools/grading/hidden/), receives the answers as
plain data and judges them with answers it computes itself. Writes
gradebook.csv, totals.csv, canvas.csv, feedback/<student>.md and by_hand.md to
--out (default _build/grade). See the "Grading" section of the instructor's
guide (appendix/instructors.md).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from time import monotonic

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grading.book import read_book  # noqa: E402
from grading.course import LatePolicy, read_roster  # noqa: E402
from grading.export import export_nbgrader, export_otter  # noqa: E402
from grading.grader import Options, _fmt, grade_all  # noqa: E402
from grading.report import write_reports  # noqa: E402
from grading.runner import probe_sandbox  # noqa: E402
from grading.sandbox import Sandbox, grading_edition  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _chapters(names: list[str] | None, book) -> list[str] | None:
    if not names:
        return None
    out = []
    for name in names:
        for part in name.replace(",", " ").split():
            stem = next((s for s, c in book.items() if part in (s, c.number, f"{s}.ipynb")
                         or (part.isdigit() and int(part) == int(c.number))), None)
            if stem is None:
                raise SystemExit(f"grade: no chapter {part!r}; the chapters are " + ", ".join(book))
            out.append(stem)
    return out


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


def _salt(out: Path) -> str:
    """The course's salt for the hidden cases: kept in OUT/.salt, so a re-run draws the same cases."""
    path = out / ".salt"
    if not path.exists():
        path.write_text(secrets.token_hex(16) + "\n")
        os.chmod(path, 0o600)
    return path.read_text().strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("submissions", type=Path, nargs="?",
                   help="the folder of submitted notebooks, one folder per student")
    p.add_argument("--out", type=Path, default=ROOT / "_build" / "grade", help="where to write the reports")
    p.add_argument("--chapters", nargs="*", default=None,
                   help="the assigned chapters (03, 03_delta_rule, ...): every student gets a row for each of "
                        "their exercises, and other chapters are not graded; default: what was handed in")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("GRADE_TIMEOUT", 120)),
                   help="seconds for all the code cells of one notebook (default 120)")
    p.add_argument("--cell-timeout", type=float, default=float(os.environ.get("GRADE_CELL_TIMEOUT", 30)),
                   help="seconds for one cell, and for one check (default 30)")
    p.add_argument("--memory", type=int, default=4096, help="memory limit of a kernel in MB (0: none; default 4096)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="notebooks graded at once (default: one per core)")
    p.add_argument("--processes", type=int, default=256, help="processes and threads of one sandbox (default 256)")
    p.add_argument("--disk", type=int, default=256, help="MB a notebook may write, in all (default 256)")
    p.add_argument("--salt", default=os.environ.get("FIXEDSTATE_GRADE_SALT", ""),
                   help="the course's secret that, with each student's id, draws the hidden cases (default: "
                        "one made at the first run and kept in OUT/.salt)")
    p.add_argument("--roster", type=Path, default=None,
                   help="a CSV with the columns name, id, email (and section): every row gets a grade, "
                        "handed in or not")
    p.add_argument("--deadline", default=None, help="the deadline, ISO 8601 (2026-03-01T23:59, local time "
                                                     "unless it says +hh:mm or Z); default: no late policy")
    p.add_argument("--grace", type=float, default=0.0, help="minutes after the deadline still on time (default 0)")
    p.add_argument("--late-penalty", type=float, default=10.0,
                   help="percent of the points off per day or part of a day late (default 10)")
    p.add_argument("--late-max-days", type=int, default=None, help="after this many days late, no points")
    p.add_argument("--duplicates", choices=["latest", "best"], default="latest",
                   help="several notebooks of one chapter from one student: grade the one handed in last "
                        "(default), or keep the best-scoring")
    p.add_argument("--no-sandbox", action="store_true",
                   help="grade without the bubblewrap sandbox (each student's code then runs with your rights)")
    p.add_argument("--points", type=Path, default=None,
                   help="a CSV (exercise,points) of the instructor's own points, overriding the book's badges")
    p.add_argument("--export-otter", type=Path, metavar="DIR",
                   help="instead of grading, write an otter-grader autograder.zip per chapter to DIR")
    p.add_argument("--export-nbgrader", type=Path, metavar="DIR",
                   help="instead of grading, write nbgrader source notebooks to DIR/source/<assignment>/")
    p.add_argument("--assignment", default="", help="the nbgrader assignment name (default: the chapter's)")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    book = read_book(args.root, args.points)
    if args.export_otter or args.export_nbgrader:
        chosen = {s: book[s] for s in (_chapters(args.chapters, book) or book)}
        if args.export_otter:
            import kit
            with tempfile.TemporaryDirectory() as tmp:
                wheel = kit.build_wheel(Path(tmp), args.root)
                paths = export_otter(chosen, args.export_otter, kit.version(args.root), wheel)
            for path in paths:
                print(f"otter-grader autograder: {path}")
        if args.export_nbgrader:
            for path in export_nbgrader(chosen, args.export_nbgrader, args.root, args.assignment):
                print(f"nbgrader source notebook: {path}")
        return 0
    if args.submissions is None or not args.submissions.is_dir():
        p.error(f"{args.submissions} is not a folder")
    try:
        roster = read_roster(args.roster) if args.roster else None
        policy = LatePolicy.parse(args.deadline, args.late_penalty, args.grace, args.late_max_days)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    sandbox = (Sandbox("none", "NO SANDBOX (--no-sandbox): each student's code runs with your account's rights")
               if args.no_sandbox else probe_sandbox())
    args.out.mkdir(parents=True, exist_ok=True)
    opts = Options(timeout=args.timeout, cell_timeout=args.cell_timeout, memory_mb=args.memory, jobs=args.jobs,
                   chapters=_chapters(args.chapters, book), salt=args.salt or _salt(args.out),
                   processes=args.processes, disk_mb=args.disk, duplicates=args.duplicates,
                   edition=grading_edition(Path(tempfile.mkdtemp(prefix="fsgrade-edition-")) / "checks"))
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    say(f"grading {args.submissions} ({sandbox.description}; {opts.timeout:g} s per notebook, "
        f"{opts.cell_timeout:g} s per cell, {opts.jobs} at a time)")
    t0 = monotonic()

    def progress(g, done, total):
        n_checks = sum(len(r.outcomes) for r in g.results)
        n_passed = sum(o.passed for r in g.results for o in r.outcomes)
        elapsed = monotonic() - t0
        left = elapsed / done * (total - done)
        say(f"  [{done}/{total} {_clock(elapsed)} elapsed, ~{_clock(left)} left] {g.student:<16} "
            f"{g.submission.rel if g.submission else '-':<36} {n_passed}/{n_checks} checks, "
            f"{_fmt(g.points)}/{_fmt(g.auto_max)} points ({g.seconds:.1f} s)")

    try:
        graded = grade_all(args.submissions, book, opts, sandbox, progress, roster=roster, policy=policy)
    finally:
        shutil.rmtree(opts.edition.parent, ignore_errors=True)
    paths = write_reports(graded, args.out)
    say(f"graded {len({g.student for g in graded})} students in {monotonic() - t0:.1f} s")
    for g in graded:
        say(f"  {g.student:<16} {g.chapter.stem:<24} {_fmt(g.points):>6} / {_fmt(g.auto_max):<6}"
            + (f" + {_fmt(g.hand_max)} by hand" if g.hand_max else "")
            + (f"  (late {g.late_days} d: -{g.penalty:.0%})" if g.penalty else "")
            + ("  REVIEW: " + ", ".join(g.review) if g.review else ""))
    for name, path in paths.items():
        say(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
