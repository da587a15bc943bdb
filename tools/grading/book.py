"""What the grader knows about the book: its exercise notebooks, read from the repository.

Everything that decides a grade is read here from the book's own files, never
from a submission:

- the chapters are the notebooks ``exercises/NN_name.ipynb``;
- an exercise is the span between a ``{exercise-start}`` directive (with its
  ``:label: ex-...``) and the next ``{exercise-end}``;
- the checks that grade it are the calls of ``check_*`` functions in the
  exercise's code cells (a cell's statement ``check_x(...)`` or
  ``print(check_x(...))``), each resolved to the ``fixedstate.checks`` module the
  notebook imports it from;
- its points are written in its title or first paragraph as a parenthesised
  badge ending in ``N points`` (``**(★★, 3 points)**``, ``(2 points)``,
  ``(1 point)``); without one an exercise is worth 1 point per check (1 point if
  it has no check);
- a part graded by hand is one marked **(conceptual)** (an exercise without any
  check is graded by hand entirely). An exercise with both splits its points
  evenly between its checks and its conceptual part;
- the rubric of a part graded by hand comes from the instructor's guide: the
  bullet that starts with the exercise's label in the "Rubrics" list of its
  "Grading" section (``appendix/instructors.md``), else the line that names the
  label in the chapter's instructor notes (``appendix/instructor_notes/``).
"""

from __future__ import annotations

import ast
import csv
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

__all__ = ["Check", "Exercise", "Chapter", "read_book", "exercise_spans", "parse_code", "check_calls",
           "normalise", "points_in", "read_rubrics", "POINTS_RE", "cell_source"]

EX_START = re.compile(r"```\{exercise-start\}([^\n]*)\n\s*:label:\s*(\S+)")
EX_END = "{exercise-end}"
SOL_START = re.compile(r"```\{solution-start\}\s+(\S+)")
SOL_END = "{solution-end}"
CONCEPTUAL = re.compile(r"\(conceptual\)", re.IGNORECASE)
#: A points badge: a parenthesised group that ends in "N point(s)", e.g. "(★★, 3 points)".
POINTS_RE = re.compile(r"\(([^()\n]*?)(\d+(?:\.\d+)?)\s*points?\s*\)", re.IGNORECASE)
CHAPTER_STEM = re.compile(r"(\d\d)_[A-Za-z0-9_]+")


def cell_source(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def normalise(src: str) -> str:
    """A cell's source without trailing blanks, for "is this cell unchanged?" comparisons."""
    return "\n".join(line.rstrip() for line in src.strip().splitlines())


@lru_cache(maxsize=4096)
def _transformed(src: str) -> str:
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(src)
    except Exception:  # noqa: BLE001 - IPython missing or a cell it cannot read: parse it as it is
        return src


def parse_code(src: str) -> ast.Module | None:
    """The cell's statements (IPython magics turned into Python first), or None if it does not parse."""
    for text in (src, _transformed(src)):
        try:
            return ast.parse(text)
        except (SyntaxError, ValueError):
            continue
    return None


def _check_call(stmt: ast.stmt) -> ast.Call | None:
    """The ``check_*(...)`` call a statement consists of (bare, or wrapped in ``print``), if any."""
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return None
    call = stmt.value
    if isinstance(call.func, ast.Name) and call.func.id == "print" and len(call.args) == 1 \
            and isinstance(call.args[0], ast.Call):
        call = call.args[0]
    if isinstance(call.func, ast.Name) and call.func.id.startswith("check_"):
        return call
    return None


def check_calls(tree: ast.Module) -> tuple[list[ast.Call], list[ast.stmt]]:
    """Split a cell's statements into check calls and the rest."""
    calls, rest = [], []
    for stmt in tree.body:
        call = _check_call(stmt)
        (calls if call is not None else rest).append(call if call is not None else stmt)
    return calls, rest


def defined_names(tree: ast.Module) -> dict[str, str]:
    """Top-level names a cell defines: ``{name: "function" | "value"}``."""
    out: dict[str, str] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[stmt.name] = "function"
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                for node in ast.walk(t):
                    if isinstance(node, ast.Name):
                        out.setdefault(node.id, "value")
    return out


def function_arity(tree: ast.Module) -> dict[str, int]:
    return {s.name: len(s.args.args) for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}


def exercise_spans(cells) -> list[tuple[str, str, int, int]]:
    """``(label, title, first cell, last cell)`` of every exercise in a list of cells.

    An exercise opens at the markdown cell with ``{exercise-start}`` and closes at
    the first later (or the same) cell with ``{exercise-end}``; one left open
    closes at the next exercise or at the end of the notebook.
    """
    spans: list[list] = []
    open_span = None
    for i, cell in enumerate(cells):
        if cell.get("cell_type") != "markdown":
            continue
        text = cell_source(cell)
        m = EX_START.search(text)
        if m:
            if open_span is not None:
                open_span[3] = i - 1
            open_span = [m.group(2), m.group(1).strip(), i, len(cells) - 1]
            spans.append(open_span)
            if EX_END in text[m.end():]:
                open_span[3] = i
                open_span = None
        elif EX_END in text and open_span is not None:
            open_span[3] = i
            open_span = None
    return [tuple(s) for s in spans]


def points_in(*texts: str) -> float | None:
    """The points of the first badge ``(... N points)`` in ``texts``, or None."""
    for text in texts:
        m = POINTS_RE.search(text or "")
        if m:
            return float(m.group(2))
    return None


@dataclass
class Check:
    """One check call of an exercise, as the book's exercise notebook writes it."""
    call: str                 # e.g. 'check_answer("ex-dr-halving", error_after_three)'
    function: str             # check_answer
    module: str               # fixedstate.checks.delta
    part: str                 # the label argument of check_answer, else the check's name
    names: list[str]          # the names of the student's that the call's arguments use
    thunk: str                # "lambda: ((args...), {kwargs...})" evaluated in the student's namespace


@dataclass
class Exercise:
    label: str
    title: str
    chapter: str              # the notebook's stem, e.g. 03_delta_rule
    points: float
    points_source: str        # "badge", "default" or "override"
    checks: list[Check]
    conceptual: bool          # has a part graded by hand
    names: dict[str, str]     # names its starter cells define: {name: "function" | "value"}
    arity: dict[str, int]     # parameters of the functions it asks for
    rubric: str = ""
    solution: str = ""        # where the worked solution is: "solutions/03_delta_rule.ipynb (sol-dr-halving)"

    hand_override: float | None = None   # the instructor's own split (``by_hand`` in --points)

    @property
    def auto_points(self) -> float:
        """The points the checks award: all of them without a conceptual part, else half
        (1 per check when the exercise has no badge), unless the instructor split them."""
        if not self.checks:
            return 0.0
        if not self.conceptual:
            return self.points
        if self.hand_override is not None:
            return max(0.0, self.points - self.hand_override)
        if self.points_source == "default":
            return float(len(self.checks))
        return self.points / 2

    @property
    def hand_points(self) -> float:
        return self.points - self.auto_points

    @property
    def kind(self) -> str:
        if not self.checks:
            return "by hand"
        return "checked + by hand" if self.conceptual else "checked"


@dataclass
class Chapter:
    stem: str                 # 03_delta_rule
    number: str               # 03
    title: str
    path: Path
    exercises: list[Exercise]
    check_cells: set[str] = field(default_factory=set)     # normalised sources of the pure check cells
    check_modules: list[str] = field(default_factory=list)

    @property
    def labels(self) -> list[str]:
        return [e.label for e in self.exercises]

    def exercise(self, label: str) -> Exercise | None:
        return next((e for e in self.exercises if e.label == label), None)


def _imports(trees) -> dict[str, str]:
    """``{name: module}`` of every ``from fixedstate.checks.x import name`` in the trees."""
    out = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fixedstate.checks"):
                for alias in node.names:
                    out[alias.asname or alias.name] = node.module
    return out


def _thunk(call: ast.Call) -> str:
    """A lambda that evaluates the call's arguments: ``lambda: ((a, b), {"k": c})``."""
    keys = [ast.Constant(k.arg) if k.arg is not None else None for k in call.keywords]
    body = ast.Tuple([ast.Tuple(list(call.args), ast.Load()),
                      ast.Dict(keys=keys, values=[k.value for k in call.keywords])], ast.Load())
    lam = ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
                     body=body)
    return ast.unparse(ast.fix_missing_locations(lam))


def _arg_names(call: ast.Call) -> list[str]:
    names = []
    for node in [*call.args, *(k.value for k in call.keywords)]:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in names:
                names.append(sub.id)
    return names


def _read_chapter(path: Path, root: Path, rubrics: dict[str, str], overrides: dict) -> Chapter:
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    stem = path.stem
    title = ""
    for cell in cells:
        if cell["cell_type"] == "markdown":
            m = re.search(r"^#\s+(.+)$", cell_source(cell), re.MULTILINE)
            if m:
                title = re.sub(r"^Exercises:\s*", "", m.group(1).strip())
                break
    trees = {i: parse_code(cell_source(c)) for i, c in enumerate(cells) if c["cell_type"] == "code"}
    imports = _imports(t for t in trees.values() if t is not None)
    chapter = Chapter(stem=stem, number=stem[:2], title=title, path=path, exercises=[],
                      check_modules=sorted(set(imports.values())))
    for i, tree in trees.items():
        if tree is None:
            continue
        calls, rest = check_calls(tree)
        if calls and not rest:
            chapter.check_cells.add(normalise(cell_source(cells[i])))
    solutions = _solution_index(root / "solutions" / path.name)
    for label, ex_title, first, last in exercise_spans(cells):
        checks, names, arity, conceptual, texts = [], {}, {}, False, []
        for i in range(first, last + 1):
            cell = cells[i]
            src = cell_source(cell)
            if cell["cell_type"] == "markdown":
                texts.append(src)
                conceptual = conceptual or bool(CONCEPTUAL.search(src))
                continue
            tree = trees.get(i)
            if tree is None:
                continue
            calls, rest = check_calls(tree)
            rest_tree = ast.Module(body=rest, type_ignores=[])
            names.update(defined_names(rest_tree))
            arity.update(function_arity(rest_tree))
            for call in calls:
                fn = call.func.id
                part = call.args[0].value if (call.args and isinstance(call.args[0], ast.Constant)
                                              and isinstance(call.args[0].value, str)) else fn
                checks.append(Check(call=ast.unparse(call), function=fn,
                                    module=imports.get(fn, chapter.check_modules[0] if chapter.check_modules else ""),
                                    part=part, names=[n for n in _arg_names(call)], thunk=_thunk(call)))
        conceptual = conceptual or CONCEPTUAL.search(ex_title) is not None or not checks
        badge = points_in(ex_title, texts[0] if texts else "")
        hand_override = None
        if label in overrides:
            (points, hand_override), source = overrides[label], "override"
        elif badge is not None:
            points, source = badge, "badge"
        else:
            points, source = float(len(checks) + (1 if conceptual else 0)), "default"
        sol = solutions.get(label)
        chapter.exercises.append(Exercise(
            label=label, title=_clean_title(ex_title), chapter=stem, points=points, points_source=source,
            checks=checks, conceptual=conceptual, names=names, arity=arity,
            rubric=rubrics.get(label, "") or _note_line(root, stem, label),
            solution=f"solutions/{path.name} ({sol})" if sol else "", hand_override=hand_override))
    return chapter


def _clean_title(title: str) -> str:
    title = POINTS_RE.sub("", title)
    title = re.sub(r"\*\*\s*\*\*", "", title)
    return re.sub(r"\s+", " ", title).strip(" *")


def _solution_index(path: Path) -> dict[str, str]:
    """``{exercise label: solution label}`` of a solutions notebook."""
    if not path.exists():
        return {}
    out = {}
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        m = SOL_START.search(cell_source(cell))
        if m:
            lab = re.search(r":label:\s*(\S+)", cell_source(cell))
            out[m.group(1)] = lab.group(1) if lab else m.group(1)
    return out


def solution_code(root: Path, stem: str) -> tuple[list[str], dict[str, list[str]]]:
    """The worked solutions' code: the cells before the first solution, and each label's cells."""
    path = root / "solutions" / f"{stem}.ipynb"
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    setup: list[str] = []
    by_label: dict[str, list[str]] = {}
    current = None
    for cell in cells:
        src = cell_source(cell)
        if cell["cell_type"] == "markdown":
            m = SOL_START.search(src)
            if m:
                current = m.group(1)
                by_label.setdefault(current, [])
            if SOL_END in src:
                current = None
            continue
        if current is None and not by_label:
            setup.append(src)
        elif current is not None:
            by_label[current].append(src)
    return setup, by_label


# --------------------------------------------------------------------------- rubrics

RUBRIC_ITEM = re.compile(r"^[-*]\s+`(ex-[\w-]+)`\s*[:.—-]?\s*(.*)$")


def read_rubrics(guide: Path) -> dict[str, str]:
    """The rubrics of the "Grading" section of the instructor's guide: ``{label: text}``.

    A rubric is a bullet that starts with the exercise's label in backticks,
    ``- `ex-dr-halving`: ...``, continued on the indented lines below it.
    """
    if not guide.exists():
        return {}
    text = guide.read_text(encoding="utf-8")
    m = re.search(r"^## Grading\s*$", text, re.MULTILINE)
    if not m:
        return {}
    section = text[m.end():]
    nxt = re.search(r"^## ", section, re.MULTILINE)
    section = section[:nxt.start()] if nxt else section
    rubrics: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        item = RUBRIC_ITEM.match(line)
        if item:
            current = item.group(1)
            rubrics[current] = item.group(2).strip()
        elif current and line.startswith("  ") and line.strip():
            rubrics[current] += " " + line.strip()
        else:
            current = None
    return rubrics


def _note_line(root: Path, stem: str, label: str) -> str:
    """What the chapter's instructor notes say about ``label``: its table row (without the label,
    difficulty and points columns) or the bullet that names it."""
    path = root / "appendix" / "instructor_notes" / f"{stem}.md"
    if not path.exists():
        return ""
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if f"`{label}`" not in line:
            continue
        if line.lstrip().startswith("|"):
            cols = [c.strip() for c in line.strip().strip("|").split("|")]
            header = None
            for j in range(i - 1, 0, -1):
                if not lines[j].lstrip().startswith("|"):
                    break
                if re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", lines[j].strip()):
                    header = [c.strip().lower() for c in lines[j - 1].strip().strip("|").split("|")]
            pairs = []
            for k, col in enumerate(cols):
                name = header[k] if header and k < len(header) else ""
                if not col or label in col or name in ("exercise", "label", "difficulty", "points"):
                    continue
                pairs.append(f"{name}: {col}" if name else col)
            return "instructor notes: " + "; ".join(pairs)
        text = [line.strip().lstrip("-* ")]
        for nxt in lines[i + 1:]:
            if not nxt.startswith("  ") or not nxt.strip():
                break
            text.append(nxt.strip())
        return "instructor notes: " + " ".join(text)
    return ""


def read_points(path: Path | None) -> dict[str, tuple[float, float | None]]:
    """An instructor's own points: a CSV with the columns ``exercise``, ``points`` and
    optionally ``by_hand`` (the part of the points graded by hand)."""
    if path is None:
        return {}
    out = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if (row.get("exercise") or "").strip():
                hand = (row.get("by_hand") or "").strip()
                out[row["exercise"].strip()] = (float(row["points"]), float(hand) if hand else None)
    return out


def read_book(root: Path, points_file: Path | None = None) -> dict[str, Chapter]:
    """Every chapter of the book, keyed by its notebook's stem (``03_delta_rule``)."""
    rubrics = read_rubrics(root / "appendix" / "instructors.md")
    overrides = read_points(points_file)
    chapters = {}
    for path in sorted((root / "exercises").glob("*.ipynb")):
        if CHAPTER_STEM.fullmatch(path.stem):
            chapters[path.stem] = _read_chapter(path, root, rubrics, overrides)
    return chapters
