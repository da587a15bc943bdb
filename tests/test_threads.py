"""The sequence forms run their products with one BLAS thread and give the caller's setting back."""

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

from fixedstate import delta_rule as dr
from fixedstate._threads import one_blas_thread

BLAS = ThreadpoolController().select(user_api="blas")
needs_blas = pytest.mark.skipif(not BLAS.lib_controllers, reason="no BLAS that threadpoolctl can control")


def blas_threads():
    return [lib.num_threads for lib in ThreadpoolController().select(user_api="blas").lib_controllers]


@needs_blas
@pytest.mark.parametrize("caller_threads", [1, 2, 3])
@pytest.mark.parametrize("name", ["delta_rule_chunkwise", "gated_delta_rule_chunkwise", "kda_chunkwise",
                                  "delta_rule_recurrent", "gated_delta_rule_recurrent", "kda_recurrent"])
def test_forms_use_one_blas_thread_and_restore_the_callers_setting(monkeypatch, name, caller_threads):
    seen = []
    real_matmul = np.matmul

    def watching_matmul(*args, **kwargs):
        seen.append(max(blas_threads()))
        return real_matmul(*args, **kwargs)

    monkeypatch.setattr(dr, "_matmul", watching_matmul)
    rng = np.random.default_rng(0)
    T, d = 40, 4
    q, k, v = rng.standard_normal((3, T, d))
    gate = {} if name.startswith("delta") else {
        "log_gate": -rng.uniform(0, 1, (T, d) if name.startswith("kda") else T)}
    with threadpool_limits(caller_threads, user_api="blas"):
        before = blas_threads()
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
