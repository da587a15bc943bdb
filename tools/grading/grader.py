"""Find the submissions, tell which chapter each holds, run and grade them, score the exercises.

A submissions folder holds one folder per student, with the student's
notebooks anywhere below it (``<folder>/<student>/03_delta_rule.ipynb``, or
nbgrader's ``<folder>/<student>/<assignment>/03_delta_rule.ipynb``); a notebook
directly in the folder counts as the submission of the student its file is
named after (``<folder>/alice.ipynb``). Checkpoint folders are ignored.

Which chapter a notebook holds is read from its content, the ``:label: ex-...``
of its exercise directives, matched against the book's exercise notebooks; the
file name decides only when the content cannot (a file that is not a readable
notebook), and a file name that names another chapter than the content is
reported.
"""

from __future__ import annotations

import asyncio
import ast
import importlib
import json
import re
import secrets
import shutil
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from time import monotonic

import nbformat

from . import hidden
from .course import LatePolicy, RosterEntry, match_roster, submitted_at
from .book import Chapter, Exercise, cell_source, exercise_spans, function_arity, normalise, parse_code
from .judge import driver_code, judge
from .runner import GRADE_MIME, KernelSession, Limits, Sandbox, scratch_dir
from .sandbox import claim_slots

__all__ = ["Options", "Submission", "Graded", "ExerciseResult", "discover", "identify", "grade_all"]

LABEL_ANYWHERE = re.compile(r":label:\s*(ex-[\w-]+)")
MAX_RESTARTS = 3
START_ATTEMPTS = 3


@dataclass
class Options:
    timeout: float = 120.0         # seconds for all the student's cells of one notebook
    cell_timeout: float = 30.0     # seconds for one cell, and for one check call
    memory_mb: int = 4096          # address-space limit of a kernel (0: none)
    jobs: int = 2                  # notebooks graded at once
    chapters: list[str] | None = None   # the assigned chapters (stems); None: whatever was handed in
    salt: str = ""                 # the course's secret: with the student id it seeds the hidden cases
    processes: int = 256           # processes and threads of one sandbox
    disk_mb: int = 256             # the sandbox's writable tmpfs
    edition: Path | None = None    # the grading edition of fixedstate/checks (sandbox.grading_edition)
    duplicates: str = "latest"     # several notebooks of one chapter: "latest" (by time handed in) or "best"

    def limits(self) -> Limits:
        return Limits(memory_mb=self.memory_mb, processes=self.processes, disk_mb=self.disk_mb,
                      cpu_seconds=int(self.timeout + 60))


@dataclass
class Submission:
    student: str
    path: Path
    rel: str                       # the path inside the submissions folder
    nb: object | None = None       # the notebook, if it could be read
    problem: str = ""              # why it could not be read
    chapter: str | None = None     # the chapter it holds (a stem)
    notes: list[str] = field(default_factory=list)
    submitted: object | None = None    # when it was handed in (datetime), see grading.course.submitted_at
    submitted_from: str = ""


@dataclass
class CheckOutcome:
    status: str                    # ok | undefined | error | timeout | killed | died | interrupted | not run
    passed: bool = False
    message: str = ""
    details: list[str] = field(default_factory=list)
    name: str = ""                 # the undefined name


@dataclass
class ExerciseResult:
    exercise: Exercise
    points: float                  # the points of the checked part
    outcomes: list[CheckOutcome]
    message: str
    texts: list[str] = field(default_factory=list)   # one line per check, for the feedback

    @property
    def passed(self) -> str:
        n = sum(o.passed for o in self.outcomes)
        return "yes" if n == len(self.outcomes) else ("no" if n == 0 else "partial")


@dataclass
class Graded:
    """One student's grade for one chapter."""
    student: str
    chapter: Chapter
    submission: Submission | None
    results: list[ExerciseResult]
    notes: list[str]               # about running the notebook: crashed cells, time-outs, other files
    seconds: float = 0.0
    answers: dict[str, list[str]] = field(default_factory=dict)   # label -> the student's own cells
    review: dict[str, str] = field(default_factory=dict)   # label -> why the instructor should look by hand
    roster: RosterEntry | None = None
    late_days: int = 0
    penalty: float = 0.0           # the fraction of the points the late policy takes off

    @property
    def points(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def auto_max(self) -> float:
        return sum(e.auto_points for e in self.chapter.exercises)

    @property
    def hand_max(self) -> float:
        return sum(e.hand_points for e in self.chapter.exercises)


# --------------------------------------------------------------------------- finding the submissions

def discover(folder: Path) -> list[Submission]:
    subs = []
    for path in sorted(folder.rglob("*.ipynb")):
        rel = path.relative_to(folder)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        student = rel.parts[0] if len(rel.parts) > 1 else path.stem
        subs.append(Submission(student=student, path=path, rel=rel.as_posix()))
    return subs


def read_submission(sub: Submission) -> None:
    try:
        if sub.path.stat().st_size == 0:
            raise ValueError("the file is empty (0 bytes)")
        with warnings.catch_warnings():           # cells without ids (older Jupyter): given ids below
            warnings.simplefilter("ignore")
            nb = nbformat.read(sub.path, as_version=4)
        for i, cell in enumerate(nb.get("cells", [])):
            if isinstance(cell, dict) and not cell.get("id"):
                cell["id"] = f"cell-{i}"
        if not isinstance(nb.get("cells"), list):
            raise ValueError("it has no cells")
        sub.nb = nb
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported, not raised
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        sub.problem = f"not a readable notebook: {msg[:200]}"


def _chapter_by_name(name: str, chapters: dict[str, Chapter]) -> str | None:
    m = re.match(r"(\d\d)[_\- ]", name)
    if m:
        return next((s for s, c in chapters.items() if c.number == m.group(1)), None)
    return next((s for s in chapters if s in name), None)


def identify(sub: Submission, chapters: dict[str, Chapter]) -> None:
    """Set ``sub.chapter`` from the labels in the notebook (else its file name); note a mismatch."""
    by_name = _chapter_by_name(sub.path.name, chapters)
    by_content = None
    if sub.nb is not None:
        labels = set()
        for cell in sub.nb.cells:
            if cell.get("cell_type") == "markdown":
                labels.update(LABEL_ANYWHERE.findall(cell_source(cell)))
        scores = {stem: len(labels & set(ch.labels)) for stem, ch in chapters.items()}
        best = max(scores.values(), default=0)
        if best > 0:
            tops = [s for s, v in scores.items() if v == best]
            by_content = by_name if by_name in tops else tops[0]
        else:
            imports = set()
            for cell in sub.nb.cells:
                if cell.get("cell_type") == "code":
                    imports.update(re.findall(r"fixedstate\.checks\.(\w+)", cell_source(cell)))
            matches = [s for s, ch in chapters.items() if {m.rsplit(".", 1)[-1] for m in ch.check_modules} & imports]
            if by_name in matches:
                by_content = by_name
            elif len(matches) == 1:
                by_content = matches[0]
    sub.chapter = by_content or by_name
    if by_content and by_name and by_content != by_name:
        sub.notes.append(f"the file is named {sub.path.name} but holds the exercises of chapter "
                         f"{chapters[by_content].number} ({chapters[by_content].stem}.ipynb)")


# --------------------------------------------------------------------------- running one notebook

@dataclass
class _Run:
    cell_notes: dict[int, str] = field(default_factory=dict)
    outcomes: dict[tuple[str, int], CheckOutcome] = field(default_factory=dict)
    fatal: set = field(default_factory=set)
    ran_out_at: int | None = None
    notes: list[str] = field(default_factory=list)


def _snippet(check, helper: str = "_fixedstate_grader") -> str:
    return (f'__import__("sys").modules["{helper}"].run({check.module!r}, {check.function!r}, '
            f"{check.thunk})")


def _from_grade(data: dict) -> CheckOutcome:
    return CheckOutcome(status=data.get("status", "error"), passed=bool(data.get("passed")),
                        message=str(data.get("message", "")), details=list(data.get("details", [])),
                        name=str(data.get("name", "")))


def _check_outcome(reply, cases) -> CheckOutcome:
    verdict = judge(cases, reply)
    if verdict.status == "undefined":
        return CheckOutcome("undefined", name=verdict.message)
    if verdict.status == "timeout":
        return CheckOutcome("timeout")
    return CheckOutcome("ok", passed=verdict.passed, message=verdict.message)


async def run_notebook(sub: Submission, chapter: Chapter, opts: Options, sandbox: Sandbox, slot: int = 0) -> _Run:
    """Execute the submission's code cells, then every check of its chapter on the student's hidden
    cases; never raises. Points come only from :func:`grading.judge.judge`, outside the kernel."""
    run = _Run()
    cells = [(i, cell_source(c)) for i, c in enumerate(sub.nb.cells)
             if c.get("cell_type") == "code" and cell_source(c).strip()
             and normalise(cell_source(c)) not in chapter.check_cells]
    checks = [(ex.label, j, check) for ex in chapter.exercises for j, check in enumerate(ex.checks)]
    scratch = scratch_dir()
    files = scratch / "files"
    files.mkdir()
    for sibling in sub.path.parent.iterdir():      # files next to the notebook (a module of the student's)
        try:
            if sibling.is_file() and not sibling.is_symlink() and sibling.suffix != ".ipynb" \
                    and sibling.stat().st_size < 2_000_000:
                shutil.copyfile(sibling, files / sibling.name)
        except OSError:
            pass
    nonce = secrets.token_hex(12)
    deadline = monotonic() + opts.timeout
    restarts = 0
    try:
        while True:
            for attempt in range(START_ATTEMPTS):      # a start can fail on a loaded machine: try again
                session = KernelSession(scratch=scratch, sandbox=sandbox, limits=opts.limits(), slot=slot,
                                        edition=opts.edition, nonce=nonce)
                try:
                    await session.start()
                    break
                except Exception as exc:  # noqa: BLE001
                    await session.stop()
                    failure = exc
            else:
                run.notes.append(f"the grader could not start a kernel ({type(failure).__name__}, "
                                 f"{START_ATTEMPTS} attempts)")
                for label, j, _ in checks:
                    run.outcomes.setdefault((label, j), CheckOutcome("not run", message="the kernel did not start"))
                return run
            restart = False
            for i, src in cells:
                if i in run.fatal:
                    continue
                remaining = deadline - monotonic()
                if remaining <= 0.5:
                    if run.ran_out_at is None:
                        run.ran_out_at = i
                    run.cell_notes.setdefault(i, f"was not run: the notebook's time limit of {opts.timeout:g} s "
                                                 "ran out before it")
                    continue
                out = await session.execute(src, i, min(opts.cell_timeout, remaining))
                if out.status == "error":
                    run.cell_notes.setdefault(i, f"raised {out.error}")
                elif out.status == "timeout":
                    run.cell_notes.setdefault(i, f"was stopped after {out.elapsed:.0f} s, still running "
                                                 "(an infinite loop?)")
                elif out.status in ("killed", "died"):
                    run.fatal.add(i)
                    run.cell_notes[i] = (
                        f"was still running after {out.elapsed:.0f} s and did not stop when interrupted: the "
                        "kernel was killed, and the notebook re-run without this cell" if out.status == "killed"
                        else "crashed the kernel (Python itself died: a segfault, os._exit, or too much memory); "
                             "the notebook was re-run without this cell")
                    restart = True
                    break
            if not restart:
                for label, j, check in checks:
                    if (label, j) in run.outcomes:
                        continue
                    found = hidden.cases_for(check, hidden.seed(opts.salt, sub.student, label, j))
                    if found is None:
                        run.outcomes[(label, j)] = CheckOutcome("no hidden cases")
                        continue
                    spec, cases = found
                    code = driver_code(check.thunk, spec.arg, spec.kind, cases, nonce, GRADE_MIME)
                    out = await session.execute(code, -1, opts.cell_timeout)
                    if out.status in ("killed", "died"):
                        run.outcomes[(label, j)] = CheckOutcome(out.status)
                        restart = True
                        break
                    if out.status == "timeout":
                        run.outcomes[(label, j)] = CheckOutcome("timeout", message=f"{out.elapsed:.0f}")
                    else:
                        run.outcomes[(label, j)] = _check_outcome(out.grades[-1] if out.grades else None, cases)
            await session.stop()
            if not restart:
                return run
            restarts += 1
            if restarts > MAX_RESTARTS:
                run.notes.append(f"the kernel died {restarts} times; the checks not yet run were not graded")
                for label, j, _ in checks:
                    run.outcomes.setdefault((label, j), CheckOutcome("not run", message="the kernel kept dying"))
                return run
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------- scoring

def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def _spans(nb) -> dict[str, tuple[int, int]]:
    """Each exercise's cells in a notebook: from its directive to the next exercise's directive.

    The answer to an exercise whose directive opens and closes in one cell comes
    after that cell, so an exercise's region runs on past its ``{exercise-end}``.
    """
    spans = exercise_spans(nb.cells)
    out = {}
    for k, (label, _, first, _) in enumerate(spans):
        nxt = spans[k + 1][2] - 1 if k + 1 < len(spans) else len(nb.cells) - 1
        out.setdefault(label, (first, nxt))
    return out


def _renamed(sub: Submission, ex: Exercise, name: str, span, known: set[str]) -> str:
    """A hint when the exercise's cells define a function of the same arity under another name."""
    if ex.names.get(name) != "function":
        return ""
    first, last = span if span else (0, len(sub.nb.cells) - 1)
    want = ex.arity.get(name)
    found = []
    for cell in sub.nb.cells[first:last + 1]:
        if cell.get("cell_type") != "code":
            continue
        tree = parse_code(cell_source(cell))
        if tree is None:
            continue
        for fn, arity in function_arity(tree).items():
            if fn != name and fn not in known and (want is None or arity == want) and fn not in found:
                found.append(fn)
    if not found:
        return ""
    return (f"; this exercise's cells define `{found[0]}` instead: was the function renamed? The check "
            f"calls it `{name}`, the name the exercise asks for")


def _describe(o: CheckOutcome, check, limit: float) -> str:
    if o.status == "ok":
        return ("PASSED: " if o.passed else "NOT YET: ") + o.message + \
            ("".join(f" {d}" for d in o.details) if o.details and not o.passed else "")
    if o.status == "undefined":
        return f"NOT YET: the notebook does not define `{o.name or '?'}`"
    if o.status in ("timeout", "interrupted"):
        what = " or ".join(f"`{n}`" for n in check.names if not n.isupper()) or "the code"
        return f"NOT YET: the check was stopped after {limit:g} s: {what} did not return (an infinite loop?)"
    if o.status == "killed":
        return (f"NOT YET: the check was stopped after {limit:g} s and the code did not stop when interrupted "
                "(an infinite loop that catches KeyboardInterrupt?)")
    if o.status == "died":
        return ("NOT YET: the kernel died while the check ran the student's code (a crash of Python itself, "
                "or more memory than the limit)")
    if o.status == "error":
        return f"NOT YET: the check could not use the answer: {o.message}"
    if o.status == "no hidden cases":
        return "BY HAND: the grader holds no hidden cases for this check yet; your instructor grades it"
    return f"NOT GRADED: {o.message or o.status}"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _where(nb, i: int, cell_exercise: dict[int, str]) -> str:
    """A cell as a student finds it: the exercise's label and the cell's rank among its code cells
    (never a 0-based index of the whole notebook, which no student sees)."""
    label = cell_exercise.get(i)
    same = [j for j in range(i + 1) if nb.cells[j].get("cell_type") == "code" and cell_exercise.get(j) == label]
    if label is None:
        first = min(cell_exercise, default=len(nb.cells))
        return (f"the {_ordinal(len(same))} code cell " + ("before the first exercise" if i < first
                                                          else "outside the exercises"))
    return f"the {_ordinal(len(same))} code cell of {label}"


def score(sub: Submission, chapter: Chapter, run: _Run, opts: Options) -> tuple[list[ExerciseResult], list[str]]:
    spans = _spans(sub.nb)
    known = {n for ex in chapter.exercises for n in ex.names}
    cell_exercise = {}
    for label, (first, last) in spans.items():
        for i in range(first, last + 1):
            cell_exercise[i] = label
    results = []
    for ex in chapter.exercises:
        outcomes, parts, texts, got = [], [], [], 0.0
        share = ex.auto_points / len(ex.checks) if ex.checks else 0.0
        for j, check in enumerate(ex.checks):
            o = run.outcomes.get((ex.label, j), CheckOutcome("not run", message="not run"))
            outcomes.append(o)
            text = _describe(o, check, opts.cell_timeout)
            if o.status == "undefined":
                text += _renamed(sub, ex, o.name, spans.get(ex.label), known)
                if run.ran_out_at is not None:
                    text += f" (the notebook ran out of time at {_where(sub.nb, run.ran_out_at, cell_exercise)})"
            if o.passed:
                got += share
            texts.append(text)
            parts.append(f"{check.part}: {text}" if len(ex.checks) > 1 else text)
        cell_notes = [f"{_where(sub.nb, i, cell_exercise)} {note}" for i, note in sorted(run.cell_notes.items())
                      if cell_exercise.get(i) == ex.label]
        message = " | ".join(parts)
        if cell_notes and not all(o.passed for o in outcomes):
            message += " [" + "; ".join(cell_notes) + "]"
        if cell_notes and not all(o.passed for o in outcomes):
            texts = [*texts, "while running the notebook: " + "; ".join(cell_notes)]
        results.append(ExerciseResult(ex, round(got, 4), outcomes, message, texts))
    notes = [f"{_where(sub.nb, i, cell_exercise)} {note}" for i, note in sorted(run.cell_notes.items())]
    return results, [*sub.notes, *run.notes, *notes]


#: Modules of the package a student's answer may use freely (printing and plotting helpers).
HELPER_MODULES = ("fixedstate.checks", "fixedstate.prose", "fixedstate.timing", "fixedstate.figures")


def _package_aliases(nb) -> set[str]:
    """Names the notebook binds to the package (outside its checks and helpers), in any cell:
    ``from fixedstate import delta_rule as dr`` binds ``dr``; ``from fixedstate.delta_rule import kda_loop``
    binds ``kda_loop``; ``import fixedstate`` binds ``fixedstate``."""
    names = {"fixedstate"}
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        tree = parse_code(cell_source(cell))
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fixedstate") \
                    and not (node.module or "").startswith(HELPER_MODULES):
                for alias in node.names:
                    if f"{node.module}.{alias.name}".startswith(HELPER_MODULES):
                        continue
                    names.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("fixedstate") and not alias.name.startswith(HELPER_MODULES):
                        names.add(alias.asname or alias.name.split(".")[0])
    return names


@lru_cache(maxsize=None)
def _forbidden_names(modules: tuple[str, ...]) -> frozenset[str]:
    """The package's functions that the chapter's self-checks refuse in an answer (their ``*_FORMS``):
    the names a challenge's answer must not call. Read in the grader's process, from the real checks."""
    names = set()
    for name in modules:
        module = importlib.import_module(name)
        groups = [getattr(module, a) for a in dir(module) if a.endswith("FORMS")]
        if callable(getattr(module, "_forbidden", None)):
            groups.append(module._forbidden())
        for group in groups:
            names.update(f.__name__ for f in group if callable(f) and hasattr(f, "__name__"))
    return frozenset(names)


def review_flags(sub: Submission, chapter: Chapter) -> dict[str, str]:
    """Per exercise with checks, why its answer should be looked at by hand: the student's own cells in
    it use a name bound to the package (outside its checks), or read the checks' stored answers. The
    hidden cases judge values, so an answer that calls the package's implementation passes them."""
    original = {normalise(cell_source(c)) for c in json.loads(chapter.path.read_text(encoding="utf-8"))["cells"]}
    spans = _spans(sub.nb)
    aliases = _package_aliases(sub.nb)
    forbidden = _forbidden_names(tuple(chapter.check_modules))
    out = {}
    for ex in chapter.exercises:
        if not ex.checks or ex.label not in spans:
            continue
        first, last = spans[ex.label]
        hits: list[str] = []
        for cell in sub.nb.cells[first:last + 1]:
            src = cell_source(cell)
            if cell.get("cell_type") != "code" or normalise(src) in original:
                continue
            tree = parse_code(src)
            if tree is None:
                continue
            for node in ast.walk(tree):
                if (isinstance(node, ast.Name) and node.id == "ANSWERS") or \
                        (isinstance(node, ast.Attribute) and node.attr == "ANSWERS"):
                    hits.append("ANSWERS")
            # inside the functions the answer defines: the package's names (a number may be computed
            # with the package; a function the exercise asks for must not call its implementation)
            for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and node.attr in forbidden and \
                            isinstance(node.value, ast.Name) and node.value.id in aliases:
                        hits.append(f"{node.value.id}.{node.attr}")
                    elif isinstance(node, ast.Name) and node.id in forbidden and node.id in aliases:
                        hits.append(node.id)
        if hits:
            out[ex.label] = ("the answer's own code uses " + ", ".join(dict.fromkeys(f"`{h}`" for h in hits))
                             + ": check by hand that it does not call the package's implementation or "
                               "read its stored answers")
    return out


def answers_by_hand(sub: Submission, chapter: Chapter) -> dict[str, list[str]]:
    """For each exercise with a part graded by hand, the student's cells in it that the book does not have."""
    original = {normalise(cell_source(c)) for c in json.loads(chapter.path.read_text(encoding="utf-8"))["cells"]}
    out = {}
    spans = _spans(sub.nb)
    for ex in chapter.exercises:
        if not ex.conceptual or ex.label not in spans:
            continue
        first, last = spans[ex.label]
        mine = []
        for cell in sub.nb.cells[first:last + 1]:
            src = cell_source(cell)
            if src.strip() and normalise(src) not in original:
                mine.append(("```python\n" + src.strip() + "\n```") if cell.get("cell_type") == "code" else src.strip())
        out[ex.label] = mine
    return out


def _not_graded(chapter: Chapter, why: str) -> list[ExerciseResult]:
    return [ExerciseResult(ex, 0.0, [CheckOutcome("not run", message=why) for _ in ex.checks],
                           f"NOT GRADED: {why}", [f"NOT GRADED: {why}"] if ex.checks else [])
            for ex in chapter.exercises]


# --------------------------------------------------------------------------- the whole folder

async def _grade_one(sub, chapter, opts, sandbox, slots, progress) -> Graded:
    slot = await slots.get()
    try:
        t0 = monotonic()
        try:
            run = await run_notebook(sub, chapter, opts, sandbox, slot)
            results, notes = score(sub, chapter, run, opts)
        except Exception as exc:  # noqa: BLE001 - a grader bug must not stop the class's run
            results = _not_graded(chapter, f"the grader failed on this notebook: {type(exc).__name__}: {exc}")
            notes = [*sub.notes, f"the grader failed: {type(exc).__name__}: {exc}"]
        g = Graded(sub.student, chapter, sub, results, notes, monotonic() - t0, answers_by_hand(sub, chapter))
        g.review = review_flags(sub, chapter)
        progress(g)
        return g
    finally:
        slots.put_nowait(slot)


def assignment(subs: list[Submission], chapters: dict[str, Chapter]) -> list[str]:
    """The chapters assigned, when the instructor did not say: those the notebooks' file names and
    contents agree on (a misfiled notebook adds no chapter for the whole class), else, if no
    notebook's name and content agree, what the notebooks hold."""
    agreed = {s.chapter for s in subs if s.chapter and _chapter_by_name(s.path.name, chapters) in (s.chapter, None)}
    return sorted(agreed or {s.chapter for s in subs if s.chapter})


def _timestamp(sub: Submission) -> None:
    try:
        sub.submitted, sub.submitted_from = submitted_at(sub.path)
    except OSError:
        sub.submitted, sub.submitted_from = None, ""


def _pick_latest(subs: list[Submission]) -> tuple[list[Submission], dict[tuple[str, str], list[str]]]:
    """Of several notebooks of one student and chapter, the one handed in last; notes on the others."""
    groups: dict[tuple[str, str], list[Submission]] = {}
    for sub in subs:
        groups.setdefault((sub.student, sub.chapter), []).append(sub)
    keep, notes = [], {}
    for key, group in groups.items():
        group.sort(key=lambda s: (s.submitted is not None, s.submitted or 0, s.path.stem == s.chapter, s.rel))
        keep.append(group[-1])
        if len(group) > 1:
            notes[key] = [f"{', '.join(s.rel for s in group[:-1])} also hold{'s' if len(group) == 2 else ''} "
                          f"this chapter; the one handed in last, {group[-1].rel}, was graded "
                          "(duplicate policy: latest)"]
    return keep, notes


def grade_all(folder: Path, chapters: dict[str, Chapter], opts: Options, sandbox: Sandbox,
              progress=lambda g: None, roster: list[RosterEntry] | None = None,
              policy: LatePolicy | None = None) -> list[Graded]:
    """Grade every notebook in ``folder``; one :class:`Graded` per student and assigned chapter
    (and per roster row, handed in or not)."""
    subs = discover(folder)
    for sub in subs:
        read_submission(sub)
        identify(sub, chapters)
        _timestamp(sub)
    assigned = opts.chapters if opts.chapters is not None else assignment(subs, chapters)
    students = sorted({s.student for s in subs})
    todo: list[Submission] = []
    graded: list[Graded] = []
    skipped: dict[str, list[str]] = {}
    for sub in subs:
        if sub.chapter is None:
            skipped.setdefault(sub.student, []).append(
                f"{sub.rel}: " + (sub.problem or "could not tell which chapter's exercises it holds; not graded"))
        elif sub.chapter not in assigned:
            skipped.setdefault(sub.student, []).append(
                f"{sub.rel} holds the exercises of chapter {chapters[sub.chapter].number} "
                f"({sub.chapter}), which was not assigned: not graded")
        elif sub.nb is None:
            graded.append(Graded(sub.student, chapters[sub.chapter], sub,
                                 _not_graded(chapters[sub.chapter], f"{sub.rel} is {sub.problem}"),
                                 [*sub.notes, f"{sub.rel} is {sub.problem}"]))
        else:
            todo.append(sub)
    dup_notes: dict[tuple[str, str], list[str]] = {}
    if opts.duplicates == "latest":
        todo, dup_notes = _pick_latest(todo)
    todo.sort(key=lambda s: (s.student, s.chapter))
    counter = {"done": 0}
    report = progress

    def progress(g):                      # noqa: F811 - the caller's, with the count done and the total
        counter["done"] += 1
        report(g, counter["done"], len(todo))

    async def main(claimed):
        slots: asyncio.Queue = asyncio.Queue()
        for slot in claimed:
            slots.put_nowait(slot)
        return await asyncio.gather(*(_grade_one(s, chapters[s.chapter], opts, sandbox, slots, progress)
                                      for s in todo))

    if todo:
        claimed, locks = claim_slots(max(1, opts.jobs))     # uids no other grader run on the machine uses
        try:
            graded.extend(asyncio.run(main(claimed)))
        finally:
            for lock in locks:
                lock.close()
    best: dict[tuple[str, str], Graded] = {}
    for g in graded:
        key = (g.student, g.chapter.stem)
        other = best.get(key)
        if other is None:
            best[key] = g
            continue
        if g.submission.nb is None or other.submission.nb is None:      # a readable copy beats a broken one
            keep, drop = (g, other) if other.submission.nb is None else (other, g)
        else:                                                              # duplicate policy: best
            keep, drop = (g, other) if _rank(g) > _rank(other) else (other, g)
        keep.notes.append(f"{drop.submission.rel} holds the same chapter; "
                          + ("the better-scoring copy " if opts.duplicates == "best" else "the readable copy ")
                          + f"{keep.submission.rel} was graded (duplicate policy: {opts.duplicates})")
        best[key] = keep
    for key, notes in dup_notes.items():
        if key in best:
            best[key].notes.extend(notes)
    wanted = list(assigned)
    on_roster = {}
    for student in students:
        entry = match_roster(student, roster) if roster else None
        on_roster[student] = entry
    missing = [e for e in roster or [] if e not in set(on_roster.values())]
    for student in [*students, *(e.id for e in missing)]:
        for stem in wanted:
            if (student, stem) not in best:
                why = "not submitted"
                if skipped.get(student):
                    why += ": " + "; ".join(skipped[student])
                best[(student, stem)] = Graded(student, chapters[stem], None, _not_graded(chapters[stem], why),
                                               [why])
            elif skipped.get(student):
                best[(student, stem)].notes.extend(skipped[student])
    out = [best[k] for k in sorted(best) if k[1] in assigned]
    entries = {**on_roster, **{e.id: e for e in missing}}
    for g in out:
        g.roster = entries.get(g.student)
        if roster and g.roster is None:
            g.notes.append(f"the folder {g.student!r} matches no one on the roster")
        if policy is not None and g.submission is not None and g.submission.submitted is not None:
            g.late_days = policy.late_days(g.submission.submitted)
            g.penalty = policy.penalty(g.late_days)
            if g.late_days:
                g.notes.append(f"handed in {g.late_days} day{'s' if g.late_days > 1 else ''} late "
                               f"({g.submission.submitted.isoformat(timespec='minutes')}, from "
                               f"{g.submission.submitted_from}; {policy.describe()}): "
                               f"{g.penalty:.0%} of the points taken off")
    return sorted(out, key=lambda g: (g.student, g.chapter.stem))


def _rank(g: Graded):
    named = g.submission is not None and g.submission.path.stem == g.chapter.stem
    return (g.points, named)
