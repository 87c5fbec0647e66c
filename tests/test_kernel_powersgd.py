"""Error-feedback projection Pallas kernel P = (G + E)·Q vs its jnp reference, CPU interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.powersgd import ef_project, ef_project_reference

# (shape of G, r, G dtype, block_rows): ragged rows, several blocks, a stacked [L, n, m] leaf, bf16 gradients.
CASES = [
    ((7, 12), 2, jnp.float32, 128),
    ((40, 24), 4, jnp.float32, 16),
    ((3, 20, 9), 2, jnp.bfloat16, 16),
    ((33, 8), 1, jnp.bfloat16, 128),
]


@pytest.mark.parametrize("shape,r,dtype,bn", CASES)
def test_matches_reference(shape, r, dtype, bn):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(shape[-2]), 3)
    G = jax.random.normal(k1, shape).astype(dtype)
    E = 0.3 * jax.random.normal(k2, shape)
    Q = jax.random.normal(k3, shape[:-2] + (shape[-1], r))
    P = jax.jit(lambda G, E, Q: ef_project(G, E, Q, interpret=True, block_rows=bn))(G, E, Q)
    want = ef_project_reference(G, E, Q)
    if len(shape) == 3:  # the batched reference is itself per layer
        np.testing.assert_allclose(np.asarray(want[1]), np.asarray(ef_project_reference(G[1], E[1], Q[1])), rtol=1e-6)
    assert P.dtype == jnp.float32 and P.shape == shape[:-1] + (r,)
    assert bool(jnp.all(jnp.isfinite(P)))
    np.testing.assert_allclose(np.asarray(P), np.asarray(want), rtol=1e-5, atol=1e-5)
    # The error memory matters: dropping it changes the answer (the test can fail).
    assert not np.allclose(np.asarray(P), np.asarray(ef_project_reference(G, jnp.zeros_like(E), Q)), atol=1e-3)


def test_refuses_compiled_kernel_on_cpu_and_bad_shapes():
    G = jnp.ones((4, 6))
    with pytest.raises(RuntimeError, match="interpret=True"):
        ef_project(G, G, jnp.ones((6, 2)))
    with pytest.raises(ValueError, match="expected"):
        ef_project(G, G, jnp.ones((5, 2)), interpret=True)
