"""The sequence forms run their products with one BLAS thread and give the caller's setting back; a training
step gives the model's large products the caller's threads, and a run of a sweep keeps to one."""

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


@needs_blas
@pytest.mark.parametrize("mixer", ["gated_delta", "softmax", "hybrid"])
def test_training_gives_the_models_products_the_callers_threads_and_the_cores_one(mixer):
    # Called alone, training runs the model's large products (projections, MLP, head) with the
    # caller's BLAS threads; the cores' products run with one. The per-step callback sees the
    # threads between steps; a watching thread sees them during the steps (softmax attention's
    # model has no core that keeps to one thread, so a step held to one would show there).
    from fixedstate import training as tr

    steps, cores = [], []
    with threadpool_limits(2, user_api="blas"):
        callers = blas_threads()
        if max(callers) < 2:
            pytest.skip("this BLAS runs one thread at most")
        with kernels.recording_products(on_product=lambda step: cores.append(max(blas_threads()))):
            tr.train_mixture(mixer, d_model=8, train_lengths=[(40, 4)], lengths=[(40, 4)], steps=2, lr=1e-2,
                             seed=0, vocab_size=16, batch_size=2, n_test=4,
                             callback=lambda *args, **kwargs: steps.append(max(blas_threads())))
        assert blas_threads() == callers                 # the caller's setting is still in force
    assert steps == [max(callers)] * 2                   # between the steps: the caller's threads
    if mixer != "softmax":
        assert cores and set(cores) == {1}               # the delta rule's chunkwise products: one thread
    else:
        with threadpool_limits(2, user_api="blas"):
            seen = threads_seen_while(lambda: tr.train_mixture(
                mixer, d_model=8, train_lengths=[(40, 4)], lengths=[(40, 4)], steps=30, lr=1e-2, seed=0,
                vocab_size=16, batch_size=4, n_test=8))
        assert len(seen) >= 5 and seen.count(max(callers)) >= 0.8 * len(seen), seen   # during the steps


def threads_seen_while(fn):
    """The BLAS thread counts a second Python thread sees, at most every half millisecond, while ``fn()`` runs."""
    import threading

    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(max(blas_threads()))
            done.wait(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        fn()
    finally:
        done.set()
        watcher.join()
    return seen


@needs_blas
def test_a_run_of_either_sweep_keeps_to_one_blas_thread_and_restores_the_callers_setting():
    # The sweeps run their runs side by side, one per core: each run keeps to one BLAS thread.
    from fixedstate import training as tr

    quick = {**tr.RECALL_QUICK, "steps": 30, "n_test": 8, "batch_size": 4}
    run = tr.recall_tuning_runs(quick)[0]
    small = {**tr.SWEEP, "steps": 30, "n_test": 8, "batch_size": 4}
    with threadpool_limits(2, user_api="blas"):
        before = blas_threads()
        if max(before) < 2:
            pytest.skip("this BLAS runs one thread at most")
        for fn in (lambda: tr.recall_run(run), lambda: tr.run_config("gated_delta", 8, 4, 0, 1e-2, small)):
            seen = threads_seen_while(fn)
            assert blas_threads() == before              # the caller's setting is back
            # the run holds one thread from its first line to its last: only the instants before
            # it enters and after it leaves can show the caller's two
            assert len(seen) >= 5 and seen.count(1) >= 0.8 * len(seen), seen
