"""The built HTML book in a real browser, offline.

Headless Chromium (Debian's ``chromium`` package, driven by Playwright) opens
every page of the built book from disk with the network cut off, and fails on:
any request to another host or any failed request, any console error or page
error, any formula MathJax did not render, any widget the widget manager did
not render. On every interactive figure it moves each slider (and clicks each
button row) and checks that the picture shown changed.

Run after the book is built (``make test`` does both). A local run without
Chromium fails with a message saying so, rather than passing silently.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("BOOK_HTML", ROOT / "_build" / "html")).resolve()
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--allow-file-access-from-files"]

pytestmark = pytest.mark.browser


def pages():
    skip = {"search.html", "genindex.html"}
    return sorted(p for p in SITE.rglob("*.html")
                  if p.name not in skip and "_static" not in p.parts and "_sources" not in p.parts
                  and not (p.name == "index.html" and p.parent == SITE))


@pytest.fixture(scope="module")
def browser():
    if not SITE.joinpath("index.html").exists():
        pytest.fail(f"no built book at {SITE}: run `make book` (or `make test`) first")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"headless Chromium not found at {CHROMIUM}: install Debian's `chromium` package "
                    "(`.ci/run` does) or set CHROMIUM to its path. The browser test cannot run without it.")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


class PageLog:
    def __init__(self, page):
        self.foreign, self.failed, self.errors = [], [], []
        page.on("request", self._request)
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url} ({r.failure})"))
        page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))

    def _request(self, request):
        if not request.url.startswith(("file://", "data:", "blob:", "about:")):
            self.foreign.append(request.url)


def begin_page(browser, path):
    """A new context and page, offline, with its log listening, sent to ``path``: returns at once, while
    the page loads (its requests, MathJax and widgets are the browser's to run, beside other pages)."""
    context = browser.new_context(offline=True, viewport={"width": 1200, "height": 900})
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(
        ("file://", "data:", "blob:")) else route.abort())
    page = context.new_page()
    log = PageLog(page)
    page.goto(path.as_uri(), wait_until="commit")
    return context, page, log


def settle(context, page, log):
    """Wait until the page begun by :func:`begin_page` has loaded, typeset its math and drawn its widgets."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.wait_for_load_state("load")
    try:
        page.wait_for_function(
            "() => !window.MathJax || (window.MathJax.startup && window.MathJax.startup.promise)",
            timeout=20_000)
    except PlaywrightTimeout:
        context.close()
        pytest.fail(f"MathJax did not start within 20 s; requests to other hosts: {log.foreign[:3]}; "
                    f"failed requests: {log.failed[:3]}; console errors: {log.errors[:3]}")
    page.evaluate("() => window.MathJax ? window.MathJax.startup.promise.then(() => true) : true")
    n_widget_views = page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count()
    if n_widget_views:
        try:
            page.wait_for_function(
                "() => document.querySelectorAll('.jupyter-widgets.widget-container, "
                ".jupyter-widgets.widget-inline-hbox, .jupyter-widgets.widget-image, .widget-vbox').length >= 1",
                timeout=20_000)
        except PlaywrightTimeout:
            context.close()
            pytest.fail(f"the page's {n_widget_views} widgets did not render within 20 s; "
                        f"requests to other hosts: {log.foreign[:3]}; failed requests: {log.failed[:3]}; "
                        f"console errors: {log.errors[:3]}")
        page.wait_for_timeout(300)
    return context, page, log


def page_params(paths):
    """One parameter per page, grouped for pytest-xdist: a page's tests run on one worker, one after another."""
    return [pytest.param(p, id=p.relative_to(SITE).as_posix(),
                         marks=pytest.mark.xdist_group(p.relative_to(SITE).as_posix())) for p in paths]


#: How many pages load at once: the one under test and the next ones, each in its own context (and
#: renderer process) of the one browser, so that one page's loading overlaps another's checks.
PAGES_AT_ONCE = int(os.environ.get("BROWSER_PAGES_AT_ONCE", "4"))


@pytest.fixture(scope="module")
def begun(browser):
    """Pages begun ahead of their tests: {path: (context, page, log)}; whatever is left is closed at the end."""
    pending = {}
    yield pending
    for context, _, _ in pending.values():
        context.close()


def _page_order(session) -> list:
    """The pages in the order the collected tests will open them (each once: the parameter is module-scoped)."""
    order = []
    for item in session.items:
        path = getattr(item, "callspec", None) and item.callspec.params.get("loaded")
        if path is not None and path not in order:
            order.append(path)
    return order


@pytest.fixture(scope="module")
def loaded(browser, begun, request):
    """The page opened once for all the tests that look at it (pytest runs them together: the
    parameter is module-scoped). The load test runs first, on the page as loaded; the slider
    test then moves the sliders; the equation test measures widths, which sliders do not change.
    The next pages in the tests' order begin loading now, in contexts of their own, so that
    the browser loads them while this one is checked (``BROWSER_PAGES_AT_ONCE``, 1 for one at a time)."""
    path = request.param
    order = _page_order(request.session)
    ahead = order[order.index(path):][:max(1, PAGES_AT_ONCE)] if path in order else [path]
    for p in ahead:
        if p not in begun:
            begun[p] = begin_page(browser, p)
    context, page, log = settle(*begun.pop(path))
    yield page, log
    context.close()


UNRENDERED_MATH = """() => Array.from(document.querySelectorAll('.math'))
    .filter(el => !el.querySelector('mjx-container')).map(el => el.textContent.slice(0, 60))"""

UNRENDERED_WIDGETS = """() => Array.from(document.querySelectorAll(
      'script[type="application/vnd.jupyter.widget-view+json"]'))
    .filter(s => { const sib = s.previousElementSibling || s.nextElementSibling;
                   const host = s.parentElement;
                   return !(host && host.querySelector('.jupyter-widgets, .widget-subarea')); })
    .length"""


@pytest.mark.parametrize("loaded", page_params(pages()), indirect=True, scope="module")
def test_page_loads_offline_with_everything_rendered(loaded):
    page, log = loaded
    assert not log.foreign, f"requests to other hosts: {log.foreign[:5]}"
    assert not log.failed, f"failed requests: {log.failed[:5]}"
    assert not log.errors, f"console errors: {log.errors[:5]}"
    unrendered = page.evaluate(UNRENDERED_MATH)
    assert not unrendered, f"{len(unrendered)} formulas not rendered by MathJax, e.g. {unrendered[:3]}"
    assert page.evaluate(UNRENDERED_WIDGETS) == 0, "a widget view was not rendered"


VISIBLE_PICTURES = """(root) => Array.from(root.querySelectorAll('img'))
    .filter(img => img.offsetParent !== null).map(img => img.src.slice(-200))"""


def picture_after_change(page, box, before, timeout=5_000):
    """The visible pictures of ``box`` once they differ from ``before`` (or after ``timeout`` ms, unchanged)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "([root, before]) => JSON.stringify(Array.from(root.querySelectorAll('img'))"
            ".filter(img => img.offsetParent !== null).map(img => img.src.slice(-200))) !== before",
            arg=[box.element_handle(), json.dumps(before, separators=(",", ":"))], timeout=timeout)
    except PlaywrightTimeout:
        pass
    return box.evaluate(VISIBLE_PICTURES)


def figures_on(page):
    """Widget boxes that hold a picture and at least one control."""
    return [box for box in page.locator(".jupyter-widgets.widget-vbox").all()
            if box.locator("img").count() and
            (box.locator(".noUi-handle").count() or box.locator(".widget-toggle-buttons button").count())]


def interactive_pages():
    return [p for p in pages() if "application/vnd.jupyter.widget-view+json" in p.read_text()]


@pytest.mark.parametrize("loaded", page_params(interactive_pages()), indirect=True, scope="module")
def test_every_slider_changes_its_figure_without_a_kernel(loaded):
    page, log = loaded
    n_errors = len(log.errors)                    # errors at load are the load test's to report
    figures = figures_on(page)
    assert figures, "the page stores widgets but no interactive figure rendered"
    for box in figures:
        box.scroll_into_view_if_needed()
        handles = box.locator(".noUi-handle").all()
        for i, handle in enumerate(handles):
            before = box.evaluate(VISIBLE_PICTURES)
            assert len(before) == 1, f"expected one visible picture in the figure, saw {len(before)}"
            handle.focus()
            key = "ArrowLeft" if handle.get_attribute("aria-valuenow") == handle.get_attribute(
                "aria-valuemax") else "ArrowRight"
            handle.press(key)
            after = picture_after_change(page, box, before)
            assert after != before, f"moving slider {i} did not change the figure"
        for row in box.locator(".widget-toggle-buttons").all():
            buttons = row.locator("button").all()
            before = box.evaluate(VISIBLE_PICTURES)
            target = next(b for b in buttons if "mod-active" not in (b.get_attribute("class") or ""))
            target.click()
            after = picture_after_change(page, box, before)
            assert after != before, "clicking a button of the figure did not change it"
    assert not log.errors[n_errors:], f"console errors while moving sliders: {log.errors[n_errors:][:5]}"


WIDE_EQUATIONS = """() => {
    return Array.from(document.querySelectorAll('mjx-container[display="true"]')).map(m => {
        const math = m.firstElementChild;
        const w = math ? math.getBoundingClientRect().width : m.scrollWidth;
        const box = m.closest('.math[id], [id]');
        return [box ? box.id : m.textContent.slice(0, 40), Math.round(w), m.clientWidth];
    }).filter(([label, w, box]) => w > box + 2);
}"""


def text_pages():
    """The chapters, the appendix (with the worked solutions) and the exercises."""
    return [p for p in pages() if p.relative_to(SITE).parts[0] in {"chapters", "appendix", "exercises", "solutions"}]


@pytest.mark.parametrize("loaded", page_params(text_pages()), indirect=True, scope="module")
def test_display_equations_fit_the_column(loaded):
    """At a 1200 px wide window every display equation fits its own box.

    The box (the MathJax container) is narrower than the article column: the
    equation number takes room beside it, and an exercise or admonition box takes
    its padding. A formula wider than its box would be cut off, or (with the
    book's CSS) need sideways scrolling on a desktop screen: such an equation is
    to be broken into lines (``aligned``) in the notebook's markdown.
    """
    page, _ = loaded
    wide = page.evaluate(WIDE_EQUATIONS)
    assert not wide, ("display equations wider than their box (label, width px, box px): "
                      f"{wide}")
