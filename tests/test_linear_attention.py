"""Causal linear attention (fixedstate.linear_attention).

Properties from chapter chap-linear-attention:
- the parallel, recurrent, chunkwise and token-by-token decode forms agree to a
  relative error of 1e-10 in float64, with and without the normalizer, from a zero
  or a nonzero initial state, for length 1, lengths not divisible by the chunk size,
  and d_k != d_v;
- the normalized output is the kernel-weighted average of eq-la-kernel, computed
  here by an independent double loop; the un-normalized identity-map form is
  tril(Q K^T) V (eq-la-associativity);
- elu+1 is positive and equals elu(x)+1; FAVOR+ features are positive, their inner
  product is an unbiased estimate of exp(q.k) and its error falls with the number
  of features; Linformer with an identity projection is bidirectional softmax attention;
- the additive write piles up: writing a second value under the same key returns
  the sum (the recall weakness);
- bad input raises ValueError naming the argument.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fixedstate import linear_attention as la
from fixedstate import softmax_attention as sa

SETTINGS = settings(max_examples=50, deadline=None)
RTOL = 1e-10


def _data(seed, t, d_k, d_v):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((t, d_k)), rng.standard_normal((t, d_k)), rng.standard_normal((t, d_v))


def _close(a, b):
    scale = max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * scale)


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
    _close(la.linear_attention_parallel(q, k, v), expected)
    _close(la.linear_attention_recurrent(q, k, v)[0], expected)


def test_identity_map_unnormalized_is_masked_product():
    q, k, v = _data(1, 6, 4, 3)
    expected = np.tril(q @ k.T) @ v
    out = la.linear_attention_parallel(q, k, v, feature_map=la.identity_feature_map, normalize=False)
    _close(out, expected)
    out2, state, normalizer = la.linear_attention_recurrent(
        q, k, v, feature_map=la.identity_feature_map, normalize=False)
    _close(out2, expected)
    _close(state, k.T @ v)                       # the whole prefix summarised in (d_k, d_v)
    _close(normalizer, k.sum(axis=0))            # tracked even without normalizing


@SETTINGS
@given(t=st.integers(1, 20), d_k=st.integers(1, 5), d_v=st.integers(1, 5), chunk=st.integers(1, 8),
       normalize=st.booleans(), with_initial=st.booleans(), seed=st.integers(0, 10**6))
def test_four_forms_agree(t, d_k, d_v, chunk, normalize, with_initial, seed):
    q, k, v = _data(seed, t, d_k, d_v)
    kwargs = {"normalize": normalize}
    if with_initial:
        rng = np.random.default_rng(seed + 1)
        kwargs["initial_state"] = rng.standard_normal((d_k, d_v))
        kwargs["initial_normalizer"] = rng.uniform(0.5, 2.0, d_k)
    par = la.linear_attention_parallel(q, k, v, **kwargs)
    rec, s_rec, z_rec = la.linear_attention_recurrent(q, k, v, **kwargs)
    chk, s_chk, z_chk = la.linear_attention_chunkwise(q, k, v, chunk_size=chunk, **kwargs)
    state = kwargs.get("initial_state", np.zeros((d_k, d_v)))
    normalizer = kwargs.get("initial_normalizer", np.zeros(d_k))
    dec = np.empty_like(par)
    for i in range(t):
        dec[i], state, normalizer = la.linear_attention_decode_step(
            state, normalizer, q[i], k[i], v[i], normalize=normalize)
    for other in (rec, chk, dec):
        _close(other, par)
    for s_, z_ in ((s_chk, z_chk), (state, normalizer)):
        _close(s_, s_rec)
        _close(z_, z_rec)


def test_state_carries_over_split_sequences():
    # processing a sequence in two calls with the state handed over = one call
    q, k, v = _data(2, 11, 3, 4)
    full, s_full, z_full = la.linear_attention_recurrent(q, k, v)
    a, s_a, z_a = la.linear_attention_chunkwise(q[:5], k[:5], v[:5], chunk_size=2)
    b, s_b, z_b = la.linear_attention_chunkwise(q[5:], k[5:], v[5:], chunk_size=4,
                                                initial_state=s_a, initial_normalizer=z_a)
    _close(np.concatenate([a, b]), full)
    _close(s_b, s_full)
    _close(z_b, z_full)


def test_readout_includes_current_token():
    q, k, v = _data(3, 1, 3, 2)
    # one token: the weighted average of a single value is that value
    _close(la.linear_attention_parallel(q, k, v), v)
    out, state, z = la.linear_attention_decode_step(np.zeros((3, 2)), np.zeros(3), q[0], k[0], v[0])
    _close(out, v[0])


def test_decode_step_does_not_modify_inputs():
    state, normalizer = np.ones((3, 2)), np.ones(3)
    q, k, v = _data(4, 1, 3, 2)
    la.linear_attention_decode_step(state, normalizer, q[0], k[0], v[0])
    np.testing.assert_array_equal(state, 1.0)
    np.testing.assert_array_equal(normalizer, 1.0)


def test_favor_features_with_other_width_agree_across_forms():
    rng = np.random.default_rng(5)
    q, k, v = (0.5 * a for a in _data(5, 13, 4, 3))
    w = la.draw_favor_projection(4, 10, rng)
    phi = lambda x: la.favor_plus_features(x, w)  # noqa: E731
    par = la.linear_attention_parallel(q, k, v, feature_map=phi)
    rec, state, z = la.linear_attention_recurrent(q, k, v, feature_map=phi)
    chk, _, _ = la.linear_attention_chunkwise(q, k, v, feature_map=phi, chunk_size=4)
    assert state.shape == (10, 3) and z.shape == (10,)
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
    exact = sa.causal_softmax_attention(q, k, v, scale=1.0)
    errors = []
    for m in (8, 128, 2048):
        rms = []
        for _ in range(10):
            w = la.draw_favor_projection(4, m, rng)
            out = la.linear_attention_parallel(q, k, v, feature_map=lambda x: la.favor_plus_features(x, w))
            rms.append(np.sqrt(np.mean((out - exact) ** 2)))
        errors.append(np.mean(rms))
    assert errors[0] > 1.5 * errors[1] > 2.25 * errors[2]
    assert errors[2] < 0.05


def test_linformer_with_identity_projection_is_bidirectional_softmax():
    q, k, v = _data(12, 7, 3, 2)
    eye = np.eye(7)
    _close(la.linformer_attention(q, k, v, eye, eye), sa.softmax_attention(q, k, v, causal=False))
    perm = eye[np.random.default_rng(0).permutation(7)]
    _close(la.linformer_attention(q, k, v, perm, perm), sa.softmax_attention(q, k, v, causal=False))


def test_linformer_exact_on_duplicated_tokens_and_not_causal():
    q, k_half, v_half = _data(13, 4, 3, 2)
    k, v = np.repeat(k_half, 2, axis=0), np.repeat(v_half, 2, axis=0)   # every token twice
    q = np.repeat(q, 2, axis=0)
    average_pairs = np.kron(np.eye(4), [[0.5, 0.5]])                      # (4, 8)
    _close(la.linformer_attention(q, k, v, average_pairs, average_pairs),
           sa.softmax_attention(q, k, v, causal=False))
    v2 = v.copy()
    v2[-1] += 1
    e = la.draw_linformer_projection(8, 3, np.random.default_rng(1))
    a = la.linformer_attention(q, k, v, e, e)
    b = la.linformer_attention(q, k, v2, e, e)
    assert not np.allclose(a[0], b[0])          # the first output sees the last token


def test_additive_write_piles_up_values_under_one_key():
    key = np.array([1.0, 0.0, 0.0])
    v_old, v_new = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    state, z = np.zeros((3, 2)), np.zeros(3)
    _, state, z = la.linear_attention_decode_step(state, z, key, key, v_old,
                                                  feature_map=la.identity_feature_map, normalize=False)
    out, state, z = la.linear_attention_decode_step(state, z, key, key, v_new,
                                                    feature_map=la.identity_feature_map, normalize=False)
    _close(out, v_old + v_new)


@pytest.mark.parametrize("call, name", [
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, feature_map=la.identity_feature_map), "feature_map"),
    (lambda q, k, v: la.linear_attention_recurrent(q, k, v, feature_map=la.identity_feature_map), "feature_map"),
    (lambda q, k, v: la.linear_attention_decode_step(np.zeros((3, 2)), np.zeros(3), q[0], k[0], v[0],
                                                     feature_map=la.identity_feature_map), "feature_map"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, feature_map=lambda x: x[:, :1].T), "feature_map"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, feature_map=3), "feature_map"),
    (lambda q, k, v: la.linear_attention_chunkwise(q, k, v, chunk_size=0), "chunk_size"),
    (lambda q, k, v: la.linear_attention_chunkwise(q, k, v, chunk_size=2.0), "chunk_size"),
    (lambda q, k, v: la.linear_attention_parallel(q, k[:-1], v), "keys"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v[:-1]), "values"),
    (lambda q, k, v: la.linear_attention_parallel(q, k[:, :2], v), "keys"),
    (lambda q, k, v: la.linear_attention_parallel(q.astype(complex), k, v), "queries"),
    (lambda q, k, v: la.linear_attention_parallel(q[:0], k[:0], v[:0]), "queries"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, initial_state=np.zeros((2, 3))), "initial_state"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, initial_normalizer=-np.ones(3)), "initial_normalizer"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, eps=0.0), "eps"),
    (lambda q, k, v: la.linear_attention_parallel(q, k, v, normalize=1), "normalize"),
    (lambda q, k, v: la.linear_attention_decode_step(np.zeros((2, 3)), np.zeros(3), q[0], k[0], v[0]), "state"),
    (lambda q, k, v: la.linear_attention_decode_step(np.zeros((3, 2)), np.zeros(2), q[0], k[0], v[0]), "normalizer"),
    (lambda q, k, v: la.favor_plus_features(q, np.ones((4, 2))), "projection"),
    (lambda q, k, v: la.draw_favor_projection(3, 4, 0), "rng"),
    (lambda q, k, v: la.linformer_attention(q, k, v, np.ones((2, 5)), np.ones((2, 4))), "proj_k"),
    (lambda q, k, v: la.linformer_attention(q, k, v, np.ones((2, 4)), np.ones((3, 4))), "proj_v"),
])
def test_bad_input_names_the_argument(call, name):
    q, k, v = _data(14, 4, 3, 2)
    with pytest.raises(ValueError, match="^" + name):
        call(q, k, v)


def test_identity_map_is_fine_without_normalizer():
    q, k, v = _data(15, 4, 3, 2)
    out = la.linear_attention_chunkwise(q, k, v, feature_map=la.identity_feature_map, normalize=False,
                                        chunk_size=3)[0]
    _close(out, np.tril(q @ k.T) @ v)
