"""The layers as they ship: Gated DeltaNet, Kimi Delta Attention, Mamba and Mamba-2.

Chapter {ref}`chap-shipped-layers`. A released model does not call a core
alone: it wraps it in projections, a short causal convolution, activations,
gates and an output norm. This module composes those parts, taken from
:mod:`fixedstate.blocks` (the gate form :func:`fixedstate.blocks.softplus_log_gate`
among them), with the cores: Gated DeltaNet's and KDA's from the mixer table
:data:`fixedstate.mixers.MIXERS` that the toy stack and the training chapter's
model also use, Mamba's and Mamba-2's from :mod:`fixedstate.ssm`. It adds no mathematics of its own: every number a layer
computes is computed by a block or a core.

Each layer has

- a configuration dataclass (:class:`GatedDeltaNetConfig`, :class:`KDAConfig`,
  :class:`MambaConfig`, :class:`Mamba2Config`), validated on construction;
- ``init_*(config, rng, dtype=np.float64)``: a dict of parameters, weights as
  ``(d_in, d_out)`` matrices (the transpose of PyTorch's ``nn.Linear.weight``),
  with the configuration itself under ``"config"``;
- a prefill ``f(params, x, *, cache=None) -> (y, cache)`` over a sequence
  ``x`` ``(..., T, d_model)``, with the leading axes a batch;
- a decode step ``f_step(params, x_t, cache=None) -> (y_t, cache)`` for one token
  ``x_t`` ``(..., d_model)``.

The cache is a dict ``{"conv": (..., K-1, conv_dim), "state": ...}``: the last
``K - 1`` inputs of the short convolution and the recurrent state. ``cache=None``
(or a step with ``cache=None``) starts from zeros. Prefill-then-decode gives the
prefill of the whole sequence (``tests/test_layers.py`` proves it to float64
precision).

Where the book's cores and the libraries differ in convention, the layers map
one onto the other at the call (the notation appendix lists the differences):

- readout scale: the cores apply none unless asked; the delta-rule layers pass
  ``scale = d_k ** -0.5``, which the libraries always apply to the queries;
- gates: the cores take log-decays (``log_gate``), as the libraries do; the layers
  compute them with :func:`fixedstate.blocks.softplus_log_gate`,
  ``-exp(A_log) * softplus(raw + dt_bias)``
  (Qwen3-Next's Gated DeltaNet, Kimi Linear's KDA per channel, and Mamba-2's
  ``delta * a``, which is the same expression);
- KDA's gate: the released layer uses this unbounded form, not the
  lower-bounded ``g_min * sigmoid(z)`` of :func:`fixedstate.delta_rule.kda_log_gate`;
  the chunkwise core builds every decay as a product of per-token decays
  ``<= 1``, so any log-decay ``<= 0`` is safe, however negative;
- SSD state: the book's state of a Mamba-2 head is ``(N, P)`` (``d_k x d_v``,
  read out as ``S^T C``); the libraries store its transpose ``(P, N)``, per
  head ``(H, P, N)``. Mamba's (v1) state is ``(d_inner, N)`` in both.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from . import blocks, mixers
from ._validate import as_float_array, as_generator, check_positive_int
from .layer_ids import GATED_DELTA, KDA
from .ssm import selective_scan_parallel, selective_scan_step, ssd_chunkwise, ssd_recurrent

__all__ = [
    "GatedDeltaNetConfig", "KDAConfig", "MambaConfig", "Mamba2Config",
    "init_gated_deltanet", "init_kda", "init_mamba", "init_mamba2", "initial_decay",
    "gated_deltanet", "gated_deltanet_step", "kda_layer", "kda_layer_step",
    "mamba_block", "mamba_block_step", "mamba2_block", "mamba2_block_step",
    "INIT_SCHEMES", "INITIALIZER_RANGE", "DT_MIN", "DT_MAX", "DT_FLOOR",
    "empty_cache", "cache_numbers", "parameter_shapes", "split_qwen3_next_projections",
]


# --------------------------------------------------------------------------- configurations

def _positive_eps(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return float(value)


def _check_fields(config, ints, floats=(), bools=()):
    for name in ints:
        check_positive_int(getattr(config, name), name)
    for name in floats:
        object.__setattr__(config, name, _positive_eps(getattr(config, name), name))
    for name in bools:
        if not isinstance(getattr(config, name), (bool, np.bool_)):
            raise ValueError(f"{name}: expected True or False, got {getattr(config, name)!r}")


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Gated DeltaNet as in Qwen3-Next (``Qwen3NextGatedDeltaNet``).

    ``n_heads`` value heads of width ``d_v`` share ``n_key_heads`` query/key heads of
    width ``d_k`` (value head ``h`` reads key head ``h // (n_heads // n_key_heads)``).
    """

    d_model: int
    n_heads: int
    n_key_heads: int
    d_k: int
    d_v: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        _check_fields(self, ("d_model", "n_heads", "n_key_heads", "d_k", "d_v", "conv_kernel", "chunk_size"),
                      ("norm_eps",))
        if self.n_heads % self.n_key_heads:
            raise ValueError(f"n_key_heads: expected a divisor of n_heads={self.n_heads} (each query/key head "
                             f"serves a whole group of value heads), got {self.n_key_heads}")

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: the queries, keys and values."""
        return 2 * self.n_key_heads * self.d_k + self.n_heads * self.d_v


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention as in Kimi Linear (``KimiLinearDeltaAttention``).

    ``gate_rank`` is the width of the low-rank projections of the forget gate and
    the output gate (Kimi Linear uses ``d_k``; None means ``d_k``).
    """

    d_model: int
    n_heads: int
    d_k: int
    d_v: int
    gate_rank: int | None = None
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        if self.gate_rank is None:
            object.__setattr__(self, "gate_rank", self.d_k)
        _check_fields(self, ("d_model", "n_heads", "d_k", "d_v", "gate_rank", "conv_kernel", "chunk_size"),
                      ("norm_eps",))

    @property
    def conv_dim(self) -> int:
        return self.n_heads * (2 * self.d_k + self.d_v)


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """The Mamba (v1) block (``MambaMixer``): ``d_inner`` channels, ``d_state`` = N per channel."""

    d_model: int
    d_inner: int
    d_state: int
    dt_rank: int
    conv_kernel: int = 4
    conv_bias: bool = True

    def __post_init__(self):
        _check_fields(self, ("d_model", "d_inner", "d_state", "dt_rank", "conv_kernel"), bools=("conv_bias",))

    @property
    def conv_dim(self) -> int:
        return self.d_inner


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """The Mamba-2 block (``Mamba2Mixer``): ``n_heads`` heads of ``head_dim`` = P channels.

    ``d_inner = n_heads * head_dim``; ``B`` and ``C`` (``d_state`` = N each) are
    shared by groups of heads (``n_groups`` divides ``n_heads``), and the output
    norm normalises each group's ``d_inner / n_groups`` channels. ``norm_before_gate``
    is ``mamba_ssm``'s argument of the same name: False (Mamba-2's default), the gate
    first, ``rms_norm(y * silu(z))``; True, ``rms_norm(y) * silu(z)``.
    """

    d_model: int
    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int = 1
    conv_kernel: int = 4
    conv_bias: bool = True
    norm_eps: float = 1e-5
    chunk_size: int = 64
    norm_before_gate: bool = False

    def __post_init__(self):
        _check_fields(self, ("d_model", "n_heads", "head_dim", "d_state", "n_groups", "conv_kernel", "chunk_size"),
                      ("norm_eps",), ("conv_bias", "norm_before_gate"))
        if self.n_heads % self.n_groups:
            raise ValueError(f"n_groups: expected a divisor of n_heads={self.n_heads}, got {self.n_groups}")

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


_CONFIGS = (GatedDeltaNetConfig, KDAConfig, MambaConfig, Mamba2Config)


def _check_config(config, kind):
    if not isinstance(config, kind):
        raise ValueError(f"config: expected a {kind.__name__}, got {type(config).__name__}")
    return config


# --------------------------------------------------------------------------- parameters

def parameter_shapes(config) -> dict[str, tuple]:
    """The shape of every parameter of a layer, by name (the keys of its params dict).

    Matrices are ``(d_in, d_out)``; the short convolution's weight is
    ``(conv_dim, K)`` (the last tap multiplies the current token).
    """
    if isinstance(config, GatedDeltaNetConfig):
        c = config
        return {"W_q": (c.d_model, c.n_key_heads * c.d_k), "W_k": (c.d_model, c.n_key_heads * c.d_k),
                "W_v": (c.d_model, c.n_heads * c.d_v), "W_z": (c.d_model, c.n_heads * c.d_v),
                "W_b": (c.d_model, c.n_heads), "W_a": (c.d_model, c.n_heads),
                "conv_weight": (c.conv_dim, c.conv_kernel), "A_log": (c.n_heads,), "dt_bias": (c.n_heads,),
                "norm_weight": (c.d_v,), "W_o": (c.n_heads * c.d_v, c.d_model)}
    if isinstance(config, KDAConfig):
        c = config
        return {"W_q": (c.d_model, c.n_heads * c.d_k), "W_k": (c.d_model, c.n_heads * c.d_k),
                "W_v": (c.d_model, c.n_heads * c.d_v), "conv_weight": (c.conv_dim, c.conv_kernel),
                "W_f_down": (c.d_model, c.gate_rank), "W_f_up": (c.gate_rank, c.n_heads * c.d_k),
                "dt_bias": (c.n_heads * c.d_k,), "A_log": (c.n_heads,), "W_b": (c.d_model, c.n_heads),
                "W_g_down": (c.d_model, c.gate_rank), "W_g_up": (c.gate_rank, c.n_heads * c.d_v),
                "norm_weight": (c.d_v,), "W_o": (c.n_heads * c.d_v, c.d_model)}
    if isinstance(config, MambaConfig):
        c = config
        shapes = {"W_in": (c.d_model, 2 * c.d_inner), "conv_weight": (c.d_inner, c.conv_kernel)}
        if c.conv_bias:
            shapes["conv_bias"] = (c.d_inner,)
        shapes.update({"W_x": (c.d_inner, c.dt_rank + 2 * c.d_state), "W_dt": (c.dt_rank, c.d_inner),
                       "dt_bias": (c.d_inner,), "A_log": (c.d_inner, c.d_state), "D": (c.d_inner,),
                       "W_out": (c.d_inner, c.d_model)})
        return shapes
    if isinstance(config, Mamba2Config):
        c = config
        shapes = {"W_in": (c.d_model, c.d_inner + c.conv_dim + c.n_heads),
                  "conv_weight": (c.conv_dim, c.conv_kernel)}
        if c.conv_bias:
            shapes["conv_bias"] = (c.conv_dim,)
        shapes.update({"dt_bias": (c.n_heads,), "A_log": (c.n_heads,), "D": (c.n_heads,),
                       "norm_weight": (c.d_inner,), "W_out": (c.d_inner, c.d_model)})
        return shapes
    raise ValueError(f"config: expected one of {', '.join(k.__name__ for k in _CONFIGS)}, "
                     f"got {type(config).__name__}")


def _dtype(dtype):
    dt = np.dtype(dtype) if dtype in (np.float32, np.float64, "float32", "float64") else None
    if dt is None:
        raise ValueError(f"dtype: expected float32 or float64, got {dtype!r}")
    return dt


def _init(config, rng, dtype, special):
    """Random weights: matrices ~ N(0, 1/d_in), convolution taps ~ N(0, 1/K), then ``special``."""
    rng, dt = as_generator(rng), _dtype(dtype)
    params = {"config": config}
    for name, shape in parameter_shapes(config).items():
        if name in special:
            params[name] = np.asarray(special[name](shape), dtype=dt)
        elif len(shape) == 2:
            params[name] = _scaled(rng.standard_normal(shape), dt, over=math.sqrt(shape[0] if name != "conv_weight"
                                                                                   else shape[1]))
        else:
            params[name] = _scaled(rng.standard_normal(shape), dt, times=0.1)
    return params


def _scaled(draw, dt, *, times=None, over=None):
    """``times * draw`` or ``draw / over`` as ``dt``, computed in place (the same numbers): a layer
    at a shipped model's size draws hundreds of megabytes, and a second array of that size costs
    more than the draw itself."""
    if times is not None:
        draw *= times
    if over is not None:
        draw /= over
    return draw.astype(dt, copy=False)


def _inverse_softplus_of_uniform_log(rng, shape, low=1e-3, high=0.1, floor=None):
    """A step size ``delta`` log-uniform in [low, high] (raised to ``floor`` if given), stored as
    ``softplus^{-1}(delta)``: Mamba's initialisation of ``dt_bias``."""
    delta = np.exp(rng.uniform(math.log(low), math.log(high), size=shape))
    if floor is not None:
        delta = np.maximum(delta, floor)
    return blocks.inverse_softplus(delta)


#: The initialisation schemes of :func:`init_gated_deltanet`, :func:`init_kda`, :func:`init_mamba`
#: and :func:`init_mamba2`: the book's own, ``transformers``' ``_init_weights`` (version 5.24), and
#: the official repositories' (flash-linear-attention for the delta-rule layers, ``mamba_ssm``).
INIT_SCHEMES = ("book", "transformers", "official")

#: ``initializer_range`` of each layer's configuration in ``transformers`` 5.24 (the standard
#: deviation of every ``nn.Linear`` weight that ``_init_weights`` draws from a normal law).
INITIALIZER_RANGE = {"GatedDeltaNetConfig": 0.02, "KDAConfig": 0.02, "MambaConfig": 0.1, "Mamba2Config": 0.1}

#: Mamba's step-size initialisation, as every reference implementation writes it: ``delta``
#: log-uniform in ``[DT_MIN, DT_MAX]``, floored at ``DT_FLOOR``, stored as its inverse softplus.
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4


def _check_scheme(scheme):
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"scheme: expected one of {', '.join(map(repr, INIT_SCHEMES))}, got {scheme!r}")
    return scheme


def _dt_bias(rng):
    return lambda s: _inverse_softplus_of_uniform_log(rng, s, DT_MIN, DT_MAX, DT_FLOOR)


def _reference_special(config, rng, scheme):
    """The parameters a reference scheme draws (``scheme`` "transformers" or "official"), by name.

    Every ``nn.Linear`` weight not named here is ``N(0, INITIALIZER_RANGE**2)`` (transformers'
    ``PreTrainedModel._init_weights``); the convolution of the delta-rule layers too, Mamba's and
    Mamba-2's is Kaiming-uniform with bound ``1/sqrt(K)`` (``a = sqrt(5)``, fan-in ``K`` for a
    depthwise filter), their bias zero, and their ``out_proj`` Kaiming-uniform with bound
    ``1/sqrt(d_inner)``. Norm weights are ones.
    """
    c, std = config, INITIALIZER_RANGE[type(config).__name__]
    normal = lambda s: _scaled(rng.standard_normal(s), np.float64, times=std)  # noqa: E731
    special = {name: normal for name, shape in parameter_shapes(c).items() if name.startswith("W_")}
    special["norm_weight"] = np.ones
    if isinstance(c, GatedDeltaNetConfig):
        special["conv_weight"] = normal
        if scheme == "transformers":          # Qwen3NextPreTrainedModel: dt_bias = 1, A ~ U(0.01, 16)
            special["dt_bias"] = np.ones
            special["A_log"] = lambda s: np.log(rng.uniform(0.01, 16.0, size=s))
        else:                                 # flash-linear-attention's GatedDeltaNet: A ~ U(0, 16), Mamba's dt
            special["dt_bias"] = _dt_bias(rng)
            special["A_log"] = lambda s: np.log(rng.uniform(0.0, 16.0, size=s))
    elif isinstance(c, KDAConfig):            # KimiLinearForgetGate, "following FLA": the same in both
        special["conv_weight"] = normal
        special["A_log"] = lambda s: np.log(rng.uniform(1.0, 16.0, size=s))
        special["dt_bias"] = _dt_bias(rng)
    else:
        special.update({"conv_weight": lambda s: rng.uniform(-1.0, 1.0, size=s) / math.sqrt(c.conv_kernel),
                        "conv_bias": np.zeros, "D": np.ones, "dt_bias": _dt_bias(rng),
                        "W_out": lambda s: _scaled(rng.uniform(-1.0, 1.0, size=s), np.float64, over=math.sqrt(s[0]))})
        if isinstance(c, MambaConfig):        # S4D-real A = (1, ..., N) per channel; dt_proj ~ U(+-r^-1/2)
            special["A_log"] = lambda s: np.log(np.broadcast_to(np.arange(1, s[1] + 1, dtype=float), s))
            special["W_dt"] = lambda s: rng.uniform(-1.0, 1.0, size=s) / math.sqrt(c.dt_rank)
        elif scheme == "transformers":        # Mamba2PreTrainedModel: A = (1, ..., H) over the heads
            special["A_log"] = lambda s: np.log(np.arange(1, s[0] + 1, dtype=float))
        else:                                 # mamba_ssm's Mamba2: A ~ U(1, 16) (A_init_range)
            special["A_log"] = lambda s: np.log(rng.uniform(1.0, 16.0, size=s))
    return special


def init_gated_deltanet(config, rng, *, dtype=np.float64, scheme="book") -> dict:
    """Random parameters of a Gated DeltaNet layer (shapes: :func:`parameter_shapes`).

    ``scheme="book"``: ``A_log = log(A)`` with ``A`` uniform in [1, 16], ``dt_bias`` the
    inverse softplus of a step log-uniform in [1e-3, 0.1], ``norm_weight`` ones; the
    matrices are Gaussian with variance ``1/d_in``. ``scheme="transformers"``
    (``Qwen3NextPreTrainedModel``): ``dt_bias = 1``, ``A`` uniform in [0.01, 16];
    ``scheme="official"`` (flash-linear-attention's ``GatedDeltaNet``): ``A`` uniform in
    [0, 16], ``dt_bias`` the inverse softplus of a step log-uniform in [1e-3, 0.1] floored at
    1e-4. In both reference schemes the projections and the convolution are ``N(0, 0.02^2)``
    and ``norm_weight`` ones.
    """
    _check_config(config, GatedDeltaNetConfig)
    rng = as_generator(rng)
    if _check_scheme(scheme) != "book":
        return _init(config, rng, dtype, _reference_special(config, rng, scheme))
    return _init(config, rng, dtype, {
        "A_log": lambda s: np.log(rng.uniform(1.0, 16.0, size=s)),
        "dt_bias": lambda s: _inverse_softplus_of_uniform_log(rng, s),
        "norm_weight": np.ones})


def init_kda(config, rng, *, dtype=np.float64, scheme="book") -> dict:
    """Random parameters of a KDA layer, initialised as :func:`init_gated_deltanet` (``dt_bias`` per channel).

    ``scheme="transformers"`` and ``"official"`` are the same (``KimiLinearForgetGate`` follows
    flash-linear-attention): ``A`` uniform in [1, 16] per head, ``dt_bias`` per key channel the
    inverse softplus of a step log-uniform in [1e-3, 0.1] floored at 1e-4, projections and
    convolution ``N(0, 0.02^2)``, ``norm_weight`` ones.
    """
    _check_config(config, KDAConfig)
    rng = as_generator(rng)
    if _check_scheme(scheme) != "book":
        return _init(config, rng, dtype, _reference_special(config, rng, scheme))
    return _init(config, rng, dtype, {
        "A_log": lambda s: np.log(rng.uniform(1.0, 16.0, size=s)),
        "dt_bias": lambda s: _inverse_softplus_of_uniform_log(rng, s),
        "norm_weight": np.ones})


def init_mamba(config, rng, *, dtype=np.float64, scheme="book") -> dict:
    """Random parameters of a Mamba block: S4D-real ``A = -(1, ..., N)`` per channel, ``D = 1``, Mamba's ``dt`` init.

    ``scheme="transformers"`` and ``"official"`` (``MambaMixer.init_mamba_weights``, as
    ``mamba_ssm``'s ``Mamba``): the same ``A`` and ``D``; ``W_dt`` uniform in
    ``[-r^{-1/2}, r^{-1/2}]`` (``r`` = ``dt_rank``); ``dt_bias`` the inverse softplus of a step
    log-uniform in [1e-3, 0.1] floored at 1e-4; the convolution uniform in ``[-K^{-1/2},
    K^{-1/2}]`` with a zero bias; ``W_out`` uniform in ``[-d_inner^{-1/2}, d_inner^{-1/2}]``
    (Kaiming-uniform with ``a = sqrt(5)``); ``W_in``, ``W_x`` ``N(0, 0.1^2)``.
    """
    _check_config(config, MambaConfig)
    rng = as_generator(rng)
    if _check_scheme(scheme) != "book":
        return _init(config, rng, dtype, _reference_special(config, rng, scheme))
    return _init(config, rng, dtype, {
        "A_log": lambda s: np.log(np.broadcast_to(np.arange(1, s[1] + 1, dtype=float), s)),
        "D": np.ones,
        "dt_bias": lambda s: _inverse_softplus_of_uniform_log(rng, s),
        "conv_bias": lambda s: 0.1 * rng.standard_normal(s)})


def init_mamba2(config, rng, *, dtype=np.float64, scheme="book") -> dict:
    """Random parameters of a Mamba-2 block: ``A = -(1, ..., H)`` over the heads, ``D = 1``, Mamba's ``dt`` init.

    ``scheme="transformers"`` (``Mamba2Mixer.init_mamba2_weights``): the same ``A`` and ``D``,
    ``dt_bias`` the inverse softplus of a step log-uniform in [1e-3, 0.1] floored at 1e-4;
    ``scheme="official"`` (``mamba_ssm``'s ``Mamba2``, ``A_init_range=(1, 16)``): ``A``
    uniform in [1, 16] per head instead. "official" follows ``mamba_ssm`` in ``A_log`` and
    ``dt_bias`` only; every other parameter is drawn in both schemes as ``transformers``
    draws it: the convolution uniform in ``[-K^{-1/2}, K^{-1/2}]`` with a zero bias,
    ``W_out`` uniform in ``[-d_inner^{-1/2}, d_inner^{-1/2}]``, ``W_in`` ``N(0, 0.1^2)``,
    ``norm_weight`` ones. (``mamba_ssm`` leaves ``in_proj`` and the convolution, bias
    included, at PyTorch's defaults.)
    """
    _check_config(config, Mamba2Config)
    rng = as_generator(rng)
    if _check_scheme(scheme) != "book":
        return _init(config, rng, dtype, _reference_special(config, rng, scheme))
    return _init(config, rng, dtype, {
        "A_log": lambda s: np.log(np.arange(1, s[0] + 1, dtype=float)),
        "D": np.ones,
        "dt_bias": lambda s: _inverse_softplus_of_uniform_log(rng, s),
        "conv_bias": lambda s: 0.1 * rng.standard_normal(s),
        "norm_weight": np.ones})


def initial_decay(params) -> np.ndarray:
    """The decay per token a layer starts with where its gate's projection is zero (``eq-sl-gate``).

    ``g_0 = exp(-exp(A_log) softplus(dt_bias))``: per value head for Gated DeltaNet and
    Mamba-2 ``(H,)``, per key channel for KDA ``(H d_k,)``, per channel and state index
    for Mamba ``(d_inner, N)``. The initialisation schemes of ``init_*`` differ in it.
    """
    config = params.get("config") if isinstance(params, dict) else None
    if not isinstance(config, _CONFIGS):
        raise ValueError(f"params: expected a layer's params dict (from init_*), got {type(params).__name__}")
    c, p = _check_layer_params(params, type(config), names=("A_log", "dt_bias"))   # the two it reads
    A, delta = np.exp(p["A_log"]), blocks.softplus(p["dt_bias"])
    if isinstance(c, MambaConfig):
        return np.exp(-delta[:, None] * A)
    if isinstance(c, KDAConfig):
        return np.exp(-np.repeat(A, c.d_k) * delta)
    return np.exp(-A * delta)


def _check_layer_params(params, kind, names=None):
    """The layer's configuration and its arrays (those in ``names``, default all), checked against
    the shapes the configuration gives."""
    if not isinstance(params, dict):
        raise ValueError(f"params: expected a dict of arrays (from init_*), got {type(params).__name__}")
    config = params.get("config")
    if not isinstance(config, kind):
        raise ValueError(f"params['config']: expected a {kind.__name__} (params of this layer, from "
                         f"init_*), got {type(config).__name__}")
    out = {}
    for name, shape in parameter_shapes(config).items():
        if names is not None and name not in names:
            continue
        if name not in params:
            raise ValueError(f"params: expected an entry {name!r} of shape {shape}, got keys {sorted(params)}")
        out[name] = as_float_array(params[name], f"params[{name!r}]", shape=shape)
    return config, out


def split_qwen3_next_projections(in_proj_qkvz, in_proj_ba, config) -> dict:
    """The input projections of Qwen3-Next's layer as the book's matrices ``W_q, W_k, W_v, W_z, W_b, W_a``.

    ``Qwen3NextGatedDeltaNet`` keeps two ``nn.Linear`` weights, ``(d_out, d_in)``
    each. ``in_proj_qkvz`` ``(2 H_k d_k + 2 H_v d_v, d_model)`` is laid out key
    head by key head: for each of the ``H_k`` groups, its ``d_k`` query rows,
    its ``d_k`` key rows, then the ``r d_v`` value rows and the ``r d_v`` gate
    rows of its ``r = H_v / H_k`` value heads. ``in_proj_ba`` ``(2 H_v, d_model)``
    likewise holds, per group, the ``r`` rows of ``b`` then the ``r`` rows of
    ``a``. Returns the six matrices ``(d_model, width)`` of a params dict.
    """
    c = _check_config(config, GatedDeltaNetConfig)
    r = c.n_heads // c.n_key_heads
    per_group = 2 * c.d_k + 2 * r * c.d_v
    W = as_float_array(in_proj_qkvz, "in_proj_qkvz", shape=(c.n_key_heads * per_group, c.d_model))
    Wba = as_float_array(in_proj_ba, "in_proj_ba", shape=(2 * c.n_heads, c.d_model))
    W = W.reshape(c.n_key_heads, per_group, c.d_model)
    Wba = Wba.reshape(c.n_key_heads, 2 * r, c.d_model)
    cuts = np.cumsum([0, c.d_k, c.d_k, r * c.d_v, r * c.d_v])
    flat = lambda a: a.reshape(-1, c.d_model).T.copy()          # noqa: E731  (groups, rows, d) -> (d, width)
    q, k, v, z = (flat(W[:, cuts[i]:cuts[i + 1]]) for i in range(4))
    return {"W_q": q, "W_k": k, "W_v": v, "W_z": z, "W_b": flat(Wba[:, :r]), "W_a": flat(Wba[:, r:])}


# --------------------------------------------------------------------------- shared parts

def _check_x(x, d_model: int, *, token: bool) -> np.ndarray:
    x = as_float_array(x, "x")
    need = 1 if token else 2
    if x.ndim < need or x.shape[-1] != d_model or (not token and x.shape[-2] < 1):
        want = "(..., d_model)" if token else "(..., T, d_model) with T >= 1"
        raise ValueError(f"x: expected shape {want} with d_model={d_model}, got shape {x.shape}")
    return x


def _state_shape(config) -> tuple:
    c = config
    if isinstance(c, GatedDeltaNetConfig):
        return (c.n_heads, c.d_k, c.d_v)
    if isinstance(c, KDAConfig):
        return (c.n_heads, c.d_k, c.d_v)
    if isinstance(c, MambaConfig):
        return (c.d_inner, c.d_state)
    return (c.n_heads, c.d_state, c.head_dim)


def empty_cache(config, batch_shape=(), *, dtype=np.float64) -> dict:
    """The zero decode cache of a layer: ``{"conv": (*batch_shape, K-1, conv_dim), "state": (*batch_shape, ...)}``.

    The state is ``(H, d_k, d_v)`` for Gated DeltaNet and KDA, ``(d_inner, N)``
    for Mamba, ``(H, N, P)`` for Mamba-2 (the book's orientation).
    """
    if not isinstance(config, _CONFIGS):
        raise ValueError(f"config: expected a layer configuration, got {type(config).__name__}")
    batch_shape = tuple(batch_shape)
    for n in batch_shape:
        check_positive_int(n, "batch_shape")
    dt = _dtype(dtype)
    return {"conv": np.zeros(batch_shape + (config.conv_kernel - 1, config.conv_dim), dtype=dt),
            "state": np.zeros(batch_shape + _state_shape(config), dtype=dt)}


def cache_numbers(config) -> dict[str, int]:
    """How many numbers one sequence's decode cache holds: ``{"state": ..., "conv": ..., "total": ...}``."""
    if not isinstance(config, _CONFIGS):
        raise ValueError(f"config: expected a layer configuration, got {type(config).__name__}")
    state = math.prod(_state_shape(config))
    conv = (config.conv_kernel - 1) * config.conv_dim
    return {"state": state, "conv": conv, "total": state + conv}


def _check_cache(cache, config, lead, *, required: bool):
    """The cache's two arrays (None when ``cache`` is None and not required), leading axes checked."""
    if cache is None:
        if required:
            raise ValueError("cache: expected a dict with 'conv' and 'state' (from a prefill or empty_cache), "
                             "got None")
        return None, None
    if not isinstance(cache, dict) or set(cache) != {"conv", "state"}:
        raise ValueError(f"cache: expected a dict with keys 'conv' and 'state', got "
                         f"{sorted(cache) if isinstance(cache, dict) else type(cache).__name__}")
    conv_shape = (config.conv_kernel - 1, config.conv_dim)
    conv = as_float_array(cache["conv"], "cache['conv']")
    state = as_float_array(cache["state"], "cache['state']")
    for name, arr, core in (("cache['conv']", conv, conv_shape), ("cache['state']", state, _state_shape(config))):
        if arr.shape[arr.ndim - len(core):] != core or arr.ndim < len(core):
            raise ValueError(f"{name}: expected shape (..., {', '.join(map(str, core))}), got shape {arr.shape}")
        try:
            np.broadcast_shapes(arr.shape[:arr.ndim - len(core)], lead)
        except ValueError:
            raise ValueError(f"{name}: expected leading axes that broadcast with x's {lead}, "
                             f"got shape {arr.shape}") from None
    return conv, state


def _conv(x, p, conv_state, *, token, mask=None):
    """The short convolution then SiLU, from its cache; returns (activations, new cache)."""
    if token:
        y, conv_state = blocks.short_conv_step(x, p["conv_weight"], initial_state=conv_state, bias=p.get("conv_bias"))
    else:
        y, conv_state = blocks.short_conv(x, p["conv_weight"], initial_state=conv_state, bias=p.get("conv_bias"),
                                          mask=mask)
    return blocks.silu(y), conv_state


def _masked(x, mask, *, token):
    """``x`` with its padded tokens zeroed (``mask`` (..., T) booleans, True at real tokens), and the mask."""
    if mask is None:
        return x, None
    if token:
        raise ValueError("mask: a decode step takes no mask (its token is real), got one")
    keep = np.asarray(mask)
    if keep.dtype != bool or keep.shape[-1:] != x.shape[-2:-1]:
        raise ValueError(f"mask: expected booleans of shape (..., T) with T={x.shape[-2]} (True at real tokens), "
                         f"got {keep.dtype} of shape {keep.shape}")
    return np.where(keep[..., None], x, 0.0).astype(x.dtype, copy=False), keep


def _heads(x, n, d, *, token):
    """(..., T, n*d) -> (..., n, T, d); a token (..., n*d) -> (..., n, d)."""
    x = x.reshape(x.shape[:-1] + (n, d))
    return x if token else np.moveaxis(x, -2, -3)


def _merge(o, *, token):
    """(..., n, T, d) -> (..., T, n*d); a token (..., n, d) -> (..., n*d)."""
    if not token:
        o = np.moveaxis(o, -3, -2)
    return o.reshape(o.shape[:-2] + (o.shape[-2] * o.shape[-1],))


def _core(layer_id, q, k, v, gates, state, c, *, token):
    """The delta-rule core of the table :data:`fixedstate.mixers.MIXERS` (the one the toy stack and the
    training chapter's model call), with the libraries' readout scale ``d_k^{-1/2}``: the one-token
    form for a decode step, the chunkwise form from the cached state for a prefill."""
    entry = mixers.mixer(layer_id)
    scale = c.d_k ** -0.5
    if token:
        return entry.step(q, k, v, gates, state, scale=scale)
    return entry.forward(q, k, v, gates, scale=scale, chunk_size=c.chunk_size, initial_state=state)


def _to_time_last(a, *, token):
    """Per-head scalars (..., T, n) -> (..., n, T); a token (..., n) stays."""
    return a if token else np.swapaxes(a, -1, -2)


# --------------------------------------------------------------------------- Gated DeltaNet

def _gated_deltanet(params, x, cache, *, token, mask=None):
    c, p = _check_layer_params(params, GatedDeltaNetConfig)
    x = _check_x(x, c.d_model, token=token)
    lead = x.shape[:x.ndim - (1 if token else 2)]
    conv_state, state = _check_cache(cache, c, lead, required=False)
    x, mask = _masked(x, mask, token=token)
    kd, vd = c.n_key_heads * c.d_k, c.n_heads * c.d_v
    qkv = np.concatenate([blocks.linear(x, p["W_q"]), blocks.linear(x, p["W_k"]), blocks.linear(x, p["W_v"])],
                         axis=-1)                                                  # (..., T, conv_dim)
    qkv, conv_state = _conv(qkv, p, conv_state, token=token, mask=mask)
    group = c.n_heads // c.n_key_heads
    q = blocks.l2_normalize(_heads(qkv[..., :kd], c.n_key_heads, c.d_k, token=token))
    k = blocks.l2_normalize(_heads(qkv[..., kd:2 * kd], c.n_key_heads, c.d_k, token=token))
    q, k = (np.repeat(a, group, axis=-2 if token else -3) for a in (q, k))   # key head h // group per value head
    v = _heads(qkv[..., 2 * kd:], c.n_heads, c.d_v, token=token)
    beta = _to_time_last(blocks.sigmoid(blocks.linear(x, p["W_b"])), token=token)
    log_gate = _to_time_last(blocks.softplus_log_gate(blocks.linear(x, p["W_a"]), p["A_log"], p["dt_bias"]), token=token)
    o, state = _core(GATED_DELTA, q, k, v, {"beta": beta, "log_gate": log_gate}, state, c, token=token)
    z = _heads(blocks.linear(x, p["W_z"]), c.n_heads, c.d_v, token=token)
    o = blocks.gated_rms_norm(o, z, p["norm_weight"], eps=c.norm_eps)          # per head, over d_v
    y = blocks.linear(_merge(o, token=token), p["W_o"])
    return y, {"conv": conv_state, "state": state}


def gated_deltanet(params, x, *, cache=None, mask=None):
    """Gated DeltaNet as in Qwen3-Next, over a sequence (prefill) (``eq-sl-gdn``).

    ``x`` ``(..., T, d_model)``; ``cache`` None (zeros) or ``{"conv": (..., K-1,
    conv_dim), "state": (..., H, d_k, d_v)}`` to continue from. Steps: project
    to q, k, v (one short convolution over their channels, then SiLU), z, b, a;
    L2-normalise q and k per head; ``beta = sigmoid(b)``; log-decay
    ``blocks.softplus_log_gate(a, A_log, dt_bias)`` per value head; the chunkwise gated delta
    rule with scale ``d_k^{-1/2}``, each query/key head serving
    ``n_heads // n_key_heads`` consecutive value heads; a gated RMSNorm per
    head with ``silu(z)``; the output projection. Returns ``(y, cache)``, ``y``
    ``(..., T, d_model)``.
    ``mask`` ``(..., T)`` booleans (True at real tokens) or None: the padded tokens are
    zeroed before the projections and around the short convolution, as the libraries'
    padding masks do. With the padding on the left and no cache, each sequence's outputs
    at its real tokens and its returned cache are those of running it alone
    (``tests/test_packing.py``); a mask after a cache, or on the right, leaves the
    returned cache holding padding.
    """
    return _gated_deltanet(params, x, cache, token=False, mask=mask)


def gated_deltanet_step(params, x, cache=None):
    """One decode step of :func:`gated_deltanet` (``eq-sl-gdn``): ``x`` ``(..., d_model)``, returns ``(y, cache)``.

    ``cache`` None starts from zeros. The core is :func:`fixedstate.delta_rule.gated_delta_rule_step`.
    """
    return _gated_deltanet(params, x, cache, token=True)


# --------------------------------------------------------------------------- KDA

def _kda(params, x, cache, *, token, mask=None):
    c, p = _check_layer_params(params, KDAConfig)
    x = _check_x(x, c.d_model, token=token)
    lead = x.shape[:x.ndim - (1 if token else 2)]
    conv_state, state = _check_cache(cache, c, lead, required=False)
    x, mask = _masked(x, mask, token=token)
    kd = c.n_heads * c.d_k
    qkv = np.concatenate([blocks.linear(x, p["W_q"]), blocks.linear(x, p["W_k"]), blocks.linear(x, p["W_v"])],
                         axis=-1)
    qkv, conv_state = _conv(qkv, p, conv_state, token=token, mask=mask)
    q = blocks.l2_normalize(_heads(qkv[..., :kd], c.n_heads, c.d_k, token=token))
    k = blocks.l2_normalize(_heads(qkv[..., kd:2 * kd], c.n_heads, c.d_k, token=token))
    v = _heads(qkv[..., 2 * kd:], c.n_heads, c.d_v, token=token)
    f = blocks.linear(blocks.linear(x, p["W_f_down"]), p["W_f_up"])            # (..., T, H d_k), low rank
    A_log = np.repeat(p["A_log"], c.d_k)                                         # one A per head, per channel
    log_gate = _heads(blocks.softplus_log_gate(f, A_log, p["dt_bias"]), c.n_heads, c.d_k, token=token)
    beta = _to_time_last(blocks.sigmoid(blocks.linear(x, p["W_b"])), token=token)
    o, state = _core(KDA, q, k, v, {"beta": beta, "log_gate": log_gate}, state, c, token=token)
    g = _heads(blocks.linear(blocks.linear(x, p["W_g_down"]), p["W_g_up"]), c.n_heads, c.d_v, token=token)
    o = blocks.rms_norm(o, p["norm_weight"], eps=c.norm_eps) * blocks.sigmoid(g)   # sigmoid output gate
    y = blocks.linear(_merge(o, token=token), p["W_o"])
    return y, {"conv": conv_state, "state": state}


def kda_layer(params, x, *, cache=None, mask=None):
    """Kimi Delta Attention as in Kimi Linear, over a sequence (prefill) (``eq-sl-kda``).

    As :func:`gated_deltanet`, with: as many query/key heads as value heads; a
    log-decay per key channel, ``blocks.softplus_log_gate(f, A_log, dt_bias)`` with ``f`` a
    low-rank projection of ``x`` and one ``A_log`` per head (the released,
    unbounded gate); the chunkwise KDA core; an output gate
    ``sigmoid(g)`` (``g`` a low-rank projection) after an RMSNorm per head.
    ``cache`` None or ``{"conv": (..., K-1, conv_dim), "state": (..., H, d_k, d_v)}``.
    Returns ``(y, cache)``.
    ``mask`` ``(..., T)`` booleans (True at real tokens) or None: the padded tokens are
    zeroed before the projections and around the short convolution, as the libraries'
    padding masks do. With the padding on the left and no cache, each sequence's outputs
    at its real tokens and its returned cache are those of running it alone
    (``tests/test_packing.py``); a mask after a cache, or on the right, leaves the
    returned cache holding padding.
    """
    return _kda(params, x, cache, token=False, mask=mask)


def kda_layer_step(params, x, cache=None):
    """One decode step of :func:`kda_layer` (``eq-sl-kda``); the core is :func:`fixedstate.delta_rule.kda_step`."""
    return _kda(params, x, cache, token=True)


# --------------------------------------------------------------------------- Mamba

def _mamba(params, x, cache, *, token, mask=None):
    c, p = _check_layer_params(params, MambaConfig)
    x = _check_x(x, c.d_model, token=token)
    lead = x.shape[:x.ndim - (1 if token else 2)]
    conv_state, state = _check_cache(cache, c, lead, required=False)
    x, mask = _masked(x, mask, token=token)
    xz = blocks.linear(x, p["W_in"])
    u, z = xz[..., :c.d_inner], xz[..., c.d_inner:]
    u, conv_state = _conv(u, p, conv_state, token=token, mask=mask)                      # (..., T, d_inner)
    dbc = blocks.linear(u, p["W_x"])
    r, N = c.dt_rank, c.d_state
    delta = blocks.softplus(blocks.linear(dbc[..., :r], p["W_dt"], p["dt_bias"]))   # softplus(dt W + bias)
    B, C = dbc[..., r:r + N], dbc[..., r + N:]
    A = -np.exp(p["A_log"])
    scan = selective_scan_step if token else selective_scan_parallel
    y, state = scan(u, delta, A, B, C, D=p["D"], initial_state=state)
    y = y * blocks.silu(z)
    return blocks.linear(y, p["W_out"]), {"conv": conv_state, "state": state}


def mamba_block(params, x, *, cache=None, mask=None):
    """The Mamba (v1) block over a sequence (prefill) (``eq-sl-mamba``).

    ``in_proj`` to ``u`` and ``z``; the short convolution (with bias) over ``u``
    and SiLU; ``x_proj`` to the low-rank step, ``B`` and ``C``;
    ``delta = softplus(dt W_dt + dt_bias)``; the selective scan
    (:func:`fixedstate.ssm.selective_scan_parallel`) with ``A = -exp(A_log)``
    and the skip ``D``; ``y * silu(z)``; ``out_proj``. ``cache`` None or
    ``{"conv": (..., K-1, d_inner), "state": (..., d_inner, N)}``. Returns ``(y, cache)``.
    ``mask`` ``(..., T)`` booleans (True at real tokens) or None: the padded tokens are
    zeroed before the projections and around the short convolution, as the libraries'
    padding masks do. With the padding on the left and no cache, each sequence's outputs
    at its real tokens and its returned cache are those of running it alone
    (``tests/test_packing.py``); a mask after a cache, or on the right, leaves the
    returned cache holding padding.
    """
    return _mamba(params, x, cache, token=False, mask=mask)


def mamba_block_step(params, x, cache=None):
    """One decode step of :func:`mamba_block` (``eq-sl-mamba``); the core is :func:`fixedstate.ssm.selective_scan_step`."""
    return _mamba(params, x, cache, token=True)


# --------------------------------------------------------------------------- Mamba-2

def _mamba2(params, x, cache, *, token, mask=None):
    c, p = _check_layer_params(params, Mamba2Config)
    x = _check_x(x, c.d_model, token=token)
    lead = x.shape[:x.ndim - (1 if token else 2)]
    conv_state, state = _check_cache(cache, c, lead, required=False)
    x, mask = _masked(x, mask, token=token)
    zxbcdt = blocks.linear(x, p["W_in"])
    di, GN = c.d_inner, c.n_groups * c.d_state
    z, xbc, dt = zxbcdt[..., :di], zxbcdt[..., di:di + c.conv_dim], zxbcdt[..., di + c.conv_dim:]
    xbc, conv_state = _conv(xbc, p, conv_state, token=token, mask=mask)
    per_group = c.n_heads // c.n_groups
    u = _heads(xbc[..., :di], c.n_heads, c.head_dim, token=token)                     # (..., H, T, P)
    B, C = (np.repeat(_heads(m, c.n_groups, c.d_state, token=token), per_group, axis=-2 if token else -3)
            for m in (xbc[..., di:di + GN], xbc[..., di + GN:]))                      # (..., H, T, N)
    delta = _to_time_last(blocks.softplus(dt + p["dt_bias"]), token=token)          # (..., H, T)
    a = -np.exp(p["A_log"])                                                            # (H,)
    if token:
        y, state = ssd_recurrent(u[..., None, :], delta[..., None], a, B[..., None, :], C[..., None, :],
                                 D=p["D"], initial_state=state)
        y = y[..., 0, :]
    else:
        y, state = ssd_chunkwise(u, delta, a, B, C, D=p["D"], initial_state=state, chunk_size=c.chunk_size)
    y = _merge(y, token=token)                                                          # (..., T, d_inner)
    g = (c.n_groups, di // c.n_groups)
    y = blocks.gated_rms_norm(y.reshape(y.shape[:-1] + g), z.reshape(z.shape[:-1] + g), eps=c.norm_eps,
                              norm_before_gate=c.norm_before_gate).reshape(y.shape) * p["norm_weight"]
    return blocks.linear(y, p["W_out"]), {"conv": conv_state, "state": state}


def mamba2_block(params, x, *, cache=None, mask=None):
    """The Mamba-2 block over a sequence (prefill) (``eq-sl-mamba2``).

    ``in_proj`` to ``z``, ``xBC`` and the step ``dt`` (one per head); the short
    convolution (with bias) over ``xBC`` and SiLU; split into ``x`` (``H`` heads
    of ``P``), ``B`` and ``C`` (``n_groups`` of ``N``, each shared by
    ``H / n_groups`` consecutive heads); ``delta = softplus(dt + dt_bias)``;
    the SSD core with the scalar ``a = -exp(A_log)`` per head and the skip
    ``D``, in Mamba-2's chunked form (:func:`fixedstate.ssm.ssd_chunkwise`); the gated RMSNorm with the gate first,
    ``rms_norm(y * silu(z))`` per group of channels; ``out_proj``. ``cache``
    None or ``{"conv": (..., K-1, conv_dim), "state": (..., H, N, P)}``.
    Returns ``(y, cache)``.
    ``mask`` ``(..., T)`` booleans (True at real tokens) or None: the padded tokens are
    zeroed before the projections and around the short convolution, as the libraries'
    padding masks do. With the padding on the left and no cache, each sequence's outputs
    at its real tokens and its returned cache are those of running it alone
    (``tests/test_packing.py``); a mask after a cache, or on the right, leaves the
    returned cache holding padding.
    """
    return _mamba2(params, x, cache, token=False, mask=mask)


def mamba2_block_step(params, x, cache=None):
    """One decode step of :func:`mamba2_block` (``eq-sl-mamba2``); the core is :func:`fixedstate.ssm.ssd_recurrent`."""
    return _mamba2(params, x, cache, token=True)
