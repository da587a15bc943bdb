"""The notebooks' markdown in a form that JupyterLab (jupyterlab-myst) and the site both show.

JupyterLab never reads ``_config.yml`` nor the bibliography, and knows nothing of myst-nb's
``glue``. So the notebooks are written in what every renderer can show, and this module turns
that form into the site's while Sphinx reads a notebook (the ``source-read`` event):

=================================  ==========================================  ======================
in the notebook (what Jupyter      on the site (after this module's            jupyterlab-myst
shows)                             ``source-read`` hook)                       shows
=================================  ==========================================  ======================
``{eval}`glued("name:.3f")```      ``{glue:text}`name:.3f```                   the value stored in
 + the value in the cell's                                                      ``user_expressions``
 ``user_expressions``                                                           (or the kernel's)
``[Yang et al. (2024)](#cite-k)``  ``{cite:t}`k```                             "Yang et al. (2024)"
``([Yang et al., 2024](#cite-k);`` ``{cite:p}`k,j```                           "(Yang et al., 2024;
`` [Gu and Dao, 2023](#cite-j))``                                                Gu and Dao, 2023)"
``{ref}`Title <label>```           unchanged                                   "Title"
``[(3.6)](../chapters/03_...       ``{eq}`eq-dr-gated``` (an equation of       "(3.6)", a link to
 .ipynb#eq-dr-gated)``              another notebook)                           that notebook
``[Proposition 3.1](../chapters/    ``{prf:ref}`prop-dr-gradient```             "Proposition 3.1"
 03_delta_rule.ipynb#prop-...)``
``\\top``, ``\\mathbf{q}``          unchanged                                   the same formula
=================================  ==========================================  ======================

The same file is the command that converts notebooks from the site's own syntax
(``{glue:text}``, ``{cite:t}``, bare ``{ref}`` to another page, the macros of
``_config.yml``) and refreshes the stored values of the inline expressions from the glued
outputs; ``--check`` only reports. ``tests/test_notebook_portability.py`` runs the check.

    python tools/sphinx_ext/portable_myst.py [--check] NOTEBOOK...
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

from fixedstate.prose import format_as_glued

ROOT = Path(__file__).resolve().parents[2]
GLUE_MIME = "application/papermill.record/text/plain"
NOTEBOOK_DIRS = ("chapters", "exercises", "solutions", "appendix")

# ---------------------------------------------------------------- the forms, as regexes
SITE_GLUE = re.compile(r"\{glue:text\}`([^`]+)`")
EVAL_GLUED = re.compile(r"\{eval\}`glued\(\"([^\"`]+)\"\)`")
SITE_CITE = re.compile(r"\{cite(?::([tp]))?\}`([^`]+)`")
_CITE_LINK = r"\[[^\[\]]+\]\(#cite-([\w:.\-]+)\)"
CITE_P = re.compile(r"\((" + _CITE_LINK + r"(?:; " + _CITE_LINK + r")*)\)")
CITE_T = re.compile(_CITE_LINK)
BARE_REF = re.compile(r"\{ref\}`([^`<>]+)`")
EQ_ROLE = re.compile(r"\{eq\}`([^`<>]+)`")
EQ_LINK = re.compile(r"\[\((\d+\.\d+)\)\]\(\.\./chapters/[\w.\-]+\.ipynb#(eq-[\w\-]+)\)")
EQ_DEF = re.compile(r"\$\$[ \t]*\((eq-[\w\-]+)\)")
PRF_ROLE = re.compile(r"\{prf:ref\}`([^`<>]+)`")
PRF_DEF = re.compile(r"^```+\{prf:(\w+)\}[^\n]*\n:label: (\S+)", re.M)
PRF_LINK = re.compile(r"\[[A-Z][a-z]+ \d+\.\d+\]\(\.\./chapters/[\w.\-]+\.ipynb#([\w\-]+)\)")
DIRECTIVE_LABEL = re.compile(r"^:label: (\S+)", re.M)
LABEL = re.compile(r"^\(([^()\s]+)\)=\s*\n+(#+)\s+(.+?)\s*$", re.M)


def expression(spec: str) -> str:
    """The kernel expression that shows the glued value ``spec`` ("name" or "name:format")."""
    return f'glued("{spec}")'


# ---------------------------------------------------------------- notebook -> site
def to_site(markdown: str) -> str:
    """The site's MyST for one markdown cell written in the portable form."""
    markdown = EVAL_GLUED.sub(lambda m: "{glue:text}`" + m.group(1) + "`", markdown)

    def cite_p(m):
        keys = re.findall(r"\(#cite-([\w:.\-]+)\)", m.group(1))
        return "{cite:p}`" + ",".join(keys) + "`"

    markdown = CITE_P.sub(cite_p, markdown)
    markdown = CITE_T.sub(lambda m: "{cite:t}`" + m.group(1) + "`", markdown)
    markdown = EQ_LINK.sub(lambda m: "{eq}`" + m.group(2) + "`", markdown)
    return PRF_LINK.sub(lambda m: "{prf:ref}`" + m.group(1) + "`", markdown)


def notebook_to_site(source: str) -> str:
    """A notebook's JSON text with every markdown cell turned into the site's MyST."""
    nb = json.loads(source)
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = to_site(text)
    return json.dumps(nb)


def _source_read(app, docname, source):
    if app.env.doc2path(docname).endswith(".ipynb"):
        source[0] = notebook_to_site(source[0])


def setup(app):
    app.connect("source-read", _source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


# ---------------------------------------------------------------- site -> notebook (the tool)
def macros(root: Path = ROOT) -> dict[str, str]:
    """The TeX macros of ``_config.yml`` (name without backslash -> expansion)."""
    import yaml

    config = yaml.safe_load((root / "_config.yml").read_text())
    return dict(config["sphinx"]["config"]["mathjax3_config"]["tex"]["macros"])


def expand_macros(markdown: str, table: dict[str, str]) -> str:
    """Every ``\\name`` of ``table`` replaced by its expansion (``\\Theta`` is not ``\\T``)."""
    for name in sorted(table, key=len, reverse=True):
        markdown = re.sub(r"\\" + re.escape(name) + r"(?![A-Za-z])", lambda _m, e=table[name]: e, markdown)
    return markdown


def author_year(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """bib key -> (authors as the text names them, year), from ``references.bib``."""
    from pybtex.database import parse_file

    def clean(s):
        s = re.sub(r"\{\\L\}", "Ł", s)
        s = re.sub(r"\{?\\c\{?c\}?\}?", "ç", s)
        s = re.sub(r"\{?\\'\{?([a-zA-Z])\}?\}?", lambda m: m.group(1) + "\u0301", s)
        s = re.sub(r'\{?\\"\{?([a-zA-Z])\}?\}?', lambda m: m.group(1) + "\u0308", s)
        s = re.sub(r"\{?\\`\{?([a-zA-Z])\}?\}?", lambda m: m.group(1) + "\u0300", s)
        s = re.sub(r"\{?\\~\{?([a-zA-Z])\}?\}?", lambda m: m.group(1) + "\u0303", s)
        import unicodedata

        return unicodedata.normalize("NFC", s.replace("{", "").replace("}", ""))

    out = {}
    for key, entry in parse_file(str(root / "references.bib")).entries.items():
        people = entry.persons.get("author") or entry.persons.get("editor") or []
        last = [clean(" ".join(p.prelast_names + p.last_names)) for p in people]
        if not last:
            names = clean(entry.fields.get("organization", entry.fields.get("title", key)))
        elif len(last) == 1:
            names = last[0]
        elif last[-1] == "others":   # bibtex's "and others": the list is cut short
            names = f"{last[0]} et al."
        elif len(last) == 2:
            names = f"{last[0]} and {last[1]}"
        else:
            names = f"{last[0]} et al."
        out[key] = (names, entry.fields.get("year", "n.d."))
    return out


def ref_titles(root: Path = ROOT) -> dict[str, str]:
    """label -> the title of the heading it stands before, over every page of the book."""
    titles = {}
    for path in sorted(root.glob("*.md")) + [p for d in NOTEBOOK_DIRS for p in sorted((root / d).glob("*"))]:
        if path.suffix == ".ipynb":
            text = "\n\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                               if c["cell_type"] == "markdown")
        elif path.suffix == ".md":
            text = path.read_text()
        else:
            continue
        for m in LABEL.finditer(text):
            titles[m.group(1)] = m.group(3)
    return titles


def equation_numbers(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """label -> (the site's number "3.6", the chapter notebook's file name), for every labelled equation.

    The site numbers the labelled display equations of chapter N as N.1, N.2, ... in order
    (``numfig``, ``numfig_secnum_depth: 1``); an unlabelled one has no number.
    """
    numbers = {}
    for path in sorted((root / "chapters").glob("[0-9][0-9]_*.ipynb")):
        chapter = int(path.name[:2])
        text = "\n\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                            if c["cell_type"] == "markdown")
        for i, label in enumerate(EQ_DEF.findall(text), start=1):
            numbers[label] = (f"{chapter}.{i}", path.name)
    return numbers


def statement_numbers(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """label -> ("Proposition 3.1", file name) for every labelled sphinx-proof statement of a chapter.

    The site numbers each kind (proposition, definition, ...) within its chapter, in order.
    """
    numbers = {}
    for path in sorted((root / "chapters").glob("[0-9][0-9]_*.ipynb")):
        chapter = int(path.name[:2])
        text = "\n\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                            if c["cell_type"] == "markdown")
        seen: dict[str, int] = {}
        for kind, label in PRF_DEF.findall(text):
            seen[kind] = seen.get(kind, 0) + 1
            numbers[label] = (f"{kind.capitalize()} {chapter}.{seen[kind]}", path.name)
    return numbers


def to_portable(markdown: str, *, table, bib, titles, local_labels, equations=None, statements=None) -> str:
    """One markdown cell in the site's MyST, turned into the portable form."""
    markdown = expand_macros(markdown, table)
    markdown = SITE_GLUE.sub(lambda m: "{eval}`" + expression(m.group(1)) + "`", markdown)

    def cite(m):
        kind, keys = m.group(1) or "p", [k.strip() for k in m.group(2).split(",")]
        for k in keys:
            if k not in bib:
                raise ValueError(f"citation key {k!r} is not in references.bib")
        if kind == "t":
            return ", ".join(f"[{bib[k][0]} ({bib[k][1]})](#cite-{k})" for k in keys)
        return "(" + "; ".join(f"[{bib[k][0]}, {bib[k][1]}](#cite-{k})" for k in keys) + ")"

    markdown = SITE_CITE.sub(cite, markdown)

    def ref(m):
        label = m.group(1).strip()
        if label in local_labels or label not in titles:
            return m.group(0)
        title = titles[label].replace("`", "").replace("<", "").replace(">", "")
        return "{ref}`" + title + " <" + label + ">`"

    markdown = BARE_REF.sub(ref, markdown)

    def link(table, text):   # a role to another chapter's equation or statement, as a link to it
        def sub(m):
            label = m.group(1).strip()
            if label in local_labels or not table or label not in table:
                return m.group(0)
            shown, file = table[label]
            return f"[{text.format(shown)}](../chapters/{file}#{label})"
        return sub

    markdown = EQ_ROLE.sub(link(equations, "({})"), markdown)
    return PRF_ROLE.sub(link(statements, "{}"), markdown)


def glued_values(nb: dict) -> dict[str, str]:
    """name -> the stored text/plain of every value the notebook glues."""
    values = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if GLUE_MIME in data:
                name = out.get("metadata", {}).get("scrapbook", {}).get("name")
                text = data[GLUE_MIME]
                values[name] = "".join(text) if isinstance(text, list) else text
    return values


def format_glued(text: str, spec: str) -> str:
    """What the site shows for ``{glue:text}`spec``` given the stored text/plain (myst-nb's rule)."""
    fmt = spec.rsplit(":", 1)[1] if ":" in spec else ""
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    return format_as_glued(value, fmt)


def user_expressions(markdown: str, values: dict[str, str], where: str = "") -> list[dict]:
    """The ``user_expressions`` metadata of a cell: each ``glued`` expression with its stored result."""
    out = []
    for spec in dict.fromkeys(EVAL_GLUED.findall(markdown)):
        name = spec.rsplit(":", 1)[0] if ":" in spec else spec
        if name not in values:
            raise ValueError(f"{where}: the text shows {name!r}, which no cell glues")
        shown = format_glued(values[name], spec)
        out.append({"expression": expression(spec),
                    "result": {"status": "ok", "data": {"text/plain": repr(shown)}, "metadata": {}}})
    return out


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def convert(path: Path, *, table, bib, titles, equations=None, statements=None) -> dict:
    """The notebook at ``path`` in the portable form, its stored expression values refreshed."""
    nb = json.loads(path.read_text())
    md = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    local = {m.group(1) for text in md for m in re.finditer(r"^\(([^()\s]+)\)=", text, re.M)}
    local |= {label for text in md for label in EQ_DEF.findall(text)}
    local |= {label for text in md for label in DIRECTIVE_LABEL.findall(text)}
    values = glued_values(nb)
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text = to_portable("".join(cell["source"]), table=table, bib=bib, titles=titles, local_labels=local,
                           equations=equations, statements=statements)
        cell["source"] = _lines(text)
        exprs = user_expressions(text, values, f"{path.name} cell {i}")
        if exprs:
            cell["metadata"]["user_expressions"] = exprs
        else:
            cell["metadata"].pop("user_expressions", None)
    return nb


def dump(nb: dict) -> str:
    """The notebook's text as nbformat writes it (the form the repository keeps)."""
    import nbformat

    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"]
    table, bib, titles = macros(), author_year(), ref_titles()
    equations, statements = equation_numbers(), statement_numbers()
    stale = []
    for path in paths:
        new = dump(convert(path, table=table, bib=bib, titles=titles, equations=equations, statements=statements))
        if new != path.read_text():
            stale.append(str(path))
            if not check:
                path.write_text(new)
    if check and stale:
        print("not in the portable form, or stored expression values stale (run "
              "python tools/sphinx_ext/portable_myst.py on them):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
