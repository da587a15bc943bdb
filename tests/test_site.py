"""The student edition: the built book without its solutions, checked for leaks.

For every worked solution, distinctive lines are taken from its code and its
prose: lines that occur nowhere else in the book's sources. Each must appear
in the full build (so the search is real) and none may appear anywhere in the
student edition's HTML, search index included.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FULL = ROOT / "_build" / "html"
STUDENT = ROOT / "_build" / "student" / "_build" / "html"

pytestmark = pytest.mark.site

SOL_START = re.compile(r"```\{solution-start\}\s+(\S+)")


def _source(cell):
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def site_text(root: Path) -> str:
    parts = []
    for f in sorted(root.rglob("*")):
        if f.suffix in {".html", ".js", ".txt", ".ipynb", ".md", ".json"} and f.is_file() \
                and "_static" not in f.parts:
            raw = f.read_text(errors="replace")
            parts.append(normalise(html.unescape(re.sub(r"<[^>]+>", "", raw))))
    return "\n".join(parts)


def other_sources() -> str:
    texts = []
    for d in ["chapters", "exercises", "appendix"]:
        for nb in (ROOT / d).glob("*.ipynb"):
            texts.extend(_source(c) for c in json.loads(nb.read_text())["cells"])
    texts.append((ROOT / "preface.md").read_text())
    texts.extend(p.read_text() for p in (ROOT / "appendix").rglob("*.md"))
    return normalise("\n".join(texts))


def solution_blocks():
    """(notebook, label, code lines, prose fragments) for every solution block."""
    blocks = []
    for nb in sorted((ROOT / "solutions").glob("*.ipynb")):
        current = None
        for cell in json.loads(nb.read_text())["cells"]:
            text = _source(cell)
            m = SOL_START.search(text) if cell["cell_type"] == "markdown" else None
            if m:
                current = (nb.name, m.group(1), [], [])
                blocks.append(current)
            if current is None:
                continue
            if cell["cell_type"] == "code":
                current[2].extend(line.strip() for line in text.splitlines())
            else:
                for line in text.splitlines():
                    if "```" in line or ":label:" in line:
                        continue
                    # plain runs of words, free of markup, as the HTML shows them
                    for run in re.findall(r"[A-Za-z][A-Za-z ,;']{40,}", line):
                        current[3].append(run.strip())
            if cell["cell_type"] == "markdown" and "{solution-end}" in text:
                current = None
    return blocks


def test_the_student_edition_holds_no_line_of_any_solution():
    if not (FULL / "index.html").exists() or not (STUDENT / "index.html").exists():
        pytest.fail("build both editions first (`make test` does): "
                    f"{FULL} and {STUDENT} must exist")
    blocks = solution_blocks()
    if not blocks:
        pytest.skip("the book has no solutions yet")
    full, student, elsewhere = site_text(FULL), site_text(STUDENT), other_sources()
    assert not (STUDENT / "solutions").exists(), "the student edition has a solutions folder"
    for nb, label, code, prose in blocks:
        distinctive = [normalise(l) for l in code + prose
                       if len(l) >= 30 and normalise(l) not in elsewhere and normalise(l) in full]
        assert distinctive, (f"{nb}, solution to {label}: found no distinctive line that the full "
                             "build shows, so the leak search would prove nothing")
        leaked = [l for l in distinctive if l in student]
        assert not leaked, f"{nb}, solution to {label}: the student edition contains {leaked[:3]}"


def test_every_notebook_page_offers_its_notebook_for_download():
    if not (FULL / "index.html").exists():
        pytest.fail(f"build the book first (`make book`): {FULL} is missing")
    pages = [p for d in ["chapters", "exercises", "solutions", "appendix"]
             for p in (FULL / d).glob("*.html") if (ROOT / d / (p.stem + ".ipynb")).exists()]
    if not pages:
        pytest.skip("the book has no notebook pages yet")
    for page in pages:
        text = page.read_text()
        links = re.findall(r'href="([^"]+\.ipynb)"', text)
        assert links, f"{page.relative_to(FULL)} offers no .ipynb download"
        for link in links:
            target = (page.parent / link).resolve()
            assert target.exists(), f"{page.relative_to(FULL)} links {link}, which the site does not hold"
            assert json.loads(target.read_text())["cells"], f"{link} is not a notebook"


def test_no_launch_button_while_the_repository_url_is_unset():
    if not (FULL / "index.html").exists():
        pytest.fail(f"build the book first (`make book`): {FULL} is missing")
    for page in FULL.rglob("*.html"):
        text = page.read_text()
        for service in ("mybinder.org", "colab.research.google.com", "executablebooks/jupyter-book"):
            assert service not in text, f"{page.relative_to(FULL)} links {service} with no repository set"


# ---------------------------------------------------------------- the site ships the package (issue #20)

def _kit_text(zip_path: Path) -> str:
    """Every text of a kit as a reader sees it: files, notebook cell sources and outputs."""
    import zipfile

    parts = []
    with zipfile.ZipFile(zip_path) as zf:
        for name in zf.namelist():
            if name.endswith((".md", ".txt")):
                parts.append(zf.read(name).decode())
            elif name.endswith(".ipynb"):
                for cell in json.loads(zf.read(name))["cells"]:
                    parts.append(_source(cell))
                    for out in cell.get("outputs", []):
                        parts.append("".join(out.get("text", "")))
                        parts.extend("".join(v) if isinstance(v, list) else str(v)
                                     for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return normalise("\n".join(parts))


@pytest.mark.parametrize("edition", ["full", "student"])
def test_every_chapter_and_exercise_page_and_the_preface_link_the_wheel_and_the_kit(edition):
    import zipfile

    site = FULL if edition == "full" else STUDENT
    if not (site / "index.html").exists():
        pytest.fail(f"build the {edition} edition first (`make test` does): {site} is missing")
    pages = [site / "preface.html"] + [p for d in ["chapters", "exercises"] for p in sorted((site / d).glob("*.html"))]
    assert len(pages) > 1
    kit_kind = "book" if edition == "full" else "student"
    for page in pages:
        text = page.read_text()
        assert "fixedstate-downloads" in text, f"{page.relative_to(site)} has no download box"
        wheels = re.findall(r'class="fixedstate-wheel[^"]*" href="([^"]+)"', text)
        kits = re.findall(r'class="fixedstate-kit[^"]*" href="([^"]+)"', text)
        assert len(wheels) == 1 and len(kits) == 1, f"{page.relative_to(site)}: expected one wheel and one kit link"
        for link in wheels + kits:
            target = (page.parent / link).resolve()
            assert target.is_file() and zipfile.is_zipfile(target), f"{page.relative_to(site)} links {link}, missing"
        assert f"-{kit_kind}-kit-" in kits[0]
        wheel = wheels[0].rsplit("/", 1)[1]
        assert f"pip<span class=\"w\"> </span>install<span class=\"w\"> </span>{wheel}" in text, \
            f"{page.relative_to(site)}: the box's command does not install {wheel}"


def test_the_student_kit_the_student_edition_serves_holds_no_line_of_any_solution():
    kits = sorted((STUDENT / "downloads").glob("*-student-kit-*.zip"))
    if not (STUDENT / "index.html").exists():
        pytest.fail(f"build the student edition first (`make test` does): {STUDENT} is missing")
    assert len(kits) == 1, f"the student edition serves {kits}, expected one student kit"
    assert not list((STUDENT / "downloads").glob("*-book-kit-*")), "the student edition serves the book kit"
    text, elsewhere = _kit_text(kits[0]), other_sources()
    for nb, label, code, prose in solution_blocks():
        distinctive = [normalise(l) for l in code + prose if len(l) >= 30 and normalise(l) not in elsewhere]
        assert distinctive, f"{nb}, {label}: no distinctive line to search the kit for"
        leaked = [l for l in distinctive if l in text]
        assert not leaked, f"{nb}, solution to {label}: the student kit contains {leaked[:3]}"


def test_a_chapter_pages_download_opens_with_the_line_that_checks_for_the_package():
    if not (FULL / "index.html").exists():
        pytest.fail(f"build the book first (`make book`): {FULL} is missing")
    for page in sorted((FULL / "chapters").glob("*.html")):
        (link,) = set(re.findall(r'href="([^"]+\.ipynb)"', page.read_text()))
        nb = json.loads((page.parent / link).read_text())
        first = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert _source(first).startswith('if not (__import__("importlib.util").util.find_spec("fixedstate")'), \
            f"{page.name}: its download does not open with the package check"


# TeX left raw on a page: a formula MathJax never saw, such as $...$ inside the text of a
# cross-reference (a {ref}'s link text is not parsed as MyST), or a macro outside any math.
RAW_TEX = re.compile(r"\$\s*\\[A-Za-z]|\\(?:frac|mathbf|mathrm|operatorname|Delta|alpha|beta|gamma|lambda|"
                     r"sum|top|left|right|cdot|approx|log|exp|in|le|ge|odot|otimes)\b")


def visible_prose(page_html: str) -> str:
    """A page's text as a reader sees it outside formulas, code and cell outputs."""
    from html.parser import HTMLParser

    skip_tags = {"script", "style", "pre", "code", "math", "svg", "head", "title"}
    skip_classes = {"math", "cell_output", "output", "highlight", "MathJax", "headerlink"}

    class Collect(HTMLParser):
        def __init__(self):
            super().__init__(convert_charrefs=True)
            self.stack, self.parts = [], []

        def handle_starttag(self, tag, attrs):
            if tag in {"br", "img", "hr", "input", "meta", "link", "wbr", "source"}:
                return
            classes = set((dict(attrs).get("class") or "").split())
            self.stack.append(tag in skip_tags or bool(classes & skip_classes))

        def handle_endtag(self, tag):
            if tag in {"br", "img", "hr", "input", "meta", "link", "wbr", "source"}:
                return
            if self.stack:
                self.stack.pop()

        def handle_data(self, data):
            if not any(self.stack):
                self.parts.append(data)

    c = Collect()
    c.feed(page_html)
    return normalise(" ".join(c.parts))


def test_visible_prose_finds_raw_tex_and_leaves_formulas_alone():
    page = ('<p>A <span class="math notranslate nohighlight">\\(\\Delta\\)</span> step, and '
            '<a href="x"><span class="std std-ref">the SSD with $\\Delta$ near 0.01</span></a>.</p>'
            '<div class="cell_output"><pre>$\\alpha$</pre></div>')
    text = visible_prose(page)
    assert RAW_TEX.findall(text) == ["$\\D"]
    assert "\\(" not in text


@pytest.mark.parametrize("edition", ["full", "student"])
def test_no_page_shows_raw_tex(edition):
    root = FULL if edition == "full" else STUDENT
    pages = sorted(p for p in root.rglob("*.html") if "_static" not in p.parts and p.name not in {"search.html", "genindex.html"})
    assert pages, f"no built pages under {root}"
    found = {}
    for page in pages:
        hits = RAW_TEX.findall(visible_prose(page.read_text(errors="replace")))
        if hits:
            found[str(page.relative_to(root))] = sorted(set(hits))
    assert not found, f"raw TeX outside formulas: {found}"
