"""The gradient-fidelity gauge (metrics/probe.py): the gradient the fast circuit applies against the dense step's
on the same batch. Exact where the circuit is exact (codec off, p=0 mask, PowerSGD at full rank), clearly below 1
under a lossy codec, and moved by the merger when M points elsewhere."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import circuit_state, narrow_batch, narrow_run_config

from twocircuit_jax.anchor.merger import init_merger, update_ema
from twocircuit_jax.fast.circuit import FastCircuit
from twocircuit_jax.metrics.probe import grad_cosines, group_of, make_fidelity_fn
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.names import OLD
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.step.grpo_step import make_grpo_loss
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.step.train_step import default_grad_fn

B, T, NEW = 16, 12, 6


def run_cfg(anchor=None, **fast):
    # 3 blocks, pp_size 3: boundaries 0 and 1, the fewest that show a drift from one to the next; each more block
    # unrolls into every gauge compiled here (five) and adds only compile time
    return narrow_run_config(kl_coef=0.01, anchor=anchor, num_layers=3, pp_size=3, **fast)


@pytest.fixture(scope="module")
def setup():
    cfg = run_cfg()
    mesh = pmesh.make_mesh(cfg.mesh)
    ref = init_params(cfg.model, jax.random.key(0), std=0.3)
    params = jax.tree.map(lambda x: x * 1.05, ref)
    batch, k = narrow_batch(3)
    batch.update(old_logp=jnp.zeros((B, T)), sampler_logp=-jax.random.uniform(k[2], (B, T)), ref_logp=jnp.zeros((B, T)))
    batch = jax.device_put(batch, pmesh.batch_shardings(batch, mesh))
    # As the loop does with codecs off: ℓ_ref from the reference weights.
    batch["ref_logp"] = dispatch.jit(make_logp_fn(cfg.model, None, OLD))(ref, batch, circuit_state())[0]
    return cfg, mesh, params, ref, batch


def fidelity(setup, circuit=None, grad_transform=None, merger=None, cfg=None):
    c, mesh, params, ref, batch = setup
    cfg = cfg or c
    act = circuit if (circuit and circuit.has_activation_codec) else None
    loss = make_grpo_loss(cfg.model, cfg.grpo, NEW, act)
    compute = (circuit.grad_fn(None) if circuit and circuit.grad_fn(None) else default_grad_fn)(loss)
    fn = make_fidelity_fn(
        cfg.model, cfg.grpo, NEW, act, compute, grad_transform, lambda: make_grpo_loss(cfg.model, cfg.grpo, NEW, None)
    )
    cs = circuit_state(circuit, params, first_minibatch=False)._replace(merger=merger)
    return {k: float(v) for k, v in dispatch.jit(fn)(params, ref, batch, cs).items()}


@pytest.mark.slow  # a compile of the gauge per circuit (3 here, 1 below): test-fast keeps only the merger case
def test_exact_circuits_read_one(setup):
    cfg, mesh = setup[0], setup[1]
    off = fidelity(setup)
    identity = fidelity(setup, FastCircuit(run_cfg(codec="prf_mask", p=0.0, rescale_mode="none"), cfg.model, mesh))
    full = FastCircuit(run_cfg(grad_codec="powersgd", start_after=0), cfg.model, mesh)
    gc = dataclasses.replace(full.fcfg.grad_codec, rank=16, min_compression_rate=0.3)  # past the config check
    full.fcfg = dataclasses.replace(full.fcfg, grad_codec=gc)
    full.grad_codec.cfg = gc  # the registered codec object holds its own section
    psgd = fidelity(setup, full)
    for m in (off, identity, psgd):
        assert abs(m["fidelity/grad_cos"] - 1.0) < 1e-5 and abs(m["fidelity/grad_norm_ratio"] - 1.0) < 1e-4, m
        assert m["fidelity/grad_cos"] == m["fidelity/grad_cos_pre_merger"]
        for g in ("attn", "mlp", "embed", "norm"):
            assert abs(m[f"fidelity/grad_cos/{g}"] - 1.0) < 1e-4, (g, m)
    assert [identity[f"fidelity/boundary_rel_err/{b}"] for b in (0, 1)] == [0.0, 0.0]


@pytest.mark.slow
def test_lossy_codec_lowers_the_cosine_and_shows_at_each_boundary(setup):
    cfg, mesh = setup[0], setup[1]
    m = fidelity(setup, FastCircuit(run_cfg(codec="prf_mask", p=0.9), cfg.model, mesh))
    assert m["fidelity/grad_cos"] < 0.9
    errs = [m[f"fidelity/boundary_rel_err/{b}"] for b in (0, 1)]
    assert min(errs) > 0.1 and errs[0] < errs[1]  # the codec view drifts further from dense boundary by boundary


def test_merger_moves_the_applied_gradient(setup):
    params = setup[2]
    acfg = run_cfg(anchor={"enabled": True, "cadence": 2, "delay": 2, "projection": {"enabled": False}}).anchor.merger
    # M from a gradient that disagrees with the dense one: the signed merger must pull the cosine down.
    st = update_ema(init_merger(params, acfg), jax.tree.map(lambda x: -jnp.ones_like(x) * jnp.sign(x), params), acfg)
    from twocircuit_jax.anchor.merger import merge

    def transform(g, cs):
        g2, st2, m = merge(cs.merger, g, acfg, jnp.asarray(False))
        return g2, cs._replace(merger=st2), m

    m = fidelity(setup, grad_transform=transform, merger=st)
    assert abs(m["fidelity/grad_cos_pre_merger"] - 1.0) < 1e-5
    assert m["fidelity/grad_cos"] < 0.9


def test_groups_and_cosine_formula():
    assert [
        group_of(p)
        for p in (
            "embed",
            "lm_head",
            "final_norm",
            "layers/input_norm",
            "layers/q_proj/kernel",
            "layers/down_proj/kernel",
        )
    ] == ["embed", "lm_head", "norm", "norm", "attn", "mlp"]
    a = {"embed": jnp.array([1.0, 0.0]), "layers": {"up_proj": {"kernel": jnp.array([0.0, 2.0])}}}
    b = {"embed": jnp.array([1.0, 1.0]), "layers": {"up_proj": {"kernel": jnp.array([0.0, -1.0])}}}
    c = grad_cosines(a, b)
    np.testing.assert_allclose(float(c["fidelity/grad_cos"]), (1 - 2) / (5**0.5 * 3**0.5), rtol=1e-6)
    np.testing.assert_allclose(float(c["fidelity/grad_cos/mlp"]), -1.0, rtol=1e-6)
