"""Pallas codec kernels inside the batch-sharded step: explicit shard_map per device, equal to the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from twocircuit_jax.config import MeshConfig
from twocircuit_jax.fast.codecs import lowrank as lr
from twocircuit_jax.fast.codecs.lowrank import LowRankConfig
from twocircuit_jax.fast.codecs.prf_mask import PrfMaskConfig, make_mask_hook
from twocircuit_jax.parallel import dispatch, make_mesh

MESH = None


def _mesh():
    global MESH
    if MESH is None:
        MESH = make_mesh(MeshConfig(data=4, fsdp=2, tensor=1))
    return MESH


def _inputs(B=8, T=6, H=48, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    sid = jnp.arange(B, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return h, sid, pos


def _run(hook_builder, h, mesh):
    sh = NamedSharding(mesh, P(("data", "fsdp")))

    def f(h):
        hook = hook_builder()
        out, _ = hook(1, h)
        return out, jax.grad(lambda x: jnp.sum(hook(1, x)[0] * jnp.cos(x)))(h)

    jitted = dispatch.jit(f, in_shardings=sh, out_shardings=sh)
    text = jitted.lower(jax.device_put(h, sh)).as_text()
    return jax.device_get(jitted(jax.device_put(h, sh))), text


@pytest.mark.parametrize("exact_k", [True, False])
def test_mask_kernel_shard_mapped_equals_reference(exact_k):
    mesh = _mesh()
    h, sid, pos = _inputs()
    kcfg = PrfMaskConfig(p=0.75, exact_k=exact_k, use_kernel=True)
    rcfg = PrfMaskConfig(p=0.75, exact_k=exact_k)
    (ko, kg), text = _run(lambda: make_mask_hook(kcfg, (1,), 3, sid, pos, interpret=True, mesh=mesh), h, mesh)
    (ro, rg), _ = _run(lambda: make_mask_hook(rcfg, (1,), 3, sid, pos), h, mesh)
    assert "shard_map" in text or "sdy.manual_computation" in text  # the kernel runs per device, explicitly
    np.testing.assert_array_equal(ko, ro)
    np.testing.assert_array_equal(kg, rg)


def test_lowrank_kernel_shard_mapped_equals_reference():
    mesh = _mesh()
    h, _, _ = _inputs(H=32)
    cfg = LowRankConfig(rank=4)
    st = lr.init_lowrank(cfg, 32, (1,))
    (ko, kg), text = _run(
        lambda: lr.make_lowrank_hook(st, (1,), sketch=False, use_kernel=True, interpret=True, mesh=mesh), h, mesh
    )
    (ro, rg), _ = _run(lambda: lr.make_lowrank_hook(st, (1,), sketch=False), h, mesh)
    assert "shard_map" in text or "sdy.manual_computation" in text
    np.testing.assert_allclose(ko, ro, atol=1e-5)
    np.testing.assert_allclose(kg, rg, atol=1e-5)


def test_rows_that_do_not_split_are_a_clear_error():
    mesh = _mesh()
    h, sid, pos = _inputs(B=1, T=3)  # 3 rows over an 8-way batch split
    cfg = PrfMaskConfig(p=0.5, use_kernel=True)
    hook = make_mask_hook(cfg, (1,), 0, sid, pos, interpret=True, mesh=mesh)
    with pytest.raises(ValueError, match="do not split"):
        dispatch.jit(lambda x: hook(1, x)[0])(h)
