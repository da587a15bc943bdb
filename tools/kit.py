"""The book's downloads: the package's wheel, and a kit of notebooks to run on one's own machine.

Usage:
  python tools/kit.py wheel OUT_DIR                  the wheel of fixedstate, into OUT_DIR
  python tools/kit.py student-kit OUT_DIR            the student kit (no solutions), into OUT_DIR
  python tools/kit.py book-kit OUT_DIR               the same with every notebook of the book

A kit is one zip holding one folder:

  README.md                            two commands: set up, open JupyterLab
  requirements.txt                     every package the notebooks and JupyterLab need, pinned
  fixedstate-X.Y.Z-py3-none-any.whl    the book's package
  chapters/*.ipynb, exercises/*.ipynb  (and, in the book kit, solutions/ and appendix/)

``make student-kit`` writes the student kit to ``_build/``; the HTML book serves the
wheel and a kit from ``downloads/`` (``tools/sphinx_ext/downloads.py`` calls
:func:`site_downloads` when a build finishes): the student kit in the student
edition, the book kit in the full one.

The wheel is built from a copy of ``pyproject.toml``, ``README.md`` and ``code/``
with the environment's own setuptools (pinned in the ``book`` extra), without
build isolation, so building it needs neither the network nor anything installed
by hand. Its dependencies are ``pyproject.toml``'s: ranges, so that installing it
keeps a reader's own newer versions (``make test-pythons`` tests their lower ends,
and the newest, on every Python from 3.11 on). ``requirements.txt`` pins, at the
versions of ``requirements-lock.txt``, everything the package and JupyterLab pull
in on this platform: the environment the book's outputs were stored from.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUDENT_DIRS = ("chapters", "exercises")
BOOK_DIRS = ("chapters", "exercises", "solutions", "appendix")
#: The fixed time stamp of every file in a kit, so that an unchanged book gives the same zip.
ZIP_TIME = (2026, 1, 1, 0, 0, 0)


def project(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]


def version(root: Path = ROOT) -> str:
    return project(root)["version"]


def wheel_name(root: Path = ROOT) -> str:
    return f"fixedstate-{version(root)}-py3-none-any.whl"


def kit_name(edition: str, root: Path = ROOT) -> str:
    if edition not in ("student", "book"):
        raise ValueError(f"edition: expected 'student' or 'book', got {edition!r}")
    return f"fixedstate-{edition}-kit-{version(root)}"


def jupyterlab_pin(root: Path = ROOT, name: str = "jupyterlab") -> str:
    """The book extra's pin of ``name`` (JupyterLab, or jupyterlab-myst, which renders the notebooks' MyST)."""
    pins = [r for r in project(root)["optional-dependencies"]["book"] if _name(r) == name]
    if len(pins) != 1:
        raise ValueError(f"pyproject.toml: expected one pinned {name} in the book extra")
    return pins[0]


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)).lower()


def lock(root: Path = ROOT) -> dict[str, str]:
    """``{normalised name: 'Name==version'}`` from requirements-lock.txt."""
    out = {}
    for line in (root / "requirements-lock.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out[_name(line)] = line
    return out


def build_wheel(out_dir: Path, root: Path = ROOT) -> Path:
    """Build the wheel of fixedstate into ``out_dir`` and return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(root / name, src / name)
        shutil.copytree(root / "code", src / "code",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        built = Path(tmp) / "wheel"
        run = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
             "--quiet", "--wheel-dir", str(built), str(src)],
            capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        wheels = sorted(built.glob("*.whl"))
        if run.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"building the wheel of fixedstate failed:\n{run.stdout}\n{run.stderr}")
        if wheels[0].name != wheel_name(root):
            raise RuntimeError(f"expected {wheel_name(root)}, pip built {wheels[0].name}")
        target = out_dir / wheels[0].name
        shutil.copy2(wheels[0], target)
    return target


def pinned_requirements(root: Path = ROOT) -> list[str]:
    """Every distribution fixedstate and JupyterLab need here, pinned as in requirements-lock.txt.

    Walks the installed distributions' requirements from the package's direct
    dependencies and JupyterLab (markers evaluated for this platform, no extras),
    and takes each version from the lock, failing on one the lock does not pin.
    """
    from packaging.requirements import Requirement

    pins = lock(root)
    todo = [Requirement(r) for r in project(root)["dependencies"]] + [Requirement(jupyterlab_pin(root))]
    todo += [Requirement(jupyterlab_pin(root, "jupyterlab-myst"))]
    seen: dict[str, str] = {}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _name(req.name)
        if name in seen:
            continue
        if name not in pins:
            raise ValueError(f"requirements-lock.txt: expected a pin for {req.name} (needed by the kit)")
        seen[name] = pins[name]
        dist = metadata.distribution(req.name)
        todo.extend(Requirement(r) for r in (dist.requires or []))
    return sorted(seen.values(), key=str.lower)


def readme(edition: str, root: Path = ROOT) -> str:
    wheel = wheel_name(root)
    what = ("the chapter and exercise notebooks" if edition == "student"
            else "every notebook of the book (chapters, exercises, worked solutions, appendix)")
    return f"""# Fixed-State Sequence Layers: notebooks to run on your own machine

This folder holds {what}, the book's package `fixedstate`
({wheel}) and `requirements.txt`, which pins every package the notebooks and
JupyterLab need at the versions the book was executed with.

You need Python 3.11. In this folder, run:

```bash
python3.11 -m venv .venv && .venv/bin/python -m pip install -r requirements.txt {wheel}
.venv/bin/jupyter lab
```

The first command creates a virtual environment in `.venv` and installs everything
into it; the second opens JupyterLab on this folder. Open a notebook in `chapters/`
and run it from the top: the sliders of the interactive figures recompute live. In
an exercise notebook, fill in the `...` of a starter and run the check cell below
it: it says `PASSED`, or `NOT YET` with what failed, on which case, and what was
expected.

(On Windows, write `py -3.11` for `python3.11`, and `.venv\\Scripts\\python` and
`.venv\\Scripts\\jupyter` for `.venv/bin/python` and `.venv/bin/jupyter`.)
"""


def build_kit(out_dir: Path, edition: str = "student", root: Path = ROOT, wheel: Path | None = None) -> Path:
    """Write the kit's zip into ``out_dir`` and return its path (the wheel is built unless given)."""
    name = kit_name(edition, root)
    dirs = STUDENT_DIRS if edition == "student" else BOOK_DIRS
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = wheel or build_wheel(Path(tmp), root)
        notebooks = sorted(p for d in dirs for p in (root / d).glob("*.ipynb"))
        if not any(p.parent.name == "exercises" for p in notebooks):
            raise ValueError(f"{root}: expected exercise notebooks in exercises/, found none")
        target = out_dir / f"{name}.zip"
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
            def add(arcname: str, data: bytes) -> None:
                info = zipfile.ZipInfo(f"{name}/{arcname}", date_time=ZIP_TIME)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = 0o644 << 16
                zf.writestr(info, data)

            add("README.md", readme(edition, root).encode())
            add("requirements.txt", ("# Pinned: what the notebooks and JupyterLab need (tools/kit.py, from "
                                     "requirements-lock.txt).\n" + "\n".join(pinned_requirements(root))
                                     + "\n").encode())
            add(wheel.name, wheel.read_bytes())
            for nb in notebooks:
                add(nb.relative_to(root).as_posix(), nb.read_bytes())
    return target


def site_downloads(out_dir: Path, edition: str, root: Path = ROOT) -> list[Path]:
    """The files the site serves from ``downloads/``: the wheel and the edition's kit."""
    wheel = build_wheel(out_dir, root)
    return [wheel, build_kit(out_dir, edition, root, wheel=wheel)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["wheel", "student-kit", "book-kit"])
    p.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    if args.what == "wheel":
        path = build_wheel(args.out_dir)
    else:
        path = build_kit(args.out_dir, args.what.split("-")[0])
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
