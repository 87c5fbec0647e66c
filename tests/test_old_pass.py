"""One tick per step (prompts_per_step = prompts_per_update, one epoch): the train forward is the old-log-prob pass. The loss
then computes ℓ_old, the TIS weights and the step's diagnostics itself, and must give what the separate passes
give; the loop compiles and runs no separate ℓ_old forward or diagnostics program."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from short_stack import narrow2_run_config
from tiny_run import circuit_state, narrow_batch, tiny_config

from twocircuit_jax.config import load_config
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.parallel.micro_batch import plain_value_and_grad
from twocircuit_jax.step.grpo_step import make_diagnostics_fn, make_grpo_loss
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.train import loop


def _disagreeing_sampler():
    """(cfg, grpo with token TIS, params, cs, batch, ℓ_old, entropy): the narrow run's batch with a sampler that
    disagreed with the trainer (TIS weights well away from 1, some capped), a loss mask that drops some rows
    (`full_mask` keeps them) and random `truncated` flags."""
    cfg = narrow2_run_config(kl_coef=0.0)  # 2 layers: the fusion is in the loss, after the layers
    grpo = cfg.grpo.__class__(**{**cfg.grpo.__dict__, "tis": "token", "tis_cap": 2.0})
    params = init_params(cfg.model, jax.random.PRNGKey(0))
    batch, k = narrow_batch(4)
    cs = circuit_state()
    old, ent, _ = jax.jit(make_logp_fn(cfg.model))(params, batch, cs)
    batch["sampler_logp"] = old + 0.5 * jax.random.normal(k[2], old.shape)
    batch["full_mask"] = batch["response_mask"]
    batch["response_mask"] = batch["response_mask"] * (jnp.arange(16) % 5 != 0)[:, None]
    batch["truncated"] = jax.random.bernoulli(k[3], 0.5, (16,))
    return cfg, grpo, params, cs, batch, old, ent


def test_fused_loss_equals_the_loss_after_separate_passes():
    cfg, grpo, params, cs, fused_batch, old, ent = _disagreeing_sampler()
    batch = dict(fused_batch)
    full, trunc = batch.pop("full_mask"), batch.pop("truncated")
    # every pass jitted, as the loop runs them: op by op, each of their few hundred ops was its own compile
    w, diag = jax.jit(make_diagnostics_fn(grpo))(old, batch["sampler_logp"], batch["response_mask"], full, trunc, ent)
    assert diag["tis/clip_frac"] > 0.01 and diag["tis/weight_min"] < 0.8

    apart = make_grpo_loss(cfg.model, grpo, 6)
    fused = make_grpo_loss(cfg.model, grpo, 6, diagnose=True)
    jitted = {f: jax.jit(plain_value_and_grad(f)) for f in (apart, fused)}
    grad = lambda f, b: jitted[f](params, b, cs)  # noqa: E731
    (la, ma, _), ga = grad(apart, {**batch, "old_logp": old, "is_weight": w})
    (lf, mf, _), gf = grad(fused, fused_batch)
    np.testing.assert_allclose(lf, la, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(gf), jax.tree.leaves(ga)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-9)
    for key, v in diag.items():
        np.testing.assert_allclose(mf[key], v, rtol=1e-6, err_msg=key)
    # the comparison can fail: without the weights (all 1: the weighted program again, not a third compile) the
    # gradient is another one
    (_, _, _), g_unweighted = grad(apart, {**batch, "old_logp": old, "is_weight": jnp.ones_like(w)})
    gap = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(g_unweighted), jax.tree.leaves(ga)))
    assert gap > 1e-3 * max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ga))


def test_fused_diagnostics_per_replica_are_the_global_ones():
    """Under a gradient codec the loss runs per data replica (fast/grad_fn.py): with `rows_over` its diagnostics
    gather their inputs, so on 8 replicas of 2 rows each the loss, gradient, TIS weights and metrics are the
    one-program loss's."""
    from jax.sharding import Mesh, PartitionSpec as P

    from twocircuit_jax.fast.grad_fn import _reduce_metrics, global_normalisers

    cfg, grpo, params, cs, batch, _, _ = _disagreeing_sampler()
    (l1, m1, _), g1 = jax.jit(plain_value_and_grad(make_grpo_loss(cfg.model, grpo, 6, diagnose=True)))(
        params, batch, cs
    )
    axes = ("data", "fsdp")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8, 1), axes)

    def per_replica(rows_over):
        loss_fn = make_grpo_loss(cfg.model, grpo, 6, diagnose=True, rows_over=rows_over)

        def body(params, batch):
            batch = dict(batch, **global_normalisers(batch["response_mask"], axes))
            (loss, m, _), g = plain_value_and_grad(loss_fn)(params, batch, cs)
            return jax.lax.pmean(loss, axes), _reduce_metrics(m, axes), jax.lax.pmean(g, axes)

        spec = jax.tree.map(lambda _: P(axes), batch)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), spec), out_specs=P(), check_vma=False))(
            params, batch
        )

    l8, m8, g8 = per_replica(axes)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-8)
    diag_keys = [key for key in m1 if key.startswith(("tis/", "mismatch/", "policy/entropy"))]
    assert {"mismatch/prob_gap_max", "mismatch/prob_corr", "tis/clip_frac"} <= set(diag_keys)
    for key in diag_keys:
        np.testing.assert_allclose(m8[key], m1[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # the comparison can fail: each replica's diagnostics on its own 2 rows, averaged, are other numbers
    _, m_local, _ = per_replica(None)
    assert any(abs(float(m_local[key]) - float(m1[key])) > 1e-3 * max(1.0, abs(float(m1[key]))) for key in diag_keys)


CFG = tiny_config(
    grpo={"kl_coef": 0.0},
    train={"steps": 2, "prompts_per_step": 4, "prompts_per_update": 4, "eval_every": 0, "final_checkpoint": False},
    eval={"at_start": False, "at_end": False},
)


def _run(path, fused, fast=None):
    data = {**CFG, "fast": {**CFG["fast"], **(fast or {})}, "train": {**CFG["train"], "fused_old_pass": fused}}
    with loop.GRPOTrainer(load_config(data=data), path, show_progress=False) as tr:
        assert tr.built.programs.fused_old_pass is fused
        tr.step(), tr.step()
        params = jax.tree.map(np.asarray, tr.state.params)
    return [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))], params


FAST = {
    "none": None,
    "prf_mask": {"codec": {"type": "prf_mask", "p": 0.5}},
    "powersgd": {"grad_codec": {"type": "powersgd", "rank": 2, "start_after": 0}},
}


@pytest.mark.slow
@pytest.mark.parametrize("codec", list(FAST))
def test_loop_skips_the_old_pass_and_reports_the_same(tmp_path, codec):
    """Dense; under the PRF mask, whose ℓ_old view is the train view (the same mask bits); and under PowerSGD,
    whose loss runs per data replica (8 here): the diagnostics gather their inputs, so a max, a correlation and
    the TIS weights are the global ones, not means over replicas."""
    fast = FAST[codec]
    fused, p_fused = _run(str(tmp_path / "fused"), True, fast)
    apart, p_apart = _run(str(tmp_path / "apart"), False, fast)
    for f, a in zip(fused, apart, strict=True):
        assert "time/logprob_s" not in f and a["time/logprob_s"] > 0  # KL 0: no log-prob pass at all
        prefixes = ("mismatch/", "tis/", "policy/", "ppo/", "grad/", "reward/", "codec/old_logprob/")
        keys = [k for k in a if k.startswith(prefixes)]
        assert {"mismatch/kl_k3", "mismatch/prob_gap_max", "policy/entropy", "ppo/clip_frac"} <= set(keys)
        if codec == "prf_mask":
            assert a["codec/old_logprob/mask_ratio"] == pytest.approx(0.5, abs=0.05)
        assert set(keys) <= set(f), set(keys) - set(f)
        for k in keys:
            assert f[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (f["step"], k)
    for x, y in zip(jax.tree.leaves(p_fused), jax.tree.leaves(p_apart)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_second_epoch_keeps_the_separate_old_pass(tmp_path):
    """With ppo_epochs 2 the second tick's ℓ_old is the first tick's weights, not its own forward: no fusion."""
    data = {**CFG, "train": {**CFG["train"], "ppo_epochs": 2}}
    with loop.GRPOTrainer(load_config(data=data), str(tmp_path / "r"), show_progress=False) as tr:
        assert not tr.built.programs.fused_old_pass
        m = tr.step()
    assert m["time/logprob_s"] > 0 and m["tick"] == 2
    assert m["ppo/clip_frac"] >= 0 and "mismatch/kl_k3" in m


@pytest.mark.slow
@pytest.mark.parametrize("codec", [{"type": "lowrank", "rank": 3}])  # the PRF mask's fused pass: the test above
def test_the_anchor_keeps_the_fused_pass_and_the_same_run(tmp_path, codec):
    """The two-circuit run (anchor firing every other tick with the optimizer-state swap, KL on so the fire reads
    the dense reference ℓ_ref^dense; under lowrank the anchor owns the basis, and a fire's sketch, absorbed before
    the tick, must not change the tick's view): with the old pass fused into the tick nothing changes, neither the
    anchor's metrics nor the weights, and the fused run never compiles the ℓ_old forward."""
    data = {
        **CFG,
        "grpo": {**CFG["grpo"], "kl_coef": 0.05},
        "fast": {**CFG["fast"], "codec": codec},
        "anchor": {"enabled": True, "cadence": 2, "delay": 2, "projection": {"window": 2}, "swap": {"cadence": 2}},
        "train": {**CFG["train"], "steps": 4},
    }
    runs = {}
    for fused in (True, False):
        path = str(tmp_path / str(fused))
        run = {**data, "train": {**data["train"], "fused_old_pass": fused}}
        with loop.GRPOTrainer(load_config(data=run), path, show_progress=False) as tr:
            b = tr.built
            assert b.programs.fused_old_pass is fused and b.anchor is not None
            assert b.anchor.owns_q is (codec["type"] == "lowrank")
            for _ in range(4):
                tr.step()
            old_programs = b.programs.logp_old._cache_size()
            params = jax.tree.map(np.asarray, tr.state.params)
        runs[fused] = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))], params, old_programs
    (fused, p_fused, n_fused), (apart, p_apart, n_apart) = runs[True], runs[False]
    assert n_fused == 0 and n_apart == 1
    assert sum(r.get("anchor/fire", 0) for r in fused) == 2 and fused[-1]["swap/count"] > 0
    for f, a in zip(fused, apart, strict=True):
        keys = [k for k in a if k.startswith(("mismatch/", "tis/", "policy/", "ppo/", "grad/", "anchor/", "swap/"))]
        assert {"mismatch/kl_k3", "policy/entropy", "anchor/fire"} <= set(keys)
        assert set(keys) <= set(f), set(keys) - set(f)
        for k in keys:
            assert f[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (f["step"], k)
    for x, y in zip(jax.tree.leaves(p_fused), jax.tree.leaves(p_apart)):
        # Two programs round apart, and Adam divides a near-zero gradient's rounding by its own size: such an element
        # moves by a rounding-sized share of lr (1e-3) per step; a wrong fire or swap moves elements by ~lr.
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
