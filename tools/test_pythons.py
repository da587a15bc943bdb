"""The wheel of fixedstate on every Python a student may have: installed, its unit tests and a chapter run there.

Usage:
  python tools/test_pythons.py [--out DIR] [--python 3.12 ...] [--skip-oldest]

``make test-pythons`` runs it (``.ci/run`` calls that). For every Python from 3.11
(the wheel's ``Requires-Python`` floor) to the newest on this machine, and never
fewer than 3.11, 3.12 and 3.13, it

1. creates a fresh virtual environment with that Python's own ``venv`` and the pip
   it ships (a student's ``%pip`` is no newer),
2. installs the wheel, built as the site builds it (``tools/kit.py``), with the
   newest versions of its dependencies that pip finds for that Python, and the
   test tools (and myst-nb, whose glue the chapter's outputs hold) at the versions
   ``pyproject.toml``'s extras pin,
3. runs the unit tests (the markers of ``make unit``, the quick hypothesis profile,
   less the tests of the book's own tools, the kit, the grader and the notebooks'
   MyST form, which run in the book's environment) with the package imported from
   that environment, and nbval over one chapter (its stored outputs reproduced, as in ``make nbval``);

and once more on the oldest of those Pythons with every dependency at the lower end
of the range the wheel declares (a constraints file that pins each lower bound), so
the ranges' lower ends are tested too. A Python that is not on the machine is a
failure, not a skip. Only wheels are installed (``--only-binary :all:``): nothing is
compiled. pip's cache is shared between the runs. Two runs go at a time (``--jobs``): one
resolves, fetches and installs (the network, the disk; one run at a time, as they share the
wheelhouse) while the other runs its tests (the processor).

It prints, and writes to ``DIR/report.md``, a table: Python, dependency set, the
versions installed, the results and the time of each run; and exits non-zero when
any run failed or a Python was missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import kit  # noqa: E402

#: The wheel's Requires-Python floor, and the Pythons every run must cover whatever the machine has.
FLOOR = (3, 11)
REQUIRED = [(3, 11), (3, 12), (3, 13)]
#: The light chapter whose stored outputs each environment must reproduce.
CHAPTER = "chapters/02_linear_attention.ipynb"
#: The distributions the table shows the installed version of (the wheel's dependencies).
UNIT_MARKERS = "not browser and not site and not kit and not grade_attack and not pdf"
#: What the unit tests and nbval need besides the wheel's dependencies, at the pins of pyproject.toml's extras:
#: the test tools, and myst-nb (its glue writes outputs that the chapter's stored ones hold).
TOOLS = {"test": ("pytest", "hypothesis", "nbval", "pytest-xdist"), "book": ("myst-nb",)}
#: Left out: tests of the book's own tools, which run in the book's environment, not a student's, and which
#: make test runs there: the kit and the site's downloads (the kit's requirements.txt is read off the
#: installed JupyterLab and the lock), the instructor's grader (its sandbox runs the book's venv), and the
#: notebooks' MyST form (tools/sphinx_ext, which needs the book's build tools), and chapter 9's sweep engine
#: (tools/mqar_sweep.py, whose cluster test needs dask.distributed, pyproject's extra ``sweep``).
BOOK_ENVIRONMENT_TESTS = ("tests/test_kit.py", "tests/test_grade.py", "tests/test_grade_course.py",
                          "tests/test_grade_hidden.py", "tests/test_grade_attack.py",
                          "tests/test_notebook_portability.py", "tests/test_mqar_sweep.py")
#: What the unit tests import from tools/ that no extra pins (their versions are whatever pip resolves).
EXTRA_TEST_DEPS = ("PyYAML", "nbclient", "nbformat")


def wheel_requirements(wheel: Path) -> tuple[str, list[str]]:
    """``(Requires-Python, [Requires-Dist without extras])`` read from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(name).decode())
    deps = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return meta["Requires-Python"], deps


def lower_bounds(requirements: list[str]) -> list[str]:
    """``name==X`` for each requirement's ``>=X``: the constraints of the oldest declared versions.

    Raises ``ValueError`` for a requirement without exactly one lower bound ``>=``.
    """
    from packaging.requirements import Requirement

    out = []
    for r in requirements:
        req = Requirement(r)
        lows = [s.version for s in req.specifier if s.operator == ">="]
        if len(lows) != 1:
            raise ValueError(f"requirement {r!r}: expected exactly one lower bound '>=X' (a tested lower end), "
                             f"got {str(req.specifier) or 'none'}")
        out.append(f"{req.name}=={lows[0]}")
    return out


def test_tool_pins(root: Path = ROOT) -> list[str]:
    """The tools of :data:`TOOLS` at the versions their extras pin, then :data:`EXTRA_TEST_DEPS`, unpinned."""
    out = []
    for extra, names in TOOLS.items():
        pins = {kit._name(r): r for r in kit.project(root)["optional-dependencies"][extra]}
        missing = [t for t in names if kit._name(t) not in pins]
        if missing:
            raise ValueError(f"pyproject.toml: expected {missing} in the {extra} extra")
        out += [pins[kit._name(t)] for t in names]
    return out + list(EXTRA_TEST_DEPS)


def _version_of(python: str) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:3])"], capture_output=True,
                             text=True, timeout=60, env=_clean_env())
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return tuple(int(x) for x in out.stdout.split())


def find_pythons() -> dict[tuple[int, int], tuple[str, tuple[int, int, int]]]:
    """``{(3, minor): (path, version)}`` of the newest interpreter of each minor version on PATH and in pyenv."""
    candidates = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and Path(d).is_dir() and ".venv" not in d and "shims" not in Path(d).parts:
            candidates += [p for p in Path(d).glob("python3.*") if re.fullmatch(r"python3\.\d+", p.name)]
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates += [p for p in Path(pyenv_root).glob("versions/*/bin/python3.*")
                   if re.fullmatch(r"python3\.\d+", p.name)]
    found: dict[tuple[int, int], tuple[str, tuple[int, int, int]]] = {}
    for p in sorted(set(candidates)):
        v = _version_of(str(p))
        if v is None or f"python{v[0]}.{v[1]}" != p.name:      # a pyenv shim of a version not selected
            continue
        if v[:2] not in found or v > found[v[:2]][1]:
            found[v[:2]] = (str(p), v)
    return found


def pythons_to_test(found) -> list[tuple[int, int]]:
    """Every minor version from the floor to the newest found (and at least the required ones)."""
    newest = max([v for v in found if v >= FLOOR] + REQUIRED)
    return [(3, m) for m in range(FLOOR[1], newest[1] + 1)]


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYENV_VERSION", "FIXEDSTATE_TIMING")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _pytest_counts(text: str) -> str:
    """pytest's closing counts ('1320 passed, 3 deselected'), or the last line when there are none."""
    for line in reversed(text.strip().splitlines()):
        if re.search(r"\d+ (passed|failed|error)", line):
            return re.sub(r"=+", "", line).strip()
    return (text.strip().splitlines() or ["no output"])[-1][:200]


#: One run at a time resolves, fetches and installs: the wheelhouse is shared, and a wheel another
#: run is still writing must not be installed.
_WHEELHOUSE = threading.Lock()


def run_one(python: str, label: str, wheel: Path, out: Path, oldest: list[str] | None, workers: int,
            wheelhouse: Path) -> dict:
    """One environment: create, install, unit tests, chapter. Returns the table's row."""
    t0 = time.perf_counter()
    venv = out / f"venv-{label}"
    shutil.rmtree(venv, ignore_errors=True)
    log = out / f"{label}.log"
    row = {"label": label, "python": python, "ok": False, "steps": {}}
    with log.open("w") as f:
        def step(name, cmd, **env):
            f.write(f"\n$ {' '.join(map(str, cmd))}\n")
            f.flush()
            t = time.perf_counter()
            res = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=_clean_env(**env), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            f.write(res.stdout + f"[{name}: exit {res.returncode}, {time.perf_counter() - t:.0f} s]\n")
            f.flush()
            row["steps"][name] = (res.returncode, res.stdout)
            return res.returncode == 0, res.stdout

        ok, _ = step("venv", [python, "-m", "venv", venv])
        vpy = venv / "bin" / "python"
        if ok:
            reqs = [wheel, *test_tool_pins()]
            if oldest is not None:
                constraints = out / "oldest-constraints.txt"
                constraints.write_text("# the lower end of each range the wheel declares\n" + "\n".join(oldest)
                                       + "\n")
                reqs += ["-c", constraints]
            # pip resolves against the index (the newest versions for this Python, or the constraints), keeps
            # the wheels it resolved in the wheelhouse (a file already there is not fetched again: the registry
            # sends no caching headers, so pip's own cache keeps nothing), then installs exactly those
            with _WHEELHOUSE:
                ok, _ = step("resolve and fetch", [vpy, "-m", "pip", "download", "--quiet", "--only-binary", ":all:",
                                                   "--dest", wheelhouse, *reqs])
                for stale in wheelhouse.glob("fixedstate-*.whl"):      # the wheel under test is always the one built
                    stale.unlink()
                if ok:
                    ok, _ = step("install", [vpy, "-m", "pip", "install", "--quiet", "--no-compile", "--no-index",
                                             "--find-links", wheelhouse, *reqs])
        if ok:
            ok, listing = step("versions", [vpy, "-m", "pip", "list", "--format", "json"])
            row["versions"] = {kit._name(d["name"]): d["version"] for d in json.loads(listing)} if ok else {}
            ok, where = step("import", [vpy, "-c", "import fixedstate, sys; print(fixedstate.__file__); "
                                                   "print(sys.version.split()[0])"])
            if ok and not Path(where.split()[0]).resolve().is_relative_to(venv.resolve()):
                f.write(f"fixedstate imported from {where.split()[0]}, not from {venv}\n")
                ok = False
            if ok:
                row["python_version"] = where.split()[1]
        if ok:
            units, text = step("unit tests", [vpy, "-m", "pytest", "tests", "-q", "-m", UNIT_MARKERS,
                                              *[f"--ignore={t}" for t in BOOK_ENVIRONMENT_TESTS],
                                              "-p", "no:cacheprovider", "-n", str(workers), "--dist", "loadscope"],
                               FIXEDSTATE_TEST_PROFILE="quick", FIXEDSTATE_TIMING="")
            row["unit"] = _pytest_counts(text)
            chapter, text = step("chapter", [vpy, "-m", "pytest", "--nbval", "--nbval-current-env",
                                             "--nbval-sanitize-with", "tests/nbval_sanitize.cfg",
                                             "--nbval-cell-timeout=600", "-p", "no:cacheprovider", "-q", CHAPTER],
                                 FIXEDSTATE_TIMING="once", FIXEDSTATE_FIGURES="frames")
            row["chapter"] = _pytest_counts(text)
            ok = units and chapter
        else:
            failed = [k for k, (rc, _) in row["steps"].items() if rc != 0]
            row["unit"] = row["chapter"] = f"not run: {failed[-1] if failed else 'import check'} failed"
    row["ok"] = ok
    row["seconds"] = time.perf_counter() - t0
    row["log"] = str(log)
    if ok:
        shutil.rmtree(venv, ignore_errors=True)      # keep a failed run's environment to look into
    return row


def table(rows, deps: list[str]) -> str:
    names = [kit._name(re.match(r"[A-Za-z0-9._-]+", d).group(0)) for d in deps]
    head = ["Python", "dependencies"] + names + ["unit tests", CHAPTER, "time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        v = r.get("versions", {})
        cells = [r.get("python_version", r["label"].split("-")[0]), r["label"].split("-", 1)[1]]
        cells += [v.get(n, "-") for n in names]
        cells += [("" if r["ok"] else "FAILED: ") + r.get("unit", "-"), r.get("chapter", "-"), f"{r['seconds']:.0f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "_build" / "pythons")
    p.add_argument("--python", action="append", default=None,
                   help="test only these minor versions (e.g. 3.12); default: every one from 3.11 on")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--skip-oldest", action="store_true", help="leave out the run with the oldest declared versions")
    which.add_argument("--oldest-only", action="store_true", help="only the run with the oldest declared versions")
    p.add_argument("--wheelhouse", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                   / "fixedstate-wheelhouse", help="where the wheels pip resolved are kept between runs")
    p.add_argument("--workers", type=int, default=int(os.environ.get("TEST_WORKERS") or os.cpu_count() or 2))
    p.add_argument("--jobs", type=int, default=2,
                   help="environments set up and tested at a time (default 2: one installs while another tests)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.wheelhouse.mkdir(parents=True, exist_ok=True)

    wheel = kit.build_wheel(out / "wheel")
    requires_python, deps = wheel_requirements(wheel)
    oldest = lower_bounds(deps)
    print(f"{wheel.name}: Requires-Python {requires_python}; {', '.join(deps)}")
    found = find_pythons()
    wanted = ([tuple(int(x) for x in v.split(".")) for v in args.python] if args.python
              else pythons_to_test(found))
    missing = [v for v in wanted if v not in found]
    for v in missing:
        print(f"Python {v[0]}.{v[1]}: MISSING on this machine (looked for python{v[0]}.{v[1]} on PATH and in "
              f"pyenv's versions); the wheel must be tested on it")
    runs = [] if args.oldest_only else [(found[v][0], f"{v[0]}.{v[1]}-newest", None) for v in wanted if v in found]
    present = [v for v in wanted if v in found]
    if present and not args.skip_oldest:
        v = min(present)
        runs.append((found[v][0], f"{v[0]}.{v[1]}-oldest", oldest))
    def one(run):
        python, label, constraints = run
        print(f"\n=== {label}: {python}", flush=True)
        row = run_one(python, label, wheel, out, constraints, args.workers, args.wheelhouse)
        tail = "" if row["ok"] else "\n" + "".join(row["steps"][list(row["steps"])[-1]][1].splitlines(True)[-30:])
        print(f"=== {label}: {'ok' if row['ok'] else 'FAILED'} in {row['seconds']:.0f} s: unit tests {row['unit']}; "
              f"chapter {row['chapter']} (log: {row['log']}){tail}", flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, runs))
    report = (f"# {wheel.name} on the Pythons of this machine\n\nRequires-Python {requires_python}; "
              f"dependencies {', '.join(deps)}; oldest: {', '.join(oldest)}.\n\n" + table(rows, deps) + "\n")
    if missing:
        report += "\nMissing: " + ", ".join(f"Python {a}.{b}" for a, b in missing) + "\n"
    (out / "report.md").write_text(report)
    print("\n" + report)
    failed = sum(not r["ok"] for r in rows) + len(missing)
    print(f"test-pythons ({time.perf_counter() - t0:.0f} s in all): {len(rows) - sum(not r['ok'] for r in rows)} "
          f"passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
