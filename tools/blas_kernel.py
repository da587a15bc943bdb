"""Print the OpenBLAS kernel numpy uses here, or (with --other) a different one this processor can run.

``make nbval-kernel`` runs the notebooks under the other kernel, so that a stored
output showing one kernel's last-bit rounding fails on every machine, not only on
a machine of another kind. OpenBLAS reads the kernel from ``OPENBLAS_CORETYPE``.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import numpy as np


def current_kernel() -> str:
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas*"))
    for path in libs:
        lib = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return "unknown"


def main() -> int:
    kernel = current_kernel()
    if "--other" not in sys.argv[1:]:
        print(kernel)
        return 0
    # Kernels of the Haswell generation (AVX2) and later round alike in places; pick one of
    # another generation. Sandybridge (AVX) runs on every x86-64 processor made since 2011.
    print("Sandybridge" if kernel.lower() in {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"}
          else "Haswell")
    return 0


if __name__ == "__main__":
    sys.exit(main())
