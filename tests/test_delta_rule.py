"""Tests for fixedstate.delta_rule.

Every form agrees with the reference loops (and the one-chunk reference chunk after
chunk), batched calls equal loops over their items, and the properties the chapter
claims hold.
"""

import numpy as np

from _shapes import thin
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import delta_rule as dr
from fixedstate import kernels

LAYERS = ("delta", "gated", "kda")


def make_inputs(rng, T, d_k, d_v, layer, *, gate_low=0.5, unit_keys=True, dtype=np.float64, lead=()):
    """q, k, v, beta and the log-gate (None for DeltaNet) of one layer, with leading axes ``lead``."""
    q = rng.standard_normal(lead + (T, d_k))
    k = rng.standard_normal(lead + (T, d_k))
    if unit_keys:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal(lead + (T, d_v))
    beta = rng.uniform(0.0, 1.0, lead + (T,))
    if layer == "delta":
        log_gate = None
    elif layer == "gated":
        log_gate = np.log(rng.uniform(gate_low, 1.0, lead + (T,)))
    else:
        log_gate = np.log(rng.uniform(gate_low, 1.0, lead + (T, d_k)))
    cast = (lambda x: None if x is None else x.astype(dtype))
    return cast(q), cast(k), cast(v), cast(beta), cast(log_gate)


def step_fn(layer):
    return {"delta": dr.delta_rule_step, "gated": dr.gated_delta_rule_step, "kda": dr.kda_step}[layer]


def recurrent_fn(layer):
    return {"delta": dr.delta_rule_recurrent, "gated": dr.gated_delta_rule_recurrent,
            "kda": dr.kda_recurrent}[layer]


def chunkwise_fn(layer):
    return {"delta": dr.delta_rule_chunkwise, "gated": dr.gated_delta_rule_chunkwise,
            "kda": dr.kda_chunkwise}[layer]


def gates(log_gate):
    return {} if log_gate is None else {"log_gate": log_gate}


def run(fn, q, k, v, beta, log_gate, **kw):
    return fn(q, k, v, beta=beta, **gates(log_gate), **kw)


def grouped(layer, q, k, v, beta, log_gate, *, initial_state=None, chunk_size, group_bytes, range_bytes):
    """The chunkwise form's kernel (kernels.delta_chunks) with the given group sizes; one leading axis or none."""
    one = q.ndim == 2
    add = (lambda x: None if x is None else x[None]) if one else (lambda x: x)
    o, s = kernels.delta_chunks(add(q), add(k), add(v), add(beta), add(log_gate), add(initial_state), 1.0, chunk_size,
                                layer == "kda", group_bytes=group_bytes, range_bytes=range_bytes)
    return (o[0], s[0]) if one else (o, s)


def reference(layer, q, k, v, beta, log_gate, **kw):
    """The reference loop: DeltaNet is the gated loop with log_gate = 0."""
    if layer == "kda":
        return dr.kda_loop(q, k, v, beta=beta, log_gate=log_gate, **kw)
    if log_gate is None:
        log_gate = np.zeros(q.shape[:-1], dtype=q.dtype)
    return dr.gated_delta_rule_loop(q, k, v, beta=beta, log_gate=log_gate, **kw)


def by_steps(layer, q, k, v, beta, log_gate, state, scale):
    step = step_fn(layer)
    outs = []
    for t in range(q.shape[0]):
        o, state = step(q[t], k[t], v[t], beta=beta[t], **gates(None if log_gate is None else log_gate[t]),
                        scale=scale, initial_state=state)
        outs.append(o)
    return np.array(outs).reshape(q.shape[0], v.shape[1]), state


def rel_err(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


# --------------------------------------------------------------------------- the forms agree

@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("T,chunk", [(50, 1), (50, 7), (64, 16), (67, 16), (40, 64), (130, 64), (33, 33)])
def test_all_forms_agree_with_the_reference_loop(layer, T, chunk):
    rng = np.random.default_rng(T * 31 + chunk)
    d_k, d_v = 6, 4
    q, k, v, beta, lg = make_inputs(rng, T, d_k, d_v, layer)
    s0 = rng.standard_normal((d_k, d_v))
    o_ref, s_ref = reference(layer, q, k, v, beta, lg, initial_state=s0, scale=0.7)
    o_step, s_step = by_steps(layer, q, k, v, beta, lg, s0, 0.7)
    o_rec, s_rec = run(recurrent_fn(layer), q, k, v, beta, lg, initial_state=s0, scale=0.7)
    o_chk, s_chk = run(chunkwise_fn(layer), q, k, v, beta, lg, initial_state=s0, scale=0.7, chunk_size=chunk)
    for o, s in ((o_step, s_step), (o_rec, s_rec), (o_chk, s_chk)):
        assert rel_err(o, o_ref) <= 1e-12 and rel_err(s, s_ref) <= 1e-12


@pytest.mark.parametrize("layer", ("delta", "gated"))
@pytest.mark.parametrize("T,chunk", [(1, 4), (50, 7), (64, 16), (67, 16), (130, 64)])
def test_one_chunk_reference_chunk_after_chunk_is_the_whole_sequence(layer, T, chunk):
    rng = np.random.default_rng(T + 7 * chunk)
    d_k, d_v = 5, 3
    q, k, v, beta, lg = make_inputs(rng, T, d_k, d_v, layer, gate_low=0.2)
    lg = np.zeros(T) if lg is None else lg
    s0 = rng.standard_normal((d_k, d_v))
    S, outs = s0, []
    for start in range(0, T, chunk):
        c = slice(start, start + chunk)
        o, S = dr.gated_delta_rule_chunk(q[c], k[c], v[c], beta=beta[c], log_gate=lg[c], scale=0.5,
                                         initial_state=S)
        outs.append(o)
    o_ref, s_ref = dr.gated_delta_rule_loop(q, k, v, beta=beta, log_gate=lg, scale=0.5, initial_state=s0)
    assert rel_err(np.concatenate(outs), o_ref) <= 1e-12 and rel_err(S, s_ref) <= 1e-12
    o_chk, s_chk = dr.gated_delta_rule_chunkwise(q, k, v, beta=beta, log_gate=lg, scale=0.5, initial_state=s0,
                                                 chunk_size=chunk)
    assert rel_err(o_chk, np.concatenate(outs)) <= 1e-12 and rel_err(s_chk, S) <= 1e-12


def test_one_chunk_reference_without_initial_state_starts_from_zero():
    rng = np.random.default_rng(3)
    q, k, v, beta, lg = make_inputs(rng, 9, 4, 2, "gated")
    o1, s1 = dr.gated_delta_rule_chunk(q, k, v, beta=beta, log_gate=lg)
    o2, s2 = dr.gated_delta_rule_loop(q, k, v, beta=beta, log_gate=lg, initial_state=np.zeros((4, 2)))
    assert rel_err(o1, o2) <= 1e-12 and rel_err(s1, s2) <= 1e-12


@pytest.mark.parametrize("layer", ("gated", "kda"))
@pytest.mark.parametrize("gate_value", [1e-12, 1e-3, 1.0])
def test_forms_agree_with_gates_near_zero_and_exactly_one(layer, gate_value):
    rng = np.random.default_rng(7)
    T, d_k, d_v = 45, 5, 3
    q, k, v, beta, lg = make_inputs(rng, T, d_k, d_v, layer)
    lg = np.full_like(lg, np.log(gate_value))
    if gate_value < 1:  # mix the extreme gate with gates of 1 so both regimes meet in a chunk
        lg[::3] = 0.0
    s0 = rng.standard_normal((d_k, d_v))
    o_ref, s_ref = reference(layer, q, k, v, beta, lg, initial_state=s0)
    for chunk in (4, 16, 64):
        o_chk, s_chk = run(chunkwise_fn(layer), q, k, v, beta, lg, initial_state=s0, chunk_size=chunk)
        assert np.all(np.isfinite(o_chk))
        assert rel_err(o_chk, o_ref) <= 1e-12 and rel_err(s_chk, s_ref) <= 1e-12


@examples(40)
@given(layer=st.sampled_from(LAYERS), T=st.integers(1, 40), d_k=st.integers(1, 6), d_v=st.integers(1, 5),
       chunk=st.integers(1, 20), seed=st.integers(0, 2**31 - 1), with_state=st.booleans())
def test_forms_agree_hypothesis(layer, T, d_k, d_v, chunk, seed, with_state):
    rng = np.random.default_rng(seed)
    q, k, v, beta, lg = make_inputs(rng, T, d_k, d_v, layer, gate_low=0.05)
    s0 = rng.standard_normal((d_k, d_v)) if with_state else None
    start = np.zeros((d_k, d_v)) if s0 is None else s0
    o_ref, s_ref = reference(layer, q, k, v, beta, lg, initial_state=s0)
    o_step, s_step = by_steps(layer, q, k, v, beta, lg, start, 1.0)
    o_rec, s_rec = run(recurrent_fn(layer), q, k, v, beta, lg, initial_state=s0)
    o_chk, s_chk = run(chunkwise_fn(layer), q, k, v, beta, lg, initial_state=s0, chunk_size=chunk)
    assert o_chk.shape == (T, d_v) and s_chk.shape == (d_k, d_v)
    scale_o = max(np.max(np.abs(o_ref)), 1.0)
    scale_s = max(np.max(np.abs(s_ref)), 1.0)
    for o, s in ((o_step, s_step), (o_rec, s_rec), (o_chk, s_chk)):
        assert np.max(np.abs(o - o_ref)) <= 1e-12 * scale_o
        assert np.max(np.abs(s - s_ref)) <= 1e-12 * scale_s


@pytest.mark.parametrize("layer", LAYERS)
def test_forms_agree_over_many_chunk_groups(layer):
    # groups of 128 tokens of d = 4, ranges of 3 chunks of 128 (chunk_size 100): several of each
    sizes = {"group_bytes": 128 * 4 * 8, "range_bytes": 3 * 128 * 128 * 8}
    rng = np.random.default_rng(12)
    T, d_k, d_v = 1300, 4, 3
    q, k, v, beta, lg = make_inputs(rng, T, d_k, d_v, layer, gate_low=0.9)
    s0 = rng.standard_normal((d_k, d_v))
    o_rec, s_rec = run(recurrent_fn(layer), q, k, v, beta, lg, initial_state=s0)
    for chunk in (16, 100):
        o_chk, s_chk = grouped(layer, q, k, v, beta, lg, initial_state=s0, chunk_size=chunk, **sizes)
        assert rel_err(o_chk, o_rec) <= 1e-10 and rel_err(s_chk, s_rec) <= 1e-10
        o_one, s_one = run(chunkwise_fn(layer), q, k, v, beta, lg, initial_state=s0, chunk_size=chunk)
        assert np.array_equal(o_chk, o_one) and np.array_equal(s_chk, s_one)   # grouping changes no bit


# --------------------------------------------------------------------------- leading axes

def _loop_over_items(layer, q, k, v, beta, lg, s0, lead, **kw):
    """The reference loop run item by item over the broadcast leading axes."""
    T, d_k, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    out = np.empty(lead + (T, d_v))
    state = np.empty(lead + (d_k, d_v))
    for idx in np.ndindex(*lead):
        def item(x, n_core):
            return None if x is None else np.broadcast_to(x, lead + x.shape[x.ndim - n_core:])[idx]
        out[idx], state[idx] = reference(layer, item(q, 2), item(k, 2), item(v, 2), item(beta, 1),
                                         item(lg, 2 if layer == "kda" else 1), initial_state=item(s0, 2), **kw)
    return out, state


@examples(40)
@given(layer=st.sampled_from(LAYERS), lead=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
       T=st.integers(1, 19), chunk=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       masks=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=6, max_size=6),
       drop=st.lists(st.integers(0, 3), min_size=6, max_size=6), with_state=st.booleans())
def test_batched_equals_loop_over_items(layer, lead, T, chunk, seed, masks, drop, with_state):
    # every input gets its own broadcastable version of the leading axes: some axes
    # of size 1, some leading axes left out (q, k, v, beta, log_gate and the state)
    rng = np.random.default_rng(seed)
    d_k, d_v = 3, 2
    shapes = [thin(lead, m, n) for m, n in zip(masks, drop)]
    q = rng.standard_normal(shapes[0] + (T, d_k))
    k = rng.standard_normal(shapes[1] + (T, d_k))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal(shapes[2] + (T, d_v))
    beta = rng.uniform(0, 1, shapes[3] + (T,))
    lg = {"delta": None, "gated": np.log(rng.uniform(0.3, 1.0, shapes[4] + (T,))),
          "kda": np.log(rng.uniform(0.3, 1.0, shapes[4] + (T, d_k)))}[layer]
    s0 = rng.standard_normal(shapes[5] + (d_k, d_v)) if with_state else None
    used = shapes[:4] + ([shapes[4]] if lg is not None else []) + ([shapes[5]] if with_state else [])
    full = np.broadcast_shapes(*used)
    o_ref, s_ref = _loop_over_items(layer, q, k, v, beta, lg, s0, full, scale=0.9)
    for fn, extra in ((recurrent_fn(layer), {}), (chunkwise_fn(layer), {"chunk_size": chunk})):
        o, s = run(fn, q, k, v, beta, lg, initial_state=s0, scale=0.9, **extra)
        assert o.shape == full + (T, d_v) and s.shape == full + (d_k, d_v)
        assert rel_err(o, o_ref) <= 1e-12 and rel_err(s, s_ref) <= 1e-12


@pytest.mark.parametrize("layer", LAYERS)
def test_batched_step_equals_loop_over_items(layer):
    rng = np.random.default_rng(40)
    lead, d_k, d_v = (2, 3), 4, 5
    q, k, v, beta, lg = make_inputs(rng, 1, d_k, d_v, layer, lead=lead)
    q, k, v, beta = q[..., 0, :], k[..., 0, :], v[..., 0, :], beta[..., 0]
    lg = None if lg is None else lg[..., 0, :] if layer == "kda" else lg[..., 0]
    s0 = rng.standard_normal((3, d_k, d_v))            # broadcast over the first leading axis
    o, s = step_fn(layer)(q, k[0], v, beta=beta, **gates(lg), initial_state=s0, scale=0.5)
    assert o.shape == lead + (d_v,) and s.shape == lead + (d_k, d_v)
    for i, j in np.ndindex(*lead):
        oo, ss = step_fn(layer)(q[i, j], k[0, j], v[i, j], beta=beta[i, j],
                                **gates(None if lg is None else lg[i, j]), initial_state=s0[j], scale=0.5)
        assert rel_err(o[i, j], oo) <= 1e-14 and rel_err(s[i, j], ss) <= 1e-14


@pytest.mark.parametrize("layer", LAYERS)
def test_long_batch_over_several_chunk_groups(layer):
    # 3 sequences in groups of 32 tokens of d = 4 (two sequences side by side, then one), ranges of 3 chunks
    sizes = {"group_bytes": 32 * 4 * 8, "range_bytes": 3 * 2 * 16 * 16 * 8}
    rng = np.random.default_rng(41)
    lead, T, d_k, d_v = (3,), 300, 4, 3
    q, k, v, beta, lg = make_inputs(rng, T, d_k, d_v, layer, lead=lead, gate_low=0.8)
    o, s = grouped(layer, q, k, v, beta, lg, chunk_size=16, **sizes)
    for i in range(3):
        oi, si = reference(layer, q[i], k[i], v[i], beta[i], None if lg is None else lg[i])
        assert rel_err(o[i], oi) <= 1e-11 and rel_err(s[i], si) <= 1e-11


# --------------------------------------------------------------------------- precision and strong decay

ALL_CORES = [
    ("delta", "step"), ("gated", "step"), ("kda", "step"),
    ("delta", "recurrent"), ("gated", "recurrent"), ("kda", "recurrent"),
    ("delta", "chunkwise"), ("gated", "chunkwise"), ("kda", "chunkwise"),
    ("delta", "loop"), ("gated", "loop"), ("kda", "loop"), ("gated", "chunk"),
]


def _call(layer, form, q, k, v, beta, lg, **kw):
    if form == "step":
        return step_fn(layer)(q[..., 0, :], k[..., 0, :], v[..., 0, :], beta=beta[..., 0],
                              **gates(None if lg is None else lg[..., 0, :] if layer == "kda" else lg[..., 0]),
                              **kw)
    if form == "loop":
        return reference(layer, q, k, v, beta, lg, **kw)
    if form == "chunk":
        return dr.gated_delta_rule_chunk(q, k, v, beta=beta, log_gate=lg, **kw)
    fn = recurrent_fn(layer) if form == "recurrent" else chunkwise_fn(layer)
    return run(fn, q, k, v, beta, lg, **kw)


@pytest.mark.parametrize("layer,form", ALL_CORES)
def test_float32_in_float32_out(layer, form):
    rng = np.random.default_rng(3)
    q, k, v, beta, lg = make_inputs(rng, 40, 8, 8, layer)
    s0 = rng.standard_normal((8, 8))
    o64, s64 = _call(layer, form, q, k, v, beta, lg, initial_state=s0, scale=0.5)
    f32 = [None if x is None else x.astype(np.float32) for x in (q, k, v, beta, lg, s0)]
    o32, s32 = _call(layer, form, *f32[:5], initial_state=f32[5], scale=0.5)
    assert o32.dtype == np.float32 and s32.dtype == np.float32
    assert o64.dtype == np.float64 and s64.dtype == np.float64
    assert rel_err(o32.astype(np.float64), o64) < 1e-4
    # a Python number for beta or the scale does not promote, and integers count as float64
    o, s = _call(layer, "step" if form == "step" else form, *f32[:5], scale=1)
    assert o.dtype == np.float32 and s.dtype == np.float32


def test_float32_with_python_beta_stays_float32_and_integers_become_float64():
    x = np.ones((3, 2), dtype=np.float32)
    o, s = dr.delta_rule_step(x[0], x[0], x[0], beta=0.5)
    assert o.dtype == np.float32 and s.dtype == np.float32
    o, s = dr.delta_rule_recurrent(np.ones((3, 2), dtype=int), np.ones((3, 2), dtype=int), np.ones((3, 2), dtype=int),
                                   beta=np.zeros(3, dtype=int))
    assert o.dtype == np.float64 and s.dtype == np.float64


@pytest.mark.parametrize("layer,form", [c for c in ALL_CORES if c[0] != "delta"])
def test_log_gate_minus_120_in_float32_has_no_inf_or_nan(layer, form):
    # exp(-120) underflows float32 to 0: the decay is exactly 0, and every form must cope
    rng = np.random.default_rng(9)
    q, k, v, beta, lg = make_inputs(rng, 70, 6, 4, layer, dtype=np.float32)
    lg = np.full_like(lg, -120.0)
    s0 = rng.standard_normal((6, 4)).astype(np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):  # underflow is the point
        o, s = _call(layer, form, q, k, v, beta, lg, initial_state=s0)
    assert o.dtype == np.float32 and np.all(np.isfinite(o)) and np.all(np.isfinite(s))
    # a zero decay forgets everything before the token: the reference with a state of zeros agrees
    o_ref, s_ref = _call(layer, form, q.astype(float), k.astype(float), v.astype(float), beta.astype(float),
                         lg.astype(float))
    assert rel_err(o.astype(float), o_ref) < 1e-5


@pytest.mark.parametrize("layer", ("gated", "kda"))
def test_long_float32_strong_decay_has_no_inf_or_nan(layer):
    # The decay is strong enough that the product of gates over the sequence
    # underflows float32 many times over: a form that divided by it would blow up.
    rng = np.random.default_rng(11)
    T, d = 2048, 8
    q, k, v, beta, _ = make_inputs(rng, T, d, d, "delta")
    if layer == "gated":
        lg = np.log(rng.uniform(0.2, 0.6, T))
    else:
        lg = dr.kda_log_gate(rng.standard_normal((T, d)) + 1.0)
    assert np.sum(lg) / (lg.size // T) < -1000  # prod of gates underflows float64 too
    o64, _ = run(chunkwise_fn(layer), q, k, v, beta, lg)
    o32, _ = run(chunkwise_fn(layer), *(x.astype(np.float32) for x in (q, k, v, beta, lg)))
    assert np.all(np.isfinite(o32))
    assert np.max(np.abs(o32 - o64)) < 1e-4 * np.max(np.abs(o64))


# --------------------------------------------------------------------------- properties from the text

def gated_step(S, q, k, v, beta, g, **kw):
    return dr.gated_delta_rule_step(q, k, v, beta=beta, log_gate=np.log(g), initial_state=S, **kw)


def test_gate_one_update_is_the_gradient_step_form():
    rng = np.random.default_rng(0)
    S = rng.standard_normal((5, 3))
    k = rng.standard_normal(5)
    k /= np.linalg.norm(k)
    v = rng.standard_normal(3)
    q = rng.standard_normal(5)
    beta = 0.37
    _, new = gated_step(S, q, k, v, beta, 1.0)
    # our orientation: S - beta k (S^T k - v)^T; the S - beta (S k - v) k^T is its transpose
    assert np.allclose(new, S - beta * np.outer(k, S.T @ k - v), rtol=1e-13, atol=1e-14)
    St = S.T  # source 000 stores the state as d_v x d_k
    assert np.allclose(new.T, St - beta * np.outer(St @ k - v, k), rtol=1e-13, atol=1e-14)
    # and the erase-then-write form (I - beta k k^T) S + beta k v^T
    assert np.allclose(new, dr.erase_factor(k, beta) @ S + beta * np.outer(k, v), rtol=1e-13, atol=1e-14)


def test_gated_update_matches_each_source_after_transposition():
    rng = np.random.default_rng(1)
    S = rng.standard_normal((4, 3))
    k = rng.standard_normal(4)
    k /= np.linalg.norm(k)
    v, q = rng.standard_normal(3), rng.standard_normal(4)
    beta, g = 0.6, 0.8
    _, new = gated_step(S, q, k, v, beta, g)
    eye = np.eye(4)
    # source 000 (S is d_v x d_k): g S (I - beta k k^T) + beta v k^T
    src000 = g * S.T @ (eye - beta * np.outer(k, k)) + beta * np.outer(v, k)
    # source 004 (S is d_k x d_v): alpha (I - beta k k^T) S + beta k v^T
    src004 = g * (eye - beta * np.outer(k, k)) @ S + beta * np.outer(k, v)
    assert np.allclose(new, src000.T, rtol=1e-13, atol=1e-14)
    assert np.allclose(new, src004, rtol=1e-13, atol=1e-14)
    # KDA, source 004: (I - beta k k^T) Diag(alpha) S + beta k v^T
    alpha = rng.uniform(0.3, 1.0, 4)
    _, new_kda = dr.kda_step(q, k, v, beta=beta, log_gate=np.log(alpha), initial_state=S)
    assert np.allclose(new_kda, (eye - beta * np.outer(k, k)) @ np.diag(alpha) @ S + beta * np.outer(k, v),
                       rtol=1e-13, atol=1e-14)


def test_output_reads_the_updated_state():
    rng = np.random.default_rng(2)
    S, q, k, v = rng.standard_normal((4, 3)), rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(3)
    out, new = gated_step(S, q, k, v, 0.5, 0.9, scale=0.25)
    assert np.allclose(out, 0.25 * new.T @ q, rtol=1e-14, atol=1e-15)


def test_step_does_not_modify_the_state_passed_in():
    S = np.ones((3, 2))
    for fn, extra in ((dr.delta_rule_step, {}), (dr.gated_delta_rule_step, {"log_gate": -0.5}),
                      (dr.kda_step, {"log_gate": np.full(3, -0.5)})):
        fn(np.ones(3), np.ones(3), np.zeros(2), beta=0.5, initial_state=S, **extra)
        np.testing.assert_array_equal(S, 1.0)


def test_sequence_forms_do_not_modify_the_initial_state():
    rng = np.random.default_rng(5)
    q, k, v, beta, lg = make_inputs(rng, 20, 3, 2, "kda")
    S = np.ones((3, 2))
    for fn in (dr.kda_recurrent, dr.kda_chunkwise, dr.kda_loop):
        fn(q, k, v, beta=beta, log_gate=lg, initial_state=S)
        np.testing.assert_array_equal(S, 1.0)


@pytest.mark.parametrize("gate", [1.0, 0.3])
def test_beta_one_unit_key_recalls_new_value_exactly(gate):
    rng = np.random.default_rng(4)
    S = rng.standard_normal((6, 4))
    k = rng.standard_normal(6)
    k /= np.linalg.norm(k)
    v = rng.standard_normal(4)
    out, new = gated_step(S, k, k, v, 1.0, gate)
    assert np.allclose(new.T @ k, v, rtol=1e-13, atol=1e-14)
    assert np.allclose(out, v, rtol=1e-13, atol=1e-14)


def test_orthonormal_keys_written_once_are_all_recalled():
    rng = np.random.default_rng(5)
    d_k, d_v = 7, 3
    keys, _ = np.linalg.qr(rng.standard_normal((d_k, d_k)))
    keys = keys.T  # rows orthonormal
    values = rng.standard_normal((d_k, d_v))
    s0 = rng.standard_normal((d_k, d_v))  # whatever was there before is overwritten
    for fn in (dr.delta_rule_recurrent, dr.delta_rule_chunkwise):
        _, S = fn(keys, keys, values, beta=np.ones(d_k), initial_state=s0)
        assert np.allclose(keys @ S, values, rtol=1e-12, atol=1e-13)
    # plain additive writes would not overwrite: they keep the old content on top
    S_add = s0 + keys.T @ values
    assert not np.allclose(keys @ S_add, values, atol=1e-3)


@pytest.mark.parametrize("key", [np.array([1.0, 0.0]), np.array([0.6, 0.8])])
def test_repeated_writes_with_half_beta_halve_the_error(key):
    v = np.array([3.0, -1.0])
    S = np.array([[0.5, 2.0], [-1.0, 0.25]])
    errors = []
    for _ in range(8):
        errors.append(np.linalg.norm(v - S.T @ key))
        _, S = dr.delta_rule_step(key, key, v, beta=0.5, initial_state=S)
    ratios = np.array(errors[1:]) / np.array(errors[:-1])
    assert np.allclose(ratios, 0.5, rtol=1e-12, atol=0)


@pytest.mark.parametrize("sq_norm,beta", [(3.0, 1.0), (1.5, 1.0), (4.0, 0.25)])
def test_non_unit_keys_scale_the_error_by_one_minus_beta_norm_squared(sq_norm, beta):
    # documented behaviour: each write multiplies the recall error by (1 - beta |k|^2);
    # beta |k|^2 > 2 makes the erase factor expand, so the error grows
    k = np.array([1.0, 1.0, 0.0]) * np.sqrt(sq_norm / 2.0)
    v = np.array([1.0, 2.0])
    S = np.zeros((3, 2))
    factor = 1.0 - beta * sq_norm
    err = v - S.T @ k
    for _ in range(5):
        _, S = dr.delta_rule_step(k, k, v, beta=beta, initial_state=S)
        new_err = v - S.T @ k
        assert np.allclose(new_err, factor * err, rtol=1e-12, atol=1e-13)
        err = new_err
    eig = np.linalg.eigvalsh(dr.erase_factor(k, beta))
    assert np.isclose(eig.min(), factor, rtol=1e-12, atol=1e-14)
    if beta * sq_norm > 2:
        assert np.linalg.norm(err) > 10 * np.linalg.norm(v)  # grew


def test_erase_factor_and_additive_step_accept_leading_axes():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((4, 3))
    betas = rng.uniform(0, 1, 4)
    E = dr.erase_factor(keys, betas)
    for i in range(4):
        assert np.allclose(E[i], dr.erase_factor(keys[i], betas[i]), rtol=1e-15, atol=0)
    S = rng.standard_normal((4, 3, 2))
    vals = rng.standard_normal((4, 2))
    assert np.allclose(dr.additive_step(S, keys, vals), S + keys[:, :, None] * vals[:, None, :])
    assert dr.erase_factor(keys.astype(np.float32), 0.5).dtype == np.float32


@pytest.mark.parametrize("form", ["step", "recurrent", "chunkwise", "loop"])
def test_gate_without_writes_shrinks_by_gate_per_step(form):
    rng = np.random.default_rng(6)
    d_k, d_v, T, g = 4, 3, 9, 0.7
    s0 = rng.standard_normal((d_k, d_v))
    q = rng.standard_normal((T, d_k))
    k = rng.standard_normal((T, d_k))
    v = rng.standard_normal((T, d_v))
    beta = np.zeros(T)  # no writes
    lg = np.full(T, np.log(g))
    if form == "step":
        S = s0
        for t in range(T):
            _, S = gated_step(S, q[t], k[t], v[t], 0.0, g)
            assert np.allclose(S, g ** (t + 1) * s0, rtol=1e-13, atol=1e-15)
    else:
        fn = {"recurrent": dr.gated_delta_rule_recurrent, "chunkwise": dr.gated_delta_rule_chunkwise,
              "loop": dr.gated_delta_rule_loop}[form]
        out, S = fn(q, k, v, beta=beta, log_gate=lg, initial_state=s0)
        assert np.allclose(S, g ** T * s0, rtol=1e-12, atol=1e-15)
        expected = np.array([g ** (t + 1) * s0.T @ q[t] for t in range(T)])
        assert np.allclose(out, expected, rtol=1e-12, atol=1e-15)
    # KDA: each row of the state shrinks by its own channel decay
    alphas = np.array([0.9, 0.5, 1.0, 0.2])
    _, S_kda = dr.kda_recurrent(q, k, v, beta=beta, log_gate=np.tile(np.log(alphas), (T, 1)), initial_state=s0)
    assert np.allclose(S_kda, (alphas ** T)[:, None] * s0, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("form", ["step", "recurrent", "chunkwise", "loop"])
def test_kda_with_equal_channel_decays_is_the_scalar_gated_rule(form):
    rng = np.random.default_rng(8)
    T, d_k, d_v = 37, 5, 4
    q, k, v, beta, lg = make_inputs(rng, T, d_k, d_v, "gated")
    s0 = rng.standard_normal((d_k, d_v))
    wide = np.repeat(lg[:, None], d_k, axis=1)
    if form == "step":
        o1, s1 = by_steps("gated", q, k, v, beta, lg, s0, 1.0)
        o2, s2 = by_steps("kda", q, k, v, beta, wide, s0, 1.0)
    else:
        f1, f2, extra = {"recurrent": (dr.gated_delta_rule_recurrent, dr.kda_recurrent, {}),
                         "chunkwise": (dr.gated_delta_rule_chunkwise, dr.kda_chunkwise, {"chunk_size": 8}),
                         "loop": (dr.gated_delta_rule_loop, dr.kda_loop, {})}[form]
        o1, s1 = f1(q, k, v, beta=beta, log_gate=lg, initial_state=s0, **extra)
        o2, s2 = f2(q, k, v, beta=beta, log_gate=wide, initial_state=s0, **extra)
    assert rel_err(o2, o1) <= 1e-12 and rel_err(s2, s1) <= 1e-12


def test_gated_with_log_gate_zero_is_deltanet():
    rng = np.random.default_rng(9)
    q, k, v, beta, _ = make_inputs(rng, 30, 4, 3, "delta")
    o1, s1 = dr.delta_rule_chunkwise(q, k, v, beta=beta, chunk_size=8)
    o2, s2 = dr.gated_delta_rule_chunkwise(q, k, v, beta=beta, log_gate=np.zeros(30), chunk_size=8)
    assert rel_err(o2, o1) <= 1e-13 and rel_err(s2, s1) <= 1e-13


def test_a_long_sequence_split_in_two_calls_is_one_call():
    rng = np.random.default_rng(10)
    q, k, v, beta, lg = make_inputs(rng, 90, 4, 3, "kda")
    o, s = dr.kda_chunkwise(q, k, v, beta=beta, log_gate=lg, chunk_size=16)
    o1, s1 = dr.kda_chunkwise(q[:50], k[:50], v[:50], beta=beta[:50], log_gate=lg[:50], chunk_size=16)
    o2, s2 = dr.kda_recurrent(q[50:], k[50:], v[50:], beta=beta[50:], log_gate=lg[50:], initial_state=s1)
    assert rel_err(np.concatenate([o1, o2]), o) <= 1e-12 and rel_err(s2, s) <= 1e-12


def test_empty_sequence_returns_the_initial_state():
    s0 = np.arange(6.0).reshape(3, 2)
    for fn in (dr.delta_rule_recurrent, dr.delta_rule_chunkwise):
        o, s = fn(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 2)), beta=np.zeros(0), initial_state=s0)
        assert o.shape == (0, 2)
        np.testing.assert_array_equal(s, s0)


# --------------------------------------------------------------------------- KDA's bounded decay

def test_kda_log_gate_is_bounded_and_matches_the_formula():
    z = np.linspace(-30.0, 30.0, 101)
    lg = dr.kda_log_gate(z)
    expected = -5.0 / (1.0 + np.exp(-z))
    assert np.allclose(lg, expected, rtol=1e-13, atol=0)
    alpha = np.exp(lg)
    assert np.all(alpha >= np.exp(-5.0)) and np.all(alpha <= 1.0) and np.all(lg <= 0)
    extreme = dr.kda_log_gate(np.array([-1e4, 1e4]), g_min=-2.0)
    assert np.all(np.isfinite(extreme))
    assert np.isclose(extreme[0], 0.0) and np.isclose(extreme[1], -2.0, rtol=1e-14)
    assert dr.kda_log_gate(z.astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("bad", [0.0, 1.0, np.nan, np.inf, True, "x"])
def test_kda_log_gate_rejects_bad_g_min(bad):
    with pytest.raises(ValueError, match="g_min"):
        dr.kda_log_gate(np.zeros(3), g_min=bad)


# --------------------------------------------------------------------------- validation

def _seq(rng, T=6, d_k=3, d_v=2):
    return rng.standard_normal((T, d_k)), rng.standard_normal((T, d_k)), rng.standard_normal((T, d_v)), \
        np.full(T, 0.5)


@pytest.mark.parametrize("fn", [dr.delta_rule_recurrent, dr.delta_rule_chunkwise])
def test_beta_outside_unit_interval_is_refused(fn):
    q, k, v, b = _seq(np.random.default_rng(0))
    for bad in (-0.1, 1.5):
        b2 = b.copy()
        b2[2] = bad
        with pytest.raises(ValueError, match="^beta"):
            fn(q, k, v, beta=b2)


@pytest.mark.parametrize("fn,shape", [(dr.gated_delta_rule_recurrent, (6,)), (dr.gated_delta_rule_chunkwise, (6,)),
                                      (dr.gated_delta_rule_loop, (6,)), (dr.gated_delta_rule_chunk, (6,)),
                                      (dr.kda_recurrent, (6, 3)), (dr.kda_chunkwise, (6, 3)),
                                      (dr.kda_loop, (6, 3))])
@pytest.mark.parametrize("bad", [0.01, 2.0, np.nan, np.inf, -np.inf])
def test_positive_or_nonfinite_log_gates_are_refused(fn, shape, bad):
    q, k, v, b = _seq(np.random.default_rng(0))
    lg = np.full(shape, -0.1)
    lg.flat[1] = bad
    with pytest.raises(ValueError, match="^log_gate"):
        fn(q, k, v, beta=b, log_gate=lg)


def test_shape_mismatches_name_the_argument():
    rng = np.random.default_rng(0)
    q, k, v, b = _seq(rng)
    cases = [
        ("k", lambda: dr.delta_rule_recurrent(q, k[:, :2], v, beta=b)),
        ("k", lambda: dr.delta_rule_recurrent(q, k[:5], v, beta=b)),
        ("v", lambda: dr.delta_rule_chunkwise(q, k, v[:5], beta=b)),
        ("q", lambda: dr.delta_rule_chunkwise(q[0], k, v, beta=b)),
        ("beta", lambda: dr.delta_rule_chunkwise(q, k, v, beta=b[:5])),
        ("beta", lambda: dr.delta_rule_chunkwise(q, k, v, beta=0.5)),       # a sequence needs (..., T)
        ("initial_state", lambda: dr.delta_rule_chunkwise(q, k, v, beta=b, initial_state=np.zeros((2, 3)))),
        ("log_gate", lambda: dr.kda_chunkwise(q, k, v, beta=b, log_gate=np.full(6, -0.1))),  # KDA: (T, d_k)
        ("log_gate", lambda: dr.gated_delta_rule_recurrent(q, k, v, beta=b, log_gate=np.full((6, 3), -0.1))),
        ("v", lambda: dr.delta_rule_step(q[0], k[0], v[0].astype(complex), beta=0.5)),
        ("k", lambda: dr.delta_rule_step(q[0], k[0, :2], v[0], beta=0.5)),
        ("initial_state", lambda: dr.delta_rule_step(q[0], k[0], v[0], beta=0.5, initial_state=np.zeros((3, 3)))),
        ("log_gate", lambda: dr.kda_step(q[0], k[0], v[0], beta=0.5, log_gate=np.full(2, -0.1))),
        ("scale", lambda: dr.delta_rule_recurrent(q, k, v, beta=b, scale=np.nan)),
        ("scale", lambda: dr.delta_rule_step(q[0], k[0], v[0], beta=0.5, scale="1")),
        ("q", lambda: dr.delta_rule_recurrent(q.astype(complex), k, v, beta=b)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match="^" + name):
            call()


def test_leading_axes_that_do_not_broadcast_are_refused():
    rng = np.random.default_rng(0)
    q, k, v, b = _seq(rng)
    q2, k3 = np.stack([q, q]), np.stack([k, k, k])
    with pytest.raises(ValueError, match="^k"):
        dr.delta_rule_chunkwise(q2, k3, v, beta=b)
    with pytest.raises(ValueError, match="^beta"):
        dr.delta_rule_recurrent(q2, k, v, beta=np.stack([b, b, b]))
    with pytest.raises(ValueError, match="^log_gate"):
        dr.gated_delta_rule_chunkwise(q2, k, v, beta=b, log_gate=np.full((3, 6), -0.1))
    with pytest.raises(ValueError, match="^initial_state"):
        dr.delta_rule_chunkwise(q2, k, v, beta=b, initial_state=np.zeros((3, 3, 2)))
    with pytest.raises(ValueError, match="^initial_state"):
        dr.delta_rule_step(q2[:, 0], k[0], v[0], beta=0.5, initial_state=np.zeros((5, 3, 2)))


def test_reference_functions_take_one_sequence():
    rng = np.random.default_rng(0)
    q, k, v, b = _seq(rng)
    with pytest.raises(ValueError, match="^q"):
        dr.gated_delta_rule_loop(np.stack([q, q]), k, v, beta=b, log_gate=np.zeros(6))
    with pytest.raises(ValueError, match="^initial_state"):
        dr.gated_delta_rule_chunk(q, k, v, beta=b, log_gate=np.zeros(6), initial_state=np.zeros((2, 3, 2)))
    with pytest.raises(ValueError, match="^q"):
        dr.gated_delta_rule_chunk(q[:0], k[:0], v[:0], beta=b[:0], log_gate=np.zeros(0))


def test_arguments_after_v_are_keyword_only():
    q, k, v, b = _seq(np.random.default_rng(0))
    with pytest.raises(TypeError):
        dr.delta_rule_recurrent(q, k, v, b)  # noqa
    with pytest.raises(TypeError):
        dr.gated_delta_rule_chunkwise(q, k, v, b, np.zeros(6))  # noqa


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_chunk_size_below_one_or_not_integer_is_refused(bad):
    q, k, v, b = _seq(np.random.default_rng(0))
    with pytest.raises(ValueError, match="chunk_size"):
        dr.delta_rule_chunkwise(q, k, v, beta=b, chunk_size=bad)


@pytest.mark.parametrize("bad", [-0.01, 1.2, np.nan])
def test_step_beta_is_checked(bad):
    x = np.ones(2)
    with pytest.raises(ValueError, match="^beta"):
        dr.delta_rule_step(x, x, x, beta=bad)


@pytest.mark.parametrize("bad", [0.5, np.nan, np.inf])
def test_step_log_gate_is_checked(bad):
    x = np.ones(2)
    with pytest.raises(ValueError, match="^log_gate"):
        dr.gated_delta_rule_step(x, x, x, beta=0.5, log_gate=bad)
    with pytest.raises(ValueError, match="^log_gate"):
        dr.kda_step(x, x, x, beta=0.5, log_gate=np.array([-0.1, bad]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["c", "transposed", "strided"])
def test_matmul_add_is_keep_times_out_plus_the_signed_product(dtype, layout):
    # the one-call update of the chunkwise forms (gemm's alpha and beta), against numpy, in every operand layout
    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 5)).astype(dtype)
    b = rng.standard_normal((5, 4)).astype(dtype)
    if layout == "transposed":
        a, b = np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T
    elif layout == "strided":
        a = np.repeat(a, 2, axis=1)[:, ::2]
    out = rng.standard_normal((6, 4)).astype(dtype)
    for keep, sign in ((0.5, 1.0), (1.0, -1.0), (0.0, 1.0)):
        expected = keep * out.astype(np.float64) + sign * (a.astype(np.float64) @ b.astype(np.float64))
        res = kernels.matmul_add(a, b, out, keep, sign)
        assert res is out and out.dtype == dtype
        tol = 1e-5 if dtype == np.float32 else 1e-13
        assert np.max(np.abs(out - expected)) <= tol * max(1.0, np.max(np.abs(expected)))
