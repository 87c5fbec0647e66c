"""train.micro_batch_per_device: the mini-batch's gradient accumulated over micro-batches inside the jitted step equals the
whole mini-batch's (loss, gradient, updated parameters and optimizer state, circuit state, metrics) for every
loss_agg with uneven response lengths and the KL term on, on one device and on the 8-device data mesh, through
PowerSGD and an activation codec; forward-only passes, the anchor's fire and the fidelity gauge likewise;
micro_batch 0 is today's program."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from short_stack import narrow2_run_config
from tiny_run import circuit_state, narrow_batch, narrow_run_config

from twocircuit_jax.anchor.loss import make_anchor_grad
from twocircuit_jax.config import ConfigError, MeshConfig, load_config
from twocircuit_jax.fast.circuit import FastCircuit
from twocircuit_jax.fast.grad_fn import make_codec_grad_fn
from twocircuit_jax.grpo.loss import AGG_MODES
from twocircuit_jax.metrics.probe import make_fidelity_fn
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.names import OLD
from twocircuit_jax.parallel import dispatch, mesh as pmesh, micro_batch
from twocircuit_jax.step.grpo_step import make_grpo_loss
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.step.train_step import (
    build_train_step,
    default_grad_fn,
    init_state,
    make_optimizer,
    state_shardings,
)

B, T, NEW = 16, 12, 6  # 16 rows: 2 per replica on the 8-device mesh; the last NEW positions are the response
F32_TOL = dict(rtol=2e-5, atol=2e-6)


def _cfg(kl_coef=0.05, **fast):
    return narrow2_run_config(kl_coef=kl_coef, **fast)  # 2 layers: accumulation splits rows, never layers


def _mesh(n):
    return pmesh.make_mesh(MeshConfig(-1, 1, 1), jax.devices()[:n])


@pytest.fixture(scope="module")
def data():
    cfg = _cfg()
    params = init_params(cfg.model, jax.random.key(0), std=0.3)
    batch, k = narrow_batch(n_keys=4)
    # Uneven response lengths: 1..6 tokens, different over rows, replicas and micro-batches (row 5 has none).
    lengths = np.array([0 if i == 5 else 1 + (5 * i + i // 3) % NEW for i in range(B)])
    resp = np.zeros((B, T), np.float32)
    for i, n in enumerate(lengths):
        resp[i, T - NEW : T - NEW + n] = 1.0
    batch["response_mask"] = jnp.asarray(resp)
    logp = make_logp_fn(cfg.model, None, OLD)(params, batch, circuit_state())[0]
    # ℓ_old and ℓ_ref away from this forward's, so the ratio clips and the KL is non-zero
    batch["old_logp"] = logp + 0.3 * jax.random.normal(k[2], (B, T))
    batch["ref_logp"] = logp + 0.5 * jax.random.normal(k[3], (B, T))
    return cfg, params, batch


def _step(cfg, mesh, params, batch, micro_batch, *, circuit=None, grad_fn=None, agg=None):
    """(new train state, circuit state, metrics) of one tick (not the step's first: ℓ_old is the batch's)."""
    grpo = dataclasses.replace(cfg.grpo, entropy_coeff=0.01, loss_agg=agg or cfg.grpo.loss_agg)
    act = circuit if (circuit and circuit.has_activation_codec) else None
    opt = make_optimizer(cfg.optim)
    state = init_state(jax.tree.map(jnp.copy, params), opt)
    sh = state_shardings(state, mesh)
    step = build_train_step(
        make_grpo_loss(cfg.model, grpo, NEW, act),
        opt,
        sh,
        mesh,
        grad_fn=grad_fn,
        absorb_aux=circuit.absorb_aux if circuit else None,
        micro_batch=micro_batch,
        donate=False,
    )
    cs = circuit_state(circuit, params, first_minibatch=False)
    b = jax.device_put(dict(batch), pmesh.batch_shardings(batch, mesh))
    return jax.device_get(step(jax.device_put(state, sh), cs, b))


MAIN = ("loss", "grad/norm", "loss/pg", "loss/kl", "loss/entropy", "loss/total", "kl/ref", "policy/entropy") + tuple(
    f"ppo/{k}" for k in ("ratio_mean", "ratio_max", "ratio_min", "clip_frac", "kl")
)


def _same(a, b, keys=MAIN, tol=F32_TOL):
    sa, ca, ma = a
    sb, cb, mb = b
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol), sa, sb)  # params, Adam moments, counts
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol), ca, cb)  # the circuit state
    assert set(ma) == set(mb)
    for k in keys:
        np.testing.assert_allclose(ma[k], mb[k], err_msg=k, **tol)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_accumulated_step_equals_whole_minibatch_on_one_device_and_8_replicas(data, agg):
    """The whole mini-batch on one device against: K = 4 micro-batches of 4 rows there, and K = 2 on 8 replicas (2
    rows per replica a pass); for token-mean also K = 2 of 8 rows on the one device. (The one-device loop is the
    same code at another trip count: a second K for every mode only compiled it again; the modes differ in the
    normalisers, which both splits read, and K = 2 runs on the replicas for every mode.)"""
    cfg, params, batch = data
    whole = _step(cfg, _mesh(1), params, batch, 0, agg=agg)
    assert float(whole[2]["loss/kl"]) > 0 and 0 < float(whole[2]["ppo/clip_frac"]) < 1
    _same(whole, _step(cfg, _mesh(1), params, batch, 4, agg=agg))
    if agg == "token-mean":
        _same(whole, _step(cfg, _mesh(1), params, batch, 8, agg=agg))
    _same(whole, _step(cfg, _mesh(8), params, batch, 1, agg=agg))


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4, 1)], ids=["data2_fsdp2_tensor2", "data2_fsdp4"])
def test_accumulated_step_on_an_fsdp_tensor_mesh(data, shape):
    """Parameters sharded over fsdp (and tensor): the fp32 carry pinned to their shardings, the same step as the
    whole mini-batch on one device: data 2 x fsdp 4 accumulates each data replica inside a shard_map manual over
    `data` (micro_batch._over_replicas); with tensor 2 the scan runs under the partitioner."""
    cfg, params, batch = data
    mesh = pmesh.make_mesh(MeshConfig(*shape), jax.devices())
    mb = B // 8 // 2  # K = 2 micro-batches of every device's rows
    _same(_step(cfg, _mesh(1), params, batch, 0), _step(cfg, mesh, params, batch, mb))


def test_the_data_reduction_crosses_the_slow_link_once_per_pass(data):
    """Two islands over `data` (dcn_data 2) x fsdp 4: the bytes that cross the slow link in a step with K = 2
    micro-batches are those of the step without micro-batches (the gradient is summed over `data` once, after the
    loop), while the in-island fsdp traffic runs per micro-batch. Before: the data reduction ran inside the loop,
    K times."""
    from twocircuit_jax.plan.measure import collectives

    cfg, params, batch = data
    mc = MeshConfig(1, 4, 1, dcn_data=2)
    mesh = pmesh.make_mesh(mc, jax.devices())
    islands = pmesh.islands(mc, mesh)
    assert len(set(islands)) == 2
    opt = make_optimizer(cfg.optim)
    sh = state_shardings(init_state(params, opt), mesh)
    b = jax.device_put(dict(batch), pmesh.batch_shardings(batch, mesh))
    slow, fast = {}, {}
    for mb in (0, 1):  # 2 rows per device: K = 1, 2
        step = build_train_step(
            make_grpo_loss(cfg.model, cfg.grpo, NEW, None), opt, sh, mesh, micro_batch=mb, donate=False
        )
        txt = step.lower(init_state(params, opt), circuit_state(None, params), b).compile().as_text()
        parts, note, slow_parts = collectives(txt, 2, islands)
        assert not note
        slow[mb], fast[mb] = sum(slow_parts.values()), sum(parts.values()) - sum(slow_parts.values())
    assert slow[0] > 0 and slow[1] <= slow[0] * 1.01, slow
    assert fast[1] > fast[0], fast  # fsdp's gathers run per micro-batch: the loop is real and counted


def _collectives_by_computation(compiled_text):
    out = {}
    for comp in re.split(r"\n(?=\S.*\{\n)", compiled_text):
        n = len(
            re.findall(r" (?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", comp)
        )
        if n:
            out[comp.split(" ", 2)[1 if comp.startswith("ENTRY") else 0]] = n
    return out


@pytest.mark.parametrize("codec", ["none", "powersgd"])
def test_gradient_is_reduced_once_after_the_loop(data, codec):
    """On the data mesh no collective runs inside the micro-batch loop: each replica accumulates its own rows and
    the gradient is summed (or PowerSGD-reduced) once; the split moves no rows (no gather, permute, all-to-all)."""
    cfg, params, batch = data
    mesh = _mesh(8)
    opt = make_optimizer(cfg.optim)
    sh = state_shardings(init_state(params, opt), mesh)
    c = FastCircuit(_cfg(grad_codec="powersgd", start_after=0), cfg.model, mesh) if codec != "none" else None
    grad_fn = make_codec_grad_fn(c.grad_codec, mesh, micro_batch=1) if c else None
    step = build_train_step(
        make_grpo_loss(cfg.model, cfg.grpo, NEW, None), opt, sh, mesh, grad_fn=grad_fn, micro_batch=1, donate=False
    )
    b = jax.device_put(dict(batch), pmesh.batch_shardings(batch, mesh))
    txt = step.lower(init_state(params, opt), circuit_state(c, params), b).compile().as_text()
    assert "while" in txt
    found = _collectives_by_computation(txt)
    assert found and list(found) == [next(iter(found))] and next(iter(found)).startswith("%main"), found


def test_micro_batch_zero_is_todays_program(data):
    """micro_batch 0 lowers to the text of the step built with today's grad_fn (plain value_and_grad)."""
    cfg, params, batch = data
    mesh = _mesh(8)
    opt = make_optimizer(cfg.optim)
    sh = state_shardings(init_state(params, opt), mesh)
    loss = make_grpo_loss(cfg.model, cfg.grpo, NEW, None)

    def todays(loss_fn):
        def pair(*args):  # (loss, metrics, aux) -> jax's (value, has_aux pair)
            loss, metrics, aux = loss_fn(*args)
            return loss, (metrics, aux)

        def fn(params, batch, cs):
            (l, (m, aux)), g = jax.value_and_grad(pair, has_aux=True)(params, batch, cs)
            return g, l, m, aux, cs

        return fn

    args = (init_state(params, opt), circuit_state(None, params), batch)
    texts = [
        build_train_step(loss, opt, sh, mesh, donate=False, **kw).lower(*args).as_text()
        for kw in ({"micro_batch": 0}, {"grad_fn": todays})
    ]
    assert texts[0] == texts[1]
    assert (
        "while" not in texts[0]
        and "while" in build_train_step(loss, opt, sh, mesh, donate=False, micro_batch=1).lower(*args).as_text()
    )


def test_bad_micro_batch_is_a_config_error():
    cfg = _cfg()  # prompts_per_update 4 x n 4 = 16 rows
    assert micro_batch.check(cfg, 8) == 0
    assert (
        micro_batch.check(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_per_device=2)), 8)
        == 2
    )
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_per_device=3))
    with pytest.raises(ConfigError, match=r"train\.micro_batch_per_device.*got 3.*16/8"):
        micro_batch.check(bad, 8)
    with pytest.raises(ConfigError, match=r"train\.micro_batch.*got 3"):
        micro_batch.check(bad, 1)
    staged = dataclasses.replace(bad, train=dataclasses.replace(cfg.train, micro_batch_per_device=2))
    staged = dataclasses.replace(staged, mesh=dataclasses.replace(cfg.mesh, stage=2))
    with pytest.raises(ConfigError, match=r"train\.micro_batch.*mesh\.stage=2"):
        micro_batch.check(staged, 4)
    with pytest.raises(ConfigError, match=r"train\.micro_batch_per_device"):
        load_config(data={"train": {"micro_batch_per_device": -1}})
    with pytest.raises(
        ConfigError, match=r"train\.micro_batch: a key of older configs; write train\.micro_batch_per_device"
    ):
        load_config(data={"train": {"micro_batch": 2}})  # the old name, one letter from the pipeline's microbatches
    with pytest.raises(ConfigError, match=r"write train\.pipeline_microbatches instead"):
        load_config(data={"train": {"microbatches": 2}})
    # The two batch sizes count prompts; their old names read as row counts.
    with pytest.raises(ConfigError, match=r"train\.train_batch: a key of older configs; write train\.prompts_per_step"):
        load_config(data={"train": {"train_batch": 8}})
    with pytest.raises(
        ConfigError, match=r"train\.mini_batch: a key of older configs; write train\.prompts_per_update"
    ):
        load_config(data={"train": {"mini_batch": 4}})


def test_logp_pass_over_micro_batches_equals_whole(data):
    cfg, params, batch = data
    for n in (1, 8):
        mesh = _mesh(n)
        b = jax.device_put(dict(batch), pmesh.batch_shardings(batch, mesh))
        cs = circuit_state()
        whole = dispatch.jit(make_logp_fn(cfg.model, None, OLD))(params, b, cs)
        acc = dispatch.jit(make_logp_fn(cfg.model, None, OLD, micro_batch=16 // n // 2, mesh=mesh))(params, b, cs)
        np.testing.assert_allclose(np.asarray(whole[0]), np.asarray(acc[0]), **F32_TOL)
        np.testing.assert_allclose(np.asarray(whole[1]), np.asarray(acc[1]), **F32_TOL)


def test_powersgd_over_micro_batches_equals_powersgd_on_the_whole(data):
    """Each replica accumulates over its micro-batches; PowerSGD reduces the sum once: the same P, Q, error memory
    and update as PowerSGD on the whole mini-batch. With a fast-owned low-rank basis at the boundary: under PowerSGD
    the loss runs per replica (fast/grad_fn.py), and its aux is psum-ed over the replicas where the codec declares a
    leaf summed (sketch, token count), so the circuit state is the XLA-mean step's, whole and over micro-batches;
    were it averaged like a metric, the token count would be 1/8 of the batch's. (One pair of runs checks both: the
    PowerSGD state and update, and the sketch, are compared whole against accumulated.)"""
    cfg, params, batch = data
    mesh = _mesh(8)
    plain = _step(cfg, mesh, params, batch, 0, circuit=FastCircuit(_cfg(codec="lowrank"), cfg.model, mesh))
    c = FastCircuit(_cfg(codec="lowrank", grad_codec="powersgd", start_after=0), cfg.model, mesh)
    whole = _step(cfg, mesh, params, batch, 0, circuit=c, grad_fn=c.grad_fn(None))
    acc = _step(cfg, mesh, params, batch, 0, circuit=c, grad_fn=make_codec_grad_fn(c.grad_codec, mesh, micro_batch=1))
    assert float(whole[2]["powersgd/compressed"]) == 1.0
    assert any(float(jnp.max(jnp.abs(e))) > 0 for e in whole[1].grad.e.values())  # lossy: a real error memory
    _same(whole, acc, MAIN + ("powersgd/error_norm",), tol=dict(rtol=1e-4, atol=1e-6))
    for got in (whole, acc):
        assert float(got[1].codec.sketch_tokens) == float(plain[1].codec.sketch_tokens) > 0
        for k in plain[1].codec.sketch:
            np.testing.assert_allclose(got[1].codec.sketch[k], plain[1].codec.sketch[k], rtol=1e-4, atol=1e-6)


def test_activation_codec_sketch_is_summed_over_micro_batches(data):
    """A fast-owned low-rank basis: the train forward's sketch and token count, summed over micro-batches (and
    replicas), give the circuit state of the whole mini-batch; codec metrics averaged like their aux."""
    # The narrow run's 4 layers (3 boundaries) here: the recon-error bound below was set on it; at 2 layers (one
    # boundary) the micro-batch mean strays 2.6e-3 from the whole batch's. The rest of the check holds at any depth.
    _, _, batch = data
    cfg = narrow_run_config(kl_coef=0.05)
    params = init_params(cfg.model, jax.random.key(0), std=0.3)
    mesh = _mesh(8)
    c = FastCircuit(narrow_run_config(kl_coef=0.05, codec="lowrank"), cfg.model, mesh)
    assert c.owns_basis
    whole = _step(cfg, mesh, params, batch, 0, circuit=c)
    acc = _step(cfg, mesh, params, batch, 1, circuit=c)
    assert float(whole[1].codec.sketch_tokens) == float(np.sum(np.asarray(batch["attention_mask"])))
    assert all(float(jnp.max(jnp.abs(v))) > 0 for v in whole[1].codec.sketch.values())
    _same(whole, acc, tol=dict(rtol=1e-4, atol=1e-6))
    # The codec's error is a ratio of sums over the rows (fast/circuit.py): a micro-batch mean is close, not equal
    # (as over the pipeline's microbatches), and it is a metric only.
    np.testing.assert_allclose(whole[2]["codec/recon_rel_err"], acc[2]["codec/recon_rel_err"], rtol=2e-3)


def test_anchor_fire_over_micro_batches_equals_the_whole_batch(data):
    """The anchor's dense fire (KL, entropy bonus, sequence TIS, the anchor-owned basis's sketch): the accumulated
    gradient, metrics (TIS over the whole batch) and sketch equal the one-pass fire's."""
    cfg, params, batch = data
    mesh = _mesh(8)
    grpo = dataclasses.replace(
        cfg.grpo, tis="sequence", tis_cap=1.5, entropy_coeff=0.01, loss_agg="seq-mean-token-mean"
    )
    c = FastCircuit(_cfg(codec="lowrank"), cfg.model, mesh)
    fire = dict(batch, ref_logp_dense=batch["ref_logp"], sampler_logp=batch["old_logp"])
    fire = jax.device_put(fire, pmesh.batch_shardings(fire, mesh))
    basis = c.init_codec_state()
    outs = [
        jax.device_get(
            dispatch.jit(make_anchor_grad(cfg.model, grpo, NEW, c.basis_sketcher, micro_batch=mb, mesh=mesh))(
                params, fire, basis
            )
        )
        for mb in (0, 1)
    ]
    (g0, m0, a0), (g1, m1, a1) = outs
    assert 0 < m0["anchor/tis/clip_frac"] < 1 and m0["anchor/kl_loss"] > 0
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), (g0, a0), (g1, a1))
    assert set(m0) == set(m1)
    for k in m0:
        np.testing.assert_allclose(m0[k], m1[k], err_msg=k, **F32_TOL)


def test_fidelity_gauge_over_micro_batches_equals_the_whole_batch(data):
    cfg, params, batch = data
    mesh = _mesh(8)
    c = FastCircuit(_cfg(codec="prf_mask"), cfg.model, mesh)
    loss = make_grpo_loss(cfg.model, cfg.grpo, NEW, c)
    b = jax.device_put(dict(batch), pmesh.batch_shardings(batch, mesh))
    cs = circuit_state(c, params, first_minibatch=False)
    ref = jax.tree.map(lambda x: x * 0.98, params)

    def gauge(mb):
        fn = make_fidelity_fn(
            cfg.model,
            cfg.grpo,
            NEW,
            c,
            default_grad_fn(loss, micro_batch=mb, mesh=mesh),
            None,
            lambda: make_grpo_loss(cfg.model, cfg.grpo, NEW, None),
            micro_batch=mb,
            mesh=mesh,
        )
        return jax.device_get(dispatch.jit(fn)(params, ref, b, cs))

    whole, acc = gauge(0), gauge(1)
    assert set(whole) == set(acc) and 0 < whole["fidelity/boundary_rel_err/0"]
    assert whole["fidelity/grad_cos"] < 1 - 1e-4  # the codec view differs: the gauge measures something
    for k in whole:
        np.testing.assert_allclose(whole[k], acc[k], err_msg=k, rtol=1e-4, atol=1e-6)


def test_only_a_data_only_mesh_counts_as_replicated_parameters():
    """The per-replica shard_map (parameters taken whole on every device) is for a data-only mesh: with fsdp > 1 it
    would gather every parameter onto every device, so the partitioner's path must run."""
    from twocircuit_jax.config.sections import MeshConfig
    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.parallel.micro_batch import _replicated_params

    def mesh(**k):
        return pmesh.make_mesh(MeshConfig(**k), jax.devices()[:8])

    assert _replicated_params(mesh(data=8))
    assert not _replicated_params(mesh(data=2, fsdp=4))
    assert not _replicated_params(mesh(data=1, fsdp=8))
    assert not _replicated_params(mesh(data=4, tensor=2))
