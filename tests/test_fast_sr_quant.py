"""sr_quant codec (design §3.4) against a NumPy reference driven by the integer-oracle uniforms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prf
from twocircuit_jax.fast.codecs import prf_mask as mask, sr_quant as sq
from twocircuit_jax.fast.codecs.sr_quant import SrQuantConfig

B, T, H, LAYER = 2, 3, 20, 5
SID = jnp.array([9, 4], jnp.int32)
POS = jnp.array([[0, 1, 2], [-3, 0, 1]], jnp.int32)
X = jax.random.normal(jax.random.key(0), (B, T, H), jnp.float32)
CT = jax.random.normal(jax.random.key(1), (B, T, H), jnp.float32)


def cfg(**kw):
    base = dict(quant_bits=1, quant_block=8, rounding="sr", seed=7)
    base.update(kw)
    return SrQuantConfig(**base)


def oracle_unif(c, step, direction, sid=SID, pos=POS, width=H):
    u = np.array(
        [
            [
                [prf.oracle_u(c.seed, LAYER, step, int(sid[b]), int(pos[b, t]), j, direction) for j in range(width)]
                for t in range(pos.shape[1])
            ]
            for b in range(len(sid))
        ],
        np.uint64,
    )
    return (u >> np.uint64(29)).astype(np.float64) / 2.0**24


def np_quantize(x, unif, bits, block, rounding):
    """Independent float64 reference: per token and block, levels -s + i * 2s / (2^bits - 1)."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    gaps = 2**bits - 1
    for start in range(0, x.shape[-1], block):
        xb = x[..., start : start + block]
        s = np.abs(xb).max(-1, keepdims=True)
        step = np.where(s > 0, 2 * s / gaps, 1.0)
        t = (xb + s) / step
        if rounding == "rn":
            q = np.round(t)
        else:
            lo = np.floor(t)
            q = lo + (unif[..., start : start + block] < t - lo)
        out[..., start : start + block] = np.where(s > 0, np.clip(q, 0, gaps) * step - s, 0.0)
    return out


@functools.partial(jax.jit, static_argnums=(0,))
def fwd_and_grad(c, h, ct, step):
    out, vjp = jax.vjp(lambda x: sq.make_quant_hook(c, (LAYER,), step, SID, POS)(LAYER, x)[0], h)
    return out, vjp(ct)[0]


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_forward_and_backward_match_numpy_reference_with_direction_bits(bits):
    c = cfg(quant_bits=bits)
    out, grad = fwd_and_grad(c, X, CT, 3)
    want_f = np_quantize(X, oracle_unif(c, 3, 0), bits, 8, "sr")
    want_b = np_quantize(CT, oracle_unif(c, 3, 1), bits, 8, "sr")
    np.testing.assert_allclose(np.asarray(out), want_f, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_b, rtol=1e-5, atol=1e-6)


def test_forward_and_backward_bits_are_independent():
    c = cfg()
    out, grad = fwd_and_grad(c, X, X, 3)  # same tensor through both directions
    up_f, up_b = np.asarray(out) > 0, np.asarray(grad) > 0
    assert (up_f != up_b).any(), "backward reused the forward bits"
    uf, ub = oracle_unif(c, 3, 0), oracle_unif(c, 3, 1)
    assert abs(np.corrcoef(uf.ravel(), ub.ravel())[0, 1]) < 0.3
    np.testing.assert_allclose(np.asarray(grad), np_quantize(X, ub, 1, 8, "sr"), rtol=1e-5, atol=1e-6)


def test_rn_is_deterministic_nearest_level():
    c = cfg(rounding="rn", quant_bits=2)
    out3, g3 = fwd_and_grad(c, X, CT, 3)
    out9, g9 = fwd_and_grad(c, X, CT, 9)
    np.testing.assert_array_equal(np.asarray(out3), np.asarray(out9))
    np.testing.assert_array_equal(np.asarray(g3), np.asarray(g9))
    np.testing.assert_allclose(np.asarray(out3), np_quantize(X, None, 2, 8, "rn"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g3), np_quantize(CT, None, 2, 8, "rn"), rtol=1e-5, atol=1e-6)


def test_sr_is_unbiased_over_steps():
    c = cfg(quant_bits=1)
    outs = jax.jit(jax.vmap(lambda s: sq.encode(c, LAYER, s, SID, POS, X)))(jnp.arange(512, dtype=jnp.int32))
    x = np.asarray(X)
    s = np.concatenate(
        [np.abs(x[..., i : i + 8]).max(-1, keepdims=True).repeat(min(8, H - i), -1) for i in range(0, H, 8)], -1
    )
    err = np.abs(np.asarray(outs).mean(0) - x)
    assert (err < 5 * s / np.sqrt(512)).all(), err.max()


def test_subset_k_quantizes_only_exact_k_channels():
    c = cfg(subset_k=6, quant_bits=2)
    out, grad = fwd_and_grad(c, X, CT, 2)
    u = mask.flipped_u(c, LAYER, 2, SID, POS, H)
    thr, thr_j = mask.exact_k_threshold(u, 6)
    keep = np.asarray(
        prf.keep_rule(
            u, prf.U64(thr.hi[..., None], thr.lo[..., None]), thr_j[..., None], jnp.arange(H, dtype=jnp.uint32)
        )
    )
    assert (keep.sum(-1) == 6).all()
    want = np_quantize(np.where(keep, X, 0), oracle_unif(c, 2, 0), 2, 8, "sr") * keep * (H / 6)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    want_b = np_quantize(np.where(keep, CT, 0), oracle_unif(c, 2, 1), 2, 8, "sr") * keep * (H / 6)
    np.testing.assert_allclose(np.asarray(grad), want_b, rtol=1e-5, atol=1e-6)


def test_rows_travel_remat_and_dtype():
    c = cfg()
    out, _ = fwd_and_grad(c, X, CT, 3)
    perm = np.array([1, 0])
    out_p = jax.jit(lambda h: sq.encode(c, LAYER, 3, SID[perm], POS[perm], h))(X[perm])
    np.testing.assert_array_equal(np.asarray(out_p), np.asarray(out)[perm])

    def loss(h, remat):
        f = lambda x: sq.make_quant_hook(c, (LAYER,), 3, SID, POS)(LAYER, jnp.tanh(x))[0]
        return jnp.sum((jax.checkpoint(f) if remat else f)(h) * CT)

    g0 = jax.jit(jax.grad(loss), static_argnums=1)(X, False)
    g1 = jax.jit(jax.grad(loss), static_argnums=1)(X, True)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))
    ob = jax.jit(lambda h: sq.encode(c, LAYER, 3, SID, POS, h))(X.astype(jnp.bfloat16))
    assert ob.dtype == jnp.bfloat16


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="subset_k"):
        sq.encode(cfg(subset_k=H + 1), LAYER, 0, SID, POS, X)
    with pytest.raises(ValueError, match="rounding"):
        sq.make_quant_hook(cfg(rounding="stochastic"), (LAYER,), 0, SID, POS)
    with pytest.raises(ValueError, match="not a boundary"):
        sq.make_quant_hook(cfg(), (LAYER,), 0, SID, POS)(LAYER + 1, X)
