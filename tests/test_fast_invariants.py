"""design §8 invariants through the real train step on the 8-device fake mesh:
codec off = the plain GRPO step bit for bit; under every codec the trainer's own first-update ratio is 1 while the
codec view differs from the dense policy (seed 003's blindness); PowerSGD at full rank = the dense all-reduce step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from short_stack import narrow2_run_config
from tiny_run import circuit_state, narrow_batch

from twocircuit_jax.fast.circuit import FastCircuit
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.names import OLD
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.step.grpo_step import make_grpo_loss
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.step.train_step import build_train_step, init_state, state_shardings

# The real 8-device train step compiled for ten circuit configurations (~90 s on one core): `make test` runs it,
# test-fast skips it (the units are in test_train_step, test_fast_circuit, test_fast_powersgd).
pytestmark = pytest.mark.slow
B, T, NEW = 16, 12, 6  # 16 rows over 8 replicas; the last NEW positions are the response


def run_cfg(**fast):
    return narrow2_run_config(**fast)  # 2 layers, one boundary: each invariant holds at any depth


@pytest.fixture(scope="module")
def setup():
    cfg = run_cfg()
    mesh = pmesh.make_mesh(cfg.mesh)
    params = init_params(cfg.model, jax.random.key(0), std=0.3)  # a peaked policy, so the codec shows
    batch, _ = narrow_batch()  # every replica holds the same number of loss tokens
    return cfg, mesh, params, batch


_JIT = {}  # (circuit, optimizer) -> (logp, step): one compile each per module, reused across tests
SGD = optax.sgd(0.5)


def one_step(cfg, mesh, params, batch, circuit, optimizer=SGD):
    """(new params, metrics, batch, new circuit state) of one tick, old log-probs from the same codec view (the
    loop's order)."""
    act = circuit if (circuit and circuit.has_activation_codec) else None
    cs = circuit_state(circuit, params)  # the loop's first tick of step 1
    key = (id(circuit), id(optimizer))
    if key not in _JIT:
        loss = make_grpo_loss(cfg.model, cfg.grpo, NEW, act)
        grad_fn = circuit.grad_fn(None) if circuit else None
        sh = state_shardings(init_state(params, optimizer), mesh)
        _JIT[key] = (
            dispatch.jit(make_logp_fn(cfg.model, act, OLD)),
            sh,
            build_train_step(
                loss, optimizer, sh, mesh, grad_fn=grad_fn, absorb_aux=circuit.absorb_aux if circuit else None
            ),
            circuit,
        )  # keep circuit alive: its id is the key
    logp, sh, step, _ = _JIT[key]
    b = jax.device_put(dict(batch), pmesh.batch_shardings(batch, mesh))
    b["old_logp"] = logp(params, b, cs)[0]
    state = init_state(jax.tree.map(jnp.copy, params), optimizer)  # the step donates its input
    new, cs, m = step(jax.device_put(state, sh), cs, b)
    return new.params, m, b, cs


def _dense_logp(cfg):
    if "dense_logp" not in _JIT:
        _JIT["dense_logp"] = dispatch.jit(make_logp_fn(cfg.model, None, OLD))
    return _JIT["dense_logp"]


def test_codec_off_is_the_plain_step_bit_for_bit(setup):
    cfg, mesh, params, batch = setup
    off = FastCircuit(run_cfg(codec="none"), cfg.model, mesh)
    assert not off.applies("train") and off.grad_fn(None) is None
    p_plain, m_plain, _, _ = one_step(cfg, mesh, params, batch, None)
    p_off, m_off, _, _ = one_step(cfg, mesh, params, batch, off)
    for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_off)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert float(m_plain["loss"]) == float(m_off["loss"]) and all(np.ndim(v) == 0 for v in m_off.values())


@pytest.mark.parametrize("codec", ["none", "prf_mask", "lowrank", "sr_quant"])
def test_first_update_ratio_is_exactly_one_while_the_codec_view_is_far_from_dense(setup, codec):
    cfg, mesh, params, batch = setup
    c = FastCircuit(run_cfg(codec=codec), cfg.model, mesh) if codec != "none" else None
    _, m, b, _ = one_step(cfg, mesh, params, batch, c)
    # Exact, not within ulps: ℓ_old on the first mini-batch is the train forward's own stop-gradient log-prob.
    assert float(m["ppo/clip_frac"]) == 0.0 and float(m["ppo/kl"]) == 0.0
    assert float(m["ppo/ratio_mean"]) == 1.0 and float(m["ppo/ratio_max"]) == 1.0 == float(m["ppo/ratio_min"])
    if c is None:
        return
    dense_logp = _dense_logp(cfg)(params, b, circuit_state())[0]
    gap = np.abs(np.exp(np.asarray(b["old_logp"])) - np.exp(np.asarray(dense_logp)))[:, T - NEW :]
    assert gap.mean() > 1e-3, gap.mean()  # the trainer's ratio cannot see this gap: it compares codec to codec
    assert float(m["codec/recon_rel_err"]) > 0.05


@pytest.fixture(scope="module")
def full_rank(setup):
    cfg, mesh, _, _ = setup
    # rank 16 = the smaller side of every compressed matrix; rate 0.3 compresses all 16x16/16x32/32x16 kernels
    # and leaves the [L, 16] norms to the packed mean (the check rejects rate < 1; the test builds it directly).
    c = FastCircuit(run_cfg(grad_codec="powersgd", start_after=0), cfg.model, mesh)
    gc = dataclasses.replace(c.fcfg.grad_codec, rank=16, min_compression_rate=0.3)
    c.fcfg = dataclasses.replace(c.fcfg, grad_codec=gc)
    c.grad_codec.cfg = gc  # the registered codec object holds its own section
    return c


def test_powersgd_full_rank_reproduces_the_dense_allreduce_step(setup, full_rank):
    cfg, mesh, params, batch = setup
    p_dense, m_dense, _, _ = one_step(cfg, mesh, params, batch, None)
    p_psgd, m_psgd, _, cs = one_step(cfg, mesh, params, batch, full_rank)
    assert float(m_psgd["powersgd/compressed"]) == 1.0
    for a, b, p in zip(jax.tree.leaves(p_dense), jax.tree.leaves(p_psgd), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(b) - np.asarray(p), np.asarray(a) - np.asarray(p), rtol=2e-3, atol=2e-6)
    np.testing.assert_allclose(float(m_psgd["grad/norm"]), float(m_dense["grad/norm"]), rtol=1e-4)
    new = cs.grad
    assert new.e and float(m_psgd["powersgd/error_norm"]) == 0.0  # enters the first tick empty
    # e_i = M_i - Ĝ: each replica keeps its deviation from the mean; at full rank they cancel over replicas
    R = pmesh.dp_size(mesh)
    assert max(float(jnp.max(jnp.abs(e.reshape(R, -1).sum(0)))) for e in new.e.values()) < 1e-4
    assert int(new.step) == 1


def test_powersgd_skipped_update_keeps_error_memory(setup, full_rank):
    cfg, mesh, params, batch = setup
    bad = dict(batch, advantages=batch["advantages"].at[0].set(jnp.nan))
    p_new, m, _, cs = one_step(cfg, mesh, params, bad, full_rank)
    assert float(m["grad/skipped"]) == 1.0 and float(m["powersgd/skipped"]) == 1.0
    st = cs.grad
    assert all(float(jnp.max(jnp.abs(e))) == 0.0 for e in st.e.values())
    for a, b in zip(jax.tree.leaves(p_new), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------- token-mean normaliser under PowerSGD (dp)
def _uneven(batch):
    """Response lengths 1..6 tokens, so the 8 replicas (2 rows each) hold different numbers of loss tokens."""
    lengths = np.array([1 + (7 * i) % NEW for i in range(B)])
    resp = np.zeros((B, T), np.float32)
    for i, n in enumerate(lengths):
        resp[i, T - NEW : T - NEW + n] = 1.0
    return dict(batch, response_mask=jnp.asarray(resp))


def _grads(cfg, mesh, params, batch, circuit, agg):
    """The train step's gradient (before clip/optimizer) from the circuit's grad_fn (None = XLA's dp mean)."""
    from twocircuit_jax.step.train_step import default_grad_fn

    c = dataclasses.replace(cfg.grpo, loss_agg=agg)
    loss = make_grpo_loss(cfg.model, c, NEW, None)
    fn = dispatch.jit((circuit.grad_fn(None) if circuit else default_grad_fn)(loss))
    b = dict(batch, old_logp=jnp.zeros((B, T)))
    b = jax.device_put(b, pmesh.batch_shardings(b, mesh))
    return fn(params, b, circuit_state(circuit, params))[0]


def _rel(a, b):
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("phase", ["full_rank", "warm_up"])
def test_powersgd_gradient_equals_dense_on_uneven_lengths(setup, full_rank, agg, phase):
    """Each replica normalises by the global token (sequence) count, so PowerSGD's replica mean is the dense
    step's global token mean also when lengths differ across replicas (a mean of per-replica means is not)."""
    cfg, mesh, params, batch = setup
    batch = _uneven(batch)
    c = full_rank
    if phase == "warm_up":
        c = FastCircuit(run_cfg(grad_codec="powersgd", start_after=5), cfg.model, mesh)
    g_dense = _grads(cfg, mesh, params, batch, None, agg)
    g_psgd = _grads(cfg, mesh, params, batch, c, agg)
    assert _rel(g_psgd, g_dense) <= 1e-6, _rel(g_psgd, g_dense)
