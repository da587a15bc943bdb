"""Write, or check, the one-line cell that opens the code of every notebook.

Usage: python tools/notebook_guard.py [--check] [NOTEBOOK ...]

Without NOTEBOOK: every notebook in chapters/, exercises/, solutions/ and appendix/.

A notebook downloaded from the HTML book runs on the reader's own machine, where
the book's package may be missing or older than the notebook. The first code cell
of every notebook holds one line, the same in every notebook, that stops the
notebook there with a short message, never a traceback:

- fixedstate missing: IPython's ``UsageError`` prints only its message, which names
  the one command that installs the wheel the book's site serves
  (``%pip install fixedstate-X.Y.Z-py3-none-any.whl``);
- fixedstate older than the version this line names: ``fixedstate.require`` stops
  with the installed and the needed version and the command that updates it.

The cell is tagged ``remove-cell``: the HTML book leaves it out (its readers get the
same instructions from the box under each title), the downloaded notebook keeps it.
The line needs nothing but the standard library and IPython (present in every
Jupyter kernel) until it has found the package. It names the package's version
from pyproject.toml. Running this script again changes nothing (a cell already in
place is rewritten only when the version changed; an older notebook whose import
cell opens with the line gets the line moved into a cell of its own, and the
execution counts after it moved up by one, as a run from the top would number
them), so run it on any new notebook and after every version bump;
``tests/test_book_structure.py`` fails on a notebook without the current cell.
Nothing executes: the line has no output, so the stored outputs stay valid.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ["chapters", "exercises", "solutions", "appendix"]

#: Any version of the line, so that a rerun replaces rather than adds.
GUARD_RE = re.compile(r'^if not \(__import__\("importlib\.util"\)\.util\.find_spec\("fixedstate"\).*$')


def package_version(root: Path = ROOT) -> str:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def wheel_name(version: str) -> str:
    return f"fixedstate-{version}-py3-none-any.whl"


def guard_line(version: str) -> str:
    message = (f"fixedstate, the book's package, is not installed. Install it with  "
               f"%pip install {wheel_name(version)}  (the wheel from the book's site, see its preface)")
    return (f'if not (__import__("importlib.util").util.find_spec("fixedstate") and '
            f'__import__("fixedstate").require("{version}")): '
            f'raise __import__("IPython").core.error.UsageError("{message}")')


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted(p for d in NOTEBOOK_DIRS for p in (root / d).glob("*.ipynb"))


def _source(cell) -> str:
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def first_code_cell(nb: dict):
    return next((c for c in nb["cells"] if c["cell_type"] == "code"), None)


GUARD_TAG = "remove-cell"
#: The cell's id, the same in every notebook (nbformat 4.5 cells carry one).
GUARD_ID = "fixedstate-package-check"


def guard_cell(version: str) -> dict:
    return {"cell_type": "code", "execution_count": None, "id": GUARD_ID, "metadata": {"tags": [GUARD_TAG]},
            "outputs": [], "source": [guard_line(version)]}


def is_guard_cell(cell) -> bool:
    """Whether ``cell`` is a guard cell of any version (the line alone, blank lines aside)."""
    return cell["cell_type"] == "code" and bool(GUARD_RE.match(_source(cell).strip()))


def has_guard(path: Path, version: str) -> bool:
    cell = first_code_cell(json.loads(path.read_text(encoding="utf-8")))
    return (cell is not None and _source(cell) == guard_line(version)
            and GUARD_TAG in cell.get("metadata", {}).get("tags", []))


def _shift_counts(cells) -> None:
    for c in cells:
        if c["cell_type"] == "code" and c.get("execution_count") is not None:
            c["execution_count"] += 1
            for out in c.get("outputs", []):
                if out.get("execution_count") is not None:
                    out["execution_count"] += 1


def with_guard(nb: dict, version: str) -> dict:
    """``nb`` with the current guard cell as its first code cell (changed in place and returned)."""
    cells = nb["cells"]
    i = next((j for j, c in enumerate(cells) if c["cell_type"] == "code"), None)
    if i is None:
        raise ValueError("expected a notebook with a code cell, found none")
    cell = cells[i]
    if is_guard_cell(cell):
        fresh = guard_cell(version)
        cell["source"] = fresh["source"]
        cell.setdefault("metadata", {})
        tags = cell["metadata"].setdefault("tags", [])
        if GUARD_TAG not in tags:
            tags.append(GUARD_TAG)
        return nb
    first, _, rest = _source(cell).partition("\n")
    if GUARD_RE.match(first):  # the older form: the line opened the import cell
        cell["source"] = rest.splitlines(keepends=True)
    executed = cell.get("execution_count") is not None
    if executed:
        _shift_counts(cells[i:])
    fresh = guard_cell(version)
    if executed:
        fresh["execution_count"] = 1
    if "id" not in cell:
        del fresh["id"]
    cells.insert(i, fresh)
    return nb


def apply(path: Path, version: str) -> bool:
    """Put the current cell in place; return whether the file changed."""
    raw = path.read_text(encoding="utf-8")
    try:
        nb = with_guard(json.loads(raw), version)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    out = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if out == raw:
        return False
    path.write_text(out, encoding="utf-8")
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report notebooks without the current line")
    p.add_argument("notebooks", nargs="*", type=Path)
    args = p.parse_args(argv)
    version = package_version()
    paths = args.notebooks or notebooks()
    if args.check:
        missing = [str(path) for path in paths if not has_guard(path, version)]
        for m in missing:
            print(f"{m}: the first code cell is not the check of fixedstate {version} (tagged {GUARD_TAG})")
        return 1 if missing else 0
    changed = [path for path in paths if apply(path, version)]
    print(f"{len(changed)} of {len(paths)} notebooks changed (fixedstate {version})")
    for path in changed:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
