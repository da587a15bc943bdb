"""Automatic feedback for the exercises of chapter "One family, one algorithm" (``chap-one-family``).

- :func:`check_table_row` for ``ex-fam-place-finch``: a layer (RWKV-6 "Finch")
  placed in the chapter's table, as a dict ``{"transition", "gate", "state_size"}``;
- :func:`check_deltaproduct_step` for ``ex-fam-deltaproduct-step``:
  ``deltaproduct_step(state, keys, values, betas) -> new_state``, ``n_h``
  delta-rule steps in order (with ``n_h = 1`` it is DeltaNet's step);
- :func:`check_ssd_chunk_step` for ``ex-fam-ssd-chunk-step``:
  ``ssd_chunk_step(x, delta, a, B, C, state) -> (y, new_state)``, one chunk of
  Mamba-2's chunked algorithm (compared with :func:`fixedstate.ssm.ssd_chunk`);
- :func:`check_implicit_step` for ``ex-fam-implicit-step``:
  ``implicit_step(state, key, value, beta) -> new_state``, the implicit (proximal)
  step on the regression loss (``eq-fam-implicit``), with one step size or one per
  value column (compared with :func:`fixedstate.delta_family.implicit_regression_step`);
- challenge :func:`check_ssd_interchunk` for ``ex-fam-ssd-interchunk``:
  ``ssd_interchunk(x, delta, a, B, C, chunk_size, initial_state=None) -> (y_state, final_state)``,
  steps 2-4 of the chunked algorithm (chunk states, the inter-chunk scalar
  recurrence, the state-to-output term), without the package's SSD forms.

Each check compares with the package, names the property that failed and
recognises the usual wrong answers; none raises for a wrong answer.
"""

from __future__ import annotations

import re

import numpy as np

from .. import delta_family as df
from .. import delta_rule as dr
from .. import gated_linear_attention as gla
from .. import linear_attention as la
from .. import ssm
from ._core import CheckResult, Failure, call_student, call_without, compare_arrays, has_nonfinite, run_check

__all__ = ["check_table_row", "check_deltaproduct_step", "check_implicit_step", "check_ssd_chunk_step",
           "check_ssd_interchunk",
           "FINCH_ROW", "TRANSITIONS", "GATES"]

#: the table's vocabulary
TRANSITIONS = ("identity", "scalar", "diagonal", "identity plus low rank")
GATES = ("nothing", "token", "channel")

#: ex-fam-place-finch: RWKV-6 "Finch", S_t = Diag(w_t) S_{t-1} + k_t v_t^T with w_t in (0, 1)^{d_k}
#: computed from the token; its state at d_k = d_v = 64.
FINCH_ROW = {"transition": "diagonal", "gate": "channel", "state_size": 64 * 64, "d_k": 64, "d_v": 64}


def _words(value) -> str:
    """Lower case, '+', '-', '_' and runs of spaces as single spaces."""
    text = str(value).lower().replace("+", " plus ").replace("-", " ").replace("_", " ")
    return re.sub(r"\s+", " ", text).strip()


def _transition(value):
    w = _words(value)
    aliases = {"diag": "diagonal", "diagonal matrix": "diagonal", "identity plus low rank": "identity plus low rank",
               "identity plus rank one": "identity plus low rank", "i plus low rank": "identity plus low rank",
               "scalar times identity": "scalar", "none": "identity"}
    return aliases.get(w, w)


def _gate(value):
    w = _words(value)
    aliases = {"per channel": "channel", "the channel": "channel", "channelwise": "channel",
               "per token": "token", "the token": "token", "none": "nothing", "constant": "nothing"}
    return aliases.get(w, w)


# --------------------------------------------------------------------------- the table

def check_table_row(row) -> CheckResult:
    """Check a row of the chapter's table for RWKV-6 "Finch" (``ex-fam-place-finch``).

    ``row`` is a dict with ``"transition"`` (one of :data:`TRANSITIONS`),
    ``"gate"`` (what the decay depends on, one of :data:`GATES`) and
    ``"state_size"`` (the numbers in the state at ``d_k = d_v = 64``). Case,
    hyphens and spaces do not matter.
    """
    label = "ex-fam-place-finch"

    def body():
        if row is None or row is Ellipsis:
            raise Failure("no answer yet: replace the `...` with a dict "
                          "{'transition': ..., 'gate': ..., 'state_size': ...}")
        if not isinstance(row, dict):
            raise Failure(f"expected a dict with the keys 'transition', 'gate' and 'state_size', got "
                          f"{type(row).__name__}")
        missing = [key for key in ("transition", "gate", "state_size") if key not in row]
        if missing:
            raise Failure(f"the dict has no {', '.join(repr(m) for m in missing)}: it needs the keys "
                          "'transition', 'gate' and 'state_size'")
        if row["transition"] is Ellipsis or row["gate"] is Ellipsis or row["state_size"] is Ellipsis:
            raise Failure("some entries are still `...`: fill in all three")
        transition = _transition(row["transition"])
        if transition not in TRANSITIONS:
            raise Failure(f"transition {row['transition']!r} is not one of the table's: "
                          + ", ".join(repr(t) for t in TRANSITIONS))
        if transition != FINCH_ROW["transition"]:
            hints = {"scalar": "w_t has one entry per key channel, not one number for the whole state",
                     "identity": "the state is multiplied by Diag(w_t) before the write, and w_t < 1",
                     "identity plus low rank": "there is no erase term k k^T: Finch only decays the rows of "
                                               "the state, then adds k v^T"}
            raise Failure(f"transition {row['transition']!r}: {hints[transition]}")
        gate = _gate(row["gate"])
        if gate not in GATES:
            raise Failure(f"gate {row['gate']!r} is not one of the table's: " + ", ".join(repr(g) for g in GATES))
        if gate != FINCH_ROW["gate"]:
            hints = {"token": "it depends on the token, and differs per channel: the table's 'channel'",
                     "nothing": "w_t is computed from the token: the decay is data-dependent"}
            raise Failure(f"gate {row['gate']!r}: {hints[gate]}")
        try:
            size = float(row["state_size"])
        except (TypeError, ValueError):
            raise Failure(f"state_size: expected a number, got {row['state_size']!r}") from None
        expected = FINCH_ROW["state_size"]
        if size != expected:
            d_k, d_v = FINCH_ROW["d_k"], FINCH_ROW["d_v"]
            hints = {d_k: "the state is a d_k x d_v matrix, not a vector",
                     d_k + d_v: "the state is a d_k x d_v matrix, not a vector",
                     2 * expected: "the bonus u is a parameter, not state",
                     expected + d_k: "the bonus u is a parameter, not state"}
            hint = hints.get(size, f"count the entries of the d_k x d_v state at d_k = d_v = {d_k}")
            raise Failure(f"state_size {row['state_size']!r}: {hint}")
        return ("RWKV-6 sits in the diagonal row: a per-channel decay computed from the token, "
                f"a {FINCH_ROW['d_k']} x {FINCH_ROW['d_v']} state of {expected} numbers")

    return run_check(label, body)


# --------------------------------------------------------------------------- DeltaProduct

def _diagnose(got, expected, candidates, case):
    """Raise a Failure naming the first wrong-answer pattern ``got`` matches (and ``expected`` does not)."""
    got = np.asarray(got, dtype=float)
    for arr, message in candidates:
        if (got.shape == arr.shape and np.allclose(got, arr, rtol=1e-9, atol=1e-12)
                and not np.allclose(arr, expected, rtol=1e-9, atol=1e-12)):
            raise Failure(f"on {case}: {message}")


def _product_cases(rng):
    cases = []
    for n_h, d_k, d_v, unit in ((1, 3, 2, True), (1, 4, 4, False), (2, 4, 3, True), (3, 3, 5, False),
                                (2, 5, 2, False)):
        S = rng.standard_normal((d_k, d_v))
        keys = rng.standard_normal((n_h, d_k))
        keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
        if not unit:
            keys *= rng.uniform(0.5, 0.9, (n_h, 1))
        values = rng.standard_normal((n_h, d_v))
        betas = rng.uniform(0.2, 2.0, n_h)
        if cases:
            betas[-1] = max(betas[-1], 1.5)                  # one beta above 1 in every case but the first
        else:
            betas[:] = rng.uniform(0.2, 0.9)                 # the first: DeltaNet's own range
        desc = (f"n_h={n_h}, a {d_k}x{d_v} state, betas={np.round(betas, 3).tolist()}"
                + ("" if unit else ", keys shorter than 1"))
        cases.append((desc, S, keys, values, betas))
    return cases


def check_deltaproduct_step(deltaproduct_step) -> CheckResult:
    """Check ``deltaproduct_step(state, keys, values, betas) -> new_state`` (``eq-fam-deltaproduct``).

    ``state`` (d_k, d_v), ``keys`` (n_h, d_k), ``values`` (n_h, d_v), ``betas``
    (n_h,) in [0, 2]: the ``n_h`` delta-rule steps of one token, applied in order,
    each against the state the previous one left (no gate, keys not normalised).
    Compared with :func:`fixedstate.delta_family.deltaproduct_step` for
    ``n_h = 1, 2, 3``, non-square states, keys shorter than 1 and betas above 1;
    with ``n_h = 1`` it must be DeltaNet's step.
    """
    label = "ex-fam-deltaproduct-step"

    def body():
        rng = np.random.default_rng(71)
        for desc, S, keys, values, betas in _product_cases(rng):
            got = call_student(deltaproduct_step, S.copy(), keys.copy(), values.copy(), betas.copy(), case=desc)
            if has_nonfinite(got):
                raise Failure(f"on {desc}: the new state contains inf or nan")
            d_k = S.shape[0]
            _, expected = df.deltaproduct_step(np.zeros(d_k), keys, values, beta=betas, initial_state=S)

            def steps(order, betas_used):
                state = S.copy()
                for j in order:
                    state = state + betas_used[j] * np.outer(keys[j], values[j] - state.T @ keys[j])
                return state

            n_h = len(betas)
            parallel = S + sum(betas[j] * np.outer(keys[j], values[j] - S.T @ keys[j]) for j in range(n_h))
            additive = S + sum(betas[j] * np.outer(keys[j], values[j]) for j in range(n_h))
            _diagnose(got, expected, [
                (steps(range(n_h - 1, -1, -1), betas),
                 "you applied the steps in reverse order: step j = 1 comes first, and each later step "
                 "corrects the state the step before it left"),
                (parallel, "every correction was computed from the old state (the writes ran in parallel): "
                           "step j must read the state left by step j - 1, v_j - S_{j-1}^T k_j"),
                (additive, "these are additive writes S + beta k v^T: each step first erases what the state "
                           "recalls for its key"),
                (steps(range(n_h), np.ones(n_h)), "the betas are ignored: step j writes with strength beta_j"),
            ], desc)
            got_arr = np.asarray(got, dtype=float)
            if got_arr.shape == S.T.shape and S.shape[0] != S.shape[1]:
                raise Failure(f"on {desc}: expected shape {S.shape}, got {got_arr.shape}: the transpose. "
                              "The book stores S as d_k x d_v, so a write is k v^T and a read is S^T k")
            compare_arrays(got, expected, what="the new state", case=desc)
            if n_h == 1:
                _, delta_net = dr.delta_rule_step(keys[0], keys[0], values[0], beta=min(betas[0], 1.0),
                                                  initial_state=S)
                if betas[0] <= 1.0:
                    compare_arrays(got, delta_net, what="the new state (n_h = 1 is DeltaNet's step)", case=desc)
        return ("your step applies the n_h Householder steps in order, as in eq-fam-deltaproduct; with n_h = 1 "
                "it is DeltaNet's step")

    return run_check(label, body)


# --------------------------------------------------------------------------- the implicit step

def _implicit_cases(rng):
    """(description, state, key, value, beta): scalar and per-column steps, keys of several lengths."""
    cases = []
    for d_k, d_v, key_norm, per_column, big in ((3, 2, 1.0, False, False), (4, 3, 0.6, False, True),
                                                (4, 2, 1.7, True, False), (5, 3, 2.5, True, True)):
        S = rng.standard_normal((d_k, d_v))
        key = rng.standard_normal(d_k)
        key *= key_norm / np.linalg.norm(key)
        value = rng.standard_normal(d_v)
        beta = rng.uniform(0.2, 1.5, d_v) if per_column else float(rng.uniform(0.3, 1.2))
        if big:
            beta = beta * 20.0
        desc = (f"a {d_k}x{d_v} state, |key| = {key_norm}, "
                + (f"beta per column {np.round(beta, 3).tolist()}" if per_column else f"beta = {beta:.3f}"))
        cases.append((desc, S, key, value, beta))
    return cases


def check_implicit_step(implicit_step) -> CheckResult:
    """Check ``implicit_step(state, key, value, beta) -> new_state`` (``eq-fam-implicit``).

    ``state`` (d_k, d_v), ``key`` (d_k,), ``value`` (d_v,), ``beta`` a number or a
    (d_v,) array of non-negative steps, one per value column. The answer must be
    the minimiser of ``1/2 |S - state|^2 + 1/2 sum_j beta_j (s_j^T key - value_j)^2``,
    compared with :func:`fixedstate.delta_family.implicit_regression_step` on keys
    shorter and longer than 1, one step size and one per column, and steps large
    enough that an explicit step overshoots. The usual slips are named: the
    explicit step, the step size without ``|key|^2``, Longhorn's diagonal in place of
    ``k k^T``, one step size used for every column, a transposed state.
    """
    label = "ex-fam-implicit-step"

    def body():
        rng = np.random.default_rng(73)
        for desc, S, key, value, beta in _implicit_cases(rng):
            beta_arg = beta.copy() if isinstance(beta, np.ndarray) else beta
            got = call_student(implicit_step, S.copy(), key.copy(), value.copy(), beta_arg, case=desc)
            if has_nonfinite(got):
                raise Failure(f"on {desc}: the new state contains inf or nan")
            expected = df.implicit_regression_step(S, key, value, beta=beta)
            got_arr = np.asarray(got, dtype=float)
            if got_arr.shape == S.T.shape and S.shape[0] != S.shape[1]:
                raise Failure(f"on {desc}: expected shape {S.shape}, got {got_arr.shape}: the transpose. "
                              "The book stores S as d_k x d_v, so a read is S^T k")
            b = np.broadcast_to(np.asarray(beta, dtype=float), (S.shape[1],))
            error = S.T @ key - value                                        # k^T s_j - v_j, per column
            kk = float(key @ key)

            def delta_step(step):
                return S - np.outer(key, step * error)

            diagonal = (1.0 - np.outer(key * key, b / (1.0 + b * kk))) * S + np.outer(key, b / (1.0 + b * kk) * value)
            _diagnose(got, expected, [
                (delta_step(b), "this is the explicit step S - beta grad L(S), the gradient taken at the old "
                                "state; the implicit step takes it at the new state and solves "
                                "(I + beta k k^T) s_j = s_j_old + beta v_j k"),
                (delta_step(b / (1.0 + b)), "the step size is beta / (1 + beta |k|^2): the Sherman-Morrison "
                                            "denominator needs the squared length of the key"),
                (diagonal, "this is Longhorn's layer, with k k^T replaced by its diagonal: the exact "
                           "minimiser keeps the whole k k^T"),
                (delta_step(np.full_like(b, b[0]) / (1.0 + b[0] * kk)),
                 "every column used the first step size: beta has one entry per value column"),
            ], desc)
            compare_arrays(got, expected, what="the new state", case=desc)
        return ("your step solves the proximal problem exactly: the delta rule with the step beta / (1 + beta |k|^2), "
                "which never overshoots")

    return run_check(label, body)


# --------------------------------------------------------------------------- one chunk of the chunked SSD

def _ssd_case(rng, T, N, P, with_state):
    x = rng.standard_normal((T, P))
    delta = rng.uniform(0.05, 0.8, T)
    a = -float(rng.uniform(0.3, 2.0))
    B = rng.standard_normal((T, N))
    C = rng.standard_normal((T, N))
    S0 = rng.standard_normal((N, P)) if with_state else None
    return x, delta, a, B, C, S0


def check_ssd_chunk_step(ssd_chunk_step) -> CheckResult:
    """Check ``ssd_chunk_step(x, delta, a, B, C, state) -> (y, new_state)``: one chunk of the chunked SSD.

    ``x`` (Q, P), ``delta`` (Q,), ``a`` a number < 0, ``B, C`` (Q, N), ``state``
    (N, P) the state entering the chunk; ``y`` (Q, P) the chunk's outputs
    (intra-chunk part plus the state-to-output term, no ``D``) and the state
    leaving it (``eq-ssm-ssd-chunk-out``, ``eq-ssm-ssd-chunk-state``). Compared
    with :func:`fixedstate.ssm.ssd_chunk`.
    """
    label = "ex-fam-ssd-chunk-step"

    def body():
        rng = np.random.default_rng(72)
        for Q, N, P in ((4, 3, 2), (6, 2, 5), (1, 3, 3)):
            x, delta, a, B, C, S0 = _ssd_case(rng, Q, N, P, True)
            case = f"a chunk of {Q} tokens, N={N}, P={P}, a={a:.3f}"
            out = call_student(ssd_chunk_step, x.copy(), delta.copy(), a, B.copy(), C.copy(), S0.copy(), case=case)
            if not isinstance(out, tuple) or len(out) != 2:
                raise Failure(f"on {case}: expected a pair (y, new_state), got {type(out).__name__}")
            y, S = out
            if has_nonfinite(y) or has_nonfinite(S):
                raise Failure(f"on {case}: the result contains inf or nan")
            y_ref, S_ref = ssm.ssd_chunk(x, delta, a, B, C, initial_state=S0)
            y_intra, S_zero = ssm.ssd_chunk(x, delta, a, B, C)
            Gamma = np.exp(np.cumsum(a * delta))
            _diagnose(y, y_ref, [
                (y_intra, "y has the intra-chunk part only: add the state-to-output term Gamma_t S_in^T C_t"),
                (y_intra + C @ S0, "the state-to-output term lacks the decay Gamma_t from the chunk's start "
                                   "through token t"),
                (y_intra + (Gamma / np.exp(a * delta))[:, None] * (C @ S0),
                 "the state-to-output term uses Gamma_{t-1}: the decay runs through token t itself"),
                (ssm.ssd_chunk(x / delta[:, None], delta, a, B, C, initial_state=S0)[0],
                 "the values are x_t, not delta_t x_t: the step size scales the input (B_bar = delta B)"),
            ], case)
            _diagnose(S, S_ref, [
                (S_zero, "the new state forgets the state that entered the chunk: add Gamma_{Q-1} S_in"),
                (S_zero + S0, "the entering state is carried without its decay Gamma_{Q-1}"),
            ], case)
            compare_arrays(y, y_ref, what="the chunk's outputs y", case=case)
            compare_arrays(S, S_ref, what="the state leaving the chunk", case=case)
        return "your chunk step matches eq-ssm-ssd-chunk-out and eq-ssm-ssd-chunk-state"

    return run_check(label, body)


# --------------------------------------------------------------------------- challenge: steps 2-4

def _forbidden():
    names = [getattr(ssm, n) for n in dir(ssm) if n.startswith(("ssd_", "selective_scan_"))]
    for mod in (la, dr, gla, df):
        names += [getattr(mod, n) for n in mod.__all__
                  if n.endswith(("_recurrent", "_chunkwise", "_step", "_loop", "_chunk", "_parallel"))]
    return [f for f in names if callable(f) and hasattr(f, "__code__")]


def _interchunk(x, delta, a, B, C, Q, S0, *, scale_values=True, leaving=False, inclusive=True):
    """Reference (and wrong variants) of the chunked SSD's steps 2-4: ``(y_state, final_state)``."""
    T, P = x.shape
    N = B.shape[1]
    S = np.zeros((N, P)) if S0 is None else S0.copy()
    y = np.empty((T, P))
    V = delta[:, None] * x if scale_values else x
    for start in range(0, T, Q):
        sl = slice(start, start + Q)
        lg = a * delta[sl]
        b = np.cumsum(lg)
        Gamma = np.exp(b if inclusive else b - lg)
        local = B[sl].T @ (np.exp(b[-1] - b)[:, None] * V[sl])       # the chunk's state from zero
        S_next = np.exp(b[-1]) * S + local
        y[sl] = Gamma[:, None] * (C[sl] @ (S_next if leaving else S))
        S = S_next
    return y, S


def check_ssd_interchunk(ssd_interchunk) -> CheckResult:
    """Check the challenge ``ssd_interchunk(x, delta, a, B, C, chunk_size, initial_state=None)``.

    It returns ``(y_state, final_state)``.

    ``x`` (T, P), ``delta`` (T,), ``a`` < 0, ``B, C`` (T, N). ``y_state`` (T, P)
    is only the contribution of the states *entering* the chunks,
    ``Gamma_t S_{c-1}^T C_t`` for the tokens of chunk ``c`` (``Gamma_t`` the decay
    from the chunk's start through ``t``); ``final_state`` (N, P) is the state
    after the last token. Computed by steps 2-4 of the chunked SSD; every SSD
    and selective-scan form of :mod:`fixedstate.ssm` and the linear-attention,
    delta-rule and GLA forms are off limits. Cases: T a multiple of the chunk,
    not a multiple, shorter than one chunk; with and without an initial state.
    """
    label = "ex-fam-ssd-interchunk"

    def body():
        rng = np.random.default_rng(73)
        forbidden = _forbidden()
        for T, Q, N, P, with_state in ((12, 4, 3, 2, False), (10, 4, 3, 2, True), (3, 8, 2, 3, True),
                                       (13, 5, 4, 3, True)):
            x, delta, a, B, C, S0 = _ssd_case(rng, T, N, P, with_state)
            case = (f"T={T}, chunk_size={Q}, N={N}, P={P}, "
                    + ("an initial state" if with_state else "no initial state"))
            args = (x.copy(), delta.copy(), a, B.copy(), C.copy(), Q)
            kwargs = {} if S0 is None else {"initial_state": S0.copy()}
            out = call_without(ssd_interchunk, forbidden, *args, case=case, **kwargs)
            if not isinstance(out, tuple) or len(out) != 2:
                raise Failure(f"on {case}: expected a pair (y_state, final_state), got {type(out).__name__}")
            y, S = out
            if has_nonfinite(y) or has_nonfinite(S):
                raise Failure(f"on {case}: the result contains inf or nan")
            y_ref, S_ref = _interchunk(x, delta, a, B, C, Q, S0)
            y_full = ssm.ssd_chunkwise(x, delta, a, B, C, initial_state=S0, chunk_size=Q)[0]
            wrong = [
                (y_full, "this is the whole output: y_state is only the part the entering states contribute "
                         "(leave out the intra-chunk quadratic part)"),
                (_interchunk(x, delta, a, B, C, Q, S0, leaving=True)[0],
                 "you used the state LEAVING each chunk: the tokens of chunk c read the state that entered it"),
                (_interchunk(x, delta, a, B, C, Q, S0, inclusive=False)[0],
                 "the state-to-output term uses Gamma_{t-1}: the decay runs from the chunk's start through "
                 "token t itself"),
                (_interchunk(x, delta, a, B, C, Q, S0, scale_values=False)[0],
                 "the values are x_t, not delta_t x_t: the step size scales the input"),
            ]
            no_gamma = np.empty_like(y_ref)
            S_c = np.zeros((N, P)) if S0 is None else S0
            for start in range(0, T, Q):
                sl = slice(start, start + Q)
                no_gamma[sl] = C[sl] @ S_c
                S_c = _interchunk(x[:start + Q], delta[:start + Q], a, B[:start + Q], C[:start + Q], Q, S0)[1]
            wrong.append((no_gamma, "the state-to-output term lacks the decay Gamma_t from the chunk's start"))
            if S0 is not None:
                wrong.append((_interchunk(x, delta, a, B, C, Q, None)[0], "the initial state is ignored"))
            _diagnose(y, y_ref, wrong, case)
            compare_arrays(y, y_ref, what="y_state, the entering states' contribution", case=case)
            if S0 is not None:
                _diagnose(S, S_ref, [(_interchunk(x, delta, a, B, C, Q, None)[1],
                                      "the final state ignores the initial state")], case)
            compare_arrays(S, ssm.ssd_recurrent(x, delta, a, B, C, initial_state=S0)[1],
                           what="the final state", case=case)
        return ("your chunk states, inter-chunk recurrence and state-to-output term match Mamba-2's chunked "
                "algorithm on every case")

    return run_check(label, body)
