"""Merger algebra (design §4.4, §8.6): every rule against a hand-computed numpy result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.anchor.merger import init_merger, merge, select_targets, update_ema
from twocircuit_jax.config.anchor import MergerConfig
from twocircuit_jax.config.base import from_dict


def _params(seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    return {
        "embed": f(5, 3),
        "final_norm": f(3),
        "layers": {
            "q_proj": {"kernel": f(2, 3, 4), "bias": f(2, 4)},
            "down_proj": {"kernel": f(2, 4, 3)},
            "input_norm": f(2, 3),
        },
        "step_ids": jnp.arange(3, dtype=jnp.int32),
    }


def _np(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def _cfg(merger="signed_ema", **kw):
    """The merger section `anchor.merger: {type: merger, **kw}`, parsed as a config file's would be."""
    return from_dict(MergerConfig, {"type": merger, **kw}, "anchor.merger")


def _fire(cfg, state, ga):
    return update_ema(state, ga, cfg)


def test_target_scopes():
    p = _params()
    assert list(select_targets(p, "decoder")) == ["layers/down_proj/kernel", "layers/q_proj/kernel"]
    allk = select_targets(p, "all")
    assert "step_ids" not in allk and "embed" in allk and len(allk) == 6


def test_bypass_until_m_exists_and_none_is_identity():
    p, g = _params(0), _params(1)
    for mode in ("signed_ema", "signed_gate", "delayed_ef", "blend"):
        cfg = _cfg(merger=mode)
        g2, st, met = merge(init_merger(p, cfg), g, cfg, True)
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g2)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        assert float(met["merger/applied"]) == 0.0 and int(st.cold_m_fallbacks) == 0
    ema = _cfg()
    st = _fire(ema, init_merger(p, ema), _params(2))  # an M exists: `none` must still leave G alone
    g2, st2, met = merge(st, g, _cfg(merger="none"), True)
    assert st2 is st and met == {}
    with pytest.raises(ValueError, match="keeps no state"):
        init_merger(p, _cfg(merger="none"))
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g2)):
        assert a is b or np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_ema_in_fp32():
    p, cfg = _params(), _cfg(beta_anc=0.25)
    st = init_merger(p, cfg)
    st = update_ema(st, _params(1), cfg)
    st = update_ema(st, _params(2), cfg)
    for k in st.m:
        g1, g2 = np.asarray(select_targets(_params(1))[k]), np.asarray(select_targets(_params(2))[k])
        np.testing.assert_allclose(np.asarray(st.m[k]), 0.25 * (0.75 * g1) + 0.75 * g2, rtol=1e-6)
    assert int(st.fired) == 2


def test_signed_ema_and_cold_guard():
    p, g, ga = _params(0), _params(1), _params(2)
    cfg = _cfg(merger="signed_ema", alpha=0.25, beta_anc=0.0)
    st = _fire(cfg, init_merger(p, cfg, "decoder"), ga)
    g2, st2, met = merge(st, g, cfg, False)
    k = "layers/q_proj/kernel"
    gn, mn = np.asarray(g["layers"]["q_proj"]["kernel"]), np.asarray(ga["layers"]["q_proj"]["kernel"])
    want = 0.25 * gn + 0.75 * np.abs(gn) * np.sign(mn)
    np.testing.assert_allclose(np.asarray(g2["layers"]["q_proj"]["kernel"]), want, rtol=1e-6)
    # Non-targets pass through (decoder scope leaves the embedding alone).
    assert np.array_equal(np.asarray(g2["embed"]), np.asarray(g["embed"]))
    assert float(met["merger/rel_change/" + k]) == pytest.approx(np.linalg.norm(want - gn) / np.linalg.norm(gn), 1e-5)
    assert int(st2.cold_m_fallbacks) == 0
    # Cold M on one target: G′ = G there and the fallback counter moves.
    ga_cold = jax.tree_util.tree_map(lambda x: x, ga)
    ga_cold["layers"]["down_proj"]["kernel"] = jnp.zeros_like(ga["layers"]["down_proj"]["kernel"])
    st = _fire(cfg, init_merger(p, cfg, "decoder"), ga_cold)
    g3, st3, _ = merge(st, g, cfg, False)
    assert np.array_equal(
        np.asarray(g3["layers"]["down_proj"]["kernel"]), np.asarray(g["layers"]["down_proj"]["kernel"])
    )
    np.testing.assert_allclose(np.asarray(g3["layers"]["q_proj"]["kernel"]), want, rtol=1e-6)
    assert int(st3.cold_m_fallbacks) == 1


def test_signed_gate_omega_and_decay():
    p, g = _params(0), _params(1)
    cfg = _cfg(merger="signed_gate", alpha=0.25, beta_anc=0.5, decay=0.75)
    ga1, ga2 = _params(2), _params(3)
    st = _fire(cfg, init_merger(p, cfg, "decoder"), ga1)
    assert float(st.omega) == 0.0  # M_old = 0 has no signs to agree with
    st = _fire(cfg, st, ga2)
    tg = lambda t: select_targets(t, "decoder")  # noqa: E731
    m_old = {k: 0.5 * np.asarray(v) for k, v in tg(ga1).items()}
    agree = np.concatenate([(np.sign(m_old[k]) * np.sign(np.asarray(v))).ravel() for k, v in tg(ga2).items()])
    omega = 0.5 * np.clip(agree.mean(), 0, 1)
    assert float(st.omega) == pytest.approx(omega, abs=1e-6)
    m = {k: 0.5 * m_old[k] + 0.5 * np.asarray(v) for k, v in tg(ga2).items()}
    # Fire tick: full signed rule; next two held ticks: w = ω·0.75^age.
    for age, fire in ((0, True), (1, False), (2, False)):
        g2, st, _ = merge(st, g, cfg, fire)
        for k, gl in tg(g).items():
            gn = np.asarray(gl)
            signed = 0.25 * gn + 0.75 * np.abs(gn) * np.sign(m[k])
            w = 1.0 if fire else omega * 0.75**age
            np.testing.assert_allclose(np.asarray(tg(g2)[k]), (1 - w) * gn + w * signed, rtol=1e-5, atol=1e-6)


def test_delayed_ef_reproduces_anchor_gradient_then_decays():
    p, ga = _params(0), _params(2)
    cfg = _cfg(merger="delayed_ef", weight=1.0, decay=1.0, beta_anc=0.0)
    st = _fire(cfg, init_merger(p, cfg), ga)
    g_fire, g_held = _params(1), _params(4)
    out, st, _ = merge(st, g_fire, cfg, True)
    for k, v in select_targets(ga).items():
        np.testing.assert_allclose(np.asarray(select_targets(out)[k]), np.asarray(v), rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.asarray(out["step_ids"]), np.asarray(g_fire["step_ids"]))
    # Held tick with λ=0.5, decay 0.5: G′ = G + 0.5·0.5¹·(M − G_fire).
    cfg2 = _cfg(merger="delayed_ef", weight=0.5, decay=0.5, beta_anc=0.0)
    out2, _, _ = merge(st, g_held, cfg2, False)
    for k, v in select_targets(g_held).items():
        want = np.asarray(v) + 0.25 * (np.asarray(select_targets(ga)[k]) - np.asarray(select_targets(g_fire)[k]))
        np.testing.assert_allclose(np.asarray(select_targets(out2)[k]), want, rtol=1e-5, atol=1e-6)


def test_blend():
    p, g, ga = _params(0), _params(1), _params(2)
    cfg = _cfg(merger="blend", eta=0.3, beta_anc=0.0)
    st = _fire(cfg, init_merger(p, cfg), ga)
    out, _, met = merge(st, g, cfg, False)
    for k, v in select_targets(g).items():
        gn, mn = np.asarray(v), np.asarray(select_targets(ga)[k])
        want = 0.7 * gn + 0.3 * (np.linalg.norm(gn) / np.linalg.norm(mn)) * mn
        np.testing.assert_allclose(np.asarray(select_targets(out)[k]), want, rtol=1e-5)
    assert float(met["merger/rel_change"]) > 0


def test_jit_with_traced_fire_flag():
    p, cfg = _params(0), _cfg(merger="signed_gate")
    st = _fire(cfg, init_merger(p, cfg), _params(2))
    f = jax.jit(lambda s, g, fire: merge(s, g, cfg, fire))
    a, _, _ = f(st, _params(1), jnp.asarray(True))
    b, _, _ = f(st, _params(1), jnp.asarray(False))
    e, _, _ = merge(st, _params(1), cfg, True)
    np.testing.assert_allclose(np.asarray(a["embed"]), np.asarray(e["embed"]), rtol=1e-6)
    assert not np.allclose(np.asarray(a["embed"]), np.asarray(b["embed"]))


def test_each_merger_keeps_only_its_own_state():
    """One state type per merger: ω only for signed_gate, δ only for delayed_ef; a state of another merger is
    refused rather than read."""
    from twocircuit_jax.anchor import merger as mg

    p = _params(0)
    want = {
        "signed_ema": (mg.SignedEmaState, ("m", "fired", "age", "cold_m_fallbacks")),
        "signed_gate": (mg.SignedGateState, ("m", "fired", "omega", "age", "cold_m_fallbacks")),
        "blend": (mg.BlendState, ("m", "fired", "age", "cold_m_fallbacks")),
        "delayed_ef": (mg.DelayedEfState, ("m", "delta", "fired", "age", "cold_m_fallbacks")),
    }
    for mode, (cls, fields) in want.items():
        st = init_merger(p, _cfg(merger=mode), "decoder")
        assert type(st) is cls and st._fields == fields
        assert list(st.m) == ["layers/down_proj/kernel", "layers/q_proj/kernel"]
    with pytest.raises(TypeError, match="expected SignedGateState"):
        merge(init_merger(p, _cfg()), _params(1), _cfg(merger="signed_gate"), True)
