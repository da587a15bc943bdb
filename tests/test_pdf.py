"""The PDF edition (issue #33): both PDFs built from the HTML editions, then read back with PyMuPDF.

``make test-pdf`` runs this (``.ci/run`` calls it after ``make test``): it builds the two
HTML editions strictly (or reuses those make test built from the same tree), and the module fixture prints each to PDF with ``tools/pdf.py``. The checks
read the PDFs' text layer and links: the page count, every chapter title and exercise
number, no line of any solution in the student PDF (the student edition's leak search,
tests/test_site.py, on the PDF's text), no text past the right margin, no formula left
as TeX source, a table of contents whose entries are links with page numbers, running
headers, and citations that link to the bibliography.

Run without ``-m pdf`` (the unit tests' run), the module is skipped: it takes minutes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import pdf  # noqa: E402  (tools/pdf.py)
from test_site import normalise, other_sources, solution_blocks  # noqa: E402

OUT = ROOT / "_build" / "pdf"
EDITIONS = {
    "book": (ROOT / "_build" / "html", ROOT / "_toc.yml", OUT / pdf.PDF_NAMES["book"]),
    "student": (ROOT / "_build" / "student" / "_build" / "html", ROOT / "_build" / "student_toc.yml",
                OUT / pdf.PDF_NAMES["student"]),
}

pytestmark = pytest.mark.pdf

#: TeX that MathJax would have typeset: none may be left in the text (outside code).
TEX_SOURCE = re.compile(r"\\frac|\\begin\{|\$\$|\\\(|\\\)|\\\[|\\\]|\\mathbf|\\sum|\\top|\\left|\\tfrac")


#: MathJax draws stretched braces and bars from pieces in Unicode's private use area; such a piece's
#: glyph box (its font's, scaled) is far wider than the ink, so the margin test does not read it as text.
PRIVATE_USE = ("\ue000", "\uf8ff")


@pytest.fixture(scope="module")
def built():
    """Both PDFs, printed now from the HTML editions: {edition: pymupdf document}."""
    import pymupdf

    for edition, (site, toc, out) in EDITIONS.items():
        if not (site / "index.html").exists() or not toc.exists():
            pytest.fail(f"build the {edition} HTML edition first (`make test-pdf` does): {site} is missing")
    t0 = time.monotonic()
    runs = {edition: subprocess.Popen([sys.executable, str(ROOT / "tools" / "pdf.py"), str(site), str(toc), str(out),
                                       "--edition", edition], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
            for edition, (site, toc, out) in EDITIONS.items()}      # side by side: mostly Chromium's waits
    docs = {}
    for edition, run in runs.items():
        output, _ = run.communicate()
        assert run.returncode == 0, f"tools/pdf.py failed for the {edition} edition:\n{output}"
        print(output.strip())
        docs[edition] = pymupdf.open(EDITIONS[edition][2])
    print(f"both PDFs in {time.monotonic() - t0:.0f} s")
    yield docs
    for d in docs.values():
        d.close()


def text_of(doc) -> str:
    return "\n".join(page.get_text() for page in doc)


def compact(text: str) -> str:
    """Text without any whitespace (a line wrapped in the PDF still matches), ligatures and quotes unfolded."""
    text = unicodedata.normalize("NFKC", text).replace("\u2019", "'").replace("\u2018", "'")
    return re.sub(r"\s+", "", text.replace("\u201c", '"').replace("\u201d", '"'))


def _source(cell) -> str:
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def titles_and_exercises(toc: Path):
    """(document, title, exercise labels) for every notebook of a table of contents, from the sources."""
    out = []
    for entry in pdf.pages_of(toc)[1:]:
        nb = ROOT / (entry["doc"] + ".ipynb")
        if not nb.exists():
            continue
        cells = json.loads(nb.read_text())["cells"]
        title = next(line[2:].strip() for c in cells if c["cell_type"] == "markdown"
                     for line in _source(c).splitlines() if line.startswith("# "))
        exercises = [m for c in cells if c["cell_type"] == "markdown"
                     for m in re.findall(r"```\{exercise-start\}", _source(c))]
        out.append((entry, title, len(exercises)))
    return out


def plain(markdown: str) -> str:
    """A heading's text as printed: MyST markup dropped."""
    return re.sub(r"[`*_]", "", markdown)


@pytest.mark.parametrize("edition", EDITIONS)
def test_page_count_is_that_of_a_book(built, edition):
    n = built[edition].page_count
    assert 150 <= n <= 900, f"{edition} PDF: {n} pages"
    if edition == "student":
        assert n < built["book"].page_count, "the student PDF is not shorter than the complete one"


@pytest.mark.parametrize("edition", EDITIONS)
def test_every_chapter_title_and_exercise_number_is_in_the_text(built, edition):
    text = compact(text_of(built[edition]))
    entries = titles_and_exercises(EDITIONS[edition][1])
    assert any(e["doc"].startswith("chapters/") for e, _, _ in entries)
    for entry, title, n_exercises in entries:
        assert compact(plain(title)) in text, f"{edition} PDF: the title of {entry['doc']} is missing: {title!r}"
        if entry["doc"].startswith("exercises/"):
            chapter = int(Path(entry["doc"]).name.split("_")[0])
            assert n_exercises > 0, f"{entry['doc']}: no exercise found in the source"
            for i in range(1, n_exercises + 1):
                assert compact(f"Exercise {chapter}.{i}") in text, f"{edition} PDF: Exercise {chapter}.{i} is missing"
            assert compact(f"Exercise {chapter}.{n_exercises + 1}") not in text
    if edition == "book":
        assert "Solutionto" in text
    else:
        assert "Solutionto" not in text and "Instructor'sguide" not in text


def test_the_student_pdf_holds_no_line_of_any_solution(built):
    full, student = compact(text_of(built["book"])), compact(text_of(built["student"]))
    elsewhere = compact(other_sources())
    blocks = solution_blocks()
    assert blocks, "no solution blocks found: the leak search would prove nothing"
    for nb, label, code, prose in blocks:
        distinctive = [compact(line) for line in code + prose
                       if len(line) >= 30 and compact(line) not in elsewhere and compact(line) in full]
        assert distinctive, (f"{nb}, solution to {label}: no distinctive line of it is in the complete PDF, "
                             "so the leak search would prove nothing")
        leaked = [line for line in distinctive if line in student]
        assert not leaked, f"{nb}, solution to {label}: the student PDF contains {leaked[:3]}"


@pytest.mark.parametrize("edition", EDITIONS)
def test_no_text_runs_past_the_right_margin(built, edition):
    import pymupdf

    doc = built[edition]
    past = []
    for number, page in enumerate(doc):
        right = page.rect.width - pdf.PAGE["right_mm"] * pdf.MM
        left = pdf.PAGE["left_mm"] * pdf.MM
        for x0, y0, x1, y1, word, *_ in page.get_text("words", flags=pymupdf.TEXT_PRESERVE_WHITESPACE):
            if all(PRIVATE_USE[0] <= ch <= PRIVATE_USE[1] for ch in word):
                continue       # a piece of a stretched brace or bar of a formula: its glyph box is the font's
            if x1 > right + 1.0 or x0 < left - 1.0:
                past.append(f"page {number + 1}: {word!r} at x = {x0:.0f}..{x1:.0f} (text from {left:.0f} to "
                            f"{right:.0f})")
    assert not past, f"{edition} PDF: {len(past)} words outside the text width, e.g. {past[:5]}"


@pytest.mark.parametrize("edition", EDITIONS)
def test_no_formula_is_left_as_tex_source(built, edition):
    found = []
    for number, page in enumerate(built[edition]):
        for block in page.get_text("dict")["blocks"]:
            for line in block.get("lines", []):
                for span in line["spans"]:
                    if "mono" in span["font"].lower():
                        continue          # code shows TeX on purpose (a plot's label)
                    m = TEX_SOURCE.search(span["text"])
                    if m:
                        found.append(f"page {number + 1}: {span['text'][:80]!r}")
    assert not found, f"{edition} PDF: TeX source in the text: {found[:5]}"


@pytest.mark.parametrize("edition", EDITIONS)
def test_contents_entries_link_to_their_heading_and_give_its_page(built, edition):
    import pymupdf

    doc = built[edition]
    bookmarks = doc.get_toc()
    first_body = next(page for level, title, page in bookmarks if level == 1 and title not in (pdf.TITLE, "Contents"))
    toc_pages = range(1, first_body - 1)
    assert len(toc_pages) >= 1
    n = 0
    for number in toc_pages:
        page = doc[number]
        for link in page.get_links():
            assert link["kind"] in (pymupdf.LINK_GOTO, pymupdf.LINK_NAMED), f"contents page {number + 1}: {link}"
            target = link["page"]
            entry = " ".join(page.get_textbox(link["from"]).split())
            title, _, printed = entry.rpartition(" ")
            assert printed == str(target + 1), f"contents: {entry!r} links page {target + 1}"
            heading = compact(title)
            assert heading in compact(doc[target].get_text()), f"contents: {title!r} is not on page {target + 1}"
            n += 1
    chapters = [e for e, _, _ in titles_and_exercises(EDITIONS[edition][1])]
    assert n >= len(chapters), f"{edition} PDF: {n} contents links for {len(chapters)} documents"


@pytest.mark.parametrize("edition", EDITIONS)
def test_pages_carry_their_chapter_in_the_header_and_citations_link_to_the_bibliography(built, edition):
    doc = built[edition]
    top = [(title, page - 1) for level, title, page in doc.get_toc() if level == 1][2:]
    chapter = next((t, p) for t, p in top if re.match(r"3\. ", t))
    following = next(p for t, p in top if p > chapter[1])
    for number in range(chapter[1] + 1, following):
        page = doc[number]
        head = " ".join(page.get_textbox((0, 0, page.rect.width, pdf.PAGE["top_mm"] * pdf.MM)).split())
        assert head == chapter[0], f"page {number + 1}: header {head!r}, expected {chapter[0]!r}"
    bib = next(p for t, p in top if t == "Bibliography")
    bib_end = next((p for t, p in top if p > bib), doc.page_count)
    to_bib = [link for number in range(chapter[1], following) for link in doc[number].get_links()
              if "bibliography" in link.get("nameddest", "") or bib <= link.get("page", -1) < bib_end]
    assert len(to_bib) >= 3, f"chapter 3 has {len(to_bib)} links into the bibliography"
    assert all(bib <= link["page"] < bib_end for link in to_bib)
