"""A non-finite anchor fire or swap is skipped, counted (`anchor/skipped`, kept across resume) and never applied.

The NaN reaches the anchor through real code: a retained mini-batch whose advantages are NaN is replayed by a later
fire (delay 2), so that fire's dense gradient is NaN. Before the guard the NaN went into M and the moments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from test_anchor_circuit import _cfg, _circuit, _cs, tiny  # noqa: F401 - the module fixture: one compile

from twocircuit_jax.anchor.circuit import AnchorCircuit
from twocircuit_jax.anchor.swap import init_anchor_moments, swap_optimizer_moments, update_anchor_moments


def _same(a, b):
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    return len(la) == len(lb) and all(np.array_equal(x, y, equal_nan=False) for x, y in zip(la, lb))


def test_nan_fire_is_skipped_counted_and_kept_across_resume(tiny, capsys):  # noqa: F811
    _, _, state, _, _, batch, moved = tiny
    cfg = _cfg(cadence=2, delay=2, projection={"enabled": False}, swap={"cadence": 2})
    circ = _circuit(cfg, state)
    cs = _cs(circ)

    def rows(tau):  # tick 4's mini-batch (replayed by the tick-6 fire) has NaN advantages
        b = dict(batch(tau))
        if tau == 4:
            b["advantages"] = jnp.full_like(b["advantages"], jnp.nan)
        return b

    for tau in range(1, 6):
        gs = (tau - 1) // 2 + 1
        cs, _, _ = circ.before_tick(tau, gs, tau % 2 == 1, rows(tau), moved(state, gs), cs)
    assert circ.step_metrics(cs)["anchor/skipped"] == 0
    before = jax.device_get((cs.merger, cs.moments))
    assert int(before[0].fired) == 2  # fires at ticks 2 and 4 applied
    cs, _, _ = circ.before_tick(6, 3, False, rows(6), moved(state, 3), cs)  # replays tick 4: NaN gradient
    assert _same((cs.merger, cs.moments), before)  # nothing applied, not even the fired count
    sm = circ.step_metrics(cs)
    assert sm["anchor/skipped"] == 1 and sm["anchor/fires"] == 3
    assert "anchor/skipped=1" in capsys.readouterr().err

    # the swap after the skipped fire blends the (kept, finite) moments: the trainer's AdamW stays finite
    st, swm = circ.after_tick(6, state, cs)
    assert float(swm["swap/applied"]) == 1.0
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(st.opt_state)))

    # a finite fire still applies (tick 8 replays tick 6's finite batch)
    for tau in (7, 8):
        cs, _, _ = circ.before_tick(tau, 4, tau == 7, rows(tau), moved(state, 4), cs)
    after = jax.device_get(cs.merger)
    assert int(after.fired) == 3 and not _same(after.m, before[0].m)
    assert all(np.all(np.isfinite(v)) for v in after.m.values())
    assert circ.step_metrics(cs)["anchor/skipped"] == 1  # cumulative

    # resume: the count is host state (checkpoint meta)
    again = AnchorCircuit(cfg, cfg.model, state.params)
    again._fire_jit = circ._fire_jit
    again.load_state_dict(circ.state_dict())
    assert again.step_metrics(cs)["anchor/skipped"] == 1


def _params(seed):
    r = np.random.default_rng(seed)
    return {"a": jnp.asarray(r.normal(size=(4, 8)), jnp.float32), "b": jnp.asarray(r.normal(size=(8,)), jnp.float32)}


def test_nonfinite_swap_is_skipped_and_a_finite_one_applies():
    p = _params(0)
    opt = optax.adamw(1e-3)
    st = opt.init(p)
    _, st = opt.update(_params(1), st, p)
    good = update_anchor_moments(init_anchor_moments(p), _params(2))
    bad = good._replace(m={**good.m, "a": good.m["a"].at[0, 0].set(jnp.inf)})
    swap = jax.jit(swap_optimizer_moments)
    new, met = swap(st, bad)
    assert _same(new, st) and float(met["swap/applied"]) == 0.0 and int(met["swap/skipped"]) == 1
    new, met = swap(st, good)
    assert not _same(new, st) and float(met["swap/applied"]) == 1.0 and int(met["swap/skipped"]) == 0
    never, met = swap(st, init_anchor_moments(p))  # not due: neither applied nor counted as skipped
    assert _same(never, st) and int(met["swap/skipped"]) == 0
