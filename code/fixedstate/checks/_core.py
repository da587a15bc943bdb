"""The machinery every exercise check shares.

A check runs the student's function on a few cases, compares with the
package's reference implementation and returns a :class:`CheckResult`. The
result prints as a short report that says which property failed, on which case,
and what was expected versus what came back: never only "wrong". A check never
raises for a wrong answer (so an unfinished exercise notebook still runs to the
end); tests read ``result.passed`` and ``result.message``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["CheckResult", "Failure", "call_student", "compare_arrays", "compare_number",
           "passed", "failed"]


class Failure(Exception):
    """Raised inside a check to stop at the first failed property."""


@dataclass
class CheckResult:
    exercise: str
    passed: bool
    message: str
    details: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        head = ("PASSED" if self.passed else "NOT YET") + f" [{self.exercise}] {self.message}"
        return "\n".join([head, *("  " + d for d in self.details)])

    __str__ = __repr__


def passed(exercise: str, message: str, details: list[str] | None = None) -> CheckResult:
    return CheckResult(exercise, True, message, details or [])


def failed(exercise: str, message: str, details: list[str] | None = None) -> CheckResult:
    return CheckResult(exercise, False, message, details or [])


def _fmt(x: Any) -> str:
    arr = np.asarray(x)
    if arr.ndim == 0:
        return f"{float(arr):.6g}" if arr.dtype.kind in "fiu" else repr(x)
    with np.printoptions(precision=4, suppress=True, threshold=12, edgeitems=3):
        return np.array2string(arr, separator=", ")


def call_student(fn: Callable, *args, case: str, **kwargs):
    """Call the student's function; turn its crash or its unfinished body into a Failure."""
    try:
        out = fn(*args, **kwargs)
    except NotImplementedError:
        raise Failure(f"the function is not written yet (it raised NotImplementedError) on {case}")
    except Exception as exc:  # noqa: BLE001 - any crash is feedback for the student
        raise Failure(f"the function raised {type(exc).__name__}: {exc} on {case}") from None
    if out is None or out is Ellipsis:
        raise Failure(f"the function returned {out!r} on {case}: replace the `...` with your code "
                      "and return the result")
    return out


def compare_arrays(got, expected, *, what: str, case: str, rtol: float = 1e-10,
                   atol: float = 1e-12) -> None:
    """Raise Failure unless ``got`` matches ``expected`` in shape and value."""
    try:
        got_arr = np.asarray(got, dtype=float)
    except (TypeError, ValueError):
        raise Failure(f"{what} on {case}: expected an array, got {type(got).__name__}") from None
    expected = np.asarray(expected, dtype=float)
    if got_arr.shape != expected.shape:
        hint = ""
        if got_arr.shape == expected.shape[::-1] and got_arr.ndim == 2:
            hint = " (the transpose: check the orientation, the book stores S as d_k x d_v)"
        raise Failure(f"{what} on {case}: expected shape {expected.shape}, got shape "
                      f"{got_arr.shape}{hint}")
    if not np.allclose(got_arr, expected, rtol=rtol, atol=atol):
        err = np.abs(got_arr - expected)
        idx = np.unravel_index(np.argmax(err), err.shape) if err.ndim else ()
        where = f" at index {tuple(int(i) for i in idx)}" if idx else ""
        raise Failure(f"{what} on {case}: largest difference {float(err.max()):.3g}{where}; "
                      f"expected {_fmt(expected)}, got {_fmt(got_arr)}")


def compare_number(got, expected: float, *, tolerance: float, what: str, relative: bool = False) -> None:
    """Raise Failure unless ``got`` is within ``tolerance`` of ``expected``."""
    try:
        value = float(got)
    except (TypeError, ValueError):
        raise Failure(f"{what}: expected a number, got {got!r}") from None
    allowed = tolerance * abs(expected) if relative else tolerance
    if not abs(value - expected) <= allowed:
        kind = "relative " if relative else ""
        raise Failure(f"{what}: expected {expected:.6g} (within {kind}{tolerance:g}), got {value:.6g}")


def run_check(exercise: str, body: Callable[[], str]) -> CheckResult:
    """Run ``body``; a Failure becomes a failed result, a return value the pass message."""
    try:
        message = body()
    except Failure as f:
        return failed(exercise, str(f))
    return passed(exercise, message)


__all__.append("run_check")


def _shown(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:.6g}"


def check_numeric(label: str, value, answers) -> CheckResult:
    """Check a numeric answer against ``answers[label]``, a dict with the keys

    ``value`` (a number or an array, computed by the package, never typed in),
    ``tolerance``, and optionally ``relative`` (default False), ``what`` (what the
    number is), ``unit`` and ``hints`` (pairs ``(wrong value, hint)`` for the
    common slips, reported when the answer matches one of them).

    A wrong number is reported as too high or too low and by how much, without
    giving the answer away. Labels may name a part of an exercise after a slash
    (``"ex-la-crossover/causal"``); the result is reported under the exercise.
    """
    exercise = label.split("/")[0]
    if label not in answers:
        return failed(exercise, f"no numeric answer is stored under {label!r}; labels are "
                                + ", ".join(sorted(answers)))
    spec = answers[label]
    expected = spec["value"]
    tol = float(spec["tolerance"])
    relative = bool(spec.get("relative", False))
    what = spec.get("what", label)
    unit = f" {spec['unit']}" if spec.get("unit") else ""

    def body() -> str:
        if value is None or value is Ellipsis:
            raise Failure(f"{what}: no answer yet: replace the `...` with your number")
        if np.ndim(expected) > 0:
            got = np.asarray(value, dtype=float) if not isinstance(value, str) else None
            if got is None or got.shape != np.shape(expected):
                raise Failure(f"{what}: expected an array of shape {np.shape(expected)}, got {value!r}")
            err = np.abs(got - np.asarray(expected, dtype=float))
            allowed = tol * np.abs(expected) if relative else tol
            if np.any(err > allowed):
                i = int(np.argmax(err - allowed))
                raise Failure(f"{what}: entry {i} is {got.ravel()[i]:.6g}, off by {err.ravel()[i]:.3g} "
                              f"(tolerance {tol:g}{' relative' if relative else ''})")
            return f"{what}: {np.round(got, 6).tolist()}{unit} is right (within {tol:g})"
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise Failure(f"{what}: expected a number, got {value!r}") from None
        miss = number - float(expected)
        allowed = tol * abs(float(expected)) if relative else tol
        if not abs(miss) <= allowed:
            for wrong, hint in spec.get("hints", ()):
                if not np.isclose(wrong, expected) and np.isclose(number, wrong, rtol=max(tol, 1e-9)):
                    raise Failure(f"{what}: {_shown(number)}{unit} is not right: {hint}")
            size = (f"{abs(miss) / abs(float(expected)):.1%}" if float(expected) != 0
                    else f"{abs(miss):.3g}")
            raise Failure(f"{what}: {_shown(number)}{unit} is too {'high' if miss > 0 else 'low'} by {size} "
                          f"(the tolerance is {tol:g}{' relative' if relative else ''})")
        return (f"{what}: {_shown(number)}{unit} is right "
                f"(within {tol:g}{' relative' if relative else ''})")

    return run_check(exercise, body)


__all__.append("check_numeric")


# --------------------------------------------------------------------------- challenge problems
#
# A challenge problem asks for a real part of a layer that the package already
# computes (the check compares with it). Two helpers keep such a check honest
# without reading the student's source: one refuses an answer that calls the
# package's own implementation, one counts the lines of Python the student's
# code executes (a parallel scan must not loop over the time steps).


def _qualified(fn) -> str:
    return f"{fn.__module__}.{getattr(fn, '__qualname__', fn.__name__)}"


def call_without(fn: Callable, forbidden, *args, case: str, **kwargs):
    """:func:`call_student`, failing if the call reaches one of the package functions ``forbidden``.

    The calls are watched with :func:`sys.setprofile` (by code object, so an alias
    such as ``from fixedstate.delta_rule import gated_delta_rule_chunk as f`` is
    caught too). The profiler in place before the call is restored afterwards.
    """
    codes = {f.__code__: _qualified(f) for f in forbidden}
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and not seen and frame.f_code in codes:
            seen.append(codes[frame.f_code])

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        out = call_student(fn, *args, case=case, **kwargs)
    finally:
        sys.setprofile(previous)
    if seen:
        raise Failure(f"on {case}: your function calls {seen[0]}, the package's own implementation, "
                      "which this check compares with: write the computation yourself (numpy and "
                      "scipy are fine)")
    return out


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))    # fixedstate itself
    return tuple(os.path.realpath(d) for d in dirs)


def count_student_lines(fn: Callable, *args, case: str, **kwargs):
    """Call ``fn`` and count the lines of Python it executes outside numpy, scipy, the
    standard library and this package: ``(result, lines)``.

    A loop over ``T`` time steps executes at least ``T`` lines; a scan that
    combines whole arrays level by level executes a few lines per level.
    """
    libraries = _library_dirs()
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def global_trace(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith("<frozen") or os.path.realpath(name).startswith(libraries):
            return None
        return local

    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        out = call_student(fn, *args, case=case, **kwargs)
    finally:
        sys.settrace(previous)
    return out, count


def has_nonfinite(x) -> bool:
    """True when ``x`` is an array of numbers with an inf or a nan in it."""
    try:
        arr = np.asarray(x, dtype=float)
    except (TypeError, ValueError):
        return False
    return not bool(np.all(np.isfinite(arr)))


__all__ += ["call_without", "count_student_lines", "has_nonfinite"]
