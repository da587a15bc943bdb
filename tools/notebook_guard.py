"""Write, or check, the one line that opens the first code cell of every notebook.

Usage: python tools/notebook_guard.py [--check] [NOTEBOOK ...]

Without NOTEBOOK: every notebook in chapters/, exercises/, solutions/ and appendix/.

A notebook downloaded from the HTML book runs on the reader's own machine, where
the book's package may be missing or older than the notebook. The line stops the
notebook at its first cell with a short message, never a traceback:

- fixedstate missing: IPython's ``UsageError`` prints only its message, which names
  the one command that installs the wheel the book's site serves
  (``%pip install fixedstate-X.Y.Z-py3-none-any.whl``);
- fixedstate older than the version this line names: ``fixedstate.require`` stops
  with the installed and the needed version and the command that updates it.

The line needs nothing but the standard library and IPython (present in every
Jupyter kernel) until it has found the package. It names the package's version
from pyproject.toml. Running this script again changes nothing (a line already in
place is rewritten only when the version changed), so run it on any new notebook
and after every version bump; ``tests/test_book_structure.py`` fails on a notebook
without the current line. Only the first code cell is touched, and nothing
executes: the line has no output, so the stored outputs stay valid.
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


def has_guard(path: Path, version: str) -> bool:
    cell = first_code_cell(json.loads(path.read_text(encoding="utf-8")))
    return cell is not None and _source(cell).split("\n", 1)[0] == guard_line(version)


def with_guard(source: str, version: str) -> str:
    first, sep, rest = source.partition("\n")
    if GUARD_RE.match(first):
        return guard_line(version) + sep + rest
    return guard_line(version) + "\n" + source


def apply(path: Path, version: str) -> bool:
    """Put the current line in place; return whether the file changed."""
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    cell = first_code_cell(nb)
    if cell is None:
        raise ValueError(f"{path}: expected a notebook with a code cell, found none")
    new = with_guard(_source(cell), version)
    cell["source"] = new.splitlines(keepends=True)
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
            print(f"{m}: the first code cell does not open with the line of fixedstate {version}")
        return 1 if missing else 0
    changed = [path for path in paths if apply(path, version)]
    print(f"{len(changed)} of {len(paths)} notebooks changed (fixedstate {version})")
    for path in changed:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
