"""Time one update of every interactive figure of the book in live mode (``make bench-figures``).

Finds every ``interactive_figure(...)`` call in the chapters (``chapters/*.ipynb``)
by running each notebook's code cells up to its last figure, skipping the cells
tagged ``nbval-ignore-output`` (timings) other than the figure cells themselves,
with ``interactive_figure`` replaced by a stub that records its arguments. Then,
for each figure, it builds the live widget as a reader's kernel does and drives
it: every numeric slider is swept from one end of its range to the other and
back in ``--steps`` steps (values between the precomputed grid points included,
the other sliders at their starting values), and every row of buttons is
clicked through. One update is the time from setting a control's value to the
new picture being set on the image widget: the computation and the drawing
(in the kernel, that is what the reader waits for, plus the transfer of the
picture to the browser). The script prints, per figure, the number of updates,
their median and 95th percentile in milliseconds, the 95th percentile of the
updates at a setting the figure had not drawn before (a figure may keep what
it computed, which helps when a slider comes back), the slowest, the time of
the first picture (built from scratch), the 95th percentiles of the two
halves of an update (``draw``: the computation and the changes to the figure;
then rendering the picture), the 95th percentile of the processor time of an
update (on a loaded machine the wall-clock times include the waits for a
processor, the processor time much less so: it is near what an update takes on
an idle machine), and whether the figure's live sliders update continuously or
on release.

It is a benchmark, not a test: it fails only if a figure cannot be driven.
The numbers depend on the machine and on what else runs on it; the load
average is printed with them. The script sets no BLAS thread variable: the
figures run as they do in a reader's kernel.

Options: ``--steps N`` (positions per sweep, default 24), ``--repeats N``
(sweeps per figure, default 1), ``--only TEXT`` (figures whose name contains
TEXT), ``--target MS`` (the 95th percentile an update should stay under,
default 50: figures above it are marked).
"""

from __future__ import annotations

import os

os.environ["FIXEDSTATE_FIGURES"] = "live"   # the benchmark times the live mode; BLAS threads are left alone

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")

import numpy as np  # noqa: E402

import fixedstate.figures as figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALL = re.compile(r"(?<![\w.])interactive_figure\(")


def book_figures(notebooks):
    """(name, draw, params, keyword arguments) of every interactive_figure call in the notebooks."""
    found = []
    real = figures.interactive_figure
    for nb in notebooks:
        cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        sources = ["".join(c["source"]) for c in cells]
        figure_cells = [i for i, src in enumerate(sources) if CALL.search(src)]
        if not figure_cells:
            continue
        captured = []

        def stub(draw, params, **kwargs):
            captured.append((draw, params, kwargs))

        namespace = {"__name__": f"bench_{nb.stem}"}
        cwd = os.getcwd()
        os.chdir(nb.parent)
        figures.interactive_figure = stub
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # what the cells print is not the benchmark's
                for i, (cell, src) in enumerate(zip(cells[:figure_cells[-1] + 1], sources)):
                    if i not in figure_cells and "nbval-ignore-output" in cell.get("metadata", {}).get("tags", []):
                        continue
                    exec(compile(src, f"{nb.name} cell {i}", "exec"), namespace)
        finally:
            figures.interactive_figure = real
            os.chdir(cwd)
        import matplotlib.pyplot as plt

        plt.close("all")
        for k, (draw, params, kwargs) in enumerate(captured):
            inner = getattr(draw, "func", draw)  # functools.partial(draw, ...) is named after draw
            name = getattr(draw, "__name__", getattr(inner, "__name__", f"figure {k}"))
            found.append((f"{nb.stem[:2]} {name}", draw, params, kwargs))
    return found


def sweep(control, steps: int):
    """The values a reader's drag passes through: one end of the control's range to the other and back."""
    import ipywidgets as widgets

    if isinstance(control, (widgets.ToggleButtons, widgets.SelectionSlider)):
        values = [v for _, v in control.options] if isinstance(control.options[0], tuple) else list(control.options)
        return values + values[-2::-1]
    if isinstance(control, widgets.FloatLogSlider):
        exps = np.linspace(control.min, control.max, steps)
        exps = np.round((exps - control.min) / control.step) * control.step + control.min
        values = [float(control.base ** e) for e in exps]
    elif isinstance(control, widgets.IntSlider):
        values = [int(v) for v in np.round(np.linspace(control.min, control.max, steps))]
    else:
        raw = np.linspace(control.min, control.max, steps)
        values = [float(v) for v in np.round((raw - control.min) / control.step) * control.step + control.min]
    values = list(dict.fromkeys(values))
    return values + values[-2::-1]


def drive(box, steps: int, repeats: int):
    """Set every control through its sweep.

    Returns the seconds of each update (wall clock), whether each was the first update
    at its setting (all controls' values): a figure may keep what it computed
    for a setting it has seen, so the first visits are its slowest updates),
    the two halves of each update and the processor time of each update.
    """
    controls = getattr(box, "controls", None) or dict(enumerate(box.children[:-1]))
    times, cpu, first, seen, halves = [], [], [], set(), []
    for _ in range(repeats):
        for control in controls.values():
            start = control.value
            for value in sweep(control, steps) + [start]:
                if value == control.value:
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                control.value = value  # the widget's observer computes and draws, synchronously
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                halves.append((getattr(box, "draw_seconds", np.nan), getattr(box, "picture_seconds", np.nan)))
                setting = tuple(c.value for c in controls.values())
                first.append(setting not in seen)
                seen.add(setting)
    return np.array(times), np.array(first), np.array(halves), np.array(cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", default="")
    parser.add_argument("--target", type=float, default=50.0)
    args = parser.parse_args()

    figures.book_style()
    found = [f for f in book_figures(sorted((ROOT / "chapters").glob("*.ipynb"))) if args.only in f[0]]
    if not found:
        print("no interactive figure found", file=sys.stderr)
        return 1
    load0 = os.getloadavg()[0]
    rows = []
    for name, draw, params, kwargs in found:
        t0 = time.perf_counter()
        box = figures.interactive_figure(draw, params, mode="live", **kwargs)
        first = time.perf_counter() - t0
        times, new, halves, cpu = drive(box, args.steps, args.repeats)
        times, halves, cpu = times * 1000, halves * 1000, cpu * 1000
        update = getattr(box, "live_update", "grid only")
        rows.append((name, len(times), np.median(times), np.percentile(times, 95), np.percentile(times[new], 95),
                     times.max(), first * 1000, np.percentile(halves[:, 0], 95), np.percentile(halves[:, 1], 95),
                     np.percentile(cpu, 95), update))
        print(f"  {name}: done", file=sys.stderr, flush=True)
    load1 = os.getloadavg()[0]
    print(f"One update of each interactive figure in live mode (ms); load average {load0:.1f} -> {load1:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"{'figure':<24} {'updates':>7} {'median':>7} {'p95':>7} {'p95 new':>7} {'max':>7} {'build':>7}"
          f" {'draw95':>7} {'pict95':>7} {'cpu95':>7}  live sliders")
    for name, n, med, p95, p95_new, worst, first, draw95, pict95, cpu95, update in rows:
        flag = "" if p95 <= args.target else f"  (p95 above {args.target:g} ms)"
        print(f"{name:<24} {n:>7d} {med:>7.1f} {p95:>7.1f} {p95_new:>7.1f} {worst:>7.1f} {first:>7.1f}"
              f" {draw95:>7.1f} {pict95:>7.1f} {cpu95:>7.1f}  {update}{flag}")
    print("median, p95, max: over all updates; p95 new: over the updates at a setting not seen before "
          "(nothing kept from earlier updates can help); build: the first picture, figure built from scratch; "
          "draw95, pict95: 95th percentiles of the update's two halves, draw(...) (the computation and the "
          "changes to the figure) and rendering the picture; cpu95: 95th percentile of the processor time of an "
          "update (this process's, all threads), which waiting for a busy processor does not inflate: near what "
          "an update takes on an idle machine.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
