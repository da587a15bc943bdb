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
- :mod:`fixedstate.figures`: interactive figures that work with and without a kernel.
- :mod:`fixedstate.checks`: automatic feedback for the exercises.

Conventions (see the notation appendix): sequences are arrays of shape
``(T, d)`` with one token per row; the state of a linear-attention layer is a
``(d_k, d_v)`` array ``S`` read out as ``o = S^T q``.
"""

__version__ = "0.1.0"
