"""fixedstate: the shared numpy implementations of the book *Fixed-State Sequence Layers*.

One module per idea, named after the chapter that explains it:

- :mod:`fixedstate.softmax_attention`: causal softmax attention and its KV cache.
- :mod:`fixedstate.costs`: FLOP and memory accounting, every counter of the book.
- :mod:`fixedstate.linear_attention`: kernel feature maps, causal linear attention
  in four forms, Performer (FAVOR+) features and Linformer projections.
- :mod:`fixedstate.delta_rule`: the delta rule, the gated delta rule and Kimi Delta
  Attention, token by token and chunkwise.
- :mod:`fixedstate.ssm`: continuous and discrete state-space models, S4, Mamba, Mamba-2.
- :mod:`fixedstate.gated_linear_attention`: linear attention with a decay per key
  channel (GLA) and its special cases (RetNet, HGRN2, mLSTM), recurrent and chunkwise.
- :mod:`fixedstate.delta_family`: the delta rule's relatives (DeltaProduct, RWKV-7,
  Longhorn) and parity with negative eigenvalues.
- :mod:`fixedstate.recall`: associative-recall experiments and the MQAR task.
- :mod:`fixedstate.recall_lab`: what one move of the recall chapter's sliders recomputes.
- :mod:`fixedstate.hybrid`: the cost model of hybrid stacks (parameters, FLOPs, bytes).
- :mod:`fixedstate.time_model`: the time per token ``t(L) = a + b L`` of a hybrid stack
  and its all-attention twin.
- :mod:`fixedstate.toy_stack`: a numpy hybrid stack with random weights, forward and decode.
- :mod:`fixedstate.training`: chapter 9's trainable model, its loss, Adam and the sweep.
- :mod:`fixedstate.mqar_stats`: the recall sweep's statistics (Wilson intervals, fractions solved and above
  the no-retrieval baseline) and its learning-rate rule.
- :mod:`fixedstate.blocks`: the parts layers are built from (projections, norms,
  activations, the short convolution, the MLP, the embedding), the gate forms, and the
  pre-norm residual block every stack repeats.
- :mod:`fixedstate.mixers`: the one table of token mixers (``MIXERS``, keyed by
  :mod:`fixedstate.layer_ids`), each a forward, backward and step over a core.
- :mod:`fixedstate.layers`: the layers as they ship (Gated DeltaNet as in Qwen3-Next,
  KDA as in Kimi Linear, the Mamba and Mamba-2 blocks), prefill and decode step.
- :mod:`fixedstate.packing`: packed sequences (``cu_seqlens``) for the fixed-state cores
  and the short convolution, recurrent and chunkwise, the state reset at each start.
- :mod:`fixedstate.serving`: serving a layer: rollback after rejected speculative tokens,
  and a layer's heads split over devices for tensor parallelism.
- :mod:`fixedstate.precision`: bfloat16 storage (``ml_dtypes``) with float32 arithmetic
  and state, as the fused kernels run the layers.
- :mod:`fixedstate.figures`: interactive figures that work with and without a kernel
  (the drawing engine, ``fixedstate.figures.engine``), and each chapter's drawing code
  (``fixedstate.figures.delta_rule``, ...).
- :mod:`fixedstate.timing`: the best-of-N timer and the measurements built on it.
- :mod:`fixedstate.prose`: numbers for the prose, glued at the precision the text shows,
  and the one measure of agreement the chapters report (``max_relative_error``).
- :mod:`fixedstate.layer_ids`: the one name each sequence mixer goes by in every module.
- :mod:`fixedstate.checks`: automatic feedback for the exercises.
- :mod:`fixedstate.gradcheck`: checking a backward pass against central finite differences
  (the cores' backward passes, ``*_backward``, sit beside their forward passes).
- :mod:`fixedstate.kernels`: the internal layer under the cores, the array-level parts
  several modules share (the chunk machinery of the delta-rule family, the recorded
  matrix products, the unchecked scans the layers and the recall lab share, the row
  softmax, the segment sums); no module reaches into another module's private names.

Conventions (the notation appendix documents them once): sequences are arrays
of shape ``(..., T, d)`` with one token per row and any leading batch and head
axes; every layer's forms share one signature, ``f(q, k, v, *, beta, log_gate,
..., scale, initial_state)`` or ``f(x, delta, A, B, C, *, D, initial_state)``,
and return ``(outputs, final_state)``; gates are passed as log-decays
(``log_gate <= 0``); the state of a linear-attention layer is a ``(..., d_k, d_v)``
array ``S`` read out as ``o = S^T q``; float32 in gives float32 out.
"""

__version__ = "0.2.0"


class OutdatedError(ImportError):
    """The installed fixedstate is older than a notebook needs. Jupyter shows only its message."""

    def _render_traceback_(self):   # IPython's hook: print the message, not a traceback
        return [f"{type(self).__name__}: {self}"]


def _version_tuple(text: str, argument: str) -> tuple[int, ...]:
    import re

    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{argument}: expected a version 'MAJOR.MINOR.PATCH' such as '0.2.0', got {text!r}")
    return tuple(int(part) for part in m.groups())


def require(version: str) -> bool:
    """``True`` if this fixedstate is at least ``version``; otherwise stop with how to update it.

    The first code cell of every notebook of the book calls it (``tools/notebook_guard.py``
    writes that one-line cell), after checking that the package is installed at all, so a
    notebook downloaded from a newer edition of the book says which version it
    needs instead of failing later on a missing function.
    """
    if _version_tuple(__version__, "__version__") >= _version_tuple(version, "version"):
        return True
    raise OutdatedError(
        f"this notebook needs fixedstate {version} or newer, and fixedstate {__version__} is installed. "
        f"Install the newer wheel from the book's site: %pip install --upgrade fixedstate-{version}-py3-none-any.whl "
        "then restart the kernel.")
