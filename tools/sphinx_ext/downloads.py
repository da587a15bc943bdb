"""The site ships the book's package: the wheel and a kit of notebooks, linked from the pages.

1. When an HTML build finishes, ``downloads/`` in the output holds the wheel of
   ``fixedstate`` and a kit (``tools/kit.py``): the student kit (chapters and
   exercises, no solutions) in the student edition, the book kit (every notebook)
   in the full one. The edition is told by whether the table of contents has
   solution pages.
2. Every chapter and exercise page gets, under its title, a collapsed box "Run
   this notebook on your own machine": the wheel's link and two commands to paste
   (create an environment; ``pip install`` the wheel). The preface places the same
   box, with the kit, where it writes ``{fixedstate-downloads}``.

3. Where a page writes ``{fixedstate-pdf}`` (the preface, the instructor's guide), a
   paragraph links the PDF editions that ``make pdf`` and ``make student-pdf`` print
   from the site and place in its ``downloads/`` (``tools/pdf.py``): both in the full
   edition, the student PDF alone in the student edition.

Links are relative to the page, so the site works from any address and offline.
"""

from __future__ import annotations

import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.util import logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kit  # noqa: E402  (tools/kit.py)
from pdf import PDF_NAMES  # noqa: E402  (tools/pdf.py: the PDF editions' file names)

logger = logging.getLogger(__name__)

#: Pages that get the box without asking for it.
BOX_ON = ("chapters/", "exercises/")


class downloads_box(nodes.General, nodes.Element):
    """Placeholder for the box; replaced once the edition is known (doctree-resolved)."""


class DownloadsDirective(Directive):
    has_content = False

    def run(self):
        return [downloads_box()]


class pdf_links(nodes.General, nodes.Element):
    """Placeholder for the paragraph that links the PDF editions (doctree-resolved)."""


class PdfDirective(Directive):
    has_content = False

    def run(self):
        return [pdf_links()]


def edition(app) -> str:
    return "book" if any(d.startswith("solutions/") for d in app.env.found_docs) else "student"


def _text(*parts):
    para = nodes.paragraph()
    for part in parts:
        para += part if isinstance(part, nodes.Node) else nodes.Text(part)
    return para


def _code(text: str):
    return nodes.literal(text, text)


def _link(text: str, uri: str, cls: str):
    ref = nodes.reference("", "", internal=False, refuri=uri, classes=[cls])
    ref += nodes.literal(text, text)
    return ref


def box(docname: str, which: str, preface: bool) -> nodes.admonition:
    root = kit.ROOT
    up = "../" * docname.count("/")
    wheel = kit.wheel_name(root)
    kit_zip = kit.kit_name(which, root) + ".zip"
    env = "fixedstate-env"
    commands = (f"python3 -m venv {env}\n"
                f"{env}/bin/python -m pip install {wheel} {kit.jupyterlab_pin(root)} "
                f"{kit.jupyterlab_pin(root, 'jupyterlab-myst')}")
    title = "Run the notebooks on your own machine" if preface else "Run this notebook on your own machine"
    adm = nodes.admonition(classes=["tip", "fixedstate-downloads"] + ([] if preface else ["dropdown"]))
    adm += nodes.title(title, title)
    what = ("a chapter or exercise notebook (the download button at the top of its page)" if preface
            else "this notebook (the download button at the top of the page)")
    adm += _text("Download ", what, " and the book's package, ",
                 _link(wheel, f"{up}downloads/{wheel}", "fixedstate-wheel"),
                 ", into one folder. There, with Python 3.11 or newer (3.11, 3.12 and 3.13 are tested), create an "
                 "environment and install the package with JupyterLab and jupyterlab-myst, which draws the "
                 "notebooks' formulas, references and exercises:")
    block = nodes.literal_block(commands, commands)
    block["language"] = "bash"
    adm += block
    adm += _text("Then ", _code(f"{env}/bin/jupyter lab"), " opens JupyterLab (on Windows, ",
                 _code("py -3"), " in place of ", _code("python3"), " and ",
                 _code(f"{env}\\Scripts\\"), " in place of ", _code(f"{env}/bin/"), "). The wheel asks for "
                 "numpy, scipy, matplotlib and ipywidgets no older than the versions it is tested with, and "
                 "leaves newer ones in place; the kit below pins the versions the book was run with.")
    contents = ("All the chapter and exercise notebooks" if which == "student"
                else "Every notebook of the book, worked solutions included,")
    adm += _text(f"{contents} at once, with the wheel, a pinned ", _code("requirements.txt"),
                 " and a README of two commands: ", _link(kit_zip, f"{up}downloads/{kit_zip}", "fixedstate-kit"),
                 ".")
    return adm


def pdf_paragraph(docname: str, which: str) -> nodes.paragraph:
    up = "../" * docname.count("/")

    def link(kind):
        return _link(PDF_NAMES[kind], f"{up}downloads/{PDF_NAMES[kind]}", "fixedstate-pdf")

    lead = ("For print, and for reading and annotating on a tablet, the book is also one PDF, numbered as here, "
            "with a table of contents, bookmarks and links: ")
    if which == "book":
        what = ("the complete edition, ", link("book"), ", with the solutions and the instructor's guide, and the "
                "student edition, ", link("student"), ", without them. ")
    else:
        what = ("the student edition, ", link("student"), ". ")
    return _text(lead, *what, "Each interactive figure is shown at its default setting, beside its description "
                 "in words; ", _code("make pdf"), " and ", _code("make student-pdf"), " print them from the site.")


def add_boxes(app, doctree, docname) -> None:
    which = edition(app)
    for node in list(doctree.findall(downloads_box)):
        node.replace_self(box(docname, which, preface=True))
    for node in list(doctree.findall(pdf_links)):
        node.replace_self(pdf_paragraph(docname, which))
    if docname.startswith(BOX_ON):
        section = next(iter(doctree.findall(nodes.section)), None)
        if section is None or not isinstance(section[0], nodes.title):
            logger.warning(f"{docname}: expected a page with a title, for the download box", location=docname)
            return
        section.insert(1, box(docname, which, preface=False))


def write_downloads(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    which = edition(app)
    files = kit.site_downloads(Path(app.outdir) / "downloads", which)
    logger.info("downloads: " + ", ".join(f"{f.name} ({f.stat().st_size / 1e6:.1f} MB)" for f in files))


def setup(app):
    app.add_node(downloads_box)
    app.add_directive("fixedstate-downloads", DownloadsDirective)
    app.add_node(pdf_links)
    app.add_directive("fixedstate-pdf", PdfDirective)
    app.connect("doctree-resolved", add_boxes)
    app.connect("build-finished", write_downloads)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
