"""The book's checks in the formats of otter-grader and nbgrader, for instructors who already use one.

- :func:`export_otter` writes, per chapter, an otter-grader autograder
  (``<out>/<chapter>/autograder.zip``): one test per check call of the book's
  exercise notebook, worth the exercise's checked points, that calls the check
  from ``fixedstate.checks`` on the student's names and fails with the check's
  own message. ``otter run -a autograder.zip <notebook>`` grades one of the
  book's notebooks as students hand them in (no otter metadata is needed in
  them); ``otter grade`` runs the same tests in Docker containers.
- :func:`export_nbgrader` writes, per chapter, an nbgrader source notebook
  (``<out>/source/<assignment>/<chapter>.ipynb``): the book's exercise notebook
  with nbgrader's cell metadata, every check cell an "autograder tests" cell
  (locked, with its points) that asserts the check passed and prints its
  message, and after every conceptual question a "manually graded answer" cell
  with its points, holding the worked solution (``nbgrader generate_assignment``
  replaces it by "YOUR ANSWER HERE" in the students' copy).
"""

from __future__ import annotations

import ast
import json
import re
import zipfile
from pathlib import Path

import nbformat

from .book import Chapter, cell_source, check_calls, exercise_spans, parse_code, solution_code

__all__ = ["export_otter", "export_nbgrader"]


def _name(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", part).strip("_")


def _renamed_call(check, name: str = "_check") -> str:
    call = ast.parse(check.call, mode="eval").body
    call.func = ast.Name(name, ast.Load())
    return ast.unparse(call)


def _test_code(check) -> list[str]:
    return [f"from {check.module} import {check.function} as _check",
            f"_result = {_renamed_call(check)}",
            "assert _result.passed, str(_result)"]


def otter_requirements(version: str, wheel: str = "") -> str:
    """The autograder's requirements.txt: the book's package, from the wheel inside the zip."""
    return ("# The book's package: its wheel is in files/ of this autograder (otter copies it to\n"
            "# /autograder/source/files), so pip needs no index for it.\n"
            "--find-links /autograder/source/files\n"
            f"fixedstate=={version}\n")


def export_otter(chapters: dict[str, Chapter], out: Path, version: str = "0", wheel: Path | None = None) -> list[Path]:
    """Write ``<out>/<chapter>/autograder.zip`` for every chapter; return the zip files.

    ``requirements.txt`` names ``fixedstate=={version}``; with ``wheel`` (``tools/kit.py``
    builds it) the wheel goes into the zip's ``files/``."""
    written = []
    for stem, ch in chapters.items():
        folder = out / stem
        tests = folder / "tests"
        tests.mkdir(parents=True, exist_ok=True)
        for ex in ch.exercises:
            for check in ex.checks:
                test_name = _name(check.part if check.part != check.function else ex.label)
                code = "\n".join(">>> " + line for line in _test_code(check))
                test = {"name": test_name, "points": round(ex.auto_points / len(ex.checks), 4),
                        "suites": [{"cases": [{"code": code, "hidden": False, "locked": False}],
                                    "scored": True, "setup": "", "teardown": "", "type": "doctest"}]}
                (tests / f"{test_name}.py").write_text(f"OK_FORMAT = True\n\ntest = {test!r}\n")
        (folder / "otter_config.json").write_text(json.dumps({"name": stem}, indent=1) + "\n")
        (folder / "requirements.txt").write_text(otter_requirements(version))
        if wheel is not None:
            (folder / "files").mkdir(exist_ok=True)
            (folder / "files" / wheel.name).write_bytes(wheel.read_bytes())
        zip_path = folder / "autograder.zip"
        with zipfile.ZipFile(zip_path, "w") as z:
            for path in sorted(folder.rglob("*")):
                if path.is_file() and path != zip_path:
                    z.write(path, path.relative_to(folder).as_posix())
        written.append(zip_path)
    return written


def _meta(**kw) -> dict:
    return {"nbgrader": {"schema_version": 3, **kw}}


def export_nbgrader(chapters: dict[str, Chapter], out: Path, root: Path, assignment: str = "") -> list[Path]:
    """Write nbgrader source notebooks ``<out>/source/<assignment>/<chapter>.ipynb``; return them."""
    written = []
    for stem, ch in chapters.items():
        nb = nbformat.read(ch.path, as_version=4)
        _, solutions = solution_code(root, stem)
        sol_md = _solution_text(root, stem)
        spans = {label: (first, last) for label, _, first, last in exercise_spans(nb.cells)}
        owner = {i: label for label, (first, last) in spans.items() for i in range(first, last + 1)}
        cells = []
        first_ex = min((f for f, _ in spans.values()), default=len(nb.cells))
        for i, cell in enumerate(nb.cells):
            cell = nbformat.from_dict(cell)
            cell.pop("id", None)
            label = owner.get(i)
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
                tree = parse_code(cell.source)
                calls, rest = check_calls(tree) if tree is not None else ([], [])
                if i < first_ex:
                    cell.metadata.update(_meta(grade=False, solution=False, locked=True, grade_id=f"setup_{i}"))
                    cells.append(cell)
                    continue
                if calls and label is not None:
                    ex = ch.exercise(label)
                    if rest:                  # an answer and its check in one cell: split them
                        lines = cell.source.splitlines()
                        keep = [ln for s in rest for ln in lines[s.lineno - 1:s.end_lineno]]
                        cells.append(nbformat.v4.new_code_cell("\n".join(keep)))
                    for check in (c for c in ex.checks if c.call in {ast.unparse(k) for k in calls}):
                        code = _test_code(check)
                        test = nbformat.v4.new_code_cell("\n".join([*code[:2], "print(_result)", code[2]]))
                        test.metadata.update(_meta(grade=True, solution=False, locked=True,
                                                   points=round(ex.auto_points / len(ex.checks), 4),
                                                   grade_id=_name(f"{check.part}_{len(cells)}")))
                        cells.append(test)
                    continue
                cells.append(cell)
                continue
            cells.append(cell)
            if label is not None and i == spans[label][1]:
                ex = ch.exercise(label)
                if ex is not None and ex.conceptual and ex.hand_points > 0:
                    answer = nbformat.v4.new_markdown_cell(sol_md.get(label, "YOUR ANSWER HERE"))
                    answer.metadata.update(_meta(grade=True, solution=True, locked=False,
                                                 points=round(ex.hand_points, 4), grade_id=_name(f"{label}_answer")))
                    cells.append(answer)
        nb.cells = cells
        for k, cell in enumerate(nb.cells):
            cell["id"] = f"cell-{k}"
        path = out / "source" / (assignment or stem) / f"{stem}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, path)
        written.append(path)
    return written


def _solution_text(root: Path, stem: str) -> dict[str, str]:
    """The worked solutions' prose, per exercise label (for nbgrader's source version)."""
    path = root / "solutions" / f"{stem}.ipynb"
    if not path.exists():
        return {}
    out: dict[str, list[str]] = {}
    current = None
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        src = cell_source(cell)
        if cell["cell_type"] != "markdown":
            continue
        m = re.search(r"```\{solution-start\}\s+(\S+)", src)
        if m:
            current = m.group(1)
            src = re.sub(r"```\{solution-start\}[^`]*```", "", src, flags=re.DOTALL)
        if current is not None:
            text = re.sub(r"```\{solution-end\}\s*```", "", src).strip()
            if text:
                out.setdefault(current, []).append(text)
        if "{solution-end}" in cell_source(cell):
            current = None
    return {k: "\n\n".join(v) for k, v in out.items()}
