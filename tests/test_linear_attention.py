"""Causal linear attention (fixedstate.linear_attention).

Properties from chapter chap-linear-attention:
- the parallel, recurrent, chunkwise and token-by-token step forms agree with the
  reference loop to a relative error of 1e-12 in float64, with and without the
  normalizer, from a zero or a nonzero initial state, for length 1, lengths not
  divisible by the chunk size, and d_k != d_v; with leading axes, a batched call
  equals the loop over its items, broadcasting included;
- the normalized output is the kernel-weighted average of eq-la-kernel, computed
  here by an independent double loop; the un-normalized identity-map form is
  tril(Q K^T) V (eq-la-associativity); with normalize=True the state's last column
  is the normalizer z = sum phi(k);
- elu+1 is positive and equals elu(x)+1; FAVOR+ features are positive, their inner
  product is an unbiased estimate of exp(q.k) and its error falls with the number
  of features; Linformer with an identity projection is bidirectional softmax attention;
- the additive write piles up: writing a second value under the same key returns
  the sum (the recall weakness);
- float32 in gives float32 out;
- bad input raises ValueError naming the argument.
"""

import numpy as np

from _shapes import thin
import pytest
from hypothesis import given, strategies as st

from _examples import examples

from fixedstate import linear_attention as la
from fixedstate import softmax_attention as sa

SETTINGS = examples(50)
RTOL = 1e-12
FORMS = ("parallel", "recurrent", "chunkwise")


def _data(seed, t, d_k, d_v, lead=()):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(lead + (t, d_k)), rng.standard_normal(lead + (t, d_k)),
            rng.standard_normal(lead + (t, d_v)))


def _close(a, b, rtol=RTOL):
    scale = max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def _form(name):
    return {"parallel": la.linear_attention_parallel, "recurrent": la.linear_attention_recurrent,
            "chunkwise": la.linear_attention_chunkwise, "loop": la.linear_attention_loop}[name]


def _by_steps(q, k, v, **kwargs):
    state = kwargs.pop("initial_state", None)
    outs = []
    for i in range(q.shape[-2]):
        o, state = la.linear_attention_step(q[..., i, :], k[..., i, :], v[..., i, :], initial_state=state, **kwargs)
        outs.append(o)
    return np.stack(outs, axis=-2), state


def _kernel_average_loop(q, k, v, phi):
    """eq-la-kernel by its definition: a weighted average with weights phi(q_t).phi(k_j), j <= t."""
    out = np.zeros((q.shape[0], v.shape[1]))
    for t in range(q.shape[0]):
        weights = [float(phi(q[t:t + 1])[0] @ phi(k[j:j + 1])[0]) for j in range(t + 1)]
        out[t] = sum(w * v[j] for j, w in enumerate(weights)) / sum(weights)
    return out


def test_elu_plus_one_definition_and_positivity():
    x = np.linspace(-30, 30, 601)
    elu = np.where(x > 0, x, np.expm1(x))
    np.testing.assert_allclose(la.elu_plus_one(x), elu + 1, rtol=1e-12, atol=1e-15)
    assert np.all(la.elu_plus_one(x) > 0)
    assert np.all(np.isfinite(la.elu_plus_one(np.array([1e300, -1e300]))))


def test_normalized_form_is_the_kernel_weighted_average():
    q, k, v = _data(0, 7, 3, 2)
    expected = _kernel_average_loop(q, k, v, la.elu_plus_one)
    for name in FORMS + ("loop",):
        _close(_form(name)(q, k, v)[0], expected, rtol=1e-10)


def test_identity_map_unnormalized_is_masked_product():
    q, k, v = _data(1, 6, 4, 3)
    expected = np.tril(q @ k.T) @ v
    for name in FORMS + ("loop",):
        out, state = _form(name)(q, k, v, feature_map=la.identity_feature_map, normalize=False)
        _close(out, expected)
        assert state.shape == (4, 3)
        _close(state, k.T @ v)                       # the whole prefix summarised in (d_k, d_v)


def test_normalized_state_holds_the_normalizer_as_its_last_column():
    q, k, v = _data(2, 9, 3, 2)
    phi_k = la.elu_plus_one(k)
    for name in FORMS + ("loop",):
        _, state = _form(name)(q, k, v)
        assert state.shape == (3, 3)                 # (r, d_v + 1)
        _close(state[:, :2], phi_k.T @ v)            # S = sum phi(k) v^T
        _close(state[:, 2], phi_k.sum(axis=0))       # z = sum phi(k): the state of a value 1


@SETTINGS
@given(t=st.integers(1, 20), d_k=st.integers(1, 5), d_v=st.integers(1, 5), chunk=st.integers(1, 8),
       normalize=st.booleans(), with_initial=st.booleans(), scale=st.sampled_from([1.0, 0.3]),
       seed=st.integers(0, 10**6))
def test_all_forms_agree_with_the_reference_loop(t, d_k, d_v, chunk, normalize, with_initial, scale, seed):
    q, k, v = _data(seed, t, d_k, d_v)
    kwargs = {"normalize": normalize, "scale": scale}
    if with_initial:
        rng = np.random.default_rng(seed + 1)
        s0 = rng.standard_normal((d_k, d_v + normalize))
        if normalize:
            s0[:, -1] = rng.uniform(0.5, 2.0, d_k)   # the normalizer of earlier tokens is positive
        kwargs["initial_state"] = s0
    ref, s_ref = la.linear_attention_loop(q, k, v, **kwargs)
    results = [_form(name)(q, k, v, **kwargs) for name in ("parallel", "recurrent")]
    results.append(la.linear_attention_chunkwise(q, k, v, chunk_size=chunk, **kwargs))
    results.append(_by_steps(q, k, v, **kwargs))
    for out, state in results:
        _close(out, ref)
        _close(state, s_ref)


def test_state_carries_over_split_sequences():
    # processing a sequence in two calls with the state handed over = one call
    q, k, v = _data(2, 11, 3, 4)
    full, s_full = la.linear_attention_recurrent(q, k, v)
    a, s_a = la.linear_attention_chunkwise(q[:5], k[:5], v[:5], chunk_size=2)
    b, s_b = la.linear_attention_parallel(q[5:], k[5:], v[5:], initial_state=s_a)
    _close(np.concatenate([a, b]), full)
    _close(s_b, s_full)


def test_readout_includes_current_token():
    q, k, v = _data(3, 1, 3, 2)
    # one token: the weighted average of a single value is that value
    _close(la.linear_attention_parallel(q, k, v)[0], v)
    out, state = la.linear_attention_step(q[0], k[0], v[0])
    _close(out, v[0])


def test_step_does_not_modify_inputs():
    state = np.ones((3, 3))
    q, k, v = _data(4, 1, 3, 2)
    la.linear_attention_step(q[0], k[0], v[0], initial_state=state)
    np.testing.assert_array_equal(state, 1.0)
    for name in ("recurrent", "chunkwise", "parallel", "loop"):
        _form(name)(q, k, v, initial_state=state)
        np.testing.assert_array_equal(state, 1.0)


# ---------------------------------------------------------------- leading axes

@examples(40)
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple), t=st.integers(1, 9),
       chunk=st.integers(1, 4), normalize=st.booleans(), seed=st.integers(0, 10**6),
       masks=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=4, max_size=4),
       drop=st.lists(st.integers(0, 3), min_size=4, max_size=4), with_state=st.booleans())
def test_batched_equals_loop_over_items(lead, t, chunk, normalize, seed, masks, drop, with_state):
    rng = np.random.default_rng(seed)
    d_k, d_v = 3, 2
    shapes = [thin(lead, m, n) for m, n in zip(masks, drop)]
    q = rng.standard_normal(shapes[0] + (t, d_k))
    k = rng.standard_normal(shapes[1] + (t, d_k))
    v = rng.standard_normal(shapes[2] + (t, d_v))
    s0 = np.abs(rng.standard_normal(shapes[3] + (d_k, d_v + normalize))) if with_state else None
    full = np.broadcast_shapes(*(shapes[:3] + ([shapes[3]] if with_state else [])))
    kw = {"normalize": normalize, "scale": 0.7}
    out_ref = np.empty(full + (t, d_v))
    s_ref = np.empty(full + (d_k, d_v + normalize))
    for idx in np.ndindex(*full):
        item = lambda x: None if x is None else np.broadcast_to(x, full + x.shape[-2:])[idx]  # noqa: E731
        out_ref[idx], s_ref[idx] = la.linear_attention_loop(item(q), item(k), item(v), initial_state=item(s0),
                                                            **kw)
    results = [_form(name)(q, k, v, initial_state=s0, **kw) for name in ("parallel", "recurrent")]
    results.append(la.linear_attention_chunkwise(q, k, v, initial_state=s0, chunk_size=chunk, **kw))
    results.append(_by_steps(q, k, v, initial_state=s0, **kw))
    for out, state in results:
        assert out.shape == full + (t, d_v) and state.shape == full + (d_k, d_v + normalize)
        _close(out, out_ref)
        _close(state, s_ref)


# ---------------------------------------------------------------- precision

@pytest.mark.parametrize("low", [np.float32, np.float16])
@pytest.mark.parametrize("name", FORMS + ("loop", "step"))
@pytest.mark.parametrize("normalize", [True, False])
def test_float32_in_float32_out(name, normalize, low):
    q, k, v = _data(20, 6, 3, 2)
    s0 = np.abs(_data(21, 3, 3, 2 + normalize)[2])
    call = (lambda *a, **kw: la.linear_attention_step(a[0][0], a[1][0], a[2][0], **kw)) if name == "step" \
        else _form(name)
    o64, s64 = call(q, k, v, normalize=normalize, initial_state=s0, scale=0.5)
    f32 = [x.astype(low) for x in (q, k, v, s0)]          # float16 computes in float32, as every core does
    o32, s32 = call(*f32[:3], normalize=normalize, initial_state=f32[3], scale=0.5)
    assert o32.dtype == np.float32 and s32.dtype == np.float32
    assert o64.dtype == np.float64 and s64.dtype == np.float64
    if low == np.float32:
        _close(o32.astype(np.float64), o64, rtol=1e-5)


def test_feature_maps_kernels_and_linformer_keep_the_precision_rule():
    """Every function of the module, not only the recurrent forms: float16 in gives float32 out."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 4))
    w = la.draw_favor_projection(4, 8, rng)
    proj = la.draw_linformer_projection(6, 3, rng)
    calls = {
        "elu_plus_one": lambda a: la.elu_plus_one(a),
        "identity_feature_map": lambda a: la.identity_feature_map(a),
        "softmax_kernel": lambda a: la.softmax_kernel(a, a),
        "favor_plus_features": lambda a: la.favor_plus_features(a, w.astype(a.dtype)),
        "linformer_attention": lambda a: la.linformer_attention(a, a, a, proj.astype(a.dtype), proj.astype(a.dtype)),
    }
    for name, call in calls.items():
        for low, want in ((np.float16, np.float32), (np.float32, np.float32), (np.float64, np.float64)):
            assert call(x.astype(low)).dtype == want, (name, low)


def test_favor_features_with_other_width_agree_across_forms():
    rng = np.random.default_rng(5)
    q, k, v = (0.5 * a for a in _data(5, 13, 4, 3))
    w = la.draw_favor_projection(4, 10, rng)
    phi = lambda x: la.favor_plus_features(x, w)  # noqa: E731
    par, _ = la.linear_attention_parallel(q, k, v, feature_map=phi)
    rec, state = la.linear_attention_recurrent(q, k, v, feature_map=phi)
    chk, _ = la.linear_attention_chunkwise(q, k, v, feature_map=phi, chunk_size=4)
    assert state.shape == (10, 4)                # (r, d_v + 1)
    _close(rec, par)
    _close(chk, par)
    _close(par, _kernel_average_loop(q, k, v, phi))


@pytest.mark.parametrize("orthogonal", [False, True])
def test_favor_is_unbiased(orthogonal):
    rng = np.random.default_rng(7)
    q = np.array([[0.3, -0.5, 0.2, 0.4]])
    k = np.array([[0.6, 0.1, -0.3, 0.5]])
    exact = float(la.softmax_kernel(q, k)[0, 0])
    estimates = []
    for _ in range(4000):
        w = la.draw_favor_projection(4, 64, rng, orthogonal=orthogonal)
        estimates.append(float(la.favor_plus_features(q, w)[0] @ la.favor_plus_features(k, w)[0]))
    estimates = np.array(estimates)
    assert np.all(estimates > 0)
    standard_error = estimates.std(ddof=1) / np.sqrt(len(estimates))
    # unbiased: the mean of 4000 independent estimates lies within 4 standard errors
    assert abs(estimates.mean() - exact) < 4 * standard_error
    assert standard_error < 0.01 * exact       # and the test has the power to see a 4% bias


def test_favor_error_falls_with_more_features():
    rng = np.random.default_rng(8)
    data = np.random.default_rng(9)
    q, k = 0.25 * data.standard_normal((6, 8)), 0.25 * data.standard_normal((6, 8))
    exact = la.softmax_kernel(q, k)

    def mse(m, orthogonal):
        errs = [np.mean((la.favor_plus_features(q, w) @ la.favor_plus_features(k, w).T - exact) ** 2)
                for w in (la.draw_favor_projection(8, m, rng, orthogonal=orthogonal) for _ in range(200))]
        return float(np.mean(errs))

    iid = {m: mse(m, False) for m in (8, 32, 128, 512)}
    # the variance of a mean of m iid features falls like 1/m: a factor 4 per step here
    for small, big in ((8, 32), (32, 128), (128, 512)):
        assert 2.5 < iid[small] / iid[big] < 7.0
    # orthogonal blocks do no worse at the same count (lower variance, Choromanski et al.)
    assert mse(512, True) < 1.2 * iid[512]


def test_orthogonal_projection_blocks_are_orthogonal():
    w = la.draw_favor_projection(5, 12, np.random.default_rng(0))
    assert w.shape == (12, 5)
    block = w[:5] / np.linalg.norm(w[:5], axis=1, keepdims=True)
    np.testing.assert_allclose(block @ block.T, np.eye(5), atol=1e-12)


def test_performer_attention_approaches_softmax_attention():
    rng = np.random.default_rng(10)
    q, k, v = _data(11, 16, 4, 3)
    q, k = 0.5 * q, 0.5 * k
    exact, _ = sa.softmax_attention(q, k, v, scale=1.0)
    errors = []
    for m in (8, 128, 2048):
        rms = []
        for _ in range(10):
            w = la.draw_favor_projection(4, m, rng)
            out, _ = la.linear_attention_parallel(q, k, v, feature_map=lambda x: la.favor_plus_features(x, w))
            rms.append(np.sqrt(np.mean((out - exact) ** 2)))
        errors.append(np.mean(rms))
    assert errors[0] > 1.5 * errors[1] > 2.25 * errors[2]
    assert errors[2] < 0.05


def test_linformer_with_identity_projection_is_bidirectional_softmax():
    q, k, v = _data(12, 7, 3, 2)
    eye = np.eye(7)
    _close(la.linformer_attention(q, k, v, eye, eye), sa.softmax_attention(q, k, v, causal=False)[0])
    perm = eye[np.random.default_rng(0).permutation(7)]
    _close(la.linformer_attention(q, k, v, perm, perm), sa.softmax_attention(q, k, v, causal=False)[0])


def test_linformer_exact_on_duplicated_tokens_and_not_causal():
    q, k_half, v_half = _data(13, 4, 3, 2)
    k, v = np.repeat(k_half, 2, axis=0), np.repeat(v_half, 2, axis=0)   # every token twice
    q = np.repeat(q, 2, axis=0)
    average_pairs = np.kron(np.eye(4), [[0.5, 0.5]])                      # (4, 8)
    _close(la.linformer_attention(q, k, v, average_pairs, average_pairs),
           sa.softmax_attention(q, k, v, causal=False)[0])
    v2 = v.copy()
    v2[-1] += 1
    e = la.draw_linformer_projection(8, 3, np.random.default_rng(1))
    a = la.linformer_attention(q, k, v, e, e)
    b = la.linformer_attention(q, k, v2, e, e)
    assert not np.allclose(a[0], b[0])          # the first output sees the last token


def test_additive_write_piles_up_values_under_one_key():
    key = np.array([1.0, 0.0, 0.0])
    v_old, v_new = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    kw = {"feature_map": la.identity_feature_map, "normalize": False}
    _, state = la.linear_attention_step(key, key, v_old, **kw)
    out, state = la.linear_attention_step(key, key, v_new, initial_state=state, **kw)
    _close(out, v_old + v_new)


@pytest.mark.parametrize("call, name", [
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, feature_map=la.identity_feature_map), "feature_map"),
    (lambda q, k, v: la.linear_attention_recurrent(q, k, v, feature_map=la.identity_feature_map), "feature_map"),
    (lambda q, k, v: la.linear_attention_step(q[0], k[0], v[0], feature_map=la.identity_feature_map),
     "feature_map"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, feature_map=lambda x: x[:, :1].T), "feature_map"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, feature_map=3), "feature_map"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, feature_map=lambda x: x[..., :2] if x is q else x),
     "feature_map"),
    (lambda q, k, v: la.linear_attention_chunkwise(q, k, v, chunk_size=0), "chunk_size"),
    (lambda q, k, v: la.linear_attention_chunkwise(q, k, v, chunk_size=2.0), "chunk_size"),
    (lambda q, k, v: la.linear_attention_parallel(q, k[:-1], v), "k"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v[:-1]), "v"),
    (lambda q, k, v: la.linear_attention_parallel(q, k[:, :2], v), "k"),
    (lambda q, k, v: la.linear_attention_parallel(q.astype(complex), k, v), "q"),
    (lambda q, k, v: la.linear_attention_parallel(q[:0], k[:0], v[:0]), "q"),
    (lambda q, k, v: la.linear_attention_parallel(q[0], k, v), "q"),
    (lambda q, k, v: la.linear_attention_parallel(np.stack([q, q]), np.stack([k, k, k]), v), "k"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, initial_state=np.zeros((3, 2))), "initial_state"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, normalize=False, initial_state=np.zeros((3, 3))),
     "initial_state"),
    (lambda q, k, v: la.linear_attention_recurrent(q, k, v, initial_state=-np.ones((3, 3))), "initial_state"),
    (lambda q, k, v: la.linear_attention_chunkwise(np.stack([q, q]), k, v, initial_state=np.ones((3, 3, 3))),
     "initial_state"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, eps=0.0), "eps"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, normalize=1), "normalize"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, scale=np.inf), "scale"),
    (lambda q, k, v: la.linear_attention_step(q[0], k[0], v[0], initial_state=np.zeros((2, 3))), "initial_state"),
    (lambda q, k, v: la.linear_attention_step(q[0], k[0], v[0], initial_state=-np.ones((3, 3))), "initial_state"),
    (lambda q, k, v: la.linear_attention_step(q[0], k[0, :2], v[0]), "k"),
    (lambda q, k, v: la.linear_attention_loop(np.stack([q, q]), k, v), "q"),
    (lambda q, k, v: la.favor_plus_features(q, np.ones((4, 2))), "projection"),
    (lambda q, k, v: la.draw_favor_projection(3, 4, 0), "rng"),
    (lambda q, k, v: la.linformer_attention(q, k, v, np.ones((2, 5)), np.ones((2, 4))), "proj_k"),
    (lambda q, k, v: la.linformer_attention(q, k, v, np.ones((2, 4)), np.ones((3, 4))), "proj_v"),
])
def test_bad_input_names_the_argument(call, name):
    q, k, v = _data(14, 4, 3, 2)
    with pytest.raises(ValueError, match="^" + name):
        call(q, k, v)


def test_arguments_after_v_are_keyword_only():
    q, k, v = _data(14, 4, 3, 2)
    with pytest.raises(TypeError):
        la.linear_attention_parallel(q, k, v, la.elu_plus_one)  # noqa


def test_identity_map_is_fine_without_normalizer():
    q, k, v = _data(15, 4, 3, 2)
    out = la.linear_attention_chunkwise(q, k, v, feature_map=la.identity_feature_map, normalize=False,
                                        chunk_size=3)[0]
    _close(out, np.tril(q @ k.T) @ v)
