"""fixedstate._heap: freed memory kept in the process, set once, where the C library is glibc."""

import ctypes
import platform
import subprocess
import sys

import pytest

from fixedstate import _heap

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_keep_freed_memory_is_set_once_and_answers_the_same():
    first = _heap.keep_freed_memory()
    assert first is GLIBC
    assert _heap.keep_freed_memory() is first


def test_a_training_step_sets_it(tmp_path):
    """In a fresh process, one call of loss_and_grads sets the thresholds (where the C library is glibc)."""
    code = (
        "import numpy as np\n"
        "from fixedstate import _heap, training as tr\n"
        "assert _heap.tried() is None\n"
        "cfg = tr.ModelConfig('linear', 16, 4)\n"
        "p = tr.init_model(cfg, 0)\n"
        "tok, tgt = tr.mqar_data(2, vocab_size=16, n_pairs=2, seq_len=8, rng=0)\n"
        "tr.loss_and_grads(p, cfg, tok, tgt)\n"
        "print(_heap.tried())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(GLIBC)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_memory_stays_in_the_process_after_it_is_set():
    """After keep_freed_memory, freeing 8 MiB of small blocks at the top of the heap does not shrink it."""
    code = (
        "import ctypes\n"
        "from fixedstate import _heap\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.sbrk.restype = ctypes.c_void_p\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "libc.free.argtypes = (ctypes.c_void_p,)\n"
        "def top_after_free():\n"
        "    blocks = [libc.malloc(64 << 10) for _ in range(128)]\n"
        "    high = libc.sbrk(0)\n"
        "    for b in reversed(blocks): libc.free(b)\n"
        "    return high - libc.sbrk(0)\n"
        "before = top_after_free()\n"
        "assert _heap.keep_freed_memory()\n"
        "after = top_after_free()\n"
        "print(before, after)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert before > 4 << 20        # by default glibc gives most of the 8 MiB back to the kernel
    assert after == 0              # with the setting it keeps all of it
