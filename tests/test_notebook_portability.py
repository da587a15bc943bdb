"""Stored notebook outputs must not depend on the processor or the BLAS kernel.

nbval re-executes every notebook and compares its outputs with the stored ones
character by character. Two kinds of output make that comparison pass on one
processor and fail on another, because their last digits depend on which BLAS
kernel ran:

- a glued float carrying more digits than the text displays (the prose shows
  ``{glue:text}`x:.3f```, but the notebook stores all 17 digits of ``x``);
- an error at rounding level (below 1e-12), printed or glued as its digits.

This test scans every stored notebook for both, so that neither can come
back. ``fixedstate.prose`` has the two helpers that avoid them:
``glue_number`` and ``glue_bound`` (and ``below`` for printing).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fixedstate.prose import ROUNDING_LEVEL, round_to_format

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ("chapters", "exercises", "solutions", "appendix")
GLUE_MIME = "application/papermill.record/text/plain"
MAX_DIGITS_UNFORMATTED = 6      # a float shown as it is must be short
MAX_DIGITS_PRINTED = 14         # a printed float with more digits shows its last bits

_GLUE_USE = re.compile(r"\{glue(?::(?:text|any|md|math))?\}`([^`:]+)(?::([^`]*))?`")
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])")
_SCALAR_REPR = re.compile(r"^np\.(?:float|int)\d*\((.*)\)$")


def notebooks() -> list[Path]:
    return sorted(p for d in NOTEBOOK_DIRS for p in (ROOT / d).rglob("*.ipynb")
                  if "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts)


def markdown_texts():
    """Every text in which the book can show a glued value: notebook markdown and .md pages."""
    for nb in notebooks():
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                yield "".join(cell["source"])
    for md in ROOT.glob("*.md"):
        yield md.read_text()
    for d in NOTEBOOK_DIRS:
        for md in (ROOT / d).rglob("*.md"):
            yield md.read_text()


def glue_formats() -> dict[str, set[str]]:
    """name -> the format specifications with which the text shows it ('' for none)."""
    formats: dict[str, set[str]] = {}
    for text in markdown_texts():
        for m in _GLUE_USE.finditer(text):
            formats.setdefault(m.group(1), set()).add(m.group(2) or "")
    return formats


def significant_digits(text: str) -> int:
    mantissa = re.split(r"[eE]", text.strip().lstrip("+-"))[0].replace(".", "").lstrip("0")
    return len(mantissa.rstrip("0")) if "." in text else len(mantissa)


def is_power_of_ten(x: float) -> bool:
    return re.fullmatch(r"1(\.0*)?e[-+]?\d+", f"{abs(x):.6e}".replace("e-0", "e-")) is not None


def glued_floats(nb_path: Path):
    """(cell index, name, stored text, value) of every glued float in a notebook."""
    nb = json.loads(nb_path.read_text())
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if GLUE_MIME not in data:
                continue
            name = out.get("metadata", {}).get("scrapbook", {}).get("name", "?")
            text = data[GLUE_MIME]
            text = "".join(text) if isinstance(text, list) else text
            m = _SCALAR_REPR.match(text.strip())
            text = m.group(1) if m else text.strip()
            try:
                value = float(text)
            except ValueError:
                continue
            if re.fullmatch(r"[-+]?\d+", text):
                continue                     # an integer: exact on every machine
            yield i, name, text, value


def printed_texts(nb_path: Path):
    """(cell index, text) of every printed or displayed plain-text output (glue records excluded)."""
    nb = json.loads(nb_path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if "nbval-ignore-output" in cell.get("metadata", {}).get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                yield i, "".join(out["text"]) if isinstance(out["text"], list) else out["text"]
            elif "text/plain" in out.get("data", {}) and GLUE_MIME not in out["data"]:
                t = out["data"]["text/plain"]
                yield i, "".join(t) if isinstance(t, list) else t


def fragile_glued(nb_path: Path, formats: dict[str, set[str]]) -> list[str]:
    problems = []
    for i, name, text, value in glued_floats(nb_path):
        where = f"{nb_path.relative_to(ROOT)} cell {i}: glued {name} = {text}"
        if value != 0 and abs(value) < ROUNDING_LEVEL and not is_power_of_ten(value):
            problems.append(f"{where} is a rounding-level number: glue a bound with glue_bound")
            continue
        used = {f for f in formats.get(name, set()) if f}
        if used:
            if not any(round_to_format(value, f) == value for f in used):
                problems.append(f"{where} has more digits than the text shows "
                                f"(formats {sorted(used)}): glue it with glue_number")
        elif significant_digits(text) > MAX_DIGITS_UNFORMATTED:
            problems.append(f"{where} has {significant_digits(text)} significant digits and the text "
                            f"shows it unformatted (or not at all): glue it with glue_number")
    return problems


def fragile_printed(nb_path: Path) -> list[str]:
    problems = []
    for i, text in printed_texts(nb_path):
        for m in _NUMBER.finditer(text):
            s = m.group(0)
            try:
                value = float(s)
            except ValueError:
                continue
            where = f"{nb_path.relative_to(ROOT)} cell {i}: printed {s}"
            if value != 0 and abs(value) < ROUNDING_LEVEL and not is_power_of_ten(value):
                problems.append(f"{where} is a rounding-level number: print a bound (fixedstate.prose.below)")
            elif "." in s and significant_digits(s) > MAX_DIGITS_PRINTED:
                problems.append(f"{where} shows its last bits: print it rounded")
    return problems


FORMATS = glue_formats()


@pytest.mark.parametrize("nb_path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_fragile_outputs(nb_path):
    problems = fragile_glued(nb_path, FORMATS) + fragile_printed(nb_path)
    assert not problems, "fragile stored outputs:\n" + "\n".join(problems)


def _fake_notebook(tmp_path, outputs, markdown=""):
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": markdown},
                    {"cell_type": "code", "metadata": {}, "source": "", "outputs": outputs,
                     "execution_count": 1}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = ROOT / "chapters" / f"_portability_probe_{tmp_path.name}.ipynb"
    path.write_text(json.dumps(nb))
    return path


def _glue_output(name, text):
    return {"output_type": "display_data", "data": {GLUE_MIME: text},
            "metadata": {"scrapbook": {"name": name, "mime_prefix": "application/papermill.record/"}}}


@pytest.mark.parametrize("case", ["sum", "rounding", "printed", "formatted-too-long"])
def test_scan_catches_fragile_outputs(tmp_path, case):
    """The scan fails on the outputs it exists to catch (a test that can fail)."""
    if case == "sum":
        outputs, md = [_glue_output("s", repr(0.1 + 0.2))], ""
    elif case == "rounding":
        outputs, md = [_glue_output("e", "3.9453139763788654e-16")], "{glue:text}`e:.1e`"
    elif case == "printed":
        outputs, md = [{"output_type": "stream", "name": "stdout", "text": "error 3.9e-16\n"}], ""
    else:
        outputs, md = [_glue_output("r", "0.25338456270911375")], "{glue:text}`r:.3f`"
    path = _fake_notebook(tmp_path, outputs, md)
    try:
        formats = dict(FORMATS)
        for m in _GLUE_USE.finditer(md):
            formats.setdefault(m.group(1), set()).add(m.group(2) or "")
        assert fragile_glued(path, formats) + fragile_printed(path)
    finally:
        path.unlink()


def test_scan_accepts_portable_outputs(tmp_path):
    outputs = [_glue_output("r", "0.253"), _glue_output("b", "1e-12"),
               {"output_type": "stream", "name": "stdout", "text": "forms agree: below 1e-12, 0.25\n"}]
    path = _fake_notebook(tmp_path, outputs, "{glue:text}`r:.3f` {glue:text}`b:.0e`")
    try:
        formats = {"r": {".3f"}, "b": {".0e"}}
        assert fragile_glued(path, formats) + fragile_printed(path) == []
    finally:
        path.unlink()
