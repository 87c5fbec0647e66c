"""Gradient PowerSGD with error feedback (design §3.5, §8 invariant 7) on the 8-device fake CPU mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from twocircuit_jax.fast.powersgd import (
    PowerSGDConfig,
    flat_leaves,
    init_powersgd,
    plan_leaves,
    powersgd_reduce,
    powersgd_reference,
    state_specs,
)
from twocircuit_jax.parallel import dispatch

R = 8
AX = "data"
# A leaf of every kind: stacked decoder matrix, plain matrix, vector, embedding (uncompressed by default).
PARAMS = {
    "embed": jnp.zeros((12, 8)),
    "layers": {"w": jnp.zeros((2, 24, 16)), "b": jnp.zeros((2, 16))},
    "head": jnp.zeros((20, 18)),
}


def _mesh():
    return Mesh(np.array(jax.devices()[:R]), (AX,))


def _grads(seed, params=PARAMS, scale=1.0):
    """Per-replica gradients stacked on a leading replica axis [R, ...]."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, (R,) + x.shape) for k, x in zip(keys, leaves)])


def _replica(g, i):
    return jax.tree.map(lambda x: x[i], g)


_CACHE = {}


def _sharded(cfg, state, interpret=False, phase=None):
    """jit(shard_map(powersgd_reduce)) -> f(g, state, skip=False) = (mean, new_state, metrics).

    Replicated outputs come back once per replica and are checked bit-identical (design §8 inv. 8) before the
    first copy is returned. One compile per (cfg, tree, interpret, phase); `skip` is traced so it reuses it.
    """
    key = (cfg, jax.tree.structure(state), interpret, phase)
    if key not in _CACHE:
        specs = state_specs(state, AX)

        def body(g, st, skip):
            mean, new, m = powersgd_reduce(_replica(g, 0), st, cfg, AX, skip=skip, interpret=interpret, phase=phase)
            return jax.tree.map(lambda x: x[None], (mean, new.Q, new.step, m)), new.e

        _CACHE[key] = dispatch.jit(
            jax.shard_map(body, mesh=_mesh(), in_specs=(P(AX), specs, P()), out_specs=(P(AX), specs.e))
        )

    def run(g, st, skip=False):
        per, e = _CACHE[key](g, st, jnp.asarray(skip))
        for x in jax.tree.leaves(per):
            x = np.asarray(x)
            assert all(x[0].tobytes() == x[i].tobytes() for i in range(1, R)), (
                "replicated value differs across replicas"
            )
        mean, Q, step, m = jax.tree.map(lambda x: x[0], per)
        return mean, state._replace(Q=Q, e=e, step=step), m

    return run


def _close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_plan_rule_and_embeddings():
    cfg = PowerSGDConfig(rank=2)
    plan = {p.path: p for p in plan_leaves(cfg, PARAMS)}
    assert [p for p in plan] == sorted(plan)
    assert plan["layers/w"].compress and plan["layers/w"].layers == 2
    assert plan["head"].compress  # (20+18)·2·2 = 152 < 360
    assert not plan["layers/b"].compress and not plan["embed"].compress
    # a layer-stack vector is L vectors, not an L x H matrix, however well the rule would compress it
    wide = {"layers": {"norm": jnp.zeros((28, 1536))}, "w": jnp.zeros((28, 1536))}
    assert [p.compress for p in plan_leaves(cfg, wide)] == [False, True]
    assert plan_leaves(dataclasses.replace(cfg, compress_embeddings=True), {"embed": jnp.zeros((40, 40))})[0].compress
    # The rule is strict: (8+8)·2·2 = 64 = 8·8 does not qualify.
    assert not plan_leaves(cfg, {"w": jnp.zeros((8, 8))})[0].compress


def test_full_rank_recovers_dp_mean_and_error_identity():
    # r = min(n, m) makes P̂ span the whole column space, so Ĝ must equal the dp mean exactly (fp32 round-off).
    params = {"a": jnp.zeros((10, 5)), "s": jnp.zeros((2, 7, 5)), "t": jnp.zeros((5, 9))}
    cfg = PowerSGDConfig(rank=5, min_compression_rate=0.1, start_after=0)
    state = init_powersgd(cfg, params, R)
    assert all(p.compress for p in plan_leaves(cfg, params))
    g = _grads(1, params)
    mean, new, metrics = _sharded(cfg, state)(g, state)
    want = jax.tree.map(lambda x: jnp.mean(x, 0), g)
    _close(mean, want, 2e-5)
    assert float(metrics["powersgd/compressed"]) == 1.0
    # Ĝ + new e == M = g + e_old for every replica (e_old = 0).
    for path, e in flat_leaves(new.e).items():
        gl = flat_leaves(g)[path]
        e = np.asarray(e).reshape((R,) + gl.shape[1:])
        np.testing.assert_allclose(e + np.asarray(flat_leaves(mean)[path])[None], np.asarray(gl), atol=1e-5)


def test_shard_map_matches_reference_over_two_ticks():
    cfg = PowerSGDConfig(rank=2, start_after=0)
    state = init_powersgd(cfg, PARAMS, R)
    ref_state = state
    f = _sharded(cfg, state)
    for step in range(2):  # the second tick uses the warm-started Q and a non-zero error memory
        g = _grads(10 + step)
        old = state
        mean, state, m = f(g, state)
        rmean, ref_state, rm = powersgd_reference([_replica(g, i) for i in range(R)], ref_state, cfg)
        _close(mean, rmean, 1e-4)
        _close(state.Q, ref_state.Q, 1e-4)
        _close(state.e, ref_state.e, 1e-4)
        np.testing.assert_allclose(float(m["powersgd/error_norm"]), rm["powersgd/error_norm"], rtol=1e-4)
        # Ĝ + new e == M = g + old e on every replica, at rank 2 (the error memory is busy here).
        for path in ("head", "layers/w"):
            gl, e_old, e_new = flat_leaves(g)[path], old.e[path], state.e[path]
            split = lambda e: np.asarray(e).reshape(gl.shape)  # noqa: E731  [R·n0, ...] -> [R, n0, ...]
            np.testing.assert_allclose(
                split(e_new) + np.asarray(flat_leaves(mean)[path])[None], np.asarray(gl) + split(e_old), atol=1e-5
            )
    assert int(state.step) == 2
    assert float(jnp.abs(state.e["head"]).max()) > 0.1


def test_skip_leaves_error_memory_and_q_untouched():
    cfg = PowerSGDConfig(rank=2, start_after=0)
    state = init_powersgd(cfg, PARAMS, R)
    state = _sharded(cfg, state)(_grads(3), state)[1]  # non-zero e
    _, kept, m = _sharded(cfg, state)(_grads(4), state, skip=True)
    assert float(m["powersgd/skipped"]) == 1.0
    _close(kept.e, state.e, 0)
    _close(kept.Q, state.Q, 0)
    assert int(kept.step) == int(state.step) + 1
    # A non-finite gradient on one replica skips by itself.
    g = _grads(5)
    g["head"] = g["head"].at[3, 0, 0].set(jnp.nan)
    _, kept, m = _sharded(cfg, state)(g, state)
    assert float(m["powersgd/skipped"]) == 1.0
    _close(kept.e, state.e, 0)


def test_start_after_is_plain_mean_and_error_feedback_off():
    cfg = PowerSGDConfig(rank=2, start_after=1)
    state = init_powersgd(cfg, PARAMS, R)
    f = _sharded(cfg, state)
    g = _grads(6)
    mean, s1, m = f(g, state)
    _close(mean, jax.tree.map(lambda x: jnp.mean(x, 0), g), 1e-6)
    assert float(m["powersgd/compressed"]) == 0.0
    _close(s1.e, state.e, 0)
    _close(s1.Q, state.Q, 0)
    mean2, s2, m2 = f(g, s1)  # step 1 >= start_after: compressed now
    assert float(m2["powersgd/compressed"]) == 1.0
    assert float(jnp.abs(mean2["head"] - jnp.mean(g["head"], 0)).max()) > 1e-3
    cfg_nf = dataclasses.replace(cfg, start_after=0, error_feedback=False)
    _, s3, _ = powersgd_reference([_replica(g, i) for i in range(R)], init_powersgd(cfg_nf, PARAMS, R), cfg_nf)
    assert all(float(jnp.abs(e).max()) == 0 for e in s3.e.values())


def test_each_phase_alone_is_the_cond_at_its_step():
    """The trainer's two train-step programs (step/programs.py PhasedTrainStep) build one phase each: the plain
    phase gives what the one-program cond gives during the warm-up, the compressed phase what it gives after, bit
    for bit (mean, Q, e, step and metrics); the compressed phase compresses even before `start_after` (the caller
    owns the choice), and a phase outside the three is refused."""
    cfg = PowerSGDConfig(rank=2, start_after=1)
    state = init_powersgd(cfg, PARAMS, R)
    g, g2 = _grads(8), _grads(9)
    both = _sharded(cfg, state)
    plain, comp = _sharded(cfg, state, phase="plain"), _sharded(cfg, state, phase="compressed")
    out0, s1, m0 = both(g, state)
    p0, ps1, pm0 = plain(g, state)
    out1, s2, m1 = both(g2, s1)
    c1, cs2, cm1 = comp(g2, s1)
    assert float(m0["powersgd/compressed"]) == 0.0 and float(m1["powersgd/compressed"]) == 1.0
    for a, b in ((out0, p0), (s1, ps1), (m0, pm0), (out1, c1), (s2, cs2), (m1, cm1)):
        _close(a, b, 0)
    early, _, em = comp(g, state)  # step 0 < start_after: the compressed phase compresses all the same
    assert float(em["powersgd/compressed"]) == 1.0
    assert float(jnp.abs(early["head"] - p0["head"]).max()) > 1e-3
    with pytest.raises(ValueError, match="phase must be None, 'plain' or 'compressed'"):
        powersgd_reduce(_replica(g, 0), state, cfg, AX, phase="warm")


def test_kernel_path_matches_and_refuses_without_interpret():
    cfg = PowerSGDConfig(rank=2, start_after=0)
    state = init_powersgd(cfg, PARAMS, R)
    g = _grads(7)
    reps = [_replica(g, i) for i in range(R)]
    kcfg = dataclasses.replace(cfg, use_kernel=True)
    mean_k, _, _ = _sharded(kcfg, state, interpret=True)(g, state)
    rmean, _, _ = powersgd_reference(reps, state, cfg)
    _close(mean_k, rmean, 1e-4)
    with pytest.raises(RuntimeError, match="interpret"):
        powersgd_reduce(reps[0], state, kcfg, AX)
