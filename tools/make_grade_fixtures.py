"""Write a folder of fake submissions for the grader, from the book's current exercises and solutions.

Usage: python tools/make_grade_fixtures.py OUT [--chapters 03 06]

For every chapter asked for (default: all), one notebook per fake student,
``OUT/<student>/<chapter>.ipynb``, built from ``exercises/<chapter>.ipynb`` (the
starter cells) and ``solutions/<chapter>.ipynb`` (the worked code), so the
fixtures follow the exercises when they change:

``correct``       every starter cell replaced by the worked solution's code;
``wrong``         the same, then a plausible wrong answer for every checked name
                  (the slips the checks know: an additive write, a missing factor
                  2, a hint's wrong number; else the right result off by 10%);
``crash``         one exercise's cell raises before its function is defined, and a
                  later exercise has an extra cell that kills the kernel (a
                  segmentation fault);
``loop``          one function loops forever when called, and an extra cell loops
                  at top level and swallows the interrupt (``except:``);
``edited_check``  only the first checked exercise done; every check cell replaced by
                  ``print("PASSED")`` with a stored output ``PASSED``, and the check
                  functions redefined to say ``PASSED``;
``empty``         the exercise notebook handed in untouched;
``renamed``       correct, but one function renamed (and its check cell edited to
                  call the new name);
``other_chapter`` the next chapter's notebook, done correctly, saved under this
                  chapter's file name;
``corrupt``       a file of 0 bytes under this chapter's name;
``tamper``        the wrong answers, plus a cell that patches the package so that any
                  answer would pass (the checks replaced, the tolerances widened, the
                  comparisons switched off) and a cell that reaches for the network.

Alongside, ``OUT/manifest.json`` says what each fixture deserves: for every
student and chapter, the fraction of each checked exercise's checks that must
pass (1: full points, 0: none), and a phrase the grader's message must contain. The fixtures
are small (outputs stripped, except the fake ``PASSED`` outputs of
``edited_check``) and are generated, not stored: the tests write them to a
temporary folder, ``make grade`` without ``SUBMISSIONS`` to ``_build/grade/fixtures``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
import sys
from pathlib import Path

import nbformat
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grading.book import (Chapter, cell_source, check_calls, exercise_spans,  # noqa: E402
                          parse_code, read_book, solution_code)

ROOT = Path(__file__).resolve().parents[1]
STUDENTS = ["correct", "wrong", "crash", "loop", "edited_check", "empty", "renamed", "other_chapter", "corrupt",
            "tamper"]

#: ``tamper``: patches the package so that any answer would pass, and tries the network.
TAMPER = """
# make every check pass: replace the checks, widen every tolerance, switch the comparisons off
import importlib, pkgutil
import fixedstate.checks as _checks
from fixedstate.checks import _core


def _always(*args, **kwargs):
    return _core.CheckResult("any", True, "PASSED")


for _info in pkgutil.iter_modules(_checks.__path__):
    _module = importlib.import_module(f"fixedstate.checks.{_info.name}")
    for _name in dir(_module):
        if _name.startswith("check_"):
            setattr(_module, _name, _always)
        elif _name.startswith("compare_") or _name == "_diagnose":
            setattr(_module, _name, lambda *args, **kwargs: None)
    for _spec in getattr(_module, "ANSWERS", {}).values():
        _spec["tolerance"], _spec["relative"] = 1e300, False
"""

NETWORK = """
import urllib.request
print(urllib.request.urlopen("http://example.com", timeout=5).status)
"""

#: Plausible wrong versions of the book's functions, keyed by the check that grades them:
#: each is a slip the check knows and names.
WRONG = {
    "check_kv_cache_size": '''
def kv_cache_size(context_len, n_layers, n_kv_heads, head_dim, bytes_per_element):
    return context_len * n_layers * n_kv_heads * head_dim * bytes_per_element   # keys only: no factor 2
''',
    "check_softmax_decode_step": '''
def decode_step(query, key, value, cache):
    keys = key[None, :] if cache is None else np.vstack([cache[0], key])
    values = value[None, :] if cache is None else np.vstack([cache[1], value])
    scores = keys @ query                      # not divided by sqrt(d_k)
    weights = np.exp(scores - scores.max())
    return weights / weights.sum() @ values, (keys, values)
''',
    "check_linear_decode_step": '''
def decode_step(state, normalizer, query, key, value):
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    new_state = state + np.outer(phi(key), value)
    return new_state.T @ phi(query), new_state, normalizer + phi(key)   # forgot to divide by phi(q) . z
''',
    "check_causal_linear_attention": '''
def causal_linear_attention(queries, keys, values):
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    weights = phi(queries) @ phi(keys).T       # no causal mask
    return (weights @ values) / weights.sum(axis=1, keepdims=True)
''',
    "check_delta_step": '''
def delta_step(state, key, value, beta):
    return state + beta * np.outer(key, value)     # linear attention's write: no correction
''',
    "check_gated_delta_step": '''
def gated_delta_step(state, key, value, beta, gate):
    return gate * (state + beta * np.outer(key, value - state.T @ key))   # corrects, then decays
''',
    "check_exact_beta": '''
def exact_beta(key):
    return 1.0 / np.linalg.norm(key)               # the norm, not its square
''',
    "check_discretize_zoh": '''
def discretize_zoh(A, B, delta):
    import scipy.linalg
    return scipy.linalg.expm(delta * A), delta * B     # Euler's B_bar, not the zero-order hold
''',
    "check_ssm_kernel": '''
def ssm_kernel(A_bar, B_bar, C, length):
    K, v = [], np.asarray(B_bar, dtype=float)
    for _ in range(length):
        v = A_bar @ v                              # one power too many: starts at C A_bar B_bar
        K.append(C @ v)
    return np.array(K)
''',
    "check_selective_step": '''
def selective_step(state, x_t, delta_t, A, B_t, C_t, D):
    y_t = state @ C_t + D * x_t                    # reads the state before the update
    new_state = np.exp(delta_t[:, None] * A) * state + np.outer(delta_t * x_t, B_t)
    return y_t, new_state
''',
    "check_recall_accuracy": '''
def recall_accuracy(state, keys, values):
    recalled = keys @ state
    picked = np.argmax(recalled @ values.T, axis=1)    # the largest dot product, not the nearest value
    return float(np.mean(picked == np.arange(len(keys))))
''',
    "check_predicted_crosstalk": '''
def predicted_crosstalk(keys, values):
    return keys @ keys.T @ values                  # the whole recall, with the pair's own term
''',
    "check_kv_cache_at": '''
def kv_cache_at(config, context_len):
    return (2 * context_len * config.n_layers * config.n_kv_heads * config.head_dim
            * config.bytes_per_element)            # a KV cache in every layer, linear ones too
''',
    "check_fit_time_model": '''
def fit_time_model(context_lengths, tokens_per_second):
    (l1, l2), (r1, r2) = context_lengths, tokens_per_second
    b = (r2 - r1) / (l2 - l1)                      # a line through the throughputs, not the times
    return r1 - b * l1, b
''',
}

GENERIC_WRONG = '''
def _off_by_ten_percent(x):
    if isinstance(x, (tuple, list)):
        return type(x)(_off_by_ten_percent(v) for v in x)
    try:
        return np.asarray(x, dtype=float) * 1.1 + 0.1
    except (TypeError, ValueError):
        return x
'''


def _code(src: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(src.strip("\n"))


def _md(src: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(src)


def _strip_checks(src: str) -> str:
    """A solution cell without its check calls (the student's check cells follow)."""
    tree = parse_code(src)
    if tree is None:
        return src
    calls, _ = check_calls(tree)
    if not calls:
        return src
    lines = src.splitlines()
    drop = set()
    for stmt in tree.body:
        if _is_check_stmt(stmt):
            drop.update(range(stmt.lineno - 1, stmt.end_lineno))
    return "\n".join(line for i, line in enumerate(lines) if i not in drop).strip("\n")


def _is_check_stmt(stmt) -> bool:
    return check_calls(ast.Module(body=[stmt], type_ignores=[]))[0] != []


def _only_checks(src: str) -> str:
    tree = parse_code(src)
    if tree is None:
        return src
    lines = src.splitlines()
    keep = []
    for stmt in tree.body:
        if _is_check_stmt(stmt):
            keep.extend(lines[stmt.lineno - 1:stmt.end_lineno])
    return "\n".join(keep)


def _starter_def(chapter_nb, first, last, name) -> str:
    """The ``def name(...):`` line of the exercise's starter cell."""
    for cell in chapter_nb.cells[first:last + 1]:
        if cell.cell_type == "code":
            m = re.search(rf"^def {re.escape(name)}\(.*?\):", cell_source(cell), re.MULTILINE | re.DOTALL)
            if m:
                return m.group(0)
    return f"def {name}(*args, **kwargs):"


class Builder:
    """Builds the fixtures of one chapter."""

    def __init__(self, chapter: Chapter, root: Path):
        self.ch = chapter
        self.nb = nbformat.read(chapter.path, as_version=4)
        self.setup, self.solutions = solution_code(root, chapter.stem)
        self.spans = {label: (first, last) for label, _, first, last in exercise_spans(self.nb.cells)}
        self.auto = [ex for ex in chapter.exercises if ex.checks]

    # -- the notebook with the worked solutions in place of the starter cells
    def filled(self, upto: str | None = None, extra: dict[str, list[str]] | None = None,
               solved: set[str] | None = None) -> nbformat.NotebookNode:
        """The exercise notebook with solutions; ``extra[label]``: code cells added after an exercise's code.

        ``solved``: the exercises that get their solution (default all); the others keep their starter cells.
        """
        extra = extra or {}
        nb = nbformat.v4.new_notebook(metadata=self.nb.metadata)
        cells = self.nb.cells
        starts = {first: label for label, (first, _) in self.spans.items()}
        first_ex = min((f for f, _ in self.spans.values()), default=len(cells))
        for cell in cells[:first_ex]:
            nb.cells.append(nbformat.from_dict(cell))
        nb.cells.append(_code("\n".join(s for s in self.setup if s.strip())))
        i = first_ex
        while i < len(cells):
            label = starts.get(i)
            if label is None:
                nb.cells.append(nbformat.from_dict(cells[i]))
                i += 1
                continue
            first, last = self.spans[label]
            solve = solved is None or label in solved
            inserted = False
            for k in range(first, last + 1):
                cell = cells[k]
                src = cell_source(cell)
                if cell.cell_type != "code" or not solve:
                    if solve and not inserted and k == last and cell.cell_type == "markdown" and k != first:
                        nb.cells.extend(self._solution_cells(label, extra))
                        inserted = True
                    nb.cells.append(nbformat.from_dict(cell))
                    continue
                tree = parse_code(src)
                calls, rest = check_calls(tree) if tree is not None else ([], [tree])
                if not inserted:
                    nb.cells.extend(self._solution_cells(label, extra))
                    inserted = True
                if calls:
                    nb.cells.append(_code(src if not rest else _only_checks(src)))
            if solve and not inserted:
                nb.cells.extend(self._solution_cells(label, extra))
            i = last + 1
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"cell-{i}"
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        return nb

    def _solution_cells(self, label, extra):
        out = []
        for src in self.solutions.get(label, []):
            code = _strip_checks(src)
            if code.strip():
                out.append(_code(code))
        for src in extra.get(label, []):
            out.append(_code(src))
        ex = self.ch.exercise(label)
        if ex is not None and ex.conceptual and self.solutions.get(label) is not None:
            out.append(_md(f"**My answer.** (the conceptual part of {label}, written by the student)"))
        return out

    # -- which names an exercise's checks grade, and who else uses them
    def _used_elsewhere(self, name: str, label: str) -> bool:
        for other, srcs in self.solutions.items():
            if other != label and any(re.search(rf"\b{re.escape(name)}\b", s) for s in srcs):
                return True
        return any(name in c.names for ex in self.ch.exercises if ex.label != label for c in ex.checks)

    def function_exercises(self):
        """Checked exercises whose checks take one function that no other exercise uses."""
        out = []
        for ex in self.auto:
            fns = [n for c in ex.checks for n in c.names if ex.names.get(n) == "function"]
            if fns and not self._used_elsewhere(fns[0], ex.label):
                out.append((ex, fns[0]))
        return out

    @staticmethod
    def passing(ex, failing: set[str]) -> float:
        """The fraction of the exercise's checks that pass when the names ``failing`` are wrong."""
        ok = [not (set(c.names) & failing) for c in ex.checks]
        return sum(ok) / len(ok)

    def starter_names(self, ex) -> set[str]:
        return {n for c in ex.checks for n in c.names if n in ex.names}

    def wrong_cells(self, ex) -> list[str]:
        cells = []
        for check in ex.checks:
            for name in check.names:
                if name not in ex.names:
                    continue                        # a name from the setup cell
                if ex.names[name] == "function":
                    if check.function in WRONG and f"def {name}(" in WRONG[check.function]:
                        cells.append(WRONG[check.function])
                    else:
                        header = _starter_def(self.nb, *self.spans[ex.label], name)
                        cells.append(GENERIC_WRONG + f"\n_right_{name} = {name}\n\n\n{header}\n"
                                     f"    return _off_by_ten_percent(_right_{name}(*args, **kwargs))\n"
                                     if header.endswith("(*args, **kwargs):") else
                                     GENERIC_WRONG + f"\n_right_{name} = {name}\n\n\n"
                                     f"def {name}(*args, **kwargs):\n"
                                     f"    return _off_by_ten_percent(_right_{name}(*args, **kwargs))\n")
                else:
                    cells.append(self._wrong_value(check, name))
        return cells

    def _wrong_value(self, check, name) -> str:
        spec = None
        if check.function == "check_answer" and check.part != check.function:
            answers = getattr(importlib.import_module(check.module), "ANSWERS", {})
            spec = answers.get(check.part)
        if spec is None:
            return GENERIC_WRONG + f"\n{name} = _off_by_ten_percent({name})\n"
        hints = spec.get("hints") or []
        value = spec["value"]
        if hints:
            wrong, why = hints[0]
        elif np.ndim(value) > 0:
            wrong, why = (np.asarray(value, dtype=float) * 2).tolist(), "twice the right numbers"
        else:
            wrong, why = value * 2, "a factor of two off"
            allowed = float(spec["tolerance"]) * (abs(value) if spec.get("relative") else 1.0)
            if abs(wrong - value) <= allowed:
                wrong, why = value + 0.5, "an error that should vanish"
        if isinstance(wrong, (int, np.integer)) or (isinstance(value, (int, np.integer))
                                                     and float(wrong).is_integer()):
            literal = repr(int(wrong))
        elif np.ndim(wrong) > 0:
            literal = repr([float(v) for v in np.ravel(wrong)])
        else:
            literal = repr(float(wrong))
        return f"{name} = {literal}   # a plausible slip: {why.split(':')[0][:60]}"

    # -- the fixtures
    def all(self, next_chapter: "Builder | None"):
        """``{student: (notebook or None for an empty file, {label: (fraction of checks passing, phrase)})}``."""
        full = {ex.label: (1.0, "PASSED") for ex in self.auto}
        out = {"correct": (self.filled(), dict(full))}

        extra = {ex.label: self.wrong_cells(ex) for ex in self.auto}
        out["wrong"] = (self.filled(extra=extra),
                        {ex.label: (self.passing(ex, self.starter_names(ex)), "NOT YET") for ex in self.auto})

        fx = self.function_exercises()
        expect = dict(full)
        if fx:
            ex_a, fn = fx[0]
            expect[ex_a.label] = (self.passing(ex_a, {fn}), f"does not define `{fn}`")
        nb = self.filled()
        if fx:
            # the cell that defines the function raises first
            for cell in nb.cells:
                if cell.cell_type == "code" and re.search(rf"^def {re.escape(fn)}\(", cell.source, re.MULTILINE):
                    cell.source = ("# trying the shapes out first\nnp.ones((3, 2)) @ np.ones(3)\n\n" + cell.source)
                    break
        others = [ex for ex in self.auto if not fx or ex.label != fx[0][0].label]
        if others:
            victim = others[-1]
            self._append_after(nb, victim.label, "import ctypes\nctypes.string_at(0)   # reads address 0: "
                                                 "the kernel dies (a segmentation fault)")
        out["crash"] = (nb, expect)

        expect = dict(full)
        loop_extra: dict[str, list[str]] = {}
        if fx:
            ex_c, fn = fx[-1]
            header = _starter_def(self.nb, *self.spans[ex_c.label], fn)
            loop_extra[ex_c.label] = [f"{header}\n    n = 0\n    while n >= 0:      # meant to stop once it "
                                      f"converges; n only grows\n        n += 1\n"]
            expect[ex_c.label] = (self.passing(ex_c, {fn}), "did not return")
        spinner = [ex for ex in self.auto if not fx or ex.label != fx[-1][0].label]
        if spinner:
            loop_extra.setdefault(spinner[0].label, []).append(
                "# try again until it works\nattempts = 0\nwhile True:\n    try:\n        attempts += 1\n"
                "    except:\n        continue")
        out["loop"] = (self.filled(extra=loop_extra), expect)

        first = self.auto[0].label if self.auto else None
        solved = set()
        for ex in self.ch.exercises:
            solved.add(ex.label)
            if ex.label == first:
                break
        nb = self.filled(solved=solved)
        fakes = sorted({c.function for ex in self.ch.exercises for c in ex.checks})
        nb.cells.insert(self._first_exercise(nb), _code(
            "\n".join(f"def {f}(*args, **kwargs):\n    print('PASSED')\n    return True\n" for f in fakes)))
        for cell in nb.cells:
            if cell.cell_type == "code":
                tree = parse_code(cell.source)
                if tree is not None and check_calls(tree)[0]:
                    cell.source = "\n".join('print("PASSED")' for _ in check_calls(tree)[0]) \
                        if not check_calls(tree)[1] else _strip_checks(cell.source) + '\nprint("PASSED")'
                    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASSED\n")]
                    cell.execution_count = 1
        out["edited_check"] = (nb, {ex.label: (1.0 if ex.label == first else self.passing(ex, self.starter_names(ex)),
                                               "PASSED" if ex.label == first else "NOT YET") for ex in self.auto})

        nb = nbformat.read(self.ch.path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        out["empty"] = (nb, {ex.label: (self.passing(ex, self.starter_names(ex)), "NOT YET") for ex in self.auto})

        expect = dict(full)
        nb = self.filled()
        if fx:
            ex_r, fn = fx[0]
            new = f"my_{fn}"
            first_i, last_i = self._span_in(nb, ex_r.label)
            for cell in nb.cells[first_i:last_i + 1]:
                if cell.cell_type == "code":
                    cell.source = re.sub(rf"\b{re.escape(fn)}\b", new, cell.source)
            expect[ex_r.label] = (self.passing(ex_r, {fn}), f"define `{new}` instead")
        out["renamed"] = (nb, expect)

        if next_chapter is not None:
            out["other_chapter"] = (next_chapter.filled(), {})
        out["corrupt"] = (None, {ex.label: (0.0, "not a readable notebook") for ex in self.auto})

        nb = self.filled(extra=extra)
        at = self._first_exercise(nb)
        nb.cells[at:at] = [_code(TAMPER), _code(NETWORK)]
        out["tamper"] = (nb, {ex.label: (self.passing(ex, self.starter_names(ex)), "NOT YET") for ex in self.auto})
        return out

    @staticmethod
    def _first_exercise(nb) -> int:
        return min((first for _, _, first, _ in exercise_spans(nb.cells)), default=len(nb.cells))

    @staticmethod
    def _span_in(nb, label):
        for lab, _, first, last in exercise_spans(nb.cells):
            if lab == label:
                return first, last
        raise KeyError(label)

    def _append_after(self, nb, label, src):
        """Add a code cell after the last code cell of an exercise."""
        first, last = self._span_in(nb, label)
        idx = max((i for i in range(first, last + 1) if nb.cells[i].cell_type == "code"), default=last - 1)
        nb.cells.insert(idx + 1, _code(src))


def make_fixtures(out: Path, chapters: list[str] | None = None, root: Path = ROOT) -> dict:
    book = read_book(root)
    stems = list(book)
    chosen = chapters or stems
    manifest: dict = {"chapters": chosen, "students": {}}
    for stem in chosen:
        nxt = stems[(stems.index(stem) + 1) % len(stems)]
        builder = Builder(book[stem], root)
        fixtures = builder.all(Builder(book[nxt], root) if nxt != stem else None)
        for student, (nb, expect) in fixtures.items():
            if student == "other_chapter" and stem != chosen[0]:
                continue                       # one misplaced notebook is enough
            folder = out / student
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{stem}.ipynb"
            if nb is None:
                path.write_bytes(b"")
            else:
                for i, cell in enumerate(nb.cells):
                    cell["id"] = f"cell-{i}"
                nbformat.write(nb, path)
            entry = manifest["students"].setdefault(student, {})
            entry[stem] = {"expect": {k: v[0] for k, v in expect.items()},
                           "phrase": {k: v[1] for k, v in expect.items()}}
            if student == "other_chapter":
                entry[stem]["holds"] = nxt
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--chapters", nargs="*", default=None, help="chapter numbers or stems (default: all)")
    args = p.parse_args(argv)
    book = read_book(ROOT)
    chosen = None
    if args.chapters:
        chosen = [next(s for s, c in book.items() if part in (s, c.number)) for part in args.chapters]
    manifest = make_fixtures(args.out, chosen)
    n = sum(len(v) for v in manifest["students"].values())
    print(f"wrote {n} fixture notebooks for {len(manifest['students'])} students to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
