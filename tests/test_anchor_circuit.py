"""The anchor circuit without the loop (tests/test_anchor_loop.py runs it through the CLI): purity, snapshot
reads, non-finite forecasts, retention bound, disabled = absent, merger identities, and the config rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.anchor.circuit import AnchorCircuit
from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.names import OLD
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.step.circuit_state import CircuitState, dense_state, init_clock
from twocircuit_jax.step.grpo_step import make_grpo_loss
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.step.train_step import init_state, jit_train_step, make_optimizer, make_train_step, state_shardings

MODEL = tiny_config()["model"]
TINY = {
    "name": "tiny",
    "tokenizer": "char",
    "model": MODEL,
    "mesh": {"data": -1},
    "optim": {"lr": 1e-3},
    "task": {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 64, "eval_size": 8},
    "sampler": {"n": 4, "sampling": {"max_new_tokens": 4}},
    "fast": {"pp_size": 2},
    "anchor": {"enabled": True, "cadence": 4, "delay": 4, "projection": {"window": 2}, "swap": {"cadence": 2}},
    "train": {
        "steps": 6,
        "prompts_per_step": 4,
        "prompts_per_update": 2,
        "eval_every": 0,
        "eval_size": 8,
        "max_prompt_len": 16,
    },
}


def _cfg(**anchor):
    """TINY with these anchor keys; a section given as a dict is merged over TINY's."""
    base = TINY["anchor"]
    merged = {
        k: {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v for k, v in anchor.items()
    }
    return load_config(data={**TINY, "anchor": {**base, **merged}})


# --------------------------------------------------------------------------- direct: a circuit without the loop
@pytest.fixture(scope="module")
def tiny():
    cfg = _cfg()
    mesh = pmesh.make_mesh(cfg.mesh)
    params = init_params(cfg.model, jax.random.PRNGKey(0))
    opt = make_optimizer(cfg.optim)
    state = init_state(params, opt)
    sh = state_shardings(state, mesh)
    state = jax.device_put(state, sh)
    rng = np.random.default_rng(0)
    B, T = 8, 12

    def batch(seed):
        r = np.random.default_rng(seed)
        b = {
            "tokens": r.integers(3, 100, (B, T)).astype(np.int32),
            "attention_mask": np.ones((B, T), np.int32),
            "response_mask": np.concatenate([np.zeros((B, T - 4)), np.ones((B, 4))], 1).astype(np.float32),
            "advantages": r.normal(size=B).astype(np.float32),
            "sample_id": np.arange(B, dtype=np.int32),
            "sampler_logp": np.zeros((B, T), np.float32),
            "old_logp": np.zeros((B, T), np.float32),
            "ref_logp": -r.uniform(1, 5, (B, T)).astype(np.float32),
        }
        b["ref_logp_dense"] = b["ref_logp"]
        return jax.device_put(b, pmesh.batch_shardings(b, mesh))

    def moved(st, gs):  # distinct weights per step, as if the trainer had moved
        p = jax.tree.map(
            lambda x: x + 0.01 * gs * jnp.sin(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) + gs), st.params
        )
        return st._replace(params=jax.device_put(p, sh.params))

    del rng
    return cfg, mesh, state, sh, opt, batch, moved


_FIRE = {}


def _circuit(cfg, state):
    """An AnchorCircuit whose jitted fire is shared across this module (one compile): the fire depends only on
    the model, the GRPO loss and the merger/moment settings, which all circuits here share."""
    circ = AnchorCircuit(cfg, cfg.model, state.params)
    key = (cfg.anchor.merger_type, cfg.anchor.swap.cadence > 0)
    circ._fire_jit = _FIRE.setdefault(key, circ._fire_jit)
    return circ


def _cs(circ):
    """A circuit state with only the anchor's fields (no fast circuit)."""
    return CircuitState(init_clock(), None, None, circ.init_merger_state(), circ.init_moments())


def _drive(circ, cs, state_of, batch, ticks, tps=2, poison_tick=None):
    """before_tick for ticks 1..ticks (no train step); returns the circuit state and per-tick metrics."""
    out = []
    for tau in range(1, ticks + 1):
        gs = (tau - 1) // tps + 1
        st = state_of(gs)
        if tau == poison_tick:
            st = st._replace(params=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), st.params))
        cs, m, _ = circ.before_tick(tau, gs, (tau - 1) % tps == 0, batch(tau), st, cs)
        out.append(m)
    return cs, out


@pytest.mark.parametrize("projection", [False, True])
def test_fire_is_pure_and_reads_only_snapshots(tiny, projection):
    cfg, _, state, _, _, batch, moved = tiny
    cfg = _cfg(cadence=2, delay=2, projection={"enabled": projection}, swap={"cadence": 2})
    results = []
    for poison in (None, 6):  # tick 6 is a fire tick and not a step's first tick: live weights are NaN there
        circ = _circuit(cfg, state)
        cs = _cs(circ)
        cs, _ = _drive(circ, cs, lambda gs: moved(state, gs), batch, 5)
        live = moved(state, 3)
        before = jax.device_get(live)
        st4 = (
            live
            if poison is None
            else live._replace(params=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), live.params))
        )
        cs, m, _ = circ.before_tick(6, 3, False, batch(6), st4, cs)
        assert circ.fires == 3 and "anchor/pg_loss" in m and m["anchor/ratio_mean"] == 1.0
        assert ("rank1/evr" in m) == projection  # window [tick 1, tick 3]: the forecast is in use
        if poison is None:  # the fire neither wrote nor donated the trainer state
            after = jax.device_get(live)
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
        results.append((jax.device_get(cs.merger.m), jax.device_get(cs.moments.m)))
    (m_a, mom_a), (m_b, mom_b) = results
    assert any(np.abs(v).max() > 0 for v in m_a.values())  # a real gradient reached M
    for k in m_a:
        assert np.all(np.isfinite(m_b[k])) and np.array_equal(m_a[k], m_b[k]), k
        assert np.array_equal(mom_a[k], mom_b[k]), k


def test_retention_bound_and_delay_over_many_ticks(tiny):
    _, _, state, _, _, batch, moved = tiny
    cfg = _cfg(cadence=2, delay=5, projection={"enabled": False}, swap={"cadence": 2})
    circ = _circuit(cfg, state)
    cs = _cs(circ)
    bound = 5 // 2 + 1
    delays = []
    for tau in range(1, 61):
        gs = (tau - 1) // 2 + 1
        cs, _, _ = circ.before_tick(tau, gs, tau % 2 == 1, batch(tau % 3), moved(state, gs % 4), cs)
        assert circ.buffer.num_batches <= bound
        assert circ.buffer.num_snapshots <= bound + 1  # plus the current step's (sampler) snapshot
        if tau % 2 == 0:
            sm = circ.step_metrics(cs)
            if tau > 6:
                delays.append((sm["anchor/data_delay"], sm["anchor/weight_staleness"]))
    assert circ.fires == 30
    assert delays and all(d == 5 and w in (5, 6) for d, w in delays)


@pytest.mark.parametrize("projection, kept", [(False, [2, 6]), (True, [2, 4, 6, 8])])
def test_only_the_kept_ticks_need_the_anchor_fields(tiny, projection, kept):
    """cadence 4, delay 2: ticks ≡ 2 (mod 4) are retained; with the projection a fire (ticks ≡ 0) also reads its own
    tick's batch. The loop computes ℓ_ref^dense for those mini-batches only, so the others may lack it; a kept
    one without it is refused, naming the tick and the field, before anything changes."""
    _, _, state, _, _, batch, moved = tiny
    circ = _circuit(_cfg(cadence=4, delay=2, projection={"enabled": projection}, swap={"cadence": 2}), state)
    assert [t for t in range(1, 9) if circ.keeps(t)] == kept

    def rows(tau):
        b = dict(batch(tau))
        return b if circ.keeps(tau) else {k: v for k, v in b.items() if k != "ref_logp_dense"}

    cs = _cs(circ)
    for tau in range(1, 9):
        gs = (tau - 1) // 2 + 1
        cs, _, _ = circ.before_tick(tau, gs, tau % 2 == 1, rows(tau), moved(state, gs), cs)
    assert circ.fires == 2
    lacking = {k: v for k, v in batch(10).items() if k != "ref_logp_dense"}
    cs, _, _ = circ.before_tick(9, 5, True, lacking, moved(state, 5), cs)  # not kept: fine
    with pytest.raises(ValueError, match=r"tick 10's mini-batch .*ref_logp_dense"):
        circ.before_tick(10, 5, False, lacking, moved(state, 5), cs)
    circ.before_tick(10, 5, False, batch(10), moved(state, 5), cs)  # the tick was not recorded: it can come again
    assert circ.buffer.retained_ticks == [10] and circ.fires == 2


def test_nonfinite_forecast_is_skipped_counted_and_changes_no_state(tiny, capsys):
    """Before, the forecast's FloatingPointError ended the run; now that fire is skipped like a non-finite gradient."""
    _, _, state, _, _, batch, moved = tiny
    cfg = _cfg(cadence=2, delay=2, projection={"enabled": True}, swap={"cadence": 2})
    circ = _circuit(cfg, state)
    cs = _cs(circ)
    bad = moved(state, 2)
    bad = bad._replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), bad.params))
    # step 2's snapshot (tick 3) holds an inf; the fire at tick 4 still replays step 1's exact pair
    cs, _ = _drive(circ, cs, lambda gs: bad if gs == 2 else moved(state, gs), batch, 5)
    assert circ.fires == 2 and circ.step_metrics(cs)["anchor/skipped"] == 0
    capsys.readouterr()
    before = jax.device_get((cs.merger, cs.moments))
    win0, snaps0, fires0 = circ.window.ticks, list(circ.window._snaps), circ.fires
    # tick 6 pairs tick 4's batch with the inf snapshot: the forecast is non-finite, the fire is skipped
    cs, m, sketch = circ.before_tick(6, 3, False, batch(6), moved(state, 3), cs)
    assert sketch is None and "rank1/evr" not in m and "anchor/pg_loss" not in m  # no backward ran
    assert circ.fires == fires0 and circ.window.ticks == win0
    assert all(a is b for a, b in zip(circ.window._snaps, snaps0))  # the window kept its snapshots
    after = jax.device_get((cs.merger, cs.moments))
    la, lb = jax.tree.leaves(before), jax.tree.leaves(after)
    assert len(la) == len(lb) and all(np.array_equal(a, b) for a, b in zip(la, lb))  # M and the moments unchanged
    sm = circ.step_metrics(cs)
    assert sm["anchor/skipped"] == 1 and "rank-1 forecast" in capsys.readouterr().err
    # the run goes on: the next fire (tick 8) forecasts from a finite window and applies
    for tau in (7, 8):
        cs, m, _ = circ.before_tick(tau, 4, tau == 7, batch(tau), moved(state, 4), cs)
    assert circ.fires == fires0 + 1 and circ.window.ticks == [1, 5] and "rank1/evr" in m
    assert circ.step_metrics(cs)["anchor/skipped"] == 1
    m_new = jax.device_get(cs.merger.m)
    assert all(np.all(np.isfinite(v)) for v in m_new.values())
    assert any(not np.array_equal(m_new[k], before[0].m[k]) for k in m_new)


def test_merger_none_and_cold_merger_leave_the_step_bit_identical(tiny):
    cfg, _, state, sh, opt, batch, moved = tiny
    loss_fn = make_grpo_loss(cfg.model, cfg.grpo, 4)
    b = dict(batch(1))
    base = dense_state()
    b["old_logp"] = dispatch.jit(make_logp_fn(cfg.model, None, OLD))(state.params, b, base)[0]

    def run(step, cs):
        new, _, m = step(jax.tree.map(jnp.copy, state), cs, b)
        return jax.device_get(new.params), m

    dense, _ = run(jit_train_step(make_train_step(loss_fn, opt), None, donate=False), base)
    # merger none: no circuit state and the transform hands back the very gradient object (the dense step)
    none = AnchorCircuit(
        _cfg(merger={"type": "none"}, projection={"enabled": False}, swap={"cadence": 0}), cfg.model, state.params
    )
    assert none.init_merger_state() is None and none.init_moments() is None
    g = jax.tree.map(jnp.ones_like, state.params)
    g2, cs_none, m_none = none.grad_transform(g, base)
    assert g2 is g and m_none == {} and cs_none is base
    # signed_ema before the first fire: the identity branch, bit for bit the dense update
    sig = _circuit(_cfg(cadence=2, delay=2, projection={"enabled": False}, swap={"cadence": 2}), state)
    cs = _cs(sig)
    step = jit_train_step(make_train_step(loss_fn, opt, grad_transform=sig.grad_transform), None, donate=False)
    p_cold, m_cold = run(step, cs)
    assert float(m_cold["merger/rel_change"]) == 0.0
    # the same update to float32 rounding: the merged gradient is the raw one bit for bit (rel_change 0 above), but the
    # two programs fuse differently, and the embedding's gradient, a scatter-add, sums in an order that follows the
    # fusion (the test suite's XLA:CPU legacy emitters, tests/conftest.py: up to 8 ulp on 24 of its 3,200 values)
    for c, d in zip(jax.tree.leaves(p_cold), jax.tree.leaves(dense)):
        np.testing.assert_array_max_ulp(c, d, maxulp=16)
    cs, _ = _drive(sig, cs, lambda gs: moved(state, gs), batch, 2)  # fires on tick 2
    p_hot, m_hot = run(step, cs)
    assert step._cache_size() == 1
    assert float(m_hot["merger/rel_change"]) > 0
    assert any(not np.array_equal(a, d) for a, d in zip(jax.tree.leaves(p_hot), jax.tree.leaves(dense)))


def test_disabled_anchor_is_absent_from_the_circuit_state(tiny):
    from twocircuit_jax.step.programs import build_circuits  # what the trainer's assembly calls (built_run.py)

    _, mesh, state, _, _, _, _ = tiny
    for anchor, present in (
        ({"enabled": False, "swap": {"cadence": 0}}, set()),
        ({"merger": {"type": "none"}, "projection": {"enabled": False}, "swap": {"cadence": 0}}, set()),
        ({"swap": {"cadence": 0}}, {"merger"}),
        ({}, {"merger", "moments"}),
    ):
        cfg = _cfg(**anchor)
        t = build_circuits(cfg, cfg.model, mesh, state.params)
        fields = {k for k in ("codec", "grad", "merger", "moments") if getattr(t.cs, k) is not None}
        assert fields == present and (t.anchor is None) == (not cfg.anchor.enabled)
        # the sharding tree has the state's structure: the step's in/out shardings fit it
        assert jax.tree.structure(t.cs) == jax.tree.structure(t.cs_sh, is_leaf=lambda x: hasattr(x, "spec"))


@pytest.mark.parametrize(
    "sets, field",
    [
        (["anchor.merger.type=none"], "anchor.projection"),
        (["anchor.replay_paired_batch=false"], "anchor.replay_paired_batch"),
        (["anchor.cadence=3", "anchor.merger.cadence=2"], "anchor.cadence"),
        (["anchor.owns_q=true"], "anchor.owns_q"),
        (["anchor.enabled=false"], "anchor.swap.cadence"),
        (["anchor.swap.alpha=1.5"], "anchor.swap.alpha"),
        (["anchor.swap.beta1=1.0"], "anchor.swap.beta1"),
    ],
)
def test_cross_circuit_rules_name_the_field(tmp_path, sets, field):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(TINY))
    with pytest.raises(ConfigError) as e:
        load_config(str(p), sets)
    assert field in str(e.value)
    load_config(str(p))  # the base itself is valid


def test_the_fire_reads_its_weights_in_the_compute_dtype_with_the_same_result(tiny):
    """The fire's snapshot crosses to the device in the compute dtype (anchor/circuit.py `fire_weights`: half the
    bytes in the fire's arguments at bf16 compute, what lets Qwen2.5-1.5B fire over two v5e-8 slices) and the fire
    widens it back: the merger's EMA, the moments and the metrics equal, bit for bit, those of the same fire fed the
    fp32 weights; the shapes-only tools give the fire the same argument."""
    from twocircuit_jax.anchor.circuit import fire_weights
    from twocircuit_jax.anchor.loss import anchor_batch_keys
    from twocircuit_jax.step.abstract_step import abstract_programs

    _, mesh, _, _, _, batch, _ = tiny
    cfg = load_config(data={**TINY, "model": {**MODEL, "compute_dtype": "bfloat16"}})
    params = jax.device_put(
        init_params(cfg.model, jax.random.PRNGKey(1)),
        pmesh.param_shardings(jax.eval_shape(lambda: init_params(cfg.model, jax.random.PRNGKey(1))), mesh),
    )
    circ = AnchorCircuit(cfg, cfg.model, params)
    host = jax.device_get(params)
    narrow = fire_weights(host, cfg.model.compute_dtype)
    assert {str(x.dtype) for x in jax.tree.leaves(host)} == {"float32"}
    assert {str(x.dtype) for x in jax.tree.leaves(narrow)} == {"bfloat16"}
    b = {k: v for k, v in batch(3).items() if k in anchor_batch_keys(cfg.grpo)}
    outs = []
    for weights in (host, narrow):
        carry = {"merger": circ.init_merger_state(), "moments": circ.init_moments()}
        carry, metrics, _ = circ.fire_program(jax.device_put(weights, circ.param_sh), b, carry, None)
        outs.append(jax.device_get((carry, metrics)))
    assert any(np.abs(v).max() > 0 for v in outs[0][0]["merger"].m.values())  # a real gradient reached M
    wide, thin = (jax.tree_util.tree_flatten_with_path(o)[0] for o in outs)
    for (path, a), (_, c) in zip(wide, thin):
        assert np.array_equal(np.asarray(a), np.asarray(c)), jax.tree_util.keystr(path)
    shapes = abstract_programs(cfg, jax.devices())["anchor_fire"].args[0]
    assert {str(x.dtype) for x in jax.tree.leaves(shapes)} == {"bfloat16"}
