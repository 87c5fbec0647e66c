"""The sharded pure train step: equals the single-device step, keeps shardings, compiles once, skips NaN."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.config import MeshConfig, ModelConfig, OptimConfig
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.model import init_params
from twocircuit_jax.parallel import batch_shardings, make_mesh, mesh_shape, replicated
from twocircuit_jax.step.sft_loss import next_token_loss
from twocircuit_jax.step.train_step import init_state, jit_train_step, make_optimizer, make_train_step, state_shardings

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64
)
OPT = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0)


def _batch(seed=0, B=8, T=12):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    mask[::3, :2] = 0
    return {"tokens": jnp.asarray(tokens), "attention_mask": jnp.asarray(mask), "loss_mask": jnp.asarray(mask)}


def _build(mesh_cfg, devices):
    mesh = make_mesh(mesh_cfg, devices)
    opt = make_optimizer(OPT)
    step = make_train_step(functools.partial(next_token_loss, CFG), opt)
    state = init_state(init_params(CFG, jax.random.key(0)), opt)
    sh = state_shardings(state, mesh)
    state = jax.device_put(state, sh)
    batch = _batch()
    bsh = batch_shardings(batch, mesh)
    jitted = jit_train_step(step, sh, None, bsh, replicated(mesh))
    return mesh, jitted, state, sh, bsh


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name, mcfg, devs in [
        ("single", MeshConfig(1, 1, 1), jax.devices()[:1]),
        ("dp8", MeshConfig(-1, 1, 1), jax.devices()),
        ("fsdp_tp", MeshConfig(2, 2, 2), jax.devices()),
    ]:
        mesh, jitted, state, sh, bsh = _build(mcfg, devs)
        init_sh = jax.tree.map(lambda x: x.sharding, state)
        ms = []
        for s in range(3):
            state, _, m = jitted(state, None, jax.device_put(_batch(s), bsh))
            ms.append(jax.device_get(m))
        out[name] = dict(state=state, metrics=ms, init_sh=init_sh, jitted=jitted, bsh=bsh)
    return out


@pytest.mark.parametrize("name", ["dp8", "fsdp_tp"])
def test_sharded_step_equals_single_device(runs, name):
    a, b = runs["single"], runs[name]
    for ma, mb in zip(a["metrics"], b["metrics"]):
        np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-5)
        np.testing.assert_allclose(ma["grad/norm"], mb["grad/norm"], rtol=1e-4)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5),
        a["state"].params,
        b["state"].params,
    )


@pytest.mark.parametrize("name", ["dp8", "fsdp_tp"])
def test_shardings_survive_init_and_step(runs, name):
    r = runs[name]
    after = jax.tree.map(lambda x: x.sharding, r["state"])
    assert jax.tree.leaves(after) == jax.tree.leaves(r["init_sh"])
    if name == "fsdp_tp":  # the rules really shard something (not all replicated)
        specs = {str(s.spec) for s in jax.tree.leaves(after.params)}
        assert any("fsdp" in s or "tensor" in s for s in specs), specs
        assert any("fsdp" in str(s.spec) for s in jax.tree.leaves(after.opt_state))


def test_second_call_does_not_recompile(runs):
    r = runs["dp8"]
    assert r["jitted"]._cache_size() == 1
    r["jitted"](r["state"], None, jax.device_put(_batch(9), r["bsh"]))
    assert r["jitted"]._cache_size() == 1


def test_nonfinite_gradient_skips_update():
    mesh, jitted, state, sh, bsh = _build(MeshConfig(-1, 1, 1), jax.devices())
    before = jax.device_get(state)
    bad = dict(_batch())
    poisoned = jax.tree.map(lambda x: x, state)
    poisoned = poisoned._replace(params={**poisoned.params, "final_norm": poisoned.params["final_norm"] * jnp.nan})
    new, _, m = jitted(jax.device_put(poisoned, sh), None, jax.device_put(bad, bsh))
    assert int(m["grad/skipped"]) == 1 and int(new.skipped) == 1 and int(new.tick) == 1
    # optimizer state unchanged bit for bit
    jax.tree.map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
        before.opt_state,
        jax.device_get(new.opt_state),
    )


def test_mesh_size_mismatch_is_a_clear_error():
    with pytest.raises(ConfigError, match="multiply to the device count"):
        mesh_shape(MeshConfig(3, 1, 1), 8)
    with pytest.raises(ConfigError, match="cannot fill"):
        mesh_shape(MeshConfig(-1, 3, 1), 8)
    assert mesh_shape(MeshConfig(-1, 2, 2), 8) == {"data": 2, "stage": 1, "fsdp": 2, "tensor": 2}
    assert mesh_shape(MeshConfig(-1, 1, 1, 4), 8) == {"data": 2, "stage": 4, "fsdp": 1, "tensor": 1}
