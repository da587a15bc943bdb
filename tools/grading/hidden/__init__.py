"""The hidden cases: what decides a grade, held by the instructor and never shipped to students.

This folder is outside the package (``code/fixedstate``), so it is not in the
student wheel, and outside ``exercises/`` and ``chapters/``, so it is not in the
student kit (``tests/test_grade_hidden.py`` checks both). For every check call
of the book's exercise notebooks there is a :class:`Hidden`: which argument of
the call is the student's answer, whether it is a function to call or a value,
and a function that draws the cases from a random generator and computes each
expected answer with the package's reference functions, in the grader's own
process.

The generator is seeded per student (:func:`seed`): the student id, the
exercise and the course's salt, so every student gets cases of their own, and
an answer that special-cases the self-check's inputs, or returns the self-check's
stored answers, meets inputs it has not seen.

A numeric answer (``check_answer(label, value)``) is a number the exercise
fixes; its expected value is the package's own (the ``ANSWERS`` of the checks
module, imported here, never in the student's kernel, whose checks are the
grading edition without them).
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..judge import Case

__all__ = ["Hidden", "HIDDEN", "seed", "cases_for", "register", "SENTINEL"]

#: A line that exists only here: tests/test_grade_hidden.py looks for it in the student wheel and kit.
SENTINEL = "fixedstate hidden cases: held by the instructor, never shipped to students"


@dataclass
class Hidden:
    arg: int                                           # which argument of the check call is the answer
    kind: str                                          # "function" (called on the cases) or "value"
    cases: Callable[[np.random.Generator], list[Case]]


#: ``(checks module, check function) -> Hidden``
HIDDEN: dict[tuple[str, str], Hidden] = {}


def register(module: str, function: str, arg: int = 0, kind: str = "function"):
    def wrap(fn):
        HIDDEN[(f"fixedstate.checks.{module}", function)] = Hidden(arg, kind, fn)
        return fn
    return wrap


def seed(salt: str, student: str, label: str, part: int) -> int:
    digest = hashlib.sha256(f"{salt}\0{student}\0{label}\0{part}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _numeric(module: str, label: str) -> list[Case]:
    spec = importlib.import_module(module).ANSWERS[label]
    return [Case(desc="the exercise's number", expected=spec["value"], atol=float(spec["tolerance"]),
                 relative=bool(spec.get("relative", False)), what=spec.get("what", label))]


def cases_for(check, rng_seed: int) -> tuple[Hidden, list[Case]] | None:
    """The hidden cases of one check call of the book (a :class:`grading.book.Check`), or None."""
    if check.function == "check_answer":
        return Hidden(1, "value", lambda rng: []), _numeric(check.module, check.part)
    hidden = HIDDEN.get((check.module, check.function))
    if hidden is None:
        return None
    return hidden, hidden.cases(np.random.default_rng(rng_seed))


from . import chapters  # noqa: E402,F401  (registers the cases)
from . import shipped_layers  # noqa: E402,F401  (chapter 8's newer cases)
