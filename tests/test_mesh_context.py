"""Programs traced under their mesh (parallel/mesh_context.py): the hidden state's rows stay split over the batch
axes between layers, values unchanged; the TPU flash kernel finds its axes inside a gradient codec's shard_map that
is manual over `data` only (hierarchical PowerSGD), where `stage` and `tensor` are automatic axes of size 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from twocircuit_jax.config.sections import MeshConfig, ModelConfig
from twocircuit_jax.model import qwen2
from twocircuit_jax.parallel import mesh as pmesh
from twocircuit_jax.parallel.mesh_context import constrain_rows, under

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)


def _loss(cfg):
    def f(params, tokens, mask):
        return jnp.sum(qwen2.forward(cfg, params, tokens, mask)[..., :3] ** 2)

    return f


def test_rows_constrained_under_the_mesh_and_values_unchanged():
    mesh = pmesh.make_mesh(MeshConfig(data=2, fsdp=4), jax.devices()[:8])
    params = qwen2.init_params(CFG, jax.random.key(0))
    sh = pmesh.param_shardings(params, mesh)
    rows = NamedSharding(mesh, P(pmesh.BATCH_AXES))
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 64)
    mask = jnp.ones((8, 12), jnp.int32).at[:, :3].set(0)
    args = (jax.device_put(params, sh), jax.device_put(tokens, rows), jax.device_put(mask, rows))
    plain = jax.jit(jax.value_and_grad(_loss(CFG)), in_shardings=(sh, rows, rows))
    ctx = jax.jit(under(mesh, jax.value_and_grad(_loss(CFG))), in_shardings=(sh, rows, rows))
    assert "sharding_constraint" not in str(plain.trace(*args).jaxpr)
    assert "sharding_constraint" in str(ctx.trace(*args).jaxpr)  # the rows, between layers
    (v0, g0), (v1, g1) = plain(*args), ctx(*args)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5), g1, g0)  # reduction order


def test_without_a_mesh_the_constraint_is_the_identity():
    x = jnp.ones((8, 4))
    assert constrain_rows(x) is x
    one = pmesh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    f = lambda x: x * 2  # noqa: E731
    assert under(one, f) is f  # one device: nothing to constrain, the program is today's


@pytest.mark.tpu_compile
def test_flash_tpu_inside_a_data_manual_shard_map_compiles_for_tpu(monkeypatch):
    """The hierarchical gradient codec's case: shard_map manual over `data`, `fsdp` split by the partitioner, and
    `stage`/`tensor` automatic of size 1. The kernel's own shard_map takes every automatic axis (a Mosaic call under
    any automatic axis is refused: "cannot be automatically partitioned")."""
    from jax.experimental import topologies

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(
        platform="tpu", topology_name="v5e:2x4", chips_per_host_bounds=(2, 4, 1), num_slices=1
    ).devices
    mesh = pmesh.make_mesh(MeshConfig(data=2, fsdp=4), devices)
    cfg = ModelConfig(
        vocab_size=256, hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
        compute_dtype="bfloat16", attention="flash_tpu",
    )  # fmt: skip
    params = jax.eval_shape(lambda: qwen2.init_params(cfg, jax.random.key(0)))
    sh = pmesh.param_shardings(params, mesh)
    tok = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    rows = NamedSharding(mesh, P(pmesh.BATCH_AXES))

    def per_replica(params, tokens, mask):
        g = jax.grad(_loss(cfg))(params, tokens, mask)
        return jax.tree.map(lambda a: jax.lax.pmean(a, "data"), g)

    def step(params, tokens, mask):
        return jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(jax.tree.map(lambda _: P(), params), P("data"), P("data")),
            out_specs=jax.tree.map(lambda _: P(), params),
            axis_names={"data"},
            check_vma=False,
        )(params, tokens, mask)

    compiled = jax.jit(under(mesh, step), in_shardings=(sh, rows, rows)).lower(params, tok, tok).compile()
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("shape", [(6, 4)])
def test_rows_that_do_not_divide_are_left_alone(shape):
    mesh = pmesh.make_mesh(MeshConfig(data=2, fsdp=4), jax.devices()[:8])

    def f(x):
        return constrain_rows(x) + 1

    out = jax.jit(under(mesh, f))(jnp.ones(shape))
    np.testing.assert_array_equal(out, 2.0)


def test_auto_attention_takes_the_flash_kernel_on_whole_blocks_only():
    """`auto` resolved for the platform a program is lowered for: the TPU flash kernel needs lengths in whole
    128-row blocks; a shorter or ragged length takes the CPU rules (xla below 2,048 tokens, blockwise from there)."""
    from twocircuit_jax.model.attention import resolve

    cfg = ModelConfig(compute_dtype="bfloat16")
    assert resolve(cfg, 4096, "tpu") == "flash_tpu"
    assert resolve(cfg, 20, "tpu") == "xla"
    assert resolve(cfg, 4100, "tpu") == "blockwise"
    assert resolve(cfg, 4096, "cuda") == "cudnn"
    assert resolve(ModelConfig(attention="blockwise"), 4096, "tpu") == "blockwise"  # a named kernel is kept
