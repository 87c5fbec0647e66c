"""prf_mask codec (design §3.2, invariants 1 and 2 of §8)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prf
from twocircuit_jax.fast.codecs import prf_mask as mask
from twocircuit_jax.fast.codecs.prf_mask import PrfMaskConfig

B, T, H = 4, 5, 32
BOUNDARIES = (3, 7)
SID = jnp.array([11, 2, 7, 30], jnp.int32)
POS = jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1))
X = jax.random.normal(jax.random.key(0), (B, T, H), jnp.float32)
CT = jax.random.normal(jax.random.key(1), (B, T, H), jnp.float32)


def cfg(**kw):
    base = dict(p=0.75, exact_k=True, rescale_mode="constant", seed=3)
    base.update(kw)
    return PrfMaskConfig(**base)


_mask_bits = jax.jit(mask.mask_bits, static_argnums=(0, 1, 2, 6))  # one compile per config/shape, not per op


def bits(c, step=5, sid=SID, pos=POS, layer=7, width=H):
    return np.asarray(_mask_bits(c, BOUNDARIES, layer, step, sid, pos, width))


def run_hook(c, layer, h, step=5, sid=SID, pos=POS, am=None):
    """The hook under jit (as in the train step), cached per config."""
    return _run_hook(c, layer, h, step, sid, pos, am)


_run_hook = jax.jit(
    lambda c, layer, h, step, sid, pos, am: mask.make_mask_hook(c, BOUNDARIES, step, sid, pos, am)(layer, h),
    static_argnums=(0, 1),
)


def oracle_u(c, step, layer, sid, pos, width):
    return np.array(
        [
            [
                [prf.oracle_u(c.seed, layer, step, int(sid[b]), int(pos[b, t]), j) for j in range(width)]
                for t in range(pos.shape[1])
            ]
            for b in range(len(sid))
        ],
        dtype=object,
    )


def test_bernoulli_matches_oracle_threshold():
    c = cfg(exact_k=False, p=0.6)
    u = oracle_u(c, 5, 7, SID[:2], POS[:2], 12)
    want = u >= math.floor(0.6 * 2**53)
    np.testing.assert_array_equal(bits(c, sid=SID[:2], pos=POS[:2], width=12), want.astype(bool))


def test_exact_k_matches_oracle_topk():
    c = cfg(p=0.75)
    u = oracle_u(c, 5, 7, SID[:2], POS[:2], 12)
    k = round(0.25 * 12)
    want = np.zeros(u.shape, bool)
    for b, t in np.ndindex(u.shape[:2]):
        order = sorted(range(12), key=lambda j: (-u[b, t, j], j))  # largest u, ties to the lower index
        want[b, t, order[:k]] = True
    np.testing.assert_array_equal(bits(c, sid=SID[:2], pos=POS[:2], width=12), want)


def test_exact_k_keeps_exactly_k_at_model_width():
    c = cfg(p=0.95)
    m = bits(c, sid=SID[:2], pos=POS[:2, :3], width=1536)
    assert mask.keep_count(0.95, 1536) == 77
    assert (m.sum(-1) == 77).all()
    tiny = cfg(p=0.99)  # round((1-p) H) = 0 -> still one channel
    assert (bits(tiny, width=8).sum(-1) == 1).all()


def test_bernoulli_keep_rate():
    c = cfg(exact_k=False, p=0.9)
    sid = jnp.arange(16, dtype=jnp.int32)
    pos = jnp.tile(jnp.arange(16, dtype=jnp.int32), (16, 1))
    rate = bits(c, sid=sid, pos=pos, width=128).mean()  # 32768 draws: sigma = 0.0017
    assert abs(rate - 0.1) < 0.007, rate


def test_antithetic_step_key_and_flip():
    c = cfg(exact_k=False, p=0.5, antithetic=True)
    m4, m5, m6 = bits(c, step=4), bits(c, step=5), bits(c, step=6)
    # p = 0.5: keep iff u >= 2^52, and 2^53-1-u >= 2^52 iff u < 2^52: odd step is the exact complement
    np.testing.assert_array_equal(m5, ~m4)
    assert (m4 != m6).mean() > 0.3  # step key gs // 2 moved on
    plain = cfg(exact_k=False, p=0.5)
    np.testing.assert_array_equal(bits(plain, step=2), m4)  # even step 4 -> key 2, no flip


def test_p_by_boundary_and_validation():
    c = cfg(p_by_boundary=(0.5, 0.875))
    assert (bits(c, layer=3).sum(-1) == 16).all() and (bits(c, layer=7).sum(-1) == 4).all()
    with pytest.raises(ValueError, match="p_by_boundary"):
        mask.make_mask_hook(cfg(p_by_boundary=(0.5,)), BOUNDARIES, 0, SID, POS)
    with pytest.raises(ValueError, match="rescale_mode"):
        mask.make_mask_hook(cfg(rescale_mode="sqrt"), BOUNDARIES, 0, SID, POS)
    with pytest.raises(ValueError, match="not a boundary"):
        mask.make_mask_hook(cfg(), BOUNDARIES, 0, SID, POS)(4, X)


def test_bits_travel_with_rows_and_minibatches():
    c = cfg()
    whole = bits(c)
    perm = np.array([2, 0, 3, 1])
    np.testing.assert_array_equal(bits(c, sid=SID[perm], pos=POS[perm]), whole[perm])
    split = np.concatenate([bits(c, sid=SID[:1], pos=POS[:1]), bits(c, sid=SID[1:], pos=POS[1:])])
    np.testing.assert_array_equal(split, whole)


def test_left_padding_invariance():
    c = cfg(exact_k=False)
    pad = 3
    pos_p = jnp.concatenate([jnp.full((B, pad), -7, jnp.int32), POS], axis=1)  # padding holds junk positions
    x_p = jnp.concatenate([jnp.ones((B, pad, H)), X], axis=1)
    am = jnp.concatenate([jnp.zeros((B, pad)), jnp.ones((B, T))], axis=1)
    out, aux = run_hook(c, 7, X)
    out_p, aux_p = run_hook(c, 7, x_p, pos=pos_p, am=am)
    np.testing.assert_array_equal(np.asarray(out_p[:, pad:]), np.asarray(out))
    np.testing.assert_allclose(aux_p["mask_ratio"], aux["mask_ratio"], rtol=1e-6)  # padding excluded
    np.testing.assert_allclose(aux["mask_ratio"], 1 - bits(c).mean(), rtol=1e-6)


def test_three_path_tags_see_the_same_mask():
    c = cfg()
    # old_logprob / train / reference: three separately built (and separately compiled) hooks
    outs = [
        np.asarray(jax.jit(lambda h: mask.make_mask_hook(c, BOUNDARIES, 9, SID, POS)(3, h)[0])(X)) for _ in range(3)
    ]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("exact_k", [True, False])
def test_p0_none_is_identity(exact_k):
    c = cfg(p=0.0, rescale_mode="none", exact_k=exact_k)
    out, aux = run_hook(c, 7, X)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(X))
    g = jax.jit(jax.grad(lambda h: jnp.sum(mask.make_mask_hook(c, BOUNDARIES, 5, SID, POS)(7, h)[0] * CT)))(X)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(CT))
    assert float(aux["mask_ratio"]) == 0.0


def _rms(x):
    return np.sqrt(np.mean(np.square(x), -1) + 1e-8)


@pytest.mark.parametrize("mode", ["none", "constant", "rms_match"])
def test_rescale_and_gradient_is_grad_g_m(mode):
    c = cfg(rescale_mode=mode, exact_k=False)
    m = bits(c).astype(np.float32)
    x = np.asarray(X)
    if mode == "none":
        g = np.ones((B, T, 1), np.float32)
    elif mode == "constant":
        g = np.full((B, T, 1), 1 / (1 - 0.75), np.float32)
    else:
        g = (_rms(x) / _rms(x * m))[..., None]

    def loss(h):
        hook = mask.make_mask_hook(c, BOUNDARIES, 5, SID, POS)
        return jnp.sum(hook(7, h)[0] * CT)

    out = run_hook(c, 7, X)[0]
    np.testing.assert_allclose(np.asarray(out), g * x * m, rtol=1e-6)
    if mode == "rms_match":
        np.testing.assert_allclose(_rms(np.asarray(out)), _rms(x), rtol=1e-5)
    # backward message = grad * g * m: the rms factor is a stop-gradient constant, no straight-through
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(loss))(X)), np.asarray(CT) * g * m, rtol=1e-6)


def test_remat_and_grad_see_the_same_bits():
    c = cfg(rescale_mode="none")

    def f(h, step):
        return mask.make_mask_hook(c, BOUNDARIES, step, SID, POS)(7, jnp.sin(h))[0]

    def loss(h, step, remat):
        fn = jax.checkpoint(f) if remat else f
        return jnp.sum(fn(h, step) * CT)

    m = bits(c, step=6)
    g_plain = jax.jit(jax.grad(loss), static_argnums=2)(X, 6, False)
    g_remat = jax.jit(jax.grad(loss), static_argnums=2)(X, 6, True)
    np.testing.assert_array_equal(np.asarray(g_remat), np.asarray(g_plain))
    np.testing.assert_allclose(np.asarray(g_remat), np.asarray(CT * jnp.cos(X)) * m, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(X, 6)) != 0, m)  # traced step == python step


def test_bfloat16_dtype_and_metric_weighting():
    c = cfg(exact_k=False)
    out, aux = run_hook(c, 7, X.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32) != 0, bits(c))
    am = jnp.zeros((B, T)).at[0].set(1.0)
    _, aux0 = run_hook(c, 7, X, am=am)
    np.testing.assert_allclose(aux0["mask_ratio"], 1 - bits(c)[0].mean(), rtol=1e-6)


@pytest.mark.parametrize(
    "shape,k,hi_range,lo_range",
    [
        ((3, 40, 128), 6, 2**21, 2**32),  # PRF-like words: ties in the top 32 bits are rare
        ((120, 128), 6, 3, 2**32),  # top bits collide often: the low 21 bits decide
        ((120, 128), 60, 2, 4),  # the low bits collide too: the channel index decides
        ((40, 128), 1, 1, 1),  # every word equal: the k smallest channels
        ((40, 128), 128, 1, 1),  # k = H
        ((30, 7), 3, 1, 2),  # H not a power of two
        ((20, 1536), 77, 2**21, 2**32),  # Qwen2.5-1.5B width, p = 0.95
    ],
)
@pytest.mark.parametrize("method", ["kth_by_count", "kth_by_selection"])
def test_exact_k_thresholds_equal_the_sorted_reference(shape, k, hi_range, lo_range, method):
    rng = np.random.default_rng(k * 7 + shape[-1])
    u = prf.U64(
        jnp.asarray(rng.integers(0, hi_range, shape, dtype=np.uint64).astype(np.uint32)),
        jnp.asarray(rng.integers(0, lo_range, shape, dtype=np.uint64).astype(np.uint32)),
    )
    (thr, thr_j), (ref, ref_j) = getattr(mask, method)(u, k), mask.exact_k_threshold_sort(u, k)
    np.testing.assert_array_equal(thr.hi, ref.hi)
    np.testing.assert_array_equal(thr.lo, ref.lo)
    np.testing.assert_array_equal(thr_j, ref_j)
