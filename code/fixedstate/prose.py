"""Numbers for the prose: glue a computed value at the precision the text shows.

The chapters never type a computed number into their prose. A cell computes it
and hands it to the text with myst-nb's ``glue``; the markdown then shows it
with a format, ``{glue:text}`name:.3f```. The stored notebook keeps the glued
value, and the test suite re-executes every notebook and compares. A value
glued with all 17 of its digits makes that comparison depend on the last bits
of whichever BLAS kernel ran, so the two functions here glue only what the
text can show:

- :func:`glue_number` rounds the value to exactly what its format displays;
- :func:`glue_bound` glues a bound for an error at rounding level (``1e-12``),
  after checking that the error is below it, because the digits of such an
  error differ from one processor to the next.

``tests/test_notebook_portability.py`` scans every stored notebook for glued
or printed numbers that break either rule.
"""

from __future__ import annotations

import math
import numbers
import re

import numpy as np

__all__ = ["round_to_format", "glue", "glued", "format_as_glued", "glue_number", "glue_bound", "below", "max_relative_error", "ROUNDING_LEVEL"]

#: Errors below this size are rounding-level: state them as bounds, never as digits.
ROUNDING_LEVEL = 1e-12

_FORMAT = re.compile(r"^(?P<comma>,)?(?:\.(?P<precision>\d+))?(?P<kind>[efg%])$")


def round_to_format(value, fmt: str):
    """The number that ``format(value, fmt)`` displays, as a float (an ``int`` stays an ``int``).

    ``fmt`` is a format specification as the prose uses it after the glued
    name: ``".3f"``, ``",.0f"``, ``",", ``".1e"``, ``".2g"``, ``".1%"``. Formatting the
    result with ``fmt`` gives the same text as formatting ``value``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"value: expected a real number, got {type(value).__name__} {value!r}")
    if not isinstance(fmt, str):
        raise ValueError(f"fmt: expected a format specification such as '.3f', got {fmt!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"value: expected a finite number, got {x!r}")
    if fmt == ",":
        fmt = ",g"
    m = _FORMAT.match(fmt)
    if m is None:
        raise ValueError(f"fmt: expected a format such as '.3f', ',.0f', '.1e', '.2g' or '.1%', got {fmt!r}")
    kind = m["kind"]
    precision = 6 if m["precision"] is None else int(m["precision"])
    if kind == "f":
        return round(x, precision)
    if kind == "%":
        # format() multiplies by 100 in floating point before rounding, so round the same way
        shown = format(x, f".{precision}%")
        return float(shown[:-1]) / 100
    shown = format(x, f".{precision}{kind}")        # 'e' and 'g': significant digits
    return float(shown)


#: Every value glued in this kernel, by name: what :func:`glued` shows.
_GLUED: dict = {}


def glue(name: str, value, display: bool = True) -> None:
    """myst-nb's ``glue`` while the book is built; without myst-nb, only the display.

    The value is also kept in this kernel for :func:`glued`, the inline expression
    with which the markdown shows it in JupyterLab.

    A reader who runs a chapter in a plain Jupyter (the package and its
    dependencies, not the book's build tools) has nothing to paste glued values
    into, so the value is shown if ``display`` asks for it and otherwise dropped.
    """
    _GLUED[name] = value
    try:
        from myst_nb import glue as myst_glue
    except ModuleNotFoundError:
        if display:
            from IPython.display import display as show

            show(value)
        return
    myst_glue(name, value, display=display)


def glued(spec: str) -> str:
    """The text of a glued value, as the book's pages show it: ``spec`` is ``"name"`` or ``"name:fmt"``.

    The notebooks' markdown shows glued values with inline expressions,
    ``{eval}`glued("loop_err:.0e")```, which JupyterLab with jupyterlab-myst
    evaluates in the kernel; the site shows the same value with myst-nb's
    ``{glue:text}`loop_err:.0e``` (tools/sphinx_ext/portable_myst.py). Both apply
    the format as myst-nb does: a type letter for floats (``e f g %``) converts to
    float, one for integers (``d`` ...) to int, no format is ``str``.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"spec: expected 'name' or 'name:format', got {spec!r}")
    name, fmt = (spec.rsplit(":", 1) if ":" in spec else (spec, ""))
    if name not in _GLUED:
        raise ValueError(f"spec: nothing is glued under {name!r} in this kernel yet "
                         f"(run the cells above first); glued: {sorted(_GLUED)}")
    return format_as_glued(_GLUED[name], fmt)


def format_as_glued(value, fmt: str) -> str:
    """``value`` as myst-nb's ``{glue:text}`name:fmt``` shows it.

    A type letter for floats (``e f g %``) converts to float first, one for integers
    (``d`` ...) to int, ``s`` to str; no format is ``str``. :func:`glued` and the
    site's reading of the notebooks (tools/sphinx_ext/portable_myst.py) both use it,
    so JupyterLab and the site show the same text.
    """
    if fmt == "":
        return str(value)
    kind = fmt[-1]
    if kind == "s":
        value = str(value)
    elif kind in "bcdoxX":
        value = int(value)
    elif kind in "eEfFgGn%":
        value = float(value)
    return format(value, fmt)


def glue_number(name: str, value, fmt: str | None) -> None:
    """Glue ``value`` under ``name`` for the prose, rounded to what ``fmt`` shows.

    Use the finest format with which the text shows ``name``. With ``fmt=None``
    (the text shows the value as it is) a float is kept to 6 significant digits.
    Integers, strings and other non-float values are glued unchanged. Returns
    None, like myst-nb's ``glue``, so a cell that ends with it shows nothing.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        value = round_to_format(value, ".6g" if fmt is None else fmt)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    glue(name, value, display=False)


def glue_bound(name: str, error, bound: float = ROUNDING_LEVEL) -> None:
    """Check ``error < bound`` and glue ``bound`` under ``name``, for the text's "below ..." claims.

    An error at rounding level has digits that depend on the processor and the
    BLAS kernel; the bound does not. Raises ``AssertionError`` (showing the
    error) if the error is not below the bound, so the claim in the text fails
    loudly instead of silently becoming false. Returns None, like
    :func:`glue_number`.
    """
    err = float(error)
    b = float(bound)
    if not (b > 0 and math.isfinite(b)):
        raise ValueError(f"bound: expected a positive finite number, got {bound!r}")
    if not err < b:
        raise AssertionError(f"{name}: the error {err:.3e} is not below the stated bound {b:.0e}")
    glue(name, b, display=False)


def below(error, bound: float = ROUNDING_LEVEL) -> str:
    """``"below 1e-12"``: the text of a rounding-level claim, after checking that it holds.

    For printing an agreement between two forms without printing the
    processor-dependent digits of the difference. Raises ``AssertionError``
    (showing the error) if ``error`` is not below ``bound``.
    """
    err = float(error)
    b = float(bound)
    if not (b > 0 and math.isfinite(b)):
        raise ValueError(f"bound: expected a positive finite number, got {bound!r}")
    if not err < b:
        raise AssertionError(f"the error {err:.3e} is not below the stated bound {b:.0e}")
    return f"below {b:.0e}"


def max_relative_error(a, b) -> float:
    """The largest entry of ``|a - b|``, relative to the largest entry of ``|b|``.

    This is how the chapters report that two forms of a layer agree: one number for a
    whole output, unaffected by entries of ``b`` that happen to be near zero. ``a`` and
    ``b`` must have the same shape and ``b`` must not be all zeros.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {a.shape} and {b.shape}")
    if b.size == 0:
        raise ValueError("b must have at least one entry, got an empty array")
    scale = float(np.max(np.abs(b)))
    if not scale > 0:
        raise ValueError(f"b must have a nonzero entry, got largest |b| = {scale}")
    return float(np.max(np.abs(a - b))) / scale
