"""Pallas prf_mask kernel vs its jnp reference (values and gradients, interpret mode) and the codec's kernel path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prf
from pallas_kernels.prf_mask import MaskRows, prf_mask_kernel, prf_mask_reference
from twocircuit_jax.fast.codecs import prf_mask as mask
from twocircuit_jax.fast.codecs.prf_mask import PrfMaskConfig


def make_rows(key, n, width, exact_k: bool, k=5):
    """Seeded per-row inputs: random row keys, a real threshold (exact-k or Bernoulli), random flips and gains."""
    ks = jax.random.split(key, 4)
    khi, klo = jax.random.bits(ks[0], (n, 1), jnp.uint32), jax.random.bits(ks[1], (n, 1), jnp.uint32)
    flip = jnp.where(jax.random.bernoulli(ks[2], 0.5, (n, 1)), jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
    gain = jax.random.uniform(ks[3], (n, 1), jnp.float32, 0.5, 4.0)
    if exact_k:
        u = prf.channel_u(prf.U64(khi, klo), jnp.arange(width, dtype=jnp.uint32)[None, :])
        u = prf.U64(u.hi ^ (flip & jnp.uint32(0x1FFFFF)), u.lo ^ flip)
        thr, thr_j = mask.exact_k_threshold(u, k)
        thr_hi, thr_lo, thr_j = thr.hi[:, None], thr.lo[:, None], thr_j[:, None]
    else:
        t = prf.const64(mask.bernoulli_threshold(0.7))
        thr_hi, thr_lo = jnp.full((n, 1), t.hi), jnp.full((n, 1), t.lo)
        thr_j = jnp.full((n, 1), 0xFFFFFFFF, jnp.uint32)
    return MaskRows(khi, klo, thr_hi, thr_lo, thr_j, flip, gain)


@functools.partial(jax.jit, static_argnames=("use_kernel", "block_rows", "block_cols"))
def value_and_grad(h, ct, rows, use_kernel, block_rows=None, block_cols=None):
    def f(x):
        if use_kernel:
            return prf_mask_kernel(x, rows, interpret=True, block_rows=block_rows, block_cols=block_cols)
        return prf_mask_reference(x, rows)

    out, vjp = jax.vjp(f, h)
    return out, vjp(ct)[0]


CASES = [
    (7, 48, jnp.float32, True),
    (7, 48, jnp.bfloat16, False),
    (14, 48, jnp.float32, False),
    (16, 128, jnp.bfloat16, True),
    (9, 200, jnp.float32, True),
]


@pytest.mark.parametrize("n,width,dtype,exact_k", CASES)
def test_kernel_matches_reference_values_and_grads(n, width, dtype, exact_k):
    key = jax.random.key(n * 1000 + width)
    kh, kc, kr = jax.random.split(key, 3)
    h = jax.random.normal(kh, (n, width), jnp.float32).astype(dtype)
    ct = jax.random.normal(kc, (n, width), jnp.float32).astype(dtype)
    rows = make_rows(kr, n, width, exact_k)
    out_r, g_r = value_and_grad(h, ct, rows, False)
    out_k, g_k = value_and_grad(h, ct, rows, True)
    assert out_k.dtype == dtype and g_k.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out_k, np.float32), np.asarray(out_r, np.float32))
    np.testing.assert_array_equal(np.asarray(g_k, np.float32), np.asarray(g_r, np.float32))
    keep = np.asarray(out_r, np.float32) != 0
    if exact_k:
        assert (keep.sum(-1) == 5).all()
    else:
        assert 0.15 < keep.mean() < 0.45  # keep rate 0.3
    # the gradient is ct * gain * m: check against the reference's own mask, not just kernel == reference
    want = np.where(keep, np.asarray(ct, np.float32) * np.asarray(rows.gain), 0.0).astype(np.float32)
    np.testing.assert_allclose(np.asarray(g_r, np.float32), np.asarray(jnp.asarray(want).astype(dtype), np.float32))


def test_multi_block_grid_offsets_channels():
    n, width = 20, 48
    h = jax.random.normal(jax.random.key(5), (n, width))
    rows = make_rows(jax.random.key(6), n, width, True)
    out_r, g_r = value_and_grad(h, h, rows, False)
    out_k, g_k = value_and_grad(h, h, rows, True, block_rows=8, block_cols=16)  # 3 x 3 grid, ragged rows
    np.testing.assert_array_equal(np.asarray(out_k), np.asarray(out_r))
    np.testing.assert_array_equal(np.asarray(g_k), np.asarray(g_r))


def test_cpu_without_interpret_is_an_error():
    rows = make_rows(jax.random.key(0), 4, 8, False)
    with pytest.raises(RuntimeError, match="use_kernel"):
        prf_mask_kernel(jnp.ones((4, 8)), rows)
    c = PrfMaskConfig(use_kernel=True)
    with pytest.raises(RuntimeError, match="use_kernel"):
        mask.make_mask_hook(c, (1,), 0, jnp.zeros(1, jnp.int32), jnp.zeros((1, 2), jnp.int32))(1, jnp.ones((1, 2, 8)))
    c3 = PrfMaskConfig(use_kernel=True, prf_impl="threefry")
    with pytest.raises(ValueError, match="threefry"):
        mask.make_mask_hook(c3, (1,), 0, jnp.zeros(1, jnp.int32), jnp.zeros((1, 2), jnp.int32), interpret=True)(
            1, jnp.ones((1, 2, 8))
        )


B, T, H = 2, 7, 48
SID = jnp.array([5, 1], jnp.int32)
POS = jnp.array([[0, 1, 2, 3, 4, 5, 6], [-1, -1, 0, 1, 2, 3, 4]], jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 4))
def codec_value_and_grad(c, h, ct, step, interpret):
    def f(x):
        return mask.make_mask_hook(c, (3, 7), step, SID, POS, interpret=interpret)(7, x)[0]

    out, vjp = jax.vjp(f, h)
    return out, vjp(ct)[0]


@pytest.mark.parametrize(
    "exact_k,rescale,antithetic,impl,dtype",
    [
        (True, "constant", False, "u32pair", jnp.float32),
        (False, "rms_match", True, "x64", jnp.float32),
        (True, "none", True, "u32pair", jnp.bfloat16),
    ],
)
def test_codec_kernel_path_matches_reference_path(exact_k, rescale, antithetic, impl, dtype):
    kw = dict(p=0.8, exact_k=exact_k, rescale_mode=rescale, antithetic=antithetic, prf_impl=impl)
    h = jax.random.normal(jax.random.key(2), (B, T, H)).astype(dtype)
    ct = jax.random.normal(jax.random.key(3), (B, T, H)).astype(dtype)
    for step in (4, 5):  # even and odd (antithetic flip)
        ref = codec_value_and_grad(PrfMaskConfig(**kw), h, ct, step, False)
        ker = codec_value_and_grad(PrfMaskConfig(use_kernel=True, **kw), h, ct, step, True)
        for a, b in zip(ker, ref):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
