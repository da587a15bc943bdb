"""Print the built HTML book to one PDF, for print and for instructors (issue #33).

Usage: python tools/pdf.py SITE TOC OUT_PDF [--edition book|student]

SITE is an HTML build of the book (``make book``'s ``_build/html``, or the student
edition's), TOC the table of contents it was built from. Everything runs offline,
with the headless Chromium that the browser test uses (Debian's ``chromium``,
driven by Playwright) and PyMuPDF:

1. Every page of the table of contents is opened from disk, MathJax held back so
   that the formulas stay as the TeX that the site typesets. The widget manager
   renders each interactive figure; its picture at the default slider setting is
   kept as a still image, with a note of that setting and that the site and the
   notebook make it interactive (the figure's description in words is already in
   the text, below it). The site's chrome goes: download boxes, copy buttons,
   heading links; dropdowns are opened (a chapter's answers are shown, as in
   the site after a click; solutions are already in the Solutions part).
2. The pages' articles are joined into one document, in the table of contents'
   order. Element ids get their page's prefix, and every link between pages
   becomes a link inside the document, so cross-references, citations and the
   table of contents are links in the PDF.
3. Chromium typesets the formulas with the site's MathJax and prints the
   document (A4, bookmarks from the headings). Code, outputs, tables and
   formulas wider than the text are wrapped or scaled to the text width.
4. PyMuPDF writes what Chromium's print cannot: the page number of each table of
   contents entry (read from where its link points), a running header with the
   chapter's number and title, and the page numbers.

The numbering is the site's own (Sphinx numbers the sections, equations, figures
and exercises in the HTML that is printed), so the PDF and the site agree.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--allow-file-access-from-files"]
TITLE = "Fixed-State Sequence Layers"
SUBTITLE = "Linear attention, the delta rule, state-space models and hybrids, derived, computed and checked"

#: The file names of the two editions, in _build/pdf/ and in the sites' downloads/.
PDF_NAMES = {"book": "fixed-state-sequence-layers.pdf", "student": "fixed-state-sequence-layers-student.pdf"}

# Page geometry, in CSS millimetres; the test reads the right margin from here.
PAGE = {"format": "A4", "width_mm": 210.0, "height_mm": 297.0,
        "top_mm": 20.0, "bottom_mm": 18.0, "left_mm": 20.0, "right_mm": 20.0}
MM = 72 / 25.4  # PDF points per millimetre


def pages_of(toc_path: Path) -> list[dict]:
    """The documents of a table of contents in reading order: docname, part caption, numbered."""
    toc = yaml.safe_load(Path(toc_path).read_text())
    docs = [{"doc": toc["root"], "part": None, "numbered": False}]
    for part in toc.get("parts", []):
        for chapter in part.get("chapters", []):
            doc = chapter["file"]
            for suffix in (".md", ".ipynb"):
                doc = doc.removesuffix(suffix)
            docs.append({"doc": doc, "part": part.get("caption"), "numbered": bool(part.get("numbered"))})
    return docs


def slug(doc: str) -> str:
    return "d-" + doc.replace("/", "-").replace("_", "-")


# ---------------------------------------------------------------- step 1: one page, made static

STATIC_PAGE = r"""
([slug, known, root]) => {
  const art = document.querySelector('article.bd-article');
  if (!art) return null;
  // Interactive figures: the picture the widget shows now (its default setting), kept as a still.
  const figures = [];
  for (const s of Array.from(art.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]'))) {
    const host = s.parentElement;
    const shown = Array.from(host.querySelectorAll('img')).filter(i => i.offsetParent !== null);
    const setting = [];
    for (const c of host.querySelectorAll('.widget-hslider, .widget-toggle-buttons, .widget-dropdown')) {
      const label = c.querySelector('.widget-label');
      const readout = c.querySelector('.widget-readout') || c.querySelector('button.mod-active')
                      || c.querySelector('select');
      const value = readout ? (readout.value !== undefined && readout.tagName === 'SELECT' ? readout.value
                                                                                           : readout.textContent) : '';
      if (label) setting.push([label.textContent.trim(), value.trim()]);
    }
    const fig = document.createElement('figure');
    fig.className = 'pdf-still';
    for (const img of shown) {
      const canvas = document.createElement('canvas');
      canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
      canvas.getContext('2d').drawImage(img, 0, 0);
      const still = document.createElement('img');
      still.src = canvas.toDataURL('image/png');
      still.style.width = img.naturalWidth + 'px';
      fig.appendChild(still);
    }
    const note = document.createElement('figcaption');
    note.className = 'pdf-interactive-note';
    const at = setting.map(([l, v]) => l + ' = ' + v).join(', ');
    note.textContent = 'Interactive figure: in the HTML book and in the notebook, its controls change the '
      + 'picture. Shown here at its default setting' + (at ? ' (' + at + ')' : '') + '.';
    fig.appendChild(note);
    figures.push([shown.length, setting.length]);
    host.replaceChildren(fig);
  }
  // The site's chrome.
  art.querySelectorAll('.fixedstate-downloads, a.headerlink, button.copybtn, .toggle-button, '
                       + '.sd-summary-up, .sd-summary-down, .sd-summary-state-marker, script, '
                       + 'div.toctree-wrapper').forEach(e => e.remove());
  // Hidden cells (myst-nb's hide-input/hide-output): their content, without the toggle.
  art.querySelectorAll('details.hide').forEach(d => {
    d.querySelectorAll(':scope > summary').forEach(s => s.remove());
    const div = document.createElement('div');
    div.className = 'pdf-unhidden';
    div.append(...d.childNodes);
    d.replaceWith(div);
  });
  art.querySelectorAll('details').forEach(d => d.setAttribute('open', ''));
  art.querySelectorAll('.toggle-hidden').forEach(e => e.classList.remove('toggle-hidden'));
  // A section's anchor moves onto its heading: a page break between the start of a section (a label's
  // empty span, a margin) and its heading would leave links to it on the page before the heading.
  art.querySelectorAll('section[id]').forEach(s => {
    const h = s.querySelector(':scope > h1, :scope > h2, :scope > h3, :scope > h4, :scope > h5, :scope > h6');
    if (h && !h.id) { h.id = s.id; s.removeAttribute('id'); }
  });
  // Ids get the page's prefix; links between pages become links inside the document.
  art.querySelectorAll('[id]').forEach(e => { e.id = slug + '--' + e.id; });
  for (const a of Array.from(art.querySelectorAll('a[href]'))) {
    const url = new URL(a.href);
    if (url.protocol === 'http:' || url.protocol === 'https:' || url.protocol === 'mailto:') continue;
    let target = null;
    if (url.protocol === 'file:' && url.pathname.startsWith(root) && url.pathname.endsWith('.html')) {
      const doc = decodeURIComponent(url.pathname.slice(root.length, -'.html'.length));
      if (known[doc]) target = '#' + known[doc] + (url.hash ? '--' + url.hash.slice(1) : '');
    }
    if (target) { a.setAttribute('href', target); continue; }
    a.replaceWith(...a.childNodes);   // a download, or a page this edition does not print
  }
  art.querySelectorAll('img[src]').forEach(i => { if (!i.src.startsWith('data:')) i.setAttribute('src', i.src); });
  const h1 = art.querySelector('h1');
  return {html: art.innerHTML, figures: figures, title: h1 ? h1.textContent.replace(/\s+/g, ' ').trim() : ''};
}
"""


def _open(context, path: Path):
    page = context.new_page()
    page.goto(path.as_uri(), wait_until="load")
    if page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count():
        page.wait_for_function(
            """() => Array.from(document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]'))
                .every(s => Array.from(s.parentElement.querySelectorAll('img')).some(i => i.offsetParent !== null
                            && i.complete && i.naturalWidth > 0))""", timeout=60_000)
    return page


def static_pages(browser, site: Path, docs: list[dict]) -> list[dict]:
    context = browser.new_context(offline=True, viewport={"width": 1100, "height": 900})
    # The formulas stay as TeX: MathJax typesets them once, in the joined document.
    context.route("**/_static/mathjax/**", lambda route: route.abort())
    known = {d["doc"]: slug(d["doc"]) for d in docs}
    root = site.resolve().as_uri()[len("file://"):] + "/"
    out = []
    for d in docs:
        path = site / (d["doc"] + ".html")
        if not path.exists():
            raise SystemExit(f"pdf.py: {path} is missing: build the site first (make book / make student-book)")
        page = _open(context, path)
        got = page.evaluate(STATIC_PAGE, [slug(d["doc"]), known, root])
        page.close()
        if got is None:
            raise SystemExit(f"pdf.py: {path} has no article")
        for n_pictures, n_controls in got["figures"]:
            if n_pictures != 1 or n_controls == 0:
                raise SystemExit(f"pdf.py: {path}: an interactive figure showed {n_pictures} pictures and "
                                 f"{n_controls} controls (expected one picture, at least one control)")
        if not got["title"]:
            raise SystemExit(f"pdf.py: {path} has no title (h1)")
        out.append({**d, "html": got["html"], "figures": len(got["figures"]), "title": got["title"]})
    context.close()
    return out


# ---------------------------------------------------------------- step 2: one document

PRINT_CSS = """
@page { size: %(width_mm)smm %(height_mm)smm; margin: %(top_mm)smm %(right_mm)smm %(bottom_mm)smm %(left_mm)smm; }
html { font-size: 10pt; --pst-font-size-base: 10pt; }
body { margin: 0; padding: 0; background: white; color: #111; }
.pdf-doc { break-before: page; }
.pdf-doc > section > h1:first-child, .pdf-doc h1 { margin-top: 0; font-size: 20pt; }
h1, h2, h3, h4, .admonition-title, details > summary { break-after: avoid; break-inside: avoid; }
h2 { font-size: 14pt; margin-top: 1.2em; } h3 { font-size: 12pt; }
p, li { orphans: 3; widows: 3; }
figure, img, .pdf-still, mjx-container[display="true"], table, div.cell_output { break-inside: avoid; }
img { max-width: 100%% !important; height: auto !important; }
pre, .highlight pre, div.cell_output pre, .output pre {
  white-space: pre-wrap !important; overflow-wrap: anywhere; word-break: break-word;
  overflow: visible !important; max-height: none !important; font-size: 7.6pt; line-height: 1.3;
}
div.highlight, div.cell_output, .output { overflow: visible !important; max-height: none !important; }
div.cell_input { break-inside: auto; }
table { font-size: 8.5pt; }
.table-wrapper, .bd-article div.math-wrapper { overflow: visible !important; }
details.sd-dropdown > summary { pointer-events: none; list-style: none; }
details.sd-dropdown > summary::-webkit-details-marker { display: none; }
.pdf-still { margin: 0.6em 0; text-align: center; }
.pdf-interactive-note { font-size: 8.5pt; font-style: italic; color: #333; margin-top: 0.3em; text-align: left; }
a { color: #1a4f9c; text-decoration: none; }
mjx-assistive-mml { display: none !important; }
/* the title page and the table of contents */
.pdf-title { height: 230mm; display: flex; flex-direction: column; justify-content: center; }
.pdf-title h1 { font-size: 30pt; margin: 0 0 0.4em 0; }
.pdf-title .sub { font-size: 14pt; color: #333; }
.pdf-title .edition { margin-top: 3em; font-size: 11pt; }
.pdf-toc { break-before: page; }
.pdf-toc h1 { font-size: 20pt; }
.pdf-toc .part { font-weight: bold; font-size: 11pt; margin: 1em 0 0.3em 0; }
.pdf-toc a { display: flex; color: #111; padding-right: 12mm; }
.pdf-toc a.chapter { font-weight: 600; margin-top: 0.35em; }
.pdf-toc a.section { padding-left: 2.2em; font-size: 9pt; }
.pdf-toc a span.fill { flex: 1; }
"""

#: Elements that may be wider than the text: scaled down to fit after typesetting.
FIT = """() => {
  const scaled = [];
  const sel = 'mjx-container[display="true"], table, div.cell_output img, div.cell_output pre, div.highlight pre, .pdf-still img, svg';
  for (const el of document.querySelectorAll(sel)) {
    const box = el.parentElement.getBoundingClientRect();
    const w = el.scrollWidth, avail = Math.min(box.width, document.body.clientWidth);
    if (w > avail + 0.5) { el.style.zoom = (avail / w).toFixed(4); scaled.push(el.tagName + ' ' + w + '>' + avail); }
  }
  return scaled;
}"""


def _toc_entries(pages: list[dict]) -> str:
    """The table of contents: parts, chapters (the pages' titles) and their sections, each a link."""
    from html.parser import HTMLParser

    class Headings(HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack, self.found = [], []

        def handle_starttag(self, tag, attrs):
            if tag == "section":
                self.stack.append(dict(attrs).get("id"))
            elif tag in ("h1", "h2") and self.stack:
                target = dict(attrs).get("id") or self.stack[-1]      # the section's anchor, on its heading
                if target:
                    self.found.append([tag, target, ""])
                    self.grab = True

        def handle_endtag(self, tag):
            if tag == "section" and self.stack:
                self.stack.pop()
            elif tag in ("h1", "h2"):
                self.grab = False

        def handle_data(self, data):
            if getattr(self, "grab", False):
                self.found[-1][2] += data

    rows, part = [], None
    for p in pages:
        if p["part"] != part and p["part"]:
            rows.append(f'<div class="part">{html.escape(p["part"])}</div>')
        part = p["part"]
        h = Headings()
        h.feed(p["html"])
        for tag, target, text in h.found:
            if tag == "h1" or p["doc"].startswith("chapters/"):
                cls = "chapter" if tag == "h1" else "section"
                text = " ".join(text.split())
                rows.append(f'<a class="{cls}" href="#{target}"><span class="t">{html.escape(text)}</span>'
                            '<span class="fill"></span></a>')
    return "\n".join(rows)


def document(site: Path, pages: list[dict], edition: str) -> str:
    mathjax = (site / "_static" / "mathjax" / "tex-chtml.js").resolve().as_uri()
    head_css = [f"{site.resolve().as_uri()}/_static/{css}" for css in (
        "styles/theme.css", "styles/pydata-sphinx-theme.css", "pygments.css", "styles/sphinx-book-theme.css",
        "exercise.css", "proof.css", "sphinx-design.min.css", "book.css")]
    head_css += [p.resolve().as_uri() for p in sorted((site / "_static").glob("mystnb.*.css"))]
    config = _mathjax_config(site)
    what = ("Student edition: chapters, exercises and appendices, without the solutions"
            if edition == "student" else "Complete edition, with the worked solutions and the instructor's guide")
    body = [f'<div class="pdf-title"><h1>{TITLE}</h1><div class="sub">{SUBTITLE}</div>'
            f'<div class="edition">{what}</div></div>',
            f'<nav class="pdf-toc"><h1 id="pdf-contents">Contents</h1>{_toc_entries(pages)}</nav>']
    for p in pages:
        body.append(f'<div class="pdf-doc bd-article" id="{slug(p["doc"])}" data-doc="{p["doc"]}">'
                    f'<article class="bd-article">{p["html"]}</article></div>')
    links = "\n".join(f'<link rel="stylesheet" href="{href}">' for href in head_css)
    return (f'<!DOCTYPE html><html lang="en" data-theme="light"><head><meta charset="utf-8">'
            f'<title>{TITLE}</title>{links}<style>{PRINT_CSS % PAGE}</style>'
            f'<script>window.MathJax = {config};</script><script defer src="{mathjax}"></script>'
            f'</head><body>{"".join(body)}</body></html>')


def _mathjax_config(site: Path) -> str:
    """The site's MathJax configuration (the macros of _config.yml), read from its preface page."""
    text = (site / "preface.html").read_text()
    start = text.find("window.MathJax = ")
    if start < 0:
        raise SystemExit(f"pdf.py: no MathJax configuration in {site / 'preface.html'}")
    start += len("window.MathJax = ")
    config, _ = json.JSONDecoder().raw_decode(text[start:])
    return json.dumps(config)


# ---------------------------------------------------------------- step 3: print

def print_pdf(browser, html_path: Path, pdf_path: Path) -> list[str]:
    context = browser.new_context(offline=True)
    page = context.new_page()
    page.emulate_media(media="print")
    page.goto(html_path.as_uri(), wait_until="load", timeout=120_000)
    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=60_000)
    page.evaluate("() => MathJax.startup.promise.then(() => document.fonts.ready).then(() => true)")
    left = page.evaluate("""() => Array.from(document.querySelectorAll('.math'))
        .filter(el => !el.querySelector('mjx-container')).map(el => el.textContent.slice(0, 60))""")
    if left:
        raise SystemExit(f"pdf.py: {len(left)} formulas were not typeset, e.g. {left[:3]}")
    scaled = page.evaluate(FIT)
    page.pdf(path=str(pdf_path), format=PAGE["format"], print_background=True, outline=True, tagged=True,
             prefer_css_page_size=True)
    context.close()
    return scaled


# ---------------------------------------------------------------- step 4: page numbers and headers

def finish(pdf_path: Path, pages: list[dict], edition: str) -> dict:
    import pymupdf

    doc = pymupdf.open(pdf_path)
    width = doc[0].rect.width
    left, right = PAGE["left_mm"] * MM, width - PAGE["right_mm"] * MM
    font = pymupdf.Font("helv")
    # The table of contents fills the pages between the title page and the first page of the book;
    # each entry's page number is read from where its link points (Chromium keeps the links).
    starts = _doc_starts(doc, pages)
    first_body = starts[0][0]
    toc_pages = list(range(1, first_body))
    entries = [(number, link) for number in toc_pages for link in doc[number].get_links()
               if link.get("kind") in (pymupdf.LINK_GOTO, pymupdf.LINK_NAMED)]
    if not entries:
        raise SystemExit("pdf.py: the table of contents has no links in the PDF")
    for number, link in entries:
        target = link.get("page", -1)
        if target is None or target < 0:
            raise SystemExit(f"pdf.py: a table of contents link points nowhere: {link}")
        label = str(target + 1)
        spans = [span for block in doc[number].get_text("dict", clip=link["from"])["blocks"]
                 for line in block.get("lines", []) for span in line["spans"] if span["text"].strip()]
        if not spans:
            raise SystemExit(f"pdf.py: a table of contents link has no text: {link}")
        bold = bool(spans[0]["flags"] & 16)
        size = spans[0]["size"]
        face = "hebo" if bold else "helv"
        w = pymupdf.Font(face).text_length(label, fontsize=size)
        doc[number].insert_text((right - w, spans[0]["origin"][1]), label, fontname=face, fontsize=size)
    # Running headers: the chapter a page belongs to (from the bookmarks, one per page of the book).
    for number, page in enumerate(doc):
        if number > 0:
            label = str(number + 1)
            w = font.text_length(label, fontsize=8.5)
            page.insert_text(((width - w) / 2, page.rect.height - PAGE["bottom_mm"] * MM / 2), label,
                             fontname="helv", fontsize=8.5, color=(0.3, 0.3, 0.3))
        if number < first_body:
            continue
        title = None
        for start, text in starts:
            if start <= number:
                title = text
        if title is None or any(start == number for start, _ in starts):
            continue
        size = 8.5
        while font.text_length(title, fontsize=size) > right - left and size > 5:
            size -= 0.5
        y = PAGE["top_mm"] * MM * 0.55
        page.insert_text((left, y), title, fontname="helv", fontsize=size, color=(0.3, 0.3, 0.3))
        page.draw_line((left, y + 3), (right, y + 3), color=(0.6, 0.6, 0.6), width=0.4)
    doc.set_metadata({"title": TITLE + (" (student edition)" if edition == "student" else ""),
                      "author": "The authors of this book", "subject": SUBTITLE})
    tmp = pdf_path.with_suffix(".tmp.pdf")
    doc.save(tmp, garbage=1, deflate=True)
    doc.close()
    tmp.replace(pdf_path)
    return {"toc_pages": [n + 1 for n in toc_pages], "starts": [(s + 1, t) for s, t in starts]}


def _doc_starts(doc, pages: list[dict]) -> list[tuple[int, str]]:
    """(page index, title) where each document of the book starts, from Chromium's bookmarks.

    Chromium makes a top-level bookmark of every h1: the title page's, the table of contents'
    and one per document of the book, in order. Their titles are rewritten from the pages' own
    (Chromium's repeat the heading's text)."""
    toc = doc.get_toc(simple=False)
    top = [i for i, entry in enumerate(toc) if entry[0] == 1]
    if len(top) != len(pages) + 2:
        raise SystemExit(f"pdf.py: expected {len(pages) + 2} top-level bookmarks (title page, contents and one "
                         f"per page of the book), found {len(top)}")
    toc[top[0]][1], toc[top[1]][1] = TITLE, "Contents"
    for i, p in zip(top[2:], pages):
        toc[i][1] = p["title"]
    doc.set_toc(toc)
    return [(toc[i][2] - 1, p["title"]) for i, p in zip(top[2:], pages)]


def _log(what: str, t0: float) -> None:
    print(f"pdf.py: {what} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)


def build(site: Path, toc: Path, out: Path, edition: str) -> dict:
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise SystemExit(f"pdf.py: headless Chromium not found at {CHROMIUM} (bash tools/system_deps.sh chromium)")
    t0 = time.monotonic()
    site, out = site.resolve(), out.resolve()
    docs = pages_of(toc)
    out.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        pages = static_pages(browser, site, docs)
        _log(f"{len(pages)} pages made static", t0)
        html_path = out.with_suffix(".html")
        html_path.write_text(document(site, pages, edition))
        scaled = print_pdf(browser, html_path, out)
        _log("printed", t0)
        browser.close()
    info = finish(out, pages, edition)
    _log("page numbers and headers written", t0)
    info.update(seconds=round(time.monotonic() - t0, 1), scaled=len(scaled),
                figures=sum(p["figures"] for p in pages))
    return info


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("toc", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--edition", choices=["book", "student"], default="book")
    parser.add_argument("--serve", type=Path, action="append", default=[],
                        help="an HTML build whose downloads/ gets a copy of the PDF (repeatable)")
    args = parser.parse_args(argv)
    if args.out.name != PDF_NAMES[args.edition]:
        parser.error(f"OUT_PDF: the {args.edition} edition is named {PDF_NAMES[args.edition]}, got {args.out.name}")
    info = build(args.site, args.toc, args.out, args.edition)
    for site in args.serve:
        (site / "downloads").mkdir(parents=True, exist_ok=True)
        shutil.copy2(args.out, site / "downloads" / args.out.name)
    import pymupdf

    with pymupdf.open(args.out) as d:
        n = d.page_count
    print(f"pdf.py: {args.out} ({n} pages, {args.out.stat().st_size / 1e6:.1f} MB) in {info['seconds']} s; "
          f"{info['figures']} interactive figures as stills, {info['scaled']} wide elements scaled to the text width")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
