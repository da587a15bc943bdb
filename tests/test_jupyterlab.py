"""Every notebook of the book, as a student sees it in JupyterLab.

The test installs the student kit as its README says (``requirements.txt`` with the
pinned JupyterLab and jupyterlab-myst, and the wheel) into a virtual environment,
starts that environment's ``jupyter lab`` on localhost, and opens every chapter,
exercise, solution and appendix notebook in headless Chromium. It fails on:

- rendered markdown that still shows role or directive syntax (``{ref}``, ``{eq}``,
  ``{cite``, ``{glue``, ``{eval}``, ``{numref}``, ``{prf:``, ``:label:``, a fence
  opening with a brace), which is what a notebook shows where no MyST renderer runs;
- any formula KaTeX could not typeset (an undefined macro such as ``\\T``);
- any cross-reference jupyterlab-myst cannot resolve (drawn as a warning), except the
  exercise a solution's title names, which lives in another notebook (its label shows);
- any exercise whose title line lacks its number or its points;
- any inline expression drawn as its code (``glued(...)``) or whose stored value
  (the cell's ``user_expressions``) does not appear in the rendered text.

It saves a screenshot of each notebook under ``_build/jupyterlab/`` (the top of the
notebook, and for an exercise notebook its first exercise too).

Run alone (``make jupyterlab-test``), the kit's environment is kept under
``_build/jupyterlab/kit-venv`` between runs and reinstalled when the kit's
``requirements.txt`` changes; the wheel is reinstalled every run. Run with the kit
tests (``make kit-tests``, which ``.ci/run`` calls), it uses the fresh environment
those install per the README, one installation for both. Marked ``kit`` (it installs
the kit): ``make test`` leaves it out. Three notebooks are open at a time, each in a
tab and a JupyterLab workspace of its own (``JUPYTERLAB_TABS_AT_ONCE``). The notebooks open in several tabs of the one
browser at a time.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "_build" / "jupyterlab"
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
NOTEBOOKS = sorted(p.relative_to(ROOT).as_posix() for d in ("chapters", "exercises", "solutions", "appendix")
                   for p in (ROOT / d).glob("*.ipynb"))

sys.path.insert(0, str(ROOT / "tools"))
import kit  # noqa: E402

pytestmark = pytest.mark.kit

#: Text that only unrendered MyST shows.
RAW_SYNTAX = re.compile(r"\{(?:ref|eq|numref|eval|prf:[a-z]+|glue(?::[a-z]+)?|cite(?::[a-z]+)?)\}`"
                        r"|:label:|^\s*(?:```+|:::+)\s*\{", re.M)
# "Exercise 2 (title (★, 2 points))"; a gated exercise (code cells inside) opens with "Start of Exercise 2 ..."
EXERCISE_TITLE = re.compile(r"^(?:Start of )?Exercise \d+(?:\.\d+)? \(.*\b\d+ points?\)\)?$", re.S)


def _kit_env(request) -> Path:
    """The python of the student kit's environment.

    Run with the kit tests (``make kit-tests``, which .ci/run calls), the environment those install
    per the README into a fresh venv (tests/conftest.py), once for both. Run alone (``make
    jupyterlab-test``), the kit installed per its README into ``_build/jupyterlab/kit-venv``, kept
    between runs while the kit's ``requirements.txt`` is unchanged, the wheel reinstalled every run."""
    if any("kit_env" in item.fixturenames for item in request.session.items):
        folder, python, _ = request.getfixturevalue("student_kit_install")
        assert "jupyterlab-myst==" in (folder / "requirements.txt").read_text().lower().replace("_", "-"), \
            "the kit's requirements.txt does not install jupyterlab-myst"
        return python
    build = OUT / "kit"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    subprocess.run([sys.executable, str(ROOT / "tools" / "kit.py"), "student-kit", str(build)], check=True)
    (zipped,) = build.glob("*.zip")
    with zipfile.ZipFile(zipped) as zf:
        zf.extractall(build)
    folder = build / kit.kit_name("student")
    requirements = folder / "requirements.txt"
    assert "jupyterlab-myst==" in requirements.read_text().lower().replace("_", "-"), \
        "the kit's requirements.txt does not install jupyterlab-myst"
    (wheel,) = folder.glob("*.whl")
    venv = OUT / "kit-venv"
    stamp = venv / ".requirements-sha256"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    if not (stamp.exists() and stamp.read_text() == digest):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", "-r", str(requirements)], env=env, check=True)
        stamp.write_text(digest)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--force-reinstall", str(wheel)], env=env, check=True)
    return venv / "bin" / "python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(request):
    """``jupyter lab`` of the kit's environment on the repository, localhost only: (url, token)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"headless Chromium not found at {CHROMIUM}: install Debian's `chromium` package "
                    "(bash tools/system_deps.sh chromium) or set CHROMIUM to its path")
    python = _kit_env(request)
    listed = subprocess.run([str(python), "-m", "jupyter", "labextension", "list"], capture_output=True, text=True)
    assert re.search(r"jupyterlab-myst v\S+ .*enabled", listed.stdout + listed.stderr), \
        "jupyterlab-myst is not an enabled extension of the kit's JupyterLab:\n" + listed.stdout + listed.stderr
    home = OUT / "lab-home"
    shutil.rmtree(home, ignore_errors=True)
    settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # every cell rendered, not only those in view (JupyterLab 4 renders a window of cells by default)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    # no autosave: JupyterLab marks a notebook changed when it writes its kernel's display name into the
    # metadata, and would save it into the repository after two minutes open (the tests check the files)
    docmanager = home / "settings" / "@jupyterlab" / "docmanager-extension"
    docmanager.mkdir(parents=True)
    (docmanager / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": False}))
    news = home / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [str(python), "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={ROOT}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(home / "lab.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail("jupyter lab exited:\n" + (home / "lab.log").read_text())
                time.sleep(0.5)
        else:
            pytest.fail("jupyter lab did not answer within 60 s:\n" + (home / "lab.log").read_text())
        yield url, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _markdown_cells(rel: str) -> list[str]:
    nb = json.loads((ROOT / rel).read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def _stored_values(rel: str) -> list[list[str]]:
    """Per markdown cell, the texts of its inline expressions' stored values (what JupyterLab must show)."""
    nb = json.loads((ROOT / rel).read_text())
    out = []
    for c in nb["cells"]:
        if c["cell_type"] != "markdown":
            continue
        texts = []
        for e in c.get("metadata", {}).get("user_expressions", []):
            plain = e.get("result", {}).get("data", {}).get("text/plain", "")
            texts.append(ast.literal_eval(plain) if plain[:1] in "'\"" else plain)
        out.append(texts)
    return out


def _shut_down_kernels(url, token, rel=None):
    """Shut down the kernel sessions of the notebook ``rel`` (of every notebook with ``rel=None``)."""
    req = urllib.request.Request(f"{url}/api/sessions?token={token}")
    for s in json.loads(urllib.request.urlopen(req, timeout=10).read()):
        if rel is None or s.get("path") == rel:
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/sessions/{s['id']}?token={token}",
                                                          method="DELETE"), timeout=10)


#: How many notebooks are open at once: the one under test and the next ones, each in a tab (a context)
#: of its own with a JupyterLab workspace of its own, so that one notebook loads while another is checked.
TABS_AT_ONCE = int(os.environ.get("JUPYTERLAB_TABS_AT_ONCE", "3"))


def _begin(browser, url, token, rel):
    """A tab sent to the notebook ``rel`` in a workspace of its own (JupyterLab saves a workspace's layout
    on the server: tabs open at once must not share one); returns at once, while JupyterLab loads."""
    page = browser.new_page(viewport={"width": 1280, "height": 1600})
    console = []
    page.on("console", lambda m: console.append(m.text))
    workspace = re.sub(r"[^A-Za-z0-9]+", "-", rel.removesuffix(".ipynb"))
    page.goto(f"{url}/lab/workspaces/{workspace}/tree/{rel}?reset&token={token}", wait_until="commit")
    return page, console, hashlib.sha256((ROOT / rel).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tabs(lab, browser):
    """Tabs begun ahead of their tests: {notebook: (page, console)}; whatever is left is closed at the end."""
    begun = {}
    yield begun
    for page, _, _ in begun.values():
        page.close()
    _shut_down_kernels(*lab)


RENDERED = r"""() => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-MarkdownCell')];
  return cells.map(c => {
    const r = c.querySelector('.myst');
    if (!r) return null;
    const flagged = [...r.querySelectorAll('.katex-error, [class*="text-yellow-"][title], [class*="text-red-"][title]')];
    const errors = flagged.map(e => ({
      what: (e.getAttribute('title') || 'KaTeX error') + ' :: ' + e.textContent,
      // the exercise a solution notebook's title names lives in another notebook: its label is shown
      inSolutionTitle: !!(e.closest('.myst-exercise-title') &&
                          e.closest('.myst-exercise-title').innerText.includes('Solution to')),
    }));
    const exercises = [...r.querySelectorAll('.myst-exercise-title')].map(e => e.innerText.replace(/\s+/g, ' ').trim());
    // all: the text of closed dropdowns too (in the page, drawn when a reader opens them)
    return {text: r.innerText, all: r.textContent, errors, exercises};
  });
}"""


@pytest.mark.parametrize("rel", NOTEBOOKS)
def test_the_notebook_renders_in_jupyterlab_without_markup_math_errors_or_unnumbered_exercises(lab, browser, tabs,
                                                                                                   request, rel):
    url, token = lab
    sources = _markdown_cells(rel)
    order = [item.callspec.params["rel"] for item in request.session.items
             if item.originalname == request.node.originalname and "rel" in item.callspec.params]
    for ahead in order[order.index(rel):][:max(1, TABS_AT_ONCE)] if rel in order else [rel]:
        if ahead not in tabs:
            tabs[ahead] = _begin(browser, url, token, ahead)
    page, console, digest = tabs.pop(rel)
    try:
        page.wait_for_function(
            f"() => document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-MarkdownCell .myst')"
            f".length >= {len(sources)}", timeout=120_000)
        page.wait_for_timeout(1500)          # the last cells' math and cross-references
        cells = page.evaluate(RENDERED)
        shot = OUT / "screenshots" / (rel.replace("/", "__").removesuffix(".ipynb") + ".png")
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot))
        first = page.query_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .myst-exercise")
        if first is not None and rel.startswith("exercises/"):
            first.scroll_into_view_if_needed()
            page.screenshot(path=str(shot.with_name(shot.stem + "__exercise.png")))
    finally:
        page.close()
        _shut_down_kernels(url, token, rel)

    assert hashlib.sha256((ROOT / rel).read_bytes()).hexdigest() == digest, \
        f"{rel}: JupyterLab changed the file while the test had it open"
    assert len(cells) == len(sources), f"{rel}: {len(cells)} markdown cells shown, {len(sources)} in the file"
    values = _stored_values(rel)
    problems = []
    for i, cell in enumerate(cells):
        if cell is None:
            problems.append(f"markdown cell {i}: not rendered by jupyterlab-myst")
            continue
        for m in RAW_SYNTAX.finditer(cell["text"]):
            line = cell["text"][max(0, m.start() - 40):m.end() + 40].replace("\n", " ")
            problems.append(f"markdown cell {i}: shows MyST syntax {m.group(0)!r}: ...{line}...")
        # every inline expression is drawn as its stored value, not as its code
        if "glued(" in cell["all"]:
            problems.append(f"markdown cell {i}: shows an inline expression's code instead of its value")
        flat = re.sub(r"\s+", "", cell["all"])
        for value in values[i]:
            if re.sub(r"\s+", "", value) not in flat:
                problems.append(f"markdown cell {i}: the stored value {value!r} is not shown")
        for e in cell["errors"]:
            if e["what"].startswith(("Cross Reference Not Found", "No target")):
                if not e["inSolutionTitle"]:
                    problems.append(f"markdown cell {i}: unresolved cross-reference {e['what']}")
            else:
                problems.append(f"markdown cell {i}: math error {e['what']}")
        for title in cell["exercises"]:
            if re.match(r"(Start of )?Exercise", title) and not EXERCISE_TITLE.match(title):
                problems.append(f"markdown cell {i}: exercise without its number and points: {title!r}")
    problems += [f"console: {t}" for t in console if re.search(r"KaTeX|Undefined control sequence", t)]
    starts = sum(len(re.findall(r"^```+\{exercise(?:-start)?\}", s, re.M)) for s in sources)
    shown = [t for c in cells if c for t in c["exercises"] if EXERCISE_TITLE.match(t)]
    if len(shown) != starts:
        problems.append(f"{starts} exercises in the file, {len(shown)} shown with number and points: {shown}")
    assert not problems, f"{rel} in JupyterLab:\n  " + "\n  ".join(problems[:40])
