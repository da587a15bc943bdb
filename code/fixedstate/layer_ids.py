"""The names the package gives its sequence mixers, in one place.

Every module that lets a caller choose a layer by name (the recall lab, the timing
tables, the cost counts, the training chapter's model and the tests) takes its names
from here, so one layer has one name everywhere:

========================  ===============================================  =================
id                        layer                                            chapter
========================  ===============================================  =================
``"softmax"``             softmax attention, the KV cache                  1
``"swa"``                 sliding-window attention, a window's KV cache     9
``"linear"``              linear attention                                 2
``"delta"``               the delta rule (DeltaNet)                        3
``"gated_delta"``         the gated delta rule (Gated DeltaNet)            3
``"kda"``                 Kimi Delta Attention, per-channel decay           3
``"ssm"``                 a diagonal selective state-space model (Mamba)   4
``"ssd"``                 Mamba-2's state-space duality, a scalar decay    4
``"hybrid"``              fixed-state layers with a few softmax layers     6
========================  ===============================================  =================

A module that accepts only some of them says which, and checks with :func:`check_layer_id`.
"""

from __future__ import annotations

__all__ = ["SOFTMAX", "SWA", "LINEAR", "DELTA", "GATED_DELTA", "KDA", "SSM", "SSD", "HYBRID", "LAYER_IDS",
           "check_layer_id"]

SOFTMAX = "softmax"
SWA = "swa"
LINEAR = "linear"
DELTA = "delta"
GATED_DELTA = "gated_delta"
KDA = "kda"
SSM = "ssm"
SSD = "ssd"
HYBRID = "hybrid"

#: Every id, in the order of the book's chapters (sliding-window attention, chapter 9's baseline, beside softmax).
LAYER_IDS = (SOFTMAX, SWA, LINEAR, DELTA, GATED_DELTA, KDA, SSM, SSD, HYBRID)


def check_layer_id(value, allowed, name: str = "layer") -> str:
    """Return ``value`` if it is one of the ids in ``allowed``, else raise a ``ValueError``.

    The error names the argument (``name``), what it got, and the ids it accepts.
    """
    allowed = tuple(allowed)
    unknown = [a for a in allowed if a not in LAYER_IDS]
    if unknown:
        raise ValueError(f"allowed must hold ids from LAYER_IDS {LAYER_IDS}, got {unknown}")
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value
