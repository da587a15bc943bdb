"""fixedstate: the shared numpy implementations of the book *Fixed-State Sequence Layers*.

One module per idea, named after the chapter that explains it:

- :mod:`fixedstate.softmax_attention`: causal softmax attention and its KV cache.
- :mod:`fixedstate.costs`: FLOP and memory accounting.
- :mod:`fixedstate.linear_attention`: kernel feature maps, causal linear attention
  in four forms, Performer (FAVOR+) features and Linformer projections.
- :mod:`fixedstate.delta_rule`: the delta rule, the gated delta rule and Kimi Delta
  Attention, token by token and chunkwise.
- :mod:`fixedstate.ssm`: continuous and discrete state-space models, S4, Mamba, Mamba-2.
- :mod:`fixedstate.recall`: associative-recall experiments and the MQAR task.
- :mod:`fixedstate.hybrid`: hybrid stacks, their cost model and a numpy toy stack.
- :mod:`fixedstate.blocks`: the parts layers are built from (projections, norms,
  activations, the short convolution, the MLP, the embedding).
- :mod:`fixedstate.figures`: interactive figures that work with and without a kernel,
  and each chapter's drawing code (``fixedstate.figures.delta_rule``, ...).
- :mod:`fixedstate.timing`: the best-of-N timer and the measurements built on it.
- :mod:`fixedstate.prose`: numbers for the prose, glued at the precision the text shows.
- :mod:`fixedstate.checks`: automatic feedback for the exercises.
- :mod:`fixedstate.gradcheck`: checking a backward pass against central finite differences
  (the cores' backward passes, ``*_backward``, sit beside their forward passes).

Conventions (the notation appendix documents them once): sequences are arrays
of shape ``(..., T, d)`` with one token per row and any leading batch and head
axes; every layer's forms share one signature, ``f(q, k, v, *, beta, log_gate,
..., scale, initial_state)`` or ``f(x, delta, A, B, C, *, D, initial_state)``,
and return ``(outputs, final_state)``; gates are passed as log-decays
(``log_gate <= 0``); the state of a linear-attention layer is a ``(..., d_k, d_v)``
array ``S`` read out as ``o = S^T q``; float32 in gives float32 out.
"""

__version__ = "0.2.0"
