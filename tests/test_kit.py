"""The student kit and the wheel the site serves: a downloaded notebook runs on the reader's machine.

Fast tests build the wheel and the kit and read them. The tests marked ``kit``
unpack the kit into an empty folder, install it into a fresh virtual environment
with the README's own command (the wheel from the kit, the pinned dependencies
from PyPI), and execute a chapter and an exercise notebook there with nbclient,
in a kernel of that environment, outside the repository; and they run a chapter
in an environment without the package. They take a few minutes, so ``make unit``
and ``make test`` leave them out: ``make kit-test`` runs them, and ``make kit-tests``
(which .ci/run calls) runs them with the JupyterLab test, on one installation of the kit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

import kit  # noqa: E402
import test_pythons  # noqa: E402
import notebook_guard  # noqa: E402

import fixedstate  # noqa: E402

CHAPTER = "02_linear_attention"
EXERCISE = "03_delta_rule"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit")
    wheel = kit.build_wheel(out)
    return wheel, kit.build_kit(out, "student", wheel=wheel)


def _source(cell):
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


# ------------------------------------------------------------------ the wheel, the kit, the version check

def test_the_wheel_holds_every_module_and_declares_ranges_that_the_lock_lies_in(built):
    from packaging.requirements import Requirement

    wheel, _ = built
    assert wheel.name == f"fixedstate-{fixedstate.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = Parser().parsestr(zf.read(f"fixedstate-{fixedstate.__version__}.dist-info/METADATA").decode())
    modules = {p.relative_to(ROOT / "code").as_posix() for p in (ROOT / "code" / "fixedstate").rglob("*.py")}
    assert modules and modules <= names, f"the wheel lacks {sorted(modules - names)[:5]}"
    assert not [n for n in names if n.endswith(".pyc") or "egg-info" in n]
    assert meta["Version"] == fixedstate.__version__
    # every Python from 3.11 on (make test-pythons installs it on each one the machine has): no upper bound
    assert meta["Requires-Python"] == ">=3.11"
    requires = sorted(r.replace(" ", "") for r in meta.get_all("Requires-Dist") if "extra" not in r)
    assert requires == sorted(kit.project()["dependencies"])
    # ranges, not the book's pins: a lower end (make test-pythons installs exactly it) and no exact version,
    # so that %pip install leaves a student's newer numpy or scipy alone ...
    lock = kit.lock()
    for r in map(Requirement, requires):
        ops = sorted(s.operator for s in r.specifier)
        assert ops in (([">="]), ["<", ">="]), f"{r}: expected a range '>=X' (with at most an upper bound '<Y')"
        # ... and the book's own environment (requirements-lock.txt) is one the ranges allow
        pinned = lock[kit._name(r.name)].split("==")[1]
        assert r.specifier.contains(pinned), f"{r} excludes the lock's {r.name}=={pinned}"
    assert len(test_pythons.lower_bounds(requires)) == len(requires)     # one lower end each, to install and test


def test_the_oldest_constraints_pin_each_lower_end_and_refuse_a_requirement_without_one():
    assert test_pythons.lower_bounds(["numpy>=2.0.0", "scipy<2,>=1.13.1"]) == ["numpy==2.0.0", "scipy==1.13.1"]
    for bad in ["numpy==2.4.6", "numpy", "numpy<3", "numpy>=2,>=2.1"]:
        with pytest.raises(ValueError, match="lower bound"):
            test_pythons.lower_bounds([bad])


def test_every_python_from_311_to_the_newest_found_is_tested_and_never_fewer_than_311_to_313():
    found = {(3, 10): None, (3, 11): None, (3, 12): None, (3, 13): None}
    assert test_pythons.pythons_to_test(found) == [(3, 11), (3, 12), (3, 13)]
    # a machine with only 3.11 and 3.15: 3.12 to 3.14 are wanted all the same (and reported missing)
    assert test_pythons.pythons_to_test({(3, 11): None, (3, 15): None}) == [(3, 11), (3, 12), (3, 13), (3, 14),
                                                                            (3, 15)]
    assert test_pythons.pythons_to_test({}) == [(3, 11), (3, 12), (3, 13)]


def test_the_pythons_found_are_the_newest_of_each_minor_version_on_path_and_in_pyenv(tmp_path, monkeypatch):
    def fake(path: Path, reports: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/sh\necho {reports}\n")
        path.chmod(0o755)

    fake(tmp_path / "bin" / "python3.12", "3 12 1")
    fake(tmp_path / "bin" / "python3.14", "3 11 7")        # a pyenv shim of a version that is not selected
    fake(tmp_path / "pyenv" / "versions" / "3.12.9" / "bin" / "python3.12", "3 12 9")
    fake(tmp_path / "pyenv" / "versions" / "3.13.0" / "bin" / "python3.13", "3 13 0")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    found = test_pythons.find_pythons()
    assert found == {(3, 12): (str(tmp_path / "pyenv" / "versions" / "3.12.9" / "bin" / "python3.12"), (3, 12, 9)),
                     (3, 13): (str(tmp_path / "pyenv" / "versions" / "3.13.0" / "bin" / "python3.13"), (3, 13, 0))}
    # 3.11 is wanted, so reported missing: a failure of make test-pythons, not a skip
    assert [v for v in test_pythons.pythons_to_test(found) if v not in found] == [(3, 11)]


def test_the_student_kit_holds_the_notebooks_without_solutions_the_wheel_pins_and_a_readme(built):
    wheel, kit_zip = built
    top = kit.kit_name("student")
    with zipfile.ZipFile(kit_zip) as zf:
        names = set(zf.namelist())
        readme = zf.read(f"{top}/README.md").decode()
        requirements = zf.read(f"{top}/requirements.txt").decode().split("\n")
        assert zf.read(f"{top}/{wheel.name}") == wheel.read_bytes()
    notebooks = {f"{top}/{p.relative_to(ROOT).as_posix()}" for d in ("chapters", "exercises")
                 for p in (ROOT / d).glob("*.ipynb")}
    assert names == notebooks | {f"{top}/README.md", f"{top}/requirements.txt", f"{top}/{wheel.name}"}
    assert not [n for n in names if "solution" in n or "instructor" in n]
    commands = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(commands) == 2 and "requirements.txt" in commands[0] and wheel.name in commands[0]
    assert commands[1].endswith("jupyter lab")
    pins = [r for r in requirements if r and not r.startswith("#")]
    lock = kit.lock()
    assert all(kit._name(p) in lock and lock[kit._name(p)] == p for p in pins), "a pin differs from the lock"
    named = {kit._name(p) for p in pins}
    for needed in ["numpy", "scipy", "matplotlib", "ipywidgets", "threadpoolctl", "jupyterlab", "ipykernel"]:
        assert needed in named, f"requirements.txt does not pin {needed}"
    assert not named & {"sphinx", "jupyter-book", "myst-nb", "pytest", "setuptools"}, "build tools in the kit"


def test_the_kit_holds_no_line_of_any_worked_solution(built):
    from test_site import normalise, other_sources, solution_blocks

    _, kit_zip = built
    with zipfile.ZipFile(kit_zip) as zf:
        text = normalise("\n".join(zf.read(n).decode() for n in zf.namelist() if n.endswith((".ipynb", ".md",
                                                                                                ".txt"))))
        # the notebooks' own text, as a reader sees it: every cell's source and output
        cells = []
        for n in zf.namelist():
            if n.endswith(".ipynb"):
                for cell in json.loads(zf.read(n))["cells"]:
                    cells.append(_source(cell))
                    for out in cell.get("outputs", []):
                        cells.append("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", "")))
    text += "\n" + normalise("\n".join(cells))
    elsewhere = other_sources()
    blocks = solution_blocks()
    assert blocks
    for nb, label, code, prose in blocks:
        distinctive = [normalise(l) for l in code + prose if len(l) >= 30 and normalise(l) not in elsewhere]
        assert distinctive, f"{nb}, {label}: no distinctive line to search the kit for"
        leaked = [l for l in distinctive if l in text]
        assert not leaked, f"{nb}, solution to {label}: the student kit contains {leaked[:3]}"


def test_require_accepts_this_version_and_older_and_names_the_newer_one_it_needs():
    assert fixedstate.require(fixedstate.__version__) is True
    assert fixedstate.require("0.0.1") is True
    with pytest.raises(fixedstate.OutdatedError) as info:
        fixedstate.require("99.0.0")
    message = str(info.value)
    assert fixedstate.__version__ in message and "99.0.0" in message
    assert "%pip install --upgrade fixedstate-99.0.0-py3-none-any.whl" in message
    assert info.value._render_traceback_() == [f"OutdatedError: {message}"]
    for bad in ["0.2", "v0.2.0", 2, None]:
        with pytest.raises(ValueError, match="version"):
            fixedstate.require(bad)


def _run(nb, kernel_name="python3", cwd=None, timeout=900):
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(cwd or ROOT)}})
    try:
        client.execute()
    except CellExecutionError:
        return False
    return True


def _guard_notebook(version):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(notebook_guard.guard_line(version) + "\nprint('first cell ran')"),
                nbformat.v4.new_code_cell("print('second cell ran')")]
    return nb


def test_the_first_line_lets_a_current_package_through_and_stops_an_older_one_with_its_message(tmp_path):
    ok = _guard_notebook(fixedstate.__version__)
    assert _run(ok, cwd=tmp_path)
    assert [o["text"] for c in ok.cells for o in c.outputs] == ["first cell ran\n", "second cell ran\n"]
    newer = _guard_notebook("99.0.0")
    assert not _run(newer, cwd=tmp_path)
    (out,) = newer.cells[0].outputs
    assert out["output_type"] == "error" and out["traceback"] == [f"OutdatedError: {out['evalue']}"]
    assert "fixedstate 99.0.0 or newer" in out["evalue"] and fixedstate.__version__ in out["evalue"]
    assert newer.cells[1].outputs == [], "the notebook went on after its first cell"


# ------------------------------------------------------------------ installed from the kit, outside the repository

def _sanitize(text: str) -> str:
    cfg = (ROOT / "tests" / "nbval_sanitize.cfg").read_text()
    for regex, replace in re.findall(r"regex: (.*)\nreplace: (.*)", cfg):
        text = re.sub(regex, replace, text)
    return text


def _printed(cell, results: bool = False) -> str:
    """What a cell printed (stdout), and with ``results`` also its displayed results' plain text."""
    parts = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream" and o["name"] == "stdout":
            parts.append("".join(o["text"]))
        elif results and "text/plain" in o.get("data", {}):
            parts.append("".join(o["data"]["text/plain"]))
    return _sanitize("".join(parts))


def _kernel(jupyter_dir: Path, name: str, python: Path) -> str:
    spec = jupyter_dir / "kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name, "language": "python"}))
    return name


@pytest.fixture(scope="module")
def kit_env(student_kit_install, tmp_path_factory):
    """The student kit installed per its README (tests/conftest.py), with a kernel of its environment."""
    folder, python, seconds = student_kit_install
    jupyter = tmp_path_factory.mktemp("jupyter")
    kernel = _kernel(jupyter, "kit", python)
    os.environ["JUPYTER_PATH"] = str(jupyter)
    yield folder, kernel, seconds
    os.environ.pop("JUPYTER_PATH", None)


@pytest.mark.kit
def test_a_chapter_from_the_kit_runs_in_its_own_environment_and_prints_what_the_book_prints(kit_env):
    folder, kernel, _ = kit_env
    path = folder / "chapters" / f"{CHAPTER}.ipynb"
    nb = nbformat.read(path, as_version=4)
    stored = [c for c in nb.cells if c.cell_type == "code"]
    expected = [_printed(c) for c in stored]
    fresh = nbformat.read(path, as_version=4)
    fresh.cells.append(nbformat.v4.new_code_cell(
        "import importlib.util, fixedstate\nprint(fixedstate.__file__)\nprint(importlib.util.find_spec('myst_nb'))"))
    assert _run(fresh, kernel, cwd=path.parent), [o for c in fresh.cells for o in c.get("outputs", [])
                                                   if o["output_type"] == "error"][:1]
    where, myst = fresh.cells[-1].outputs[0]["text"].split("\n")[:2]
    assert Path(where).resolve().is_relative_to(folder / ".venv"), f"fixedstate came from {where}"
    assert myst == "None", "the kit's environment has the book's build tools: glue's fallback went untested"
    ran = [c for c in fresh.cells if c.cell_type == "code"][:len(stored)]
    for i, (old, new) in enumerate(zip(stored, ran)):
        if "nbval-ignore-output" in old.metadata.get("tags", []):
            continue
        assert _printed(new) == expected[i], f"{CHAPTER}, code cell {i}: prints otherwise than the book"


@pytest.mark.kit
def test_an_exercise_from_the_kit_gives_feedback_and_its_checks_pass_a_worked_solution(kit_env):
    from make_grade_fixtures import Builder
    from grading.book import read_book

    folder, kernel, _ = kit_env
    path = folder / "exercises" / f"{EXERCISE}.ipynb"
    starter = nbformat.read(path, as_version=4)
    assert _run(starter, kernel, cwd=path.parent)
    printed = "\n".join(_printed(c, True) for c in starter.cells if c.cell_type == "code")
    stored = "\n".join(_printed(c, True) for c in nbformat.read(ROOT / "exercises" / path.name, as_version=4).cells
                       if c.cell_type == "code")
    assert printed.count("NOT YET") == stored.count("NOT YET") > 0 and "PASSED" not in printed
    solved = Builder(read_book(ROOT)[EXERCISE], ROOT).filled()   # the worked solutions in the starters' place
    solved_path = path.with_name("solved.ipynb")
    nbformat.write(solved, solved_path)
    solved = nbformat.read(solved_path, as_version=4)
    assert _run(solved, kernel, cwd=path.parent)
    printed = "\n".join(_printed(c, True) for c in solved.cells if c.cell_type == "code")
    assert "NOT YET" not in printed and printed.count("PASSED") == stored.count("NOT YET")


@pytest.mark.kit
def test_a_downloaded_chapter_without_the_package_stops_at_its_first_cell_with_the_install_command(kit_env):
    """The kit's environment with numpy, matplotlib, ipywidgets and Jupyter, but not fixedstate."""
    folder, kernel, _ = kit_env
    pip = [str(folder / ".venv" / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(pip + ["uninstall", "--quiet", "--yes", "fixedstate"], check=True)
    try:
        nb = nbformat.read(ROOT / "chapters" / f"{CHAPTER}.ipynb", as_version=4)   # as the page downloads it
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        assert not _run(nb, kernel, cwd=folder.parent)
    finally:
        wheel = folder / f"fixedstate-{fixedstate.__version__}-py3-none-any.whl"
        subprocess.run(pip + ["install", "--quiet", "--no-deps", str(wheel)], check=True)
    code = [c for c in nb.cells if c.cell_type == "code"]
    (out,) = code[0].outputs
    wheel = f"fixedstate-{fixedstate.__version__}-py3-none-any.whl"
    assert out["output_type"] == "stream" and out["name"] == "stderr", out
    assert out["text"].startswith("UsageError: fixedstate, the book's package, is not installed.")
    assert f"%pip install {wheel}" in out["text"]
    assert "Traceback" not in out["text"] and "ModuleNotFoundError" not in out["text"]
    assert all(not c.outputs and c.execution_count is None for c in code[1:]), \
        "the notebook went on after its first cell"
    print("\nthe first cell of a downloaded chapter without the package shows:\n" + out["text"])
