"""The sequence forms run their products with one BLAS thread and give the caller's setting back."""

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

from fixedstate import delta_rule as dr
from fixedstate import kernels
from fixedstate._threads import one_blas_thread

BLAS = ThreadpoolController().select(user_api="blas")
needs_blas = pytest.mark.skipif(not BLAS.lib_controllers, reason="no BLAS that threadpoolctl can control")


def blas_threads():
    return [lib.num_threads for lib in ThreadpoolController().select(user_api="blas").lib_controllers]


@needs_blas
@pytest.mark.parametrize("caller_threads", [1, 2, 3])
@pytest.mark.parametrize("name", ["delta_rule_chunkwise", "gated_delta_rule_chunkwise", "kda_chunkwise",
                                  "delta_rule_recurrent", "gated_delta_rule_recurrent", "kda_recurrent"])
def test_forms_use_one_blas_thread_and_restore_the_callers_setting(name, caller_threads):
    seen = []                                          # the BLAS threads in force at each product
    rng = np.random.default_rng(0)
    T, d = 40, 4
    q, k, v = rng.standard_normal((3, T, d))
    gate = {} if name.startswith("delta") else {
        "log_gate": -rng.uniform(0, 1, (T, d) if name.startswith("kda") else T)}
    with threadpool_limits(caller_threads, user_api="blas"):
        before = blas_threads()
        with kernels.recording_products(on_product=lambda step: seen.append(max(blas_threads()))):
            getattr(dr, name)(q, k, v, beta=rng.uniform(0, 1, T), **gate)
        assert blas_threads() == before                 # the caller's setting is back
    if name.endswith("chunkwise"):
        assert seen and set(seen) == {1}                # every product ran with one thread


@needs_blas
def test_the_setting_is_restored_after_an_error():
    @one_blas_thread
    def fails():
        assert max(blas_threads()) == 1
        raise RuntimeError("inside")

    with threadpool_limits(2, user_api="blas"):
        before = blas_threads()
        with pytest.raises(RuntimeError, match="inside"):
            fails()
        assert blas_threads() == before


class _FakeBLAS:
    """A stand-in for a BLAS library's controller: one process-wide count, as a real BLAS has."""

    def __init__(self, path, threads):
        self.filepath, self.threads, self.changes = path, threads, 0

    def get_num_threads(self):
        return self.threads

    def set_num_threads(self, n):
        self.threads, self.changes = n, self.changes + 1


def test_overlapping_sections_from_several_python_threads_keep_the_limit_and_restore_the_setting(monkeypatch):
    # Four Python threads enter and leave (nested) sections over and over, overlapping in every order.
    # Inside any section every library has one thread; when all have ended, the caller's counts are back.
    # (Fake libraries: some OpenBLAS builds ignore a count set from a thread other than the main one.)
    import threading

    from fixedstate import _threads
    libs = [_FakeBLAS("a.so", 3), _FakeBLAS("b.so", 2)]
    monkeypatch.setattr(_threads, "scan_libraries", lambda: libs)
    errors, start = [], threading.Barrier(4)

    def worker(n):
        start.wait()
        for i in range(n):
            with _threads.blas_threads(1):
                if max(lib.threads for lib in libs) != 1:
                    errors.append(i)
                with _threads.blas_threads(1):
                    if max(lib.threads for lib in libs) != 1:
                        errors.append(-i)

    workers = [threading.Thread(target=worker, args=(2000,)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    assert [lib.threads for lib in libs] == [3, 2]
    assert not _threads.sections_running()


def test_a_section_ending_while_another_runs_keeps_the_limit(monkeypatch):
    # A's section starts, B's starts, A's ends: B still runs with the limit; the count returns when B's ends
    from fixedstate import _threads
    libs = [_FakeBLAS("a.so", 4)]
    monkeypatch.setattr(_threads, "scan_libraries", lambda: libs)
    a, b = _threads.blas_threads(1), _threads.blas_threads(1)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert libs[0].threads == 1
    b.__exit__(None, None, None)
    assert libs[0].threads == 4


@needs_blas
def test_the_smallest_active_limit_wins_and_the_larger_one_comes_back():
    from fixedstate._threads import blas_threads as limit
    with threadpool_limits(4, user_api="blas"):
        with limit(3):
            assert max(blas_threads()) == 3
            with limit(1):
                assert max(blas_threads()) == 1
            assert max(blas_threads()) == 3
            with limit(None):                           # None: the setting as it is
                assert max(blas_threads()) == 3
        assert max(blas_threads()) == 4


def test_libraries_are_scanned_again_after_an_import(monkeypatch):
    # a BLAS loaded after the first limited section (say by a later import) is found: the scan is redone
    import sys
    import types

    from fixedstate import _threads
    scans = []
    real = _threads.ThreadpoolController

    def counting():
        scans.append(1)
        return real()

    monkeypatch.setattr(_threads, "ThreadpoolController", counting)
    with _threads.blas_threads(1):
        pass
    n = len(scans)
    with _threads.blas_threads(1):
        pass
    assert len(scans) == n                              # nothing imported: no new scan
    monkeypatch.setitem(sys.modules, "fixedstate_fake_module_for_the_scan_test", types.ModuleType("fake"))
    with _threads.blas_threads(1):
        pass
    assert len(scans) == n + 1


@needs_blas
def test_entering_a_section_is_cheap_against_a_chunkwise_call():
    from fixedstate._threads import section_overhead
    section_overhead(20)
    assert section_overhead(200) < 2e-4                 # a few microseconds; a chunkwise call takes milliseconds
