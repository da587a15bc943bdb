"""Checks at the public boundary of the package.

Every public function in :mod:`fixedstate` validates its arguments with these
helpers, so that bad input fails loudly with a :class:`ValueError` that names
the argument, says what it got and what was expected.
"""

from __future__ import annotations

import numbers
from typing import Callable, NamedTuple

import numpy as np

__all__ = [
    "as_float_array",
    "check_positive_int",
    "check_interval",
    "check_same_length",
    "check_dim",
    "as_token_sequences",
    "as_float_batch",
    "broadcast_leading",
    "float_dtype",
    "check_log_gate",
    "check_real_number",
    "as_generator",
    "Arg",
    "prepare_layer_args",
]


def _describe(x) -> str:
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"


def as_float_array(x, name: str, *, ndim: int | tuple[int, ...] | None = None,
                   shape: tuple | None = None, allow_nonfinite: bool = False) -> np.ndarray:
    """Return ``x`` as a floating-point numpy array, or raise ``ValueError``.

    Integer input is converted to float64, float16 to float32 (the package's
    precision rule, as in :func:`float_dtype`); float32 and float64 arrays keep
    their dtype. Complex, boolean, object and string input
    is refused, as are NaN and infinity unless ``allow_nonfinite``.

    ``ndim`` is the required number of axes (an int or a tuple of allowed
    ints); ``shape`` is a tuple whose entries are ints (required sizes) or
    ``None`` (any size), checked after ``ndim``.
    """
    if isinstance(x, (str, bytes)):
        raise ValueError(f"{name}: expected a real numeric array, got {_describe(x)}")
    try:
        arr = np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise ValueError(f"{name}: expected a real numeric array, got {type(x).__name__} "
                         f"that numpy cannot convert ({exc})") from None
    if arr.dtype == bool or arr.dtype.kind not in "iuf":
        raise ValueError(f"{name}: expected a real numeric array (integer or float dtype), "
                         f"got dtype {arr.dtype}")
    if arr.dtype.kind in "iu":
        arr = arr.astype(np.float64)
    elif arr.dtype == np.float16:                     # the package's precision rule: float16 computes in float32
        arr = arr.astype(np.float32)
    elif arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float64)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if arr.ndim not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name}: expected an array with {want} axes, "
                             f"got {arr.ndim} axes (shape {arr.shape})")
    if shape is not None:
        if arr.ndim != len(shape) or any(s is not None and s != a for s, a in zip(shape, arr.shape)):
            want = "(" + ", ".join("any" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got shape {arr.shape}")
    if not allow_nonfinite and arr.size and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite values, got an array containing NaN or infinity")
    return arr


def check_positive_int(value, name: str, *, minimum: int = 1) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``, else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {_describe(value)}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return int(value)


def check_interval(x, name: str, low: float, high: float, *, low_closed: bool = True,
                   high_closed: bool = True) -> np.ndarray:
    """Check that every entry of ``x`` lies in the interval; return it as an array."""
    arr = as_float_array(x, name)
    lo_ok = arr >= low if low_closed else arr > low
    hi_ok = arr <= high if high_closed else arr < high
    if not np.all(lo_ok & hi_ok):
        bad = arr[~(lo_ok & hi_ok)].ravel()[0]
        interval = ("[" if low_closed else "(") + f"{low}, {high}" + ("]" if high_closed else ")")
        raise ValueError(f"{name}: expected values in {interval}, got {float(bad)!r}")
    return arr


def check_same_length(name_a: str, a: np.ndarray, name_b: str, b: np.ndarray, axis: int = 0) -> None:
    """Raise unless ``a`` and ``b`` have the same size along ``axis``."""
    if a.shape[axis] != b.shape[axis]:
        raise ValueError(f"{name_b}: expected {a.shape[axis]} entries along axis {axis} to match "
                         f"{name_a} (shape {a.shape}), got shape {b.shape}")


def check_dim(arr: np.ndarray, name: str, axis: int, expected: int, what: str) -> None:
    """Raise unless ``arr.shape[axis] == expected``; ``what`` says where it comes from."""
    if arr.shape[axis] != expected:
        raise ValueError(f"{name}: expected size {expected} along axis {axis} ({what}), "
                         f"got shape {arr.shape}")


def as_token_sequences(queries, keys, values, *, min_length: int = 1):
    """Validate the three sequences of an attention-like layer; return them as float arrays.

    ``queries`` and ``keys`` are ``(T, d_k)``, ``values`` is ``(T, d_v)``, one token
    per row, with at least ``min_length`` tokens.
    """
    q = as_float_array(queries, "queries", ndim=2)
    k = as_float_array(keys, "keys", ndim=2)
    v = as_float_array(values, "values", ndim=2)
    if q.shape[0] < min_length:
        raise ValueError(f"queries: expected at least {min_length} token(s), got shape {q.shape}")
    check_same_length("queries", q, "keys", k)
    check_same_length("queries", q, "values", v)
    check_dim(k, "keys", 1, q.shape[1], "d_k, the width of queries")
    return q, k, v


def as_float_batch(x, name: str, core: tuple, core_names: tuple | None = None, *,
                   allow_nonfinite: bool = False) -> np.ndarray:
    """``x`` as a float array of shape ``(..., *core)``: any leading axes, then the core axes.

    ``core`` holds the required sizes of the last axes (an int, or ``None`` for any
    size); ``core_names`` names them in the error message, e.g. ``("T", "d")``.
    ``allow_nonfinite`` as in :func:`as_float_array`.
    """
    arr = as_float_array(x, name, allow_nonfinite=allow_nonfinite)
    names = core_names or tuple("any" if s is None else str(s) for s in core)
    if arr.ndim < len(core) or any(s is not None and s != a for s, a in
                                   zip(core, arr.shape[arr.ndim - len(core):])):
        want = ", ".join(n if s is None or n == str(s) else f"{n}={s}" for n, s in zip(names, core))
        raise ValueError(f"{name}: expected shape (..., {want}), got shape {arr.shape}")
    return arr


def broadcast_leading(*items) -> tuple:
    """The broadcast shape of the leading axes of several arrays, or a ``ValueError``.

    Each item is ``(name, array, n_core)``: the array's leading axes are all but its
    last ``n_core`` axes. The error names the first array whose leading axes do not
    broadcast with those of the arrays before it.
    """
    lead, seen = (), []
    for name, arr, n_core in items:
        own = arr.shape[:arr.ndim - n_core]
        try:
            lead = np.broadcast_shapes(lead, own)
        except ValueError:
            raise ValueError(f"{name}: expected leading axes that broadcast with {lead} (the leading "
                             f"axes of {', '.join(seen)}), got shape {arr.shape} (leading axes {own})"
                             ) from None
        seen.append(name)
    return lead


def float_dtype(*values) -> np.dtype:
    """The dtype a core computes in and returns: ``np.result_type`` of its floating inputs, at least float32.

    Integer and boolean arrays count as float64; Python ``int`` and ``float`` are weak
    (a float32 array with ``0.5`` stays float32, as in numpy); ``None`` is skipped.
    Only float32 or float64 comes out.
    """
    kinds = []
    for v in values:
        if v is None:
            continue
        if type(v) in (int, float):
            kinds.append(v)
            continue
        dt = np.asarray(v).dtype
        kinds.append(np.float64 if dt.kind in "iub" else dt)
    dt = np.result_type(*kinds) if kinds else np.dtype(np.float64)
    return np.dtype(np.float32) if np.promote_types(dt, np.float32) == np.float32 else np.dtype(np.float64)


def check_log_gate(x, name: str = "log_gate") -> np.ndarray:
    """Check log-decays: finite and ``<= 0`` (the decay ``exp(log_gate)`` lies in [0, 1]); return them."""
    if not (isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float64)):
        x = as_float_array(x, name, allow_nonfinite=True)
    if x.size:
        low, high = x.min(), x.max()                      # two passes instead of three (NaN propagates)
        if not (np.isfinite(low) and np.isfinite(high)):
            raise ValueError(f"{name}: expected finite values, got an array containing NaN or infinity")
        if high > 0:
            raise ValueError(f"{name}: expected log-decays <= 0 (the decay is exp({name}), at most 1), "
                             f"got {float(x[x > 0].ravel()[0])!r}")
    return x


def as_generator(rng, name: str = "rng", *, default_seed: int | None = None) -> np.random.Generator:
    """``rng`` as a numpy ``Generator``: a ``Generator`` itself, or a fresh one seeded with an integer ``rng``.

    With ``default_seed``, ``None`` is allowed too and means ``np.random.default_rng(default_seed)``;
    anything else raises ``ValueError`` naming ``name``.
    """
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    if rng is None and default_seed is not None:
        return np.random.default_rng(default_seed)
    allowed = "a numpy Generator, an integer seed or None" if default_seed is not None else \
        "a numpy Generator or an integer seed"
    raise ValueError(f"{name}: expected {allowed}, got {_describe(rng)}")


def check_real_number(value, name: str) -> float:
    """Return ``value`` as a float if it is a finite real number (not a bool), else raise."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
            or not np.isfinite(value)):
        raise ValueError(f"{name}: expected a finite real number, got {_describe(value)}")
    return float(value)


class Arg(NamedTuple):
    """One array argument of a sequence layer, for :func:`prepare_layer_args`.

    ``axes`` names its core axes, last axes first to last, e.g. ``("T", "d_k")``;
    an axis named ``"T"`` is the token axis, dropped for one-token forms. A name
    seen before must have the same size (a key's ``d_k`` is the query's).
    ``check`` (optional) is called on the parsed array and returns it, raising a
    ``ValueError`` if a value is out of range; ``allow_nonfinite`` leaves NaN and
    infinity to that check (the log-gate checks find them on their own pass).
    A ``value`` of None means the argument was not given.
    """

    name: str
    value: object
    axes: tuple
    check: Callable | None = None
    allow_nonfinite: bool = False


def prepare_layer_args(args, *, initial_state=None, scale=1.0, tokens=True, min_length=0, one_sequence=None):
    """Validate a sequence layer's arguments, broadcast their leading axes and cast them to one dtype.

    ``args`` is a list of :class:`Arg`, the first the queries (its axes fix
    ``T`` and ``d_k``). ``initial_state`` is None or ``(..., d_k, d_v)``;
    ``scale`` a finite real number. With ``tokens`` False the ``"T"`` axes are
    dropped (one-token forms); ``min_length`` is the fewest tokens accepted.
    ``one_sequence``, if given, is the hint a reference function gives when an
    argument has leading axes (it takes one sequence). Every error is a
    ``ValueError`` that names the argument.

    Returns ``(lead, arrays, initial_state, scale)``: the broadcast leading axes,
    the arrays in the order of ``args`` (None where not given), each cast to the
    common dtype (:func:`float_dtype`) and broadcast to ``lead`` (a view where
    possible), the initial state likewise, and ``scale`` as a float.
    """
    dtype = float_dtype(*(a.value for a in args), initial_state)
    sizes, parsed, items = {}, [], []
    for arg in args:
        if arg.value is None:
            parsed.append(None)
            continue
        axes = tuple(a for a in arg.axes if tokens or a != "T")
        arr = as_float_batch(arg.value, arg.name, tuple(sizes.get(a) for a in axes), axes,
                             allow_nonfinite=arg.allow_nonfinite)
        if arg.check is not None:
            arr = arg.check(arr)
        for axis, size in zip(axes, arr.shape[arr.ndim - len(axes):]):
            sizes.setdefault(axis, size)
        if not parsed and tokens and sizes["T"] < min_length:
            raise ValueError(f"{arg.name}: expected at least {min_length} token(s), got shape {arr.shape}")
        parsed.append(arr)
        items.append((arg.name, arr, len(axes)))
    if initial_state is not None:
        initial_state = as_float_batch(initial_state, "initial_state", (sizes["d_k"], sizes["d_v"]), ("d_k", "d_v"))
        items.append(("initial_state", initial_state, 2))
    scale = check_real_number(scale, "scale")
    lead = broadcast_leading(*items)
    if one_sequence is not None:
        for name, arr, n_core in items:
            if arr.ndim > n_core:
                raise ValueError(f"{name}: the reference functions take one sequence with no leading axes, got "
                                 f"shape {arr.shape} ({one_sequence})")

    def fit(arr, n_core):
        if arr is None:
            return None
        arr = arr.astype(dtype, copy=False)
        shape = lead + arr.shape[arr.ndim - n_core:]
        return arr if arr.shape == shape else np.broadcast_to(arr, shape)

    n_cores = iter(n for _, _, n in items)
    arrays = [None if arr is None else fit(arr, next(n_cores)) for arr in parsed]
    return lead, arrays, fit(initial_state, 2), scale
