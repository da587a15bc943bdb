"""The drawing code of chapter {ref}`chap-ssm`: the selectivity figure.

The states come from :func:`fixedstate.ssm.selective_scan_step`
(``eq-ssm-selective``), called one token at a time; this module only sets the
steps and draws what the state does.
"""

from __future__ import annotations

import math

import numpy as np

from .._validate import as_float_array
from ..ssm import selective_scan_step
from .engine import changing, figure_parts, keep_background, live_update, new_figure, text_fields

__all__ = ["SELECTIVITY_TOKEN", "selectivity_states", "draw_selectivity"]

SELECTIVITY_TOKEN = 8
"""The token whose step the selectivity figure's first slider sets."""

# The settings computed ahead, in one batched pass, when the figure is built: the values the chapter's live
# sliders offer (steps at token 8 from 0.01 to 10, 20 per decade, to 4 digits; elsewhere 0.1 to 0.5 by 0.01).
# Any other setting is computed when asked for.
_AHEAD_TOKEN8 = tuple(float(f"{10.0 ** (e / 20):.4g}") for e in range(-40, 21))
_AHEAD_OTHERS = tuple(round(0.1 + 0.01 * k, 5) for k in range(41))

_STATE_LIMITS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # the top of the state axis moves between these


def _state_axis(low: float, high: float) -> tuple[float, float]:
    """Limits of the state axis: the first of ``_STATE_LIMITS`` above the states, the first of their negatives
    (from 0.8 on) below them, so that the limits take few values."""
    top = next((t for t in _STATE_LIMITS if t >= 1.05 * high), 1.05 * high)
    depth = max(-1.05 * low, 0.1 * top)
    bottom = next((0.8 * t for t in _STATE_LIMITS if 0.8 * t >= depth), depth)
    return -bottom, top


def selectivity_states(x, A, B, C, step_token8, step_others):
    """The states of one channel after each token, with step ``step_token8`` at token 8 and ``step_others`` elsewhere.

    ``x`` ``(T,)`` are the inputs of the channel, ``A`` ``(1, N)``, ``B`` and
    ``C`` ``(T, N)``; the state goes token by token through
    :func:`fixedstate.ssm.selective_scan_step` (``eq-ssm-selective``), starting
    from zeros. The two steps may be arrays of one shape ``S`` (many settings at
    once, as a batch of the step). Returns the states ``S + (T, N)``, row ``t``
    after token ``t``.
    """
    x = as_float_array(x, "x", ndim=1)
    A = as_float_array(A, "A", ndim=2)
    T = x.shape[0]
    if T <= SELECTIVITY_TOKEN:
        raise ValueError(f"x: expected more than {SELECTIVITY_TOKEN} tokens, got shape {x.shape}")
    step_token8, step_others = np.broadcast_arrays(np.asarray(step_token8, dtype=float),
                                                   np.asarray(step_others, dtype=float))
    settings = step_token8.shape
    h = np.zeros(settings + (1, A.shape[-1]))
    states = np.empty(settings + (T, A.shape[-1]))
    for t in range(T):  # one token at a time, with the package's step
        delta = step_token8 if t == SELECTIVITY_TOKEN else step_others
        _, h = selective_scan_step(np.broadcast_to(x[t], settings + (1,)), delta[..., None], A, B[t], C[t],
                                   initial_state=h)
        states[..., t, :] = h[..., 0, :]
    return states


@live_update("continuous")
def draw_selectivity(step_token8=1.0, step_others=0.5, *, x, A, B, C, fig=None):
    """Draw the inputs and the state of one selective-SSM channel, for one setting of the sliders.

    Top: the inputs ``x`` as bars, token 8 in red, and above them what token 8
    does to the state entry with ``a = A[0, 0]``: the fraction kept,
    ``exp(step_token8 * a)``, and the amount written, ``step_token8 * x[8]``.
    Bottom: the state entries after each token (:func:`selectivity_states`), one
    line per entry of ``A``, with token 8 marked. Returns the matplotlib Figure.

    Updatable (see :mod:`fixedstate.figures`): with ``fig``, a figure this
    function built, it changes the state lines, the limits of the bottom panel
    (they follow the states, which grow with the step at token 8, in steps of a
    factor of two) and the two numbers of the top title, and returns it. **Live
    sliders: continuous** (the latest value wins): the states of every setting the
    chapter's live sliders offer are computed when the figure is built, in one
    batched pass of 16 one-token steps (tens of milliseconds; another setting is
    computed when asked for, a few milliseconds), so an update looks them up and
    redraws three lines and two numbers over a kept background (one per pair of
    limits of the state axis that these settings reach, all drawn when the
    figure is built); ``make bench-figures`` measures it.
    """
    x = as_float_array(x, "x", ndim=1)
    A = as_float_array(A, "A", ndim=2)
    if fig is None:
        fig = _selectivity_figure(x, A)
        ahead = selectivity_states(x, A, B, C, np.array(_AHEAD_TOKEN8)[:, None], np.array(_AHEAD_OTHERS)[None, :])
        figure_parts(fig)["ahead"] = {(s8, so): ahead[i, j] for i, s8 in enumerate(_AHEAD_TOKEN8)
                                      for j, so in enumerate(_AHEAD_OTHERS)}
        # the state axis takes a few limits over these settings: their pictures are drawn now, not at an update
        limits = {_state_axis(float(low), float(high))
                  for low, high in zip(ahead.min(axis=(2, 3)).ravel(), ahead.max(axis=(2, 3)).ravel())}
        for limit in sorted(limits):
            fig.axes[1].set_ylim(*limit)
            keep_background(fig)
    parts = figure_parts(fig)
    states = parts["ahead"].get((float(step_token8), float(step_others)))
    if states is None:
        states = selectivity_states(x, A, B, C, step_token8, step_others)
    for line, column in zip(parts["states"], states.T):
        line.set_ydata(column)
    fig.axes[1].set_ylim(*_state_axis(float(states.min()), float(states.max())))
    kept, written = parts["title"]
    kept.set_text(f"{math.exp(A[0, 0] * step_token8):.3f}")
    written.set_text(f"{step_token8 * x[SELECTIVITY_TOKEN]:.3g}")
    return fig


def _selectivity_figure(x, A):
    T = x.shape[0]
    fig, (ax0, ax1) = new_figure(2, 1, figsize=(6.0, 4.2), sharex=True)
    parts = figure_parts(fig)
    colors = ["C0"] * T
    colors[SELECTIVITY_TOKEN] = "C3"
    ax0.bar(np.arange(T), x, color=colors)
    ax0.set_ylabel("input x")
    parts["title"] = text_fields(
        ax0, f"token {SELECTIVITY_TOKEN}: kept " + r"$e^{{\Delta a}}$ = {} " + f"(a = {A[0, 0]:g}), written "
        + r"$\Delta x$ = {}",
        ("0.000", "00.0"), fontsize=ax0.title.get_fontsize())
    parts["states"] = [ax1.plot(np.arange(T), np.zeros(T), "o-", ms=3, label=f"state entry a = {a:g}")[0]
                       for a in A[0]]
    ax1.axvline(SELECTIVITY_TOKEN, color="C3", alpha=0.3, lw=6)
    ax1.set_xlabel("token")
    ax1.set_ylabel("state h")
    # above the panel, where the lines never pass
    ax1.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=len(A[0]), frameon=False,
               borderaxespad=0.1)
    changing(fig, *parts["states"])
    return fig
