"""Optimizer-state swap purity (design §4.6, §8.5), including sharded optax states on the 8-device fake mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from twocircuit_jax.anchor.merger import select_targets
from twocircuit_jax.anchor.swap import AnchorMoments, init_anchor_moments, swap_optimizer_moments, update_anchor_moments


def _params(seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    return {
        "embed": f(8, 16),
        "final_norm": f(16),
        "layers": {"q_proj": {"kernel": f(2, 8, 16), "bias": f(2, 16)}, "up_proj": {"kernel": f(2, 8, 16)}},
    }


def _adam_state(opt, params, seed=1):
    st = opt.init(params)
    _, st = opt.update(_params(seed), st, params)
    _, st = opt.update(_params(seed + 1), st, params)
    return st


def _find_adam(state):
    found = [
        x
        for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(x, optax.ScaleByAdamState)
    ]
    assert len(found) == 1
    return found[0]


def _fired_moments(params, scope="all", n=2):
    mom = init_anchor_moments(params, scope)
    for i in range(n):
        mom = update_anchor_moments(mom, _params(10 + i))
    return mom


def _bits_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8))
        for x, y in zip(la, lb)
    )


def test_anchor_moment_update_formula():
    p = _params()
    mom = init_anchor_moments(p, "decoder")
    assert sorted(mom.m) == ["layers/q_proj/kernel", "layers/up_proj/kernel"]
    mom = update_anchor_moments(update_anchor_moments(mom, _params(10)), _params(11), beta1=0.8, beta2=0.95)
    g1, g2 = (np.asarray(_params(s)["layers"]["up_proj"]["kernel"]) for s in (10, 11))
    k = "layers/up_proj/kernel"
    np.testing.assert_allclose(np.asarray(mom.m[k]), 0.8 * 0.2 * g1 + 0.2 * g2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mom.v[k]), 0.95 * 0.05 * g1**2 + 0.05 * g2**2, rtol=1e-5, atol=1e-6)
    assert int(mom.fired) == 2


@pytest.mark.parametrize("wrap", ["adamw", "inject", "multisteps", "masked"])
def test_alpha_one_replaces_with_matched_norm(wrap):
    p = _params()
    if wrap == "adamw":
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    elif wrap == "inject":
        opt = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    elif wrap == "multisteps":
        opt = optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=1)
    else:
        opt = optax.masked(optax.adam(1e-3), jax.tree_util.tree_map(lambda x: x.ndim >= 2, p))
    st = _adam_state(opt, p)
    mom = _fired_moments(p)
    new, met = swap_optimizer_moments(st, mom, alpha=1.0)
    old_a, new_a = _find_adam(st), _find_adam(new)
    old_mu = {k: v for k, v in select_targets(old_a.mu).items()}
    new_mu, new_nu = select_targets(new_a.mu), select_targets(new_a.nu)
    assert old_mu, "no moments found"
    for k, mu in old_mu.items():
        rho = np.linalg.norm(np.asarray(mu)) / (np.linalg.norm(np.asarray(mom.m[k])) + 1e-12)
        np.testing.assert_allclose(np.asarray(new_mu[k]), rho * np.asarray(mom.m[k]), rtol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(np.asarray(new_mu[k])), np.linalg.norm(np.asarray(mu)), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(new_nu[k]), rho**2 * np.asarray(mom.v[k]), rtol=1e-5)
    assert np.array_equal(np.asarray(new_a.count), np.asarray(old_a.count))
    assert float(met["swap/applied"]) == 1.0 and float(met["swap/rho"]) > 0
    if wrap == "masked":  # 1-D leaves are masked out of Adam and must stay untouched (no mu there at all)
        assert "final_norm" not in old_mu


def test_partial_blend_formula_and_no_scale_match():
    p = _params()
    opt = optax.adamw(1e-3)
    st, mom = _adam_state(opt, p), _fired_moments(p, "decoder")
    new, _ = swap_optimizer_moments(st, mom, alpha=0.25, scale_match=False)
    a0, a1 = _find_adam(st), _find_adam(new)
    k = "layers/q_proj/kernel"
    mu0, nu0 = np.asarray(a0.mu["layers"]["q_proj"]["kernel"]), np.asarray(a0.nu["layers"]["q_proj"]["kernel"])
    np.testing.assert_allclose(
        np.asarray(a1.mu["layers"]["q_proj"]["kernel"]), 0.75 * mu0 + 0.25 * np.asarray(mom.m[k]), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(a1.nu["layers"]["q_proj"]["kernel"]), 0.75 * nu0 + 0.25 * np.asarray(mom.v[k]), rtol=1e-5
    )
    # Decoder scope: the embedding's moments are not targets and stay bit-identical.
    assert _bits_equal(a0.mu["embed"], a1.mu["embed"]) and _bits_equal(a0.nu["embed"], a1.nu["embed"])


def test_identity_cases_and_zero_mode():
    p = _params()
    opt = optax.adamw(1e-3)
    st = _adam_state(opt, p)
    same, met = swap_optimizer_moments(st, _fired_moments(p), alpha=0.0)
    assert _bits_equal(same, st) and float(met["swap/applied"]) == 0.0
    never, met = swap_optimizer_moments(st, init_anchor_moments(p), alpha=1.0)
    assert _bits_equal(never, st) and float(met["swap/applied"]) == 0.0
    zero, _ = swap_optimizer_moments(st, _fired_moments(p), alpha=1.0, mode="zero")
    a = _find_adam(zero)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree_util.tree_leaves((a.mu, a.nu)))
    assert np.array_equal(np.asarray(a.count), np.asarray(_find_adam(st).count))
    with pytest.raises(ValueError, match="ScaleByAdamState"):
        swap_optimizer_moments(optax.sgd(0.1).init(p), _fired_moments(p))


def test_purity_under_jit_weights_untouched():
    p = _params()
    opt = optax.adamw(1e-3)
    st, mom = _adam_state(opt, p), _fired_moments(p)
    p_copy = jax.tree_util.tree_map(lambda x: np.array(x), p)
    st_copy = jax.tree_util.tree_map(lambda x: np.array(x), st)
    f = jax.jit(swap_optimizer_moments, static_argnames="mode")
    a, _ = f(st, mom, alpha=0.5)
    b, _ = f(st, mom, alpha=0.5)
    e, _ = swap_optimizer_moments(st, mom, alpha=0.5)
    assert _bits_equal(a, b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(e)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
    assert _bits_equal(st, st_copy) and _bits_equal(p, p_copy)  # inputs not mutated


@pytest.mark.parametrize("anchor_sharded", [True, False])
def test_sharded_state_keeps_shardings_and_no_recompile(anchor_sharded):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))

    def spec(x):
        if x.ndim == 3:
            return NamedSharding(mesh, P(None, "dp", "tp"))
        if x.ndim == 2:
            return NamedSharding(mesh, P("dp", "tp"))
        if x.ndim == 1:
            return NamedSharding(mesh, P("tp"))
        return NamedSharding(mesh, P())

    shard = lambda t: jax.tree_util.tree_map(lambda x: jax.device_put(x, spec(x)), t)  # noqa: E731
    p = shard(_params())
    opt = optax.adamw(1e-3)
    st = shard(_adam_state(opt, p))
    mom0, mom1 = init_anchor_moments(p), _fired_moments(p)
    if anchor_sharded:
        mom0, mom1 = shard(mom0), shard(mom1)
    traces = []

    def fn(s, m, alpha):
        traces.append(1)
        return swap_optimizer_moments(s, m, alpha=alpha)

    f = jax.jit(fn)
    out0, met0 = f(st, mom0, 1.0)  # before the first fire: identity
    out1, met1 = f(out0, mom1, 1.0)  # after a fire: applied, same compiled program
    out2, _ = f(out1, mom1, 0.5)
    assert len(traces) == 1 and f._cache_size() == 1
    assert float(met0["swap/applied"]) == 0.0 and float(met1["swap/applied"]) == 1.0
    assert _bits_equal(out0, st)
    for before, after in zip(jax.tree_util.tree_leaves(st), jax.tree_util.tree_leaves(out2)):
        assert after.sharding == before.sharding, (before.shape, before.sharding, after.sharding)
    k = "layers/up_proj/kernel"
    a_old, a_new = _find_adam(st), _find_adam(out1)
    mu = np.asarray(a_old.mu["layers"]["up_proj"]["kernel"])
    rho = np.linalg.norm(mu) / np.linalg.norm(np.asarray(mom1.m[k]))
    np.testing.assert_allclose(
        np.asarray(a_new.mu["layers"]["up_proj"]["kernel"]), rho * np.asarray(mom1.m[k]), rtol=1e-5
    )


def test_moments_type_is_a_namedtuple_pytree():
    mom = _fired_moments(_params())
    assert isinstance(mom, AnchorMoments)
    leaves = jax.tree_util.tree_leaves(mom)
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in leaves)
