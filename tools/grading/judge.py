"""Judge a student's answers outside the student's code.

The grader, never the student's kernel, decides the points:

1. for each check of an exercise, :mod:`grading.hidden` draws the student's own
   hidden cases (seeded from the student, the exercise and the course's salt)
   and computes the expected answers itself, in the grader's process, with the
   package's reference functions;
2. :func:`driver_code` is the cell sent to the student's sandboxed kernel: it
   calls the student's function on the cases' inputs (or takes the student's
   value), and sends back only plain data: arrays as ``.npy`` bytes (base64), read
   here with ``allow_pickle=False`` after their size is checked, numbers, short
   strings, and the *name* of an exception;
3. :func:`judge` compares what came back with the expected answers, with the
   grader's own numpy. Whatever the student's code patched in its kernel (numpy,
   builtins, the checks, this driver) changes only what comes back, never how
   it is judged.

The messages say which hidden case failed and how (a shape, the largest
difference, an exception's type), never the expected values, and never text the
student's code chose.
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Case", "Verdict", "encode", "structure", "driver_code", "judge", "exception_name", "MAX_BYTES"]

#: The most bytes of answers one check may send back.
MAX_BYTES = 16 * 1024 * 1024
_BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
_BUILTIN_EXCEPTIONS |= {"LinAlgError", "AxisError", "ComplexWarning"}   # numpy's own, by name only


def exception_name(name: object) -> str:
    """The name of a builtin (or numpy) exception as such; anything else as the notebook's own class."""
    if isinstance(name, str) and name in _BUILTIN_EXCEPTIONS:
        return name
    return "an exception of the notebook's own class"


@dataclass
class Case:
    """One hidden case: the call's inputs and the grader's own expected answer."""
    desc: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    expected: Any = None
    rtol: float = 1e-9
    atol: float = 1e-10
    what: str = "the result"
    relative: bool | None = None      # numeric answers: tolerance relative to the value
    normalise: dict = field(default_factory=dict)   # part name -> how a string answer is read (aliases)


@dataclass
class Verdict:
    passed: bool
    message: str                      # written by the grader only
    status: str = "ok"                # ok | undefined | error | bad-data | timeout


# --------------------------------------------------------------------------- plain data, both ways

def encode(x: Any) -> Any:
    """Inputs as JSON: arrays as base64 ``.npy`` (no pickles), tuples and dicts kept, and the package's
    configuration dataclasses as their class's name and fields."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x).__module__.startswith("fixedstate."):
        fields = {f.name: encode(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        return {"__obj__": f"{type(x).__module__}:{type(x).__qualname__}", "fields": fields}
    if isinstance(x, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, x, allow_pickle=False)
        return {"__nd__": base64.b64encode(buf.getvalue()).decode()}
    if isinstance(x, tuple):
        return {"__tuple__": [encode(v) for v in x]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {"__dict__": [[encode(k), encode(v)] for k, v in x.items()]}
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    return x


def structure(x: Any) -> Any:
    """The shape of an expected answer that the driver flattens the student's answer by:
    ``"a"`` an array or number, ``"s"`` a string, ``["t", [...]]`` a tuple, ``["d", {...}]`` a dict."""
    if isinstance(x, str):
        return "s"
    if isinstance(x, (tuple, list)) and not (isinstance(x, list) and all(isinstance(v, (int, float)) for v in x)):
        return ["t", [structure(v) for v in x]]
    if isinstance(x, dict):
        return ["d", {str(k): structure(v) for k, v in x.items()}]
    return "a"


def _flatten_expected(x: Any, st: Any) -> list:
    if st == "a" or st == "s":
        return [x]
    if st[0] == "t":
        return [y for v, s in zip(x, st[1]) for y in _flatten_expected(v, s)]
    return [y for k, s in st[1].items() for y in _flatten_expected(x[k], s)]


def _part_names(st: Any, prefix: str = "") -> list[str]:
    if st == "a" or st == "s":
        return [prefix]
    if st[0] == "t":
        return [n for i, s in enumerate(st[1]) for n in _part_names(s, f"{prefix}[{i}]")]
    return [n for k, s in st[1].items() for n in _part_names(s, f"{prefix}[{k!r}]")]


# The cell that runs in the student's kernel. Nothing in it is trusted: it only moves data.
_DRIVER = r'''
def __fixedstate_hidden(__thunk):
    import base64 as _b64, io as _io, json as _json
    import numpy as _np
    from IPython.display import publish_display_data as _publish
    _spec = _json.loads({spec!r})
    def _dec(x):
        if isinstance(x, dict):
            if "__nd__" in x:
                return _np.load(_io.BytesIO(_b64.b64decode(x["__nd__"])), allow_pickle=False)
            if "__tuple__" in x:
                return tuple(_dec(v) for v in x["__tuple__"])
            if "__dict__" in x:
                return {{_dec(k): _dec(v) for k, v in x["__dict__"]}}
            if "__obj__" in x and x["__obj__"].startswith("fixedstate."):
                import importlib as _il
                _mod, _cls = x["__obj__"].split(":")
                return getattr(_il.import_module(_mod), _cls)(**{{k: _dec(v) for k, v in x["fields"].items()}})
        if isinstance(x, list):
            return [_dec(v) for v in x]
        return x
    def _flat(x, st, out):
        if st == "s":
            out.append({{"s": str(x)[:200]}} if isinstance(x, str) else {{"bad": "not a string: " + type(x).__name__}})
        elif st == "a":
            try:
                a = _np.asarray(x, dtype=_np.float64)
                buf = _io.BytesIO()
                _np.save(buf, a, allow_pickle=False)
                out.append({{"nd": _b64.b64encode(buf.getvalue()).decode()}})
            except Exception:
                out.append({{"bad": "not numbers: " + type(x).__name__}})
        elif st[0] == "t":
            items = list(x) if isinstance(x, (tuple, list)) else None
            if items is None or len(items) != len(st[1]):
                n = len(items) if items is not None else None
                for _ in _names(st):
                    out.append({{"bad": "not a tuple of %d: %s" % (len(st[1]),
                                 type(x).__name__ if n is None else "%d items" % n)}})
            else:
                for v, s in zip(items, st[1]):
                    _flat(v, s, out)
        else:
            for k, s in st[1].items():
                if isinstance(x, dict) and k in x:
                    _flat(x[k], s, out)
                else:
                    for _ in _names(s):
                        out.append({{"bad": "no key %r" % k}})
    def _names(st):
        if st in ("a", "s"):
            return [0]
        return [n for s in (st[1] if st[0] == "t" else list(st[1].values())) for n in _names(s)]
    result = {{"nonce": _spec["nonce"], "cases": []}}
    try:
        __args, __kwargs = __thunk()
        __target = __args[_spec["arg"]]
    except NameError as exc:
        result["undefined"] = str(getattr(exc, "name", "") or "")[:100]
        __target = None
    except BaseException as exc:
        result["error"] = type(exc).__name__
        __target = None
    if "undefined" not in result and "error" not in result:
        for case in _spec["cases"]:
            try:
                if _spec["kind"] == "function":
                    value = __target(*_dec(case["args"]), **_dec(case["kwargs"]))
                else:
                    value = __target
                out = []
                _flat(value, case["structure"], out)
                result["cases"].append({{"parts": out}})
            except KeyboardInterrupt:
                result["cases"].append({{"interrupted": True}})
                break
            except BaseException as exc:
                result["cases"].append({{"raised": type(exc).__name__}})
    _publish({{{mime!r}: result, "text/plain": "graded"}})
__fixedstate_hidden({thunk})
del __fixedstate_hidden
'''


def driver_code(thunk: str, arg: int, kind: str, cases: list[Case], nonce: str, mime: str) -> str:
    """The cell that calls the student's function (``kind="function"``) or takes its value (``"value"``)."""
    spec = {"nonce": nonce, "arg": arg, "kind": kind,
            "cases": [{"args": encode(tuple(c.args)), "kwargs": encode(dict(c.kwargs)),
                       "structure": structure(c.expected)} for c in cases]}
    return _DRIVER.format(spec=json.dumps(spec), mime=mime, thunk=thunk)


# --------------------------------------------------------------------------- judging

def _load_part(part: Any) -> tuple[Any, str]:
    """A part of a student's answer as an array (or a string), or ``(None, why)``."""
    if not isinstance(part, dict):
        return None, "not data"
    if "bad" in part:
        return None, str(part["bad"])[:80] if isinstance(part["bad"], str) else "not data"
    if "s" in part:
        return (part["s"], "") if isinstance(part["s"], str) else (None, "not a string")
    data = part.get("nd")
    if not isinstance(data, str) or len(data) > MAX_BYTES * 4 // 3 + 8:
        return None, "too large"
    try:
        raw = base64.b64decode(data, validate=True)
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception:  # noqa: BLE001 - whatever came back, it is not an answer
        return None, "not an array"
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        return None, "not an array of numbers"
    return arr.astype(np.float64), ""


def _close(got: np.ndarray, exp: np.ndarray, case: Case) -> tuple[bool, float]:
    exp = np.asarray(exp, dtype=np.float64)
    if got.shape != exp.shape:
        return False, math.nan
    if not np.array_equal(np.isfinite(got), np.isfinite(exp)):
        return False, math.inf
    fin = np.isfinite(exp)
    if not np.array_equal(got[~fin], exp[~fin]):
        return False, math.inf
    err = np.abs(got[fin] - exp[fin])
    if case.relative is not None:
        allowed = case.atol * np.abs(exp[fin]) if case.relative else np.full_like(err, case.atol)
    else:
        allowed = case.atol + case.rtol * np.abs(exp[fin])
    worst = float(err.max()) if err.size else 0.0
    return bool(np.all(err <= allowed)), worst


def judge(cases: list[Case], reply: Any) -> Verdict:
    """Compare the student's answers (``reply``, plain data from the kernel) with the cases' expected ones."""
    if not isinstance(reply, dict):
        return Verdict(False, "the notebook's kernel sent no answer back", "error")
    if "undefined" in reply:
        name = reply["undefined"] if isinstance(reply["undefined"], str) else ""
        return Verdict(False, name, "undefined")
    if "error" in reply:
        return Verdict(False, f"evaluating the answer raised {exception_name(reply['error'])}", "error")
    got_cases = reply.get("cases")
    if not isinstance(got_cases, list):
        return Verdict(False, "the notebook's kernel sent no answer back", "error")
    for n, case in enumerate(cases, 1):
        where = f"hidden case {n} of {len(cases)} ({case.desc})" if len(cases) > 1 else case.desc
        if n > len(got_cases) or not isinstance(got_cases[n - 1], dict):
            return Verdict(False, f"on {where}: no answer came back", "error")
        got = got_cases[n - 1]
        if got.get("interrupted"):
            return Verdict(False, f"on {where}: interrupted at the time limit", "timeout")
        if "raised" in got:
            return Verdict(False, f"on {where}: the function raised {exception_name(got['raised'])}", "error")
        st = structure(case.expected)
        expected = _flatten_expected(case.expected, st)
        names = _part_names(st)
        parts = got.get("parts")
        if not isinstance(parts, list) or len(parts) != len(expected):
            return Verdict(False, f"on {where}: the answer does not have the expected parts", "bad-data")
        for exp, name, part in zip(expected, names, parts):
            what = case.what + (f" {name}" if name else "")
            value, why = _load_part(part)
            if value is None:
                return Verdict(False, f"on {where}: {what} is {why}", "bad-data")
            if isinstance(exp, str):
                read = case.normalise.get(name)
                if read is not None and isinstance(value, str):
                    try:
                        value = read(value)
                    except Exception:  # noqa: BLE001 - the grader's own reader; an odd string is just wrong
                        pass
                if value != exp:
                    return Verdict(False, f"on {where}: {what} is not right")
                continue
            if isinstance(value, str):
                return Verdict(False, f"on {where}: {what} is a string, not numbers", "bad-data")
            exp_arr = np.asarray(exp, dtype=np.float64)
            if value.shape != exp_arr.shape:
                return Verdict(False, f"on {where}: {what} has shape {value.shape}, expected {exp_arr.shape}")
            ok, worst = _close(value, exp_arr, case)
            if not ok:
                if case.relative is not None:       # a number the exercise fixes: say no more than "off"
                    return Verdict(False, f"{what} is not right (the tolerance is {case.atol:g}"
                                          f"{' relative' if case.relative else ''})")
                size = "an inf or nan where a finite number belongs, or the reverse" if math.isinf(worst) \
                    else f"largest difference {worst:.3g}"
                return Verdict(False, f"on {where}: {what} is off ({size})")
    n = len(cases)
    return Verdict(True, f"right on {'all ' + str(n) + ' hidden cases' if n > 1 else 'the hidden case'}")
