"""One BLAS thread inside the package's hot sections, whatever the caller's setting.

The sequence forms of the delta-rule family do hundreds of small matrix products
one after the other (a chunk of 64 tokens against a 128 x 128 state, one token
against the state). A multithreaded BLAS splits each of them across its threads
and waits for all of them; for products this small the splitting and the waiting
cost more than they save, and when another program holds a core the waiting
makes a product several times slower. So these forms run their products with one
BLAS thread and give the caller's setting back when they return (also on an
error). The limit is set with :mod:`threadpoolctl`, which knows the BLAS builds
numpy and scipy load (OpenBLAS, MKL, BLIS, ...); where it finds none it does
nothing. Where every BLAS already has at most the requested number of threads
(a limited form calling another), nothing is changed, which costs a microsecond
or two instead of the few tens that setting and restoring the limit take.

The setting is process-wide: a product that another Python thread runs while
such a form is working also gets one thread.
"""

from __future__ import annotations

import contextlib
import functools

from threadpoolctl import ThreadpoolController

__all__ = ["blas_threads", "one_blas_thread"]

_blas = None  # the BLAS libraries loaded when the first limited call runs (numpy's and scipy's)


def _blas_controller():
    global _blas
    if _blas is None:
        _blas = ThreadpoolController().select(user_api="blas")
    return _blas


@contextlib.contextmanager
def blas_threads(limit):
    """Run the ``with`` block with at most ``limit`` BLAS threads (None: the caller's setting, unchanged)."""
    blas = _blas_controller()
    if limit is None or all(lib.num_threads <= limit for lib in blas.lib_controllers):
        yield
        return
    with blas.limit(limits=limit):
        yield


def one_blas_thread(fn):
    """Decorator: ``fn`` runs with one BLAS thread; the caller's thread counts are restored after."""
    @functools.wraps(fn)
    def limited(*args, **kwargs):
        with blas_threads(1):
            return fn(*args, **kwargs)
    return limited
