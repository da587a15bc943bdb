"""The book's wiring: table of contents, exercises and solutions, citations, notebooks."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ["chapters", "exercises", "solutions", "appendix"]


def notebooks(*dirs):
    return sorted(p for d in (dirs or NOTEBOOK_DIRS) for p in (ROOT / d).glob("*.ipynb"))


def cells(path):
    return json.loads(path.read_text())["cells"]


def source(cell):
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def toc_files(toc=None):
    toc = toc or yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        for ch in part.get("chapters", []):
            files.append(ch["file"])
            files.extend(s["file"] for s in ch.get("sections", []))
    return files


def test_every_toc_entry_exists_and_every_notebook_is_in_the_toc():
    listed = toc_files()
    for f in listed:
        assert any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb")), f"_toc.yml names missing {f}"
    for nb in notebooks():
        rel = nb.relative_to(ROOT).with_suffix("").as_posix()
        assert rel in listed, f"{rel}.ipynb is not in _toc.yml (it would not be built)"


def test_student_toc_drops_exactly_the_solutions_and_the_instructor_part():
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    from student_toc import student_toc

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    student = toc_files(student_toc(toc))
    assert not any(f.startswith("solutions/") for f in student)
    assert "appendix/instructors" not in student
    assert set(toc_files(toc)) - set(student) == {
        f for f in toc_files(toc) if f.startswith("solutions/") or f == "appendix/instructors"}


LABEL = re.compile(r"```\{exercise-start\}[^\n]*\n:label:\s*(\S+)")
SOL = re.compile(r"```\{solution-start\}\s+(\S+)")


def exercise_blocks(path, start_re, end_marker):
    """Map each exercise (or solution) label to the code cells inside its block."""
    blocks, current = {}, None
    for cell in cells(path):
        text = source(cell)
        if cell["cell_type"] == "markdown":
            m = start_re.search(text)
            if m:
                current = m.group(1)
                blocks[current] = []
            if end_marker in text:
                current = None
        elif current is not None:
            blocks[current].append(text)
    return blocks


def exercise_labels():
    labels = {}
    for nb in notebooks("exercises"):
        for label, code in exercise_blocks(nb, LABEL, "{exercise-end}").items():
            assert label not in labels, f"exercise label {label} is used twice"
            labels[label] = (nb, code)
    return labels


def solution_labels():
    labels = {}
    for nb in notebooks("solutions"):
        for label, code in exercise_blocks(nb, SOL, "{solution-end}").items():
            labels[label] = (nb, code)
    return labels


def test_every_solution_answers_an_existing_exercise_and_every_exercise_has_a_solution():
    ex, sol = exercise_labels(), solution_labels()
    assert set(sol) <= set(ex), f"solutions to unknown exercises: {sorted(set(sol) - set(ex))}"
    assert set(ex) <= set(sol), f"exercises without a worked solution: {sorted(set(ex) - set(sol))}"
    for nb in notebooks("exercises"):
        twin = ROOT / "solutions" / nb.name
        assert twin.exists(), f"{nb.name} has no solutions notebook of the same name"


def signatures(code_cells):
    sigs = {}
    for text in code_cells:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                sigs[node.name] = ast.unparse(node.args)
    return sigs


def test_starters_and_solutions_keep_the_same_function_names_and_signatures():
    ex, sol = exercise_labels(), solution_labels()
    for label, (nb, code) in ex.items():
        if label not in sol:
            continue
        starter = signatures(code)
        solved = signatures(sol[label][1])
        for name, args in starter.items():
            assert name in solved, f"{label}: the solution does not define {name}() of the starter"
            assert solved[name] == args, (f"{label}: {name}({args}) in the exercise but "
                                          f"{name}({solved[name]}) in the solution")


def test_exercises_never_link_to_solutions():
    for nb in notebooks("exercises", "chapters"):
        for cell in cells(nb):
            text = source(cell)
            assert "sol-" not in " ".join(re.findall(r"\{ref\}`[^`]*`", text)), \
                f"{nb.name} links to a solution label (the student edition has none)"


def bib_keys():
    return set(re.findall(r"@\w+\{([^,]+),", (ROOT / "references.bib").read_text()))


# Every paper the three source texts cite, by arXiv identifier (the requirement).
SOURCE_PAPERS = ["1706.03762", "2006.16236", "2102.11174", "2412.06464", "2111.00396", "2312.00752",
                 "2405.21060", "2312.04927", "2009.14794", "2006.04768", "2008.07669", "2406.06484",
                 "2608.30320", "2607.24653", "2510.26692", "2403.19887", "2402.19427", "2501.08313"]


def test_every_citation_is_in_the_bibliography_and_the_sources_papers_have_arxiv_ids():
    keys = bib_keys()
    text_files = [*notebooks(), ROOT / "preface.md", *(ROOT / "appendix").rglob("*.md")]
    cite = re.compile(r"\{cite(?::\w+)?\}`([^`]+)`")
    for f in text_files:
        for m in cite.finditer(f.read_text()):
            for key in m.group(1).split(","):
                assert key.strip() in keys, f"{f.name} cites {key.strip()}, not in references.bib"
    bib = (ROOT / "references.bib").read_text()
    eprints = set(re.findall(r"eprint\s*=\s*\{([^}]+)\}", bib))
    missing = [a for a in SOURCE_PAPERS if a not in eprints]
    assert not missing, f"papers the sources cite are missing from references.bib: {missing}"
    for entry in re.split(r"\n(?=@)", bib.strip()):
        key = re.match(r"@\w+\{([^,]+),", entry).group(1)
        assert re.search(r"(eprint|url|doi|journal|booktitle|publisher)\s*=", entry), \
            f"{key} says nowhere where it was published"


@pytest.mark.parametrize("nb", notebooks(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_notebooks_are_executed_cleanly_and_stored_without_errors(nb):
    data = json.loads(nb.read_text())
    assert data["metadata"].get("kernelspec", {}).get("name") == "python3"
    code = [c for c in data["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in code if source(c).strip()]
    assert counts == list(range(1, len(counts) + 1)), \
        f"{nb.name}: execution counts {counts} show it was not run top to bottom from a clean kernel"
    for c in code:
        for out in c.get("outputs", []):
            assert out["output_type"] != "error", f"{nb.name} stores an error output"
            if out["output_type"] == "stream" and out["name"] == "stderr":
                pytest.fail(f"{nb.name} stores stderr output: {''.join(out['text'])[:200]}")


CHAPTER_FURNITURE = ["What you will be able to do", "What this builds on", "Key equations",
                     "Retrieval questions", "Teaching notes"]


@pytest.mark.parametrize("nb", notebooks("chapters"), ids=lambda p: p.name)
def test_every_chapter_has_its_furniture_and_describes_every_figure_in_words(nb):
    all_cells = cells(nb)
    first = source(all_cells[0])
    assert re.match(r"\(chap-[a-z-]+\)=\s*\n# ", first), f"{nb.name} does not open with a chapter label and title"
    markdown = "\n".join(source(c) for c in all_cells if c["cell_type"] == "markdown").lower()
    for heading in CHAPTER_FURNITURE:
        assert heading.lower() in markdown, f"{nb.name} has no '{heading}' section"
    assert "{dropdown}" in markdown or ":class: dropdown" in markdown, \
        f"{nb.name}: retrieval answers belong in dropdown toggles"
    for i, cell in enumerate(all_cells):
        if cell["cell_type"] != "code":
            continue
        is_figure = (any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))
                     or "interactive_figure(" in source(cell))
        if not is_figure:
            continue
        following = [source(c) for c in all_cells[i + 1:i + 4] if c["cell_type"] == "markdown"]
        assert any("**In words.**" in text for text in following), \
            f"{nb.name}, code cell {i}: a figure without an '**In words.**' description after it"


def _stored_text(nb):
    texts = []
    for cell in cells(nb):
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                texts.append("".join(out["text"]))
            elif "text/plain" in out.get("data", {}):
                texts.append("".join(out["data"]["text/plain"]))
    return "\n".join(texts)


@pytest.mark.parametrize("nb", notebooks("solutions"), ids=lambda p: p.name)
def test_every_worked_solution_passes_its_check_and_every_starter_does_not(nb):
    solved = _stored_text(nb)
    assert "NOT YET" not in solved, f"solutions/{nb.name}: a worked solution fails its check"
    assert "PASSED" in solved, f"solutions/{nb.name} runs no check"
    starter = _stored_text(ROOT / "exercises" / nb.name)
    assert "PASSED" not in starter, f"exercises/{nb.name}: a starter already passes its check"
    assert starter.count("NOT YET") == solved.count("PASSED"), \
        f"exercises/{nb.name}: every check the solutions pass should stand unfinished in the starter"


# ---------------------------------------------------------------- numbers, difficulty and points (issue #18)

#: The badge every exercise title ends with; tools/grade.py reads the points from it.
BADGE = re.compile(r"\((★{1,3}), (\d+) points?\)$")
POINTS_OF_STARS = {"★": 2, "★★": 4, "★★★": 8}
TITLE = re.compile(r"```\{exercise-start\}([^\n]*)\n:label:\s*(\S+)")


def exercise_titles():
    """(notebook, label, title) of every exercise, in the order of the pages."""
    out = []
    for nb in notebooks("exercises"):
        for cell in cells(nb):
            if cell["cell_type"] == "markdown":
                out.extend((nb, m.group(2), m.group(1).strip()) for m in TITLE.finditer(source(cell)))
    return out


def test_every_exercise_title_ends_with_its_difficulty_and_points():
    titles = exercise_titles()
    assert titles
    for nb, label, title in titles:
        m = BADGE.search(title)
        assert m, f"{nb.name}: {label} has the title {title!r}, without a badge '(★★, 4 points)' at its end"
        assert title[:m.start()].strip(), f"{nb.name}: {label} has a badge but no title"
        assert int(m.group(2)) == POINTS_OF_STARS[m.group(1)], \
            f"{nb.name}: {label} is {m.group(1)} but worth {m.group(2)} points (★ 2, ★★ 4, ★★★ 8)"


def test_every_chapter_has_a_three_star_challenge_problem_with_a_checked_coding_part():
    ex = exercise_labels()
    for nb in notebooks("exercises"):
        challenges = [label for n, label, title in exercise_titles() if n == nb and "(★★★," in title]
        assert challenges, f"{nb.name} has no challenge problem (★★★)"
        for label in challenges:
            code = "\n".join(ex[label][1])
            assert re.search(r"^def \w+\(", code, re.M) and "check_" in code, \
                f"{label}: a challenge problem is a coding exercise with a starter and a check"


def test_exercises_are_numbered_per_chapter():
    """Exercise page N is chapter N's, in a numbered part that restarts at 1 (not 7-12), so that
    sphinx-exercise numbers the exercises "Exercise N.1", "Exercise N.2", ... in both editions."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    parts = {p["caption"]: p for p in toc["parts"]}
    chapters = [c["file"].split("/")[-1] for c in parts["Chapters"]["chapters"]]
    exercises = [c["file"].split("/")[-1] for c in parts["Exercises"]["chapters"]]
    assert parts["Chapters"].get("numbered") and parts["Exercises"].get("numbered"), \
        "the Chapters and Exercises parts must both be numbered"
    assert exercises == chapters, "exercise page N must belong to chapter N"
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["html"].get("use_multitoc_numbering") is False, \
        "use_multitoc_numbering must be false: otherwise the exercise pages are numbered 7-12"
    assert config["sphinx"]["config"].get("numfig_secnum_depth", 1) == 1


EXERCISE_HEAD = re.compile(r'<span class="caption-number">Exercise (\d+)\.(\d+) </span>')
SOLUTION_HEAD = re.compile(r"Solution to\s*(?:<[^>]+>\s*)*Exercise (\d+)\.(\d+)")


@pytest.mark.site
@pytest.mark.parametrize("edition", ["_build/html", "_build/student/_build/html"])
def test_built_exercise_pages_show_per_chapter_numbers(edition):
    site = ROOT / edition
    if not (site / "index.html").exists():
        pytest.skip(f"{edition} is not built")
    for nb in notebooks("exercises"):
        chapter = int(nb.name[:2])
        page = (site / "exercises" / nb.with_suffix(".html").name).read_text()
        numbers = [(int(a), int(b)) for a, b in EXERCISE_HEAD.findall(page)]
        expected = [(chapter, i) for i in range(1, 1 + sum(1 for n, _, _ in exercise_titles() if n == nb))]
        assert numbers == expected, f"{edition}/exercises/{nb.name}: numbered {numbers}, expected {expected}"
        if edition == "_build/html":
            solved = (site / "solutions" / nb.with_suffix(".html").name).read_text()
            shown = {(int(a), int(b)) for a, b in SOLUTION_HEAD.findall(solved)}
            assert shown == set(expected), f"solutions/{nb.name}: 'Solution to Exercise' numbers {sorted(shown)}"


# ---------------------------------------------------------------- a downloaded notebook explains itself (issue #20)

def _guard():
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    import notebook_guard
    return notebook_guard


@pytest.mark.parametrize("nb", notebooks(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_notebook_opens_with_the_line_that_checks_for_the_package(nb):
    guard = _guard()
    version = guard.package_version()
    first = next(c for c in cells(nb) if c["cell_type"] == "code")
    assert source(first) == guard.guard_line(version) and guard.GUARD_TAG in first["metadata"].get("tags", []), (
        f"{nb.relative_to(ROOT)}: the first code cell must be the line that stops with the install command "
        f"when fixedstate {version} is missing, alone and tagged {guard.GUARD_TAG}: "
        "run `.venv/bin/python tools/notebook_guard.py`")
    text = "\n".join(source(c) for c in cells(nb) if c["cell_type"] == "code")
    assert not re.search(r"^\s*(from|import)\s+myst_nb\b", text, re.M), (
        f"{nb.relative_to(ROOT)} imports myst_nb, which a reader's environment lacks: "
        "use `from fixedstate.prose import glue`")


def test_the_package_version_is_one_and_the_line_names_the_wheel_the_site_serves():
    import fixedstate

    guard = _guard()
    assert guard.package_version() == fixedstate.__version__, "pyproject.toml and fixedstate.__version__ differ"
    line = guard.guard_line(fixedstate.__version__)
    assert f"%pip install fixedstate-{fixedstate.__version__}-py3-none-any.whl" in line
    assert guard.GUARD_RE.match(line) and "\n" not in line
    compile(line, "<first line>", "exec")


def test_the_guard_script_is_idempotent_and_updates_an_old_line(tmp_path):
    guard = _guard()
    nb = tmp_path / "x.ipynb"
    data = {"cells": [{"cell_type": "markdown", "id": "m", "metadata": {}, "source": ["# T"]},
                      {"cell_type": "code", "id": "a", "metadata": {}, "execution_count": 1, "outputs": [],
                       "source": ["import numpy as np\n", "x = 1"]},
                      {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": 2,
                       "outputs": [{"output_type": "execute_result", "execution_count": 2, "metadata": {},
                                    "data": {"text/plain": ["1"]}}], "source": ["x"]}],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    nb.write_text(json.dumps(data, indent=1) + "\n")
    assert guard.apply(nb, "0.1.0") and not guard.apply(nb, "0.1.0")
    assert guard.apply(nb, "0.3.0") and not guard.apply(nb, "0.3.0")
    out = json.loads(nb.read_text())["cells"]
    assert [c.get("id") for c in out] == ["m", guard.GUARD_ID, "a", "b"]
    assert out[1]["source"] == [guard.guard_line("0.3.0")] and out[1]["metadata"]["tags"] == [guard.GUARD_TAG]
    assert out[1]["outputs"] == [] and out[2]["source"] == ["import numpy as np\n", "x = 1"]
    # numbered as a run from the top numbers them: the check first
    assert [c["execution_count"] for c in out[1:]] == [1, 2, 3] and out[3]["outputs"][0]["execution_count"] == 3
    assert guard.has_guard(nb, "0.3.0") and not guard.has_guard(nb, "0.1.0")
    # the older form, the line opening the import cell, becomes a cell of its own
    data["cells"][1]["source"] = [guard.guard_line("0.1.0") + "\n", "import numpy as np\n", "x = 1"]
    nb.write_text(json.dumps(data, indent=1) + "\n")
    assert guard.apply(nb, "0.3.0") and not guard.apply(nb, "0.3.0")
    assert json.loads(nb.read_text())["cells"] == out


def test_no_math_line_opens_with_a_bracket_that_latex_would_read_as_an_option():
    # After `\\` or `\begin{aligned}`, TeX reads a `[...]` as an optional argument (a line
    # skip, the environment's position) and drops it from the equation: write `{[...]}`.
    bad = []
    pattern = re.compile(r"(\\begin\{(?:aligned|gathered|split|array)\}|\\\\)\s*\[")
    for path in notebooks():
        for cell in cells(path):
            if cell["cell_type"] == "markdown" and pattern.search(source(cell)):
                bad.append(f"{path.relative_to(ROOT)} cell {cell.get('id')}")
    assert not bad, "a math line opens with '[' that TeX takes as an optional argument: " + ", ".join(bad)
