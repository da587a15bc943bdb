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

# a glued value shown in the text: the site's role, or the inline expression the notebooks use
# (tools/sphinx_ext/portable_myst.py turns the second into the first while the site is built)
_GLUE_USE = re.compile(r"\{glue(?::(?:text|any|md|math))?\}`([^`:]+)(?::([^`]*))?`"
                       r"|\{eval\}`glued\(\"([^\"`:]+)(?::([^\"`]*))?\"\)`")
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
            formats.setdefault(m.group(1) or m.group(3), set()).add(m.group(2) or m.group(4) or "")
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
        outputs, md = [_glue_output("r", "0.25338456270911375")], '{eval}`glued("r:.3f")`'
    path = _fake_notebook(tmp_path, outputs, md)
    try:
        formats = dict(FORMATS)
        for m in _GLUE_USE.finditer(md):
            formats.setdefault(m.group(1) or m.group(3), set()).add(m.group(2) or m.group(4) or "")
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


# ------------------------------------------------------------------ the portable form (issue #27)
# The notebooks are written in MyST that JupyterLab (jupyterlab-myst) shows as it is and that
# tools/sphinx_ext/portable_myst.py turns into the site's roles while Sphinx reads them. The
# values the inline expressions show are stored in each markdown cell's user_expressions; they
# must be exactly the glued outputs (which nbval compares with a fresh execution) as the site
# formats them, so every number a reader sees in JupyterLab is checked against the code.

import sys  # noqa: E402

from hypothesis import given, strategies as st  # noqa: E402

from _examples import examples  # noqa: E402

sys.path.insert(0, str(ROOT / "tools" / "sphinx_ext"))
import portable_myst  # noqa: E402

from fixedstate import prose  # noqa: E402

TABLE, BIB, TITLES = portable_myst.macros(), portable_myst.author_year(), portable_myst.ref_titles()
EQUATIONS, STATEMENTS = portable_myst.equation_numbers(), portable_myst.statement_numbers()


def _markdown_cells(nb_path):
    return ["".join(c["source"]) for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == "markdown"]


@pytest.mark.parametrize("nb_path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_notebook_is_in_the_portable_form_and_shows_its_glued_values(nb_path):
    """No role, macro or bare reference JupyterLab cannot show; stored expression values are the glued ones."""
    converted = portable_myst.dump(portable_myst.convert(nb_path, table=TABLE, bib=BIB, titles=TITLES,
                                                         equations=EQUATIONS, statements=STATEMENTS))
    assert converted == nb_path.read_text(), (
        f"{nb_path.relative_to(ROOT)} is not in the portable form or its user_expressions are stale: "
        f"run  .venv/bin/python tools/sphinx_ext/portable_myst.py {nb_path.relative_to(ROOT)}")


@pytest.mark.parametrize("nb_path", notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_site_reads_every_portable_form_back_as_its_own_roles(nb_path):
    """The hook leaves no inline expression or citation link, and undoes exactly what the tool did."""
    local = {m for text in _markdown_cells(nb_path) for m in re.findall(r"^\(([^()\s]+)\)=", text, re.M)}
    local |= {m for text in _markdown_cells(nb_path) for m in portable_myst.EQ_DEF.findall(text)}
    local |= {m for text in _markdown_cells(nb_path) for m in portable_myst.DIRECTIVE_LABEL.findall(text)}
    for i, text in enumerate(_markdown_cells(nb_path)):
        site = portable_myst.to_site(text)
        assert "glued(" not in site and "(#cite-" not in site and ".ipynb#eq-" not in site, f"cell {i}: {site[:200]}"
        again = portable_myst.to_portable(site, table=TABLE, bib=BIB, titles=TITLES, local_labels=local,
                                          equations=EQUATIONS, statements=STATEMENTS)
        assert again == text, f"{nb_path.relative_to(ROOT)} cell {i}: the site form does not convert back"


def test_the_tool_converts_each_site_form_and_the_hook_converts_it_back():
    site = ("See {cite:t}`yang2024gated` and {cite}`katharopoulos2020transformers,schlag2021linear`; "
            "$k^\\T q \\in \\R^{d}$, $\\Theta$, {glue:text}`loop_err:.0e` {glue:text}`n`, "
            "{ref}`chap-delta-rule`, {ref}`sec-here`, {ref}`Own text <chap-ssm>`, {eq}`eq-dr-gated`, {eq}`eq-here`.")
    out = portable_myst.to_portable(site, table=TABLE, bib=BIB, titles=TITLES, local_labels={"sec-here", "eq-here"},
                                    equations=EQUATIONS)
    assert "[Yang et al. (2025)](#cite-yang2024gated)" in out        # references.bib: year = 2025 (ICLR)
    assert "([Katharopoulos et al., 2020](#cite-katharopoulos2020transformers); [Schlag et al., 2021]" in out
    assert "$k^\\top q \\in \\mathbb{R}^{d}$, $\\Theta$" in out
    assert '{eval}`glued("loop_err:.0e")` {eval}`glued("n")`' in out
    assert "{ref}`The delta rule: DeltaNet, Gated DeltaNet and Kimi Delta Attention <chap-delta-rule>`" in out
    assert "{ref}`sec-here`" in out and "{ref}`Own text <chap-ssm>`" in out
    number, name = EQUATIONS["eq-dr-gated"]
    assert f"[({number})](../chapters/{name}#eq-dr-gated), {{eq}}`eq-here`" in out
    back = portable_myst.to_site(out)
    assert "{eq}`eq-dr-gated`, {eq}`eq-here`" in back
    assert "{cite:t}`yang2024gated`" in back
    assert "{cite:p}`katharopoulos2020transformers,schlag2021linear`" in back
    assert "{glue:text}`loop_err:.0e` {glue:text}`n`" in back


def test_the_tool_refuses_an_unknown_citation_and_a_value_no_cell_glues():
    with pytest.raises(ValueError, match="nosuchkey2099"):
        portable_myst.to_portable("{cite:t}`nosuchkey2099`", table=TABLE, bib=BIB, titles=TITLES, local_labels=set())
    with pytest.raises(ValueError, match="missing"):
        portable_myst.user_expressions('{eval}`glued("missing:.2f")`', {"other": "1.0"}, "probe")


def test_a_stale_stored_value_is_caught(tmp_path):
    """Change one stored expression value of a chapter: the portable-form check fails (a test that can fail)."""
    nb_path = ROOT / "chapters" / "03_delta_rule.ipynb"
    nb = json.loads(nb_path.read_text())
    cell = next(c for c in nb["cells"] if c["metadata"].get("user_expressions"))
    cell["metadata"]["user_expressions"][0]["result"]["data"]["text/plain"] = "'9.99'"
    probe = ROOT / "chapters" / f"_portable_probe_{tmp_path.name}.ipynb"
    probe.write_text(portable_myst.dump(nb))
    try:
        fresh = portable_myst.dump(portable_myst.convert(probe, table=TABLE, bib=BIB, titles=TITLES))
        assert fresh != probe.read_text()
    finally:
        probe.unlink()


_FORMATS = st.sampled_from(["", ".3f", ".0f", ",.0f", ",", ".1e", ".0e", ".2g", ".3g", ".1%", ".2%", "d", ",d"])


@examples(300)
@given(value=st.one_of(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12),
                       st.integers(-10**9, 10**9)), fmt=_FORMATS)
def test_the_kernel_and_the_site_show_a_glued_value_alike(value, fmt):
    """prose.glued (JupyterLab, in the kernel) == myst-nb's rule on the stored text/plain (the site)."""
    if fmt.endswith("d") and not isinstance(value, int):
        value = int(value)
    spec = f"v:{fmt}" if fmt else "v"
    prose.glue("v", value, display=False)
    assert prose.glued(spec) == portable_myst.format_glued(repr(value), spec)


def test_glued_names_what_it_lacks():
    with pytest.raises(ValueError, match="spec"):
        prose.glued("")
    with pytest.raises(ValueError, match="never_glued"):
        prose.glued("never_glued:.2f")


@pytest.mark.site
def test_the_equation_numbers_the_notebooks_show_are_the_sites():
    """An equation of another notebook is shown by number in JupyterLab: the number the built site gives it."""
    site = ROOT / "_build" / "html" / "chapters"
    if not site.is_dir():
        pytest.fail(f"no built book at {site.parent}: run `make book` first")
    wrong = []
    for label, (number, name) in EQUATIONS.items():
        html = (site / name.replace(".ipynb", ".html")).read_text()
        m = re.search(r'id="equation-' + re.escape(label) + r'".{0,3000}?class="eqno">\(([\d.]+)\)', html, re.S)
        if m is None or m.group(1) != number:
            wrong.append(f"{label}: the notebooks say ({number}), the site ({m and m.group(1)})")
    for label, (name, file) in STATEMENTS.items():
        html = (site / file.replace(".ipynb", ".html")).read_text()
        shown = re.findall(r'href="#' + re.escape(label) + r'"[^>]*>([^<]*)<', html) + \
            re.findall(r'id="' + re.escape(label) + r'".{0,400}?(' + name.split()[0] + r' [\d.]+)', html, re.S)
        if name not in [t.strip() for t in shown]:
            wrong.append(f"{label}: the notebooks say {name}, the site {shown}")
    assert len(EQUATIONS) > 100 and STATEMENTS and not wrong, wrong
