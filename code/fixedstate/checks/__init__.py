"""Automatic feedback for the book's exercises, in one place.

Each chapter's checks live in a module of this package; every check takes the
student's function (or number), runs it on the cases that matter and returns a
:class:`~fixedstate.checks._core.CheckResult` that names the property that failed,
the case, and what was expected versus what came back.
"""

from ._core import CheckResult

__all__ = ["CheckResult"]
