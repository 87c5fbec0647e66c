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


# The masks, on a batch small enough to work out by hand. Column 0 is the prompt; Δ = ℓ_old − ℓ_s per token.
MASK = np.array([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1]], np.float32)
ADV = np.array([1.0, -1.0, 0.5], np.float32)


def _grpo(**kw):
    from twocircuit_jax.config.run import load_config

    return load_config(data={"grpo": {"kl_coef": 0.0, **kw}}).grpo


def _loss(w, cfg):
    """The clipped loss at ratio 1 (the step's first mini-batch): token-mean of −A·w over the 8 response tokens."""
    from twocircuit_jax.grpo.loss import grpo_loss

    lp = jnp.full(MASK.shape, -1.0)
    return float(grpo_loss(lp, lp, None, jnp.asarray(ADV), jnp.asarray(MASK), w, cfg)[0])


def test_geometric_mask_drops_whole_sequences_by_the_mean_log_ratio():
    from twocircuit_jax.grpo.tis import correction_weights

    # Row 0: mean Δ 0.001 (geo 1.001, kept). Row 1: mean Δ 0.015 (geo 1.0151 > 1.01, dropped). Row 2: token ratios
    # 1.65, 0.61, 0.98 but mean Δ −0.0067 (geo 0.9934, kept): the test is on the sequence's mean, not its tokens.
    delta = np.array([[9, 0.01, -0.01, 0.003], [9, 0.03, 0.0, 9], [9, 0.5, -0.5, -0.02]], np.float32)
    samp = np.full(MASK.shape, -1.0, np.float32)
    cfg = _grpo(is_mask={"type": "geometric"})
    assert (cfg.is_mask.low, cfg.is_mask.high) == (0.99, 1.01)
    w, met = jax.jit(lambda a, b, c: correction_weights(a, b, c, cfg))(samp + delta, samp, MASK)
    want = np.array([[1, 1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 1]], np.float32)  # off-mask entries are 1
    np.testing.assert_array_equal(np.asarray(w), want)
    assert float(met["mismatch/masked_tokens"]) == 2 and float(met["mismatch/masked_seqs"]) == 1
    assert float(met["tis/mask_token_frac"]) == pytest.approx(2 / 8)
    assert float(met["tis/mask_seq_frac"]) == pytest.approx(1 / 3)
    assert float(met["tis/weight_mean"]) == pytest.approx(6 / 8)
    # Loss: row 0 gives −1·3, row 1 nothing, row 2 −0.5·3; over 8 tokens (the dropped ones stay in the count).
    assert _loss(w, cfg) == pytest.approx(-4.5 / 8, rel=1e-6)
    assert _loss(None, cfg) == pytest.approx((-4.5 + 2.0) / 8, rel=1e-6)  # unmasked, row 1 adds +1·2

    # With token TIS (cap 2) the kept rows carry their capped ratios; the dropped row stays 0.
    cfg = _grpo(is_mask={"type": "geometric"}, tis="token", tis_cap=2.0)
    w, met = correction_weights(samp + delta, samp, MASK, cfg)
    e = np.exp
    want = np.array([[1, e(0.01), e(-0.01), e(0.003)], [1, 0, 0, 1], [1, e(0.5), e(-0.5), e(-0.02)]], np.float32)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
    row0, row2 = e(0.01) + e(-0.01) + e(0.003), e(0.5) + e(-0.5) + e(-0.02)
    assert _loss(w, cfg) == pytest.approx((-row0 - 0.5 * row2) / 8, rel=1e-5)


def test_icepop_drops_tokens_outside_the_band_and_weights_the_rest_by_their_ratio():
    from twocircuit_jax.grpo.tis import correction_weights

    # ρ = e^Δ. Row 0: 1.105 kept, 0.449 dropped, 1.822 kept. Row 1: 2.460 and 0.472, both dropped (the whole
    # sequence). Row 2: 1.0, 1.994, 0.502, all kept (just inside [0.5, 2]).
    delta = np.array([[9, 0.1, -0.8, 0.6], [9, 0.9, -0.75, 9], [9, 0.0, 0.69, -0.69]], np.float32)
    samp = np.full(MASK.shape, -2.0, np.float32)
    cfg = _grpo(is_mask={"type": "icepop"})
    assert (cfg.is_mask.low, cfg.is_mask.high) == (0.5, 2.0)
    w, met = correction_weights(samp + delta, samp, MASK, cfg)
    e = np.exp
    want = np.array([[1, e(0.1), 0, e(0.6)], [1, 0, 0, 1], [1, 1, e(0.69), e(-0.69)]], np.float32)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
    assert float(met["mismatch/masked_tokens"]) == 3 and float(met["mismatch/masked_seqs"]) == 1
    assert float(met["tis/mask_token_frac"]) == pytest.approx(3 / 8)
    assert float(met["tis/mask_seq_frac"]) == pytest.approx(1 / 3)
    # Loss: row 0 −(1.1052 + 1.8221), row 1 nothing, row 2 −0.5·(1 + 1.9937 + 0.5016); over 8 tokens.
    assert _loss(w, cfg) == pytest.approx(-(2.927295 + 0.5 * 3.495302) / 8, rel=1e-5)
    # A band that holds every ratio drops nothing: the weights are token IS, uncapped.
    cfg = _grpo(is_mask={"type": "icepop", "low": 0.1, "high": 10.0})
    w, met = correction_weights(samp + delta, samp, MASK, cfg)
    np.testing.assert_allclose(np.asarray(w), np.where(MASK > 0, e(delta), 1.0), rtol=1e-6)
    assert float(met["mismatch/masked_tokens"]) == 0


def test_no_correction_leaves_the_loss_untouched_and_bad_masks_are_refused():
    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.grpo.tis import correction_weights

    cfg = _grpo()
    assert not cfg.corrects and correction_weights(MASK, MASK, MASK, cfg) == (None, {})
    with pytest.raises(ConfigError, match="grpo.tis.*icepop"):
        load_config(data={"grpo": {"tis": "token", "is_mask": {"type": "icepop"}}})
    with pytest.raises(ConfigError, match="grpo.is_mask.low"):
        load_config(data={"grpo": {"is_mask": {"type": "geometric", "low": 1.5}}})
    with pytest.raises(ConfigError, match="grpo.is_mask.type.*allowed: geometric, icepop, none"):
        load_config(overrides=["grpo.is_mask.type=sequence"])
    assert load_config(overrides=["grpo.is_mask.type=icepop", "grpo.is_mask.high=5"]).grpo.is_mask.high == 5.0
