"""One BLAS thread inside the package's hot sections, whatever the caller's setting.

The sequence forms of the delta-rule family do hundreds of small matrix products
one after the other (a chunk of 64 tokens against a 128 x 128 state, one token
against the state). A multithreaded BLAS splits each of them across its threads
and waits for all of them; for products this small the splitting and the waiting
cost more than they save, and when another program holds a core the waiting
makes a product several times slower. So these forms run their products with one
BLAS thread and give the caller's setting back when they return (also on an
error). The training functions of :mod:`fixedstate.training` are not limited as
a whole: their large products (a projection of every token of a batch, the MLP,
the vocabulary head) gain from the caller's threads, and on this book's machine
their results came out bit-identical with one thread or two. A run of a sweep
(``recall_run``, ``run_config``), which runs side by side with others, one per
core, is limited to one thread. The limit is set through :mod:`threadpoolctl`,
which knows the BLAS builds numpy and scipy load (OpenBLAS, MKL, BLIS, ...);
where it finds none it does nothing.

The thread count of a BLAS is a setting of the whole process, so the limit is
kept process-wide and counted: the first limited section to start saves each
library's count and lowers it, the last one to end restores it. Sections that
overlap (nested calls, or calls from several Python threads at once) share the
limit; while any of them runs, every BLAS has at most the smallest limit asked
for, and the caller's counts come back only when none is running. A product that
another Python thread runs meanwhile also gets the limit. Changing the counts
yourself (``threadpoolctl.threadpool_limits``) from another thread while a
limited section runs is not supported: the section's end restores the counts it
saved. One more limit is the BLAS's own: the OpenBLAS builds numpy 2.x and scipy
ship (0.3.30, 0.3.31) were seen to ignore a count set from a thread other than
the main one once the main thread had set a count; a section that starts in such
a thread then runs with the count in force.

The libraries are found by a scan of the loaded shared objects (about a
millisecond), done again whenever a module has been imported since the last scan,
so a BLAS loaded later (scipy's, when scipy is first imported after numpy) is
limited too. Entering and leaving a section costs a few microseconds per library
(:func:`section_overhead` measures it).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections import Counter

from threadpoolctl import ThreadpoolController

__all__ = ["blas_threads", "one_blas_thread", "section_overhead"]

_lock = threading.RLock()
_libs = []             # the BLAS libraries' controllers, from the last scan
_modules_seen = -1     # len(sys.modules) at the last scan
_active = Counter()    # limit -> number of sections running with it
_saved = {}            # library path -> its thread count before the first running section


def scan_libraries():
    """The BLAS controllers, scanned again when a module has been imported since the last scan.

    Internal (outside ``__all__``): :func:`blas_threads` sets the counts of what it returns;
    the tests put fake libraries in its place to watch the counts.
    """
    global _libs, _modules_seen
    if len(sys.modules) != _modules_seen:
        _libs = list(ThreadpoolController().select(user_api="blas").lib_controllers)
        _modules_seen = len(sys.modules)
    return _libs


def _apply():
    """Set every library to min(saved count, smallest active limit), or back to its saved count."""
    target = min(_active) if _active else None
    for lib in scan_libraries():
        key = lib.filepath
        if target is None:
            if key in _saved:
                count = _saved.pop(key)
                if lib.get_num_threads() != count:
                    lib.set_num_threads(count)
            continue
        current = lib.get_num_threads()
        if key not in _saved:
            _saved[key] = current
        wanted = min(_saved[key], target)
        if current != wanted:
            lib.set_num_threads(wanted)
    if target is None:
        _saved.clear()   # libraries that are no longer found


@contextlib.contextmanager
def blas_threads(limit):
    """Run the ``with`` block with at most ``limit`` BLAS threads (None: the caller's setting, unchanged).

    Safe to nest and to enter from several Python threads at once (see the module's
    description); the caller's counts are restored when the last section ends, also
    on an error.
    """
    if limit is None:
        yield
        return
    with _lock:
        _active[limit] += 1
        try:
            _apply()
        except BaseException:
            _leave(limit)
            raise
    try:
        yield
    finally:
        with _lock:
            _leave(limit)


def _leave(limit):
    _active[limit] -= 1
    if not _active[limit]:
        del _active[limit]
    _apply()


def sections_running() -> bool:
    """Whether a limited section is running, or a library's count is still kept to restore (internal)."""
    with _lock:
        return bool(_active) or bool(_saved)


def one_blas_thread(fn):
    """Decorator: ``fn`` runs with one BLAS thread; the caller's thread counts are restored after."""
    @functools.wraps(fn)
    def limited(*args, **kwargs):
        with blas_threads(1):
            return fn(*args, **kwargs)
    return limited


def section_overhead(repeats=1000):
    """Seconds to enter and leave one limited section (the median of ``repeats``), for the record."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with blas_threads(1):
            pass
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]
