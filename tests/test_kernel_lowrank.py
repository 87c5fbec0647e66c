"""Fused low-rank project/reconstruct Pallas kernel vs its jnp reference, CPU interpret mode (design §3.6 Kernels)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lowrank import lowrank_fused, lowrank_reference, project_reconstruct
from twocircuit_jax.fast.codecs.lowrank import LowRankConfig, init_lowrank, make_lowrank_hook
from twocircuit_jax.fast.orth import orth

# (N, H, r, dtype, block_rows): ragged N (not a multiple of the block), several blocks, rank 1, bf16.
CASES = [
    (5, 24, 3, jnp.float32, 128),
    (37, 64, 4, jnp.bfloat16, 16),
    (32, 16, 1, jnp.float32, 16),
    (50, 32, 2, jnp.bfloat16, 128),
]


def _inputs(N, H, r, dtype, seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, (N, H)).astype(dtype), orth(jax.random.normal(k2, (H, r)))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("N,H,r,dtype,bn", CASES)
def test_values_and_gradients_match_reference(N, H, r, dtype, bn):
    M, Q = _inputs(N, H, r, dtype, seed=N)
    Y, Mh = jax.jit(lambda M, Q: lowrank_fused(M, Q, interpret=True, block_rows=bn))(M, Q)
    Yr, Mhr = lowrank_reference(M, Q)
    assert Y.dtype == dtype and Mh.dtype == dtype and Y.shape == (N, r) and Mh.shape == (N, H)
    assert bool(jnp.all(jnp.isfinite(Mh)))  # no result depends on out-of-bounds (NaN) reads
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert _rel(Y, Yr) < tol and _rel(Mh, Mhr) < tol
    W = jax.random.normal(jax.random.PRNGKey(99), (N, H))  # a fixed, non-trivial cotangent

    def loss(fn):
        return lambda M, Q: jnp.sum(jnp.sin(fn(M, Q).astype(jnp.float32)) * W)

    k = jax.jit(jax.grad(loss(lambda M, Q: project_reconstruct(M, Q, interpret=True, block_rows=bn)), (0, 1)))
    gM, gQ = k(M, Q)
    rM, rQ = jax.grad(loss(lambda M, Q: lowrank_reference(M, Q)[1]), (0, 1))(M, Q)
    gtol = 1e-5 if dtype == jnp.float32 else 3e-2
    assert gM.dtype == dtype and gQ.dtype == jnp.float32
    assert _rel(gM, rM) < gtol and _rel(gQ, rQ) < gtol


def test_leading_dims_and_codec_uses_kernel():
    cfg = LowRankConfig(rank=3, use_kernel=True)
    st = init_lowrank(cfg, 16, [1])
    h = jax.random.normal(jax.random.PRNGKey(3), (2, 7, 16))
    ref, aux_r = make_lowrank_hook(st, [1], sketch=True)(1, h)
    out, aux_k = jax.jit(lambda h: make_lowrank_hook(st, [1], sketch=True, use_kernel=True, interpret=True)(1, h))(h)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
    np.testing.assert_allclose(np.asarray(aux_k["sketch"]), np.asarray(aux_r["sketch"]), rtol=1e-5, atol=1e-5)


def test_refuses_compiled_kernel_on_cpu():
    M, Q = _inputs(4, 8, 2, jnp.float32, 0)
    with pytest.raises(RuntimeError, match="interpret=True"):
        lowrank_fused(M, Q)
    with pytest.raises(RuntimeError, match="use_kernel"):
        project_reconstruct(M, Q)
