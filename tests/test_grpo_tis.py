"""Truncated importance sampling weights against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.grpo.tis import tis_weights


def _inputs(seed=0, B=4, T=6):
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 3, (B, T)).astype(np.float32)
    samp = (old + rng.normal(0, 1.0, (B, T))).astype(np.float32)
    m = (rng.uniform(size=(B, T)) < 0.7).astype(np.float32)
    m[:, 0] = 0
    m[-1] = 0  # a row with no response tokens
    return old, samp, m


def test_off_is_exact_ones():
    old, samp, m = _inputs()
    w, met = tis_weights(old, samp, m, "off", 2.0)
    assert w.dtype == jnp.float32 and np.all(np.asarray(w) == 1.0)
    assert float(met["tis/clip_frac"]) == 0.0 and float(met["tis/weight_mean"]) == 1.0


def test_token_mode_matches_numpy():
    old, samp, m = _inputs(1)
    cap = 1.5
    w, met = jax.jit(lambda a, b, c: tis_weights(a, b, c, "token", cap))(old, samp, m)
    raw = np.exp(old.astype(np.float64) - samp)
    want = np.where(m > 0, np.minimum(raw, cap), 1.0)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
    sel = m > 0
    np.testing.assert_allclose(float(met["tis/weight_mean"]), want[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(met["tis/weight_max"]), want[sel].max(), rtol=1e-6)
    np.testing.assert_allclose(float(met["tis/weight_min"]), want[sel].min(), rtol=1e-6)
    np.testing.assert_allclose(float(met["tis/clip_frac"]), (raw[sel] > cap).mean(), rtol=1e-6)
    ws = want[sel]
    np.testing.assert_allclose(float(met["tis/ess"]), ws.sum() ** 2 / (ws.size * (ws**2).sum()), rtol=1e-5)
    assert 0 < float(met["tis/clip_frac"]) < 1


def test_sequence_mode_broadcasts_capped_sequence_weight():
    old, samp, m = _inputs(2)
    cap = 2.0
    w, met = tis_weights(old, samp, m, "sequence", cap)
    log_w = ((old.astype(np.float64) - samp) * m).sum(-1)
    w_seq = np.minimum(np.exp(log_w), cap)
    w_seq[m.sum(-1) == 0] = 1.0
    np.testing.assert_allclose(np.asarray(w), np.broadcast_to(w_seq[:, None], m.shape), rtol=1e-5)
    valid = m.sum(-1) > 0
    np.testing.assert_allclose(float(met["tis/clip_frac"]), (np.exp(log_w[valid]) > cap).mean(), rtol=1e-6)
    np.testing.assert_allclose(float(met["tis/weight_mean"]), w_seq[valid].mean(), rtol=1e-5)


def test_huge_gap_is_capped_not_inf_and_has_no_gradient():
    old = jnp.array([[0.0, 0.0, -0.1]])
    samp = jnp.array([[0.0, -200.0, -0.2]])
    m = jnp.array([[0.0, 1.0, 1.0]])
    for mode in ("token", "sequence"):
        w, met = tis_weights(old, samp, m, mode, 2.0)
        assert np.all(np.isfinite(np.asarray(w))) and float(met["tis/weight_max"]) == 2.0
    g = jax.grad(lambda o: tis_weights(o, samp, m, "token", 2.0)[0].sum())(old)
    assert np.all(np.asarray(g) == 0.0)


def test_bad_mode_raises():
    old, samp, m = _inputs()
    with pytest.raises(ValueError, match="tis mode"):
        tis_weights(old, samp, m, "seq", 2.0)
