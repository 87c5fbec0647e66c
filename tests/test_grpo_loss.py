"""GRPO loss pieces against a straightforward float64 numpy implementation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.config import GRPOConfig
from twocircuit_jax.grpo.loss import agg_loss, grpo_loss, kl_penalty, token_entropy, token_logprobs
from twocircuit_jax.grpo.tis import tis_weights

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _np_agg(mat, m, mode, token_count=None, norm_len=None):
    if mode == "token-mean":
        return (mat * m).sum() / (m.sum() if token_count is None else token_count)
    seqs = [b for b in range(m.shape[0]) if m[b].sum() > 0]
    vals = []
    for b in seqs:
        s = (mat[b] * m[b]).sum()
        vals.append(
            {
                "seq-mean-token-sum": s,
                "seq-mean-token-mean": s / m[b].sum(),
                "seq-mean-token-sum-norm": s / (m.shape[1] if norm_len is None else norm_len),
            }[mode]
        )
    return np.mean(vals)


def _np_loss(logp, old, ref, adv, m, w, cfg, token_count=None):
    logp, old, ref = (np.asarray(a, np.float64) for a in (logp, old, ref))
    ratio = np.exp(logp - old)
    a = np.asarray(adv, np.float64)[:, None]
    pg1 = -a * ratio
    pg2 = -a * np.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = np.maximum(pg1, pg2)
    if cfg.dual_clip:
        pg = np.where(a < 0, np.minimum(pg, -a * cfg.dual_clip), pg)
    if w is not None:
        pg = pg * w
    if cfg.kl_estimator == "k1":
        kl = logp - ref
    else:
        d = ref - logp
        kl = np.clip(np.exp(d) - d - 1, -10, 10)
    pg_loss = _np_agg(pg, m, cfg.loss_agg, token_count)
    kl_loss = _np_agg(kl, m, cfg.loss_agg, token_count)
    sel = m > 0
    metrics = {
        "loss/pg": pg_loss,
        "loss/kl": kl_loss,
        "kl/ref": kl[sel].mean(),
        "ppo/ratio_mean": ratio[sel].mean(),
        "ppo/ratio_max": ratio[sel].max(),
        "ppo/ratio_min": ratio[sel].min(),
        "ppo/clip_frac": (pg2 > pg1)[sel].mean(),
        "ppo/kl": (old - logp)[sel].mean(),
    }
    return pg_loss + cfg.kl_coef * kl_loss, metrics


def _inputs(seed, B=4, T=7, spread=0.6):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, spread, (B, T))).astype(np.float32)  # ratios from ~0.2 to ~5: all clip regimes
    ref = (logp + rng.normal(0, 0.5, (B, T))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    adv[0], adv[1] = -1.5, 1.2  # both signs present
    m = np.zeros((B, T), np.float32)
    for b in range(B):
        start = rng.integers(1, 3)
        m[b, start : start + rng.integers(2, T - start)] = 1.0  # varied response lengths
    return logp, old, ref, adv, m


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("est", ["k1", "low_var_kl"])
def test_loss_and_metrics_match_numpy(mode, est):
    cfg = GRPOConfig(loss_agg=mode, kl_estimator=est, kl_coef=0.05, dual_clip=3.0)
    logp, old, ref, adv, m = _inputs(1)
    w = np.random.default_rng(2).uniform(0.5, 2.0, logp.shape).astype(np.float32)
    loss, met = jax.jit(lambda *a: grpo_loss(*a, cfg))(logp, old, ref, adv, m, w)
    want, want_met = _np_loss(logp, old, ref, adv, m, w, cfg)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    for k, v in want_met.items():
        np.testing.assert_allclose(float(met[k]), v, rtol=2e-5, atol=1e-6, err_msg=k)
    assert 0 < float(met["ppo/clip_frac"]) < 1  # the inputs really exercise clipping


def test_clipping_regimes_by_hand():
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.0, loss_agg="seq-mean-token-sum")
    ratios = np.array([[1.0, 1.5, 0.5, 5.0]], np.float32)
    logp = np.log(ratios)
    zeros = np.zeros_like(logp)
    mask = np.array([[0, 1, 1, 1]], np.float32)
    for a, want, frac, dual in [
        (1.0, -(1.28 + 0.5 + 1.28), 2 / 3, 0.0),  # A>0: 1.5, 5 -> 1.28; 0.5 unclipped
        (-1.0, 1.5 + 0.8 + 3.0, 1 / 3, 1 / 3),
    ]:  # A<0: 0.5 -> 0.8; 5 capped at c=3
        loss, met = grpo_loss(jnp.asarray(logp), zeros, None, jnp.array([a]), mask, None, cfg)
        np.testing.assert_allclose(float(loss), want, rtol=1e-6)
        np.testing.assert_allclose(float(met["ppo/clip_frac"]), frac, rtol=1e-6)
        np.testing.assert_allclose(float(met["ppo/dual_clip_frac"]), dual, rtol=1e-6)
    # without dual clip the A<0, r=5 token costs 5
    loss, _ = grpo_loss(
        jnp.asarray(logp), zeros, None, jnp.array([-1.0]), mask, None, dataclasses.replace(cfg, dual_clip=0.0)
    )
    np.testing.assert_allclose(float(loss), 1.5 + 0.8 + 5.0, rtol=1e-6)


def test_ratio_one_gives_zero_clip_and_kl():
    cfg = GRPOConfig(kl_coef=0.0)
    logp, _, _, adv, m = _inputs(3)
    loss, met = grpo_loss(logp, logp, None, adv, m, None, cfg)
    assert float(met["ppo/clip_frac"]) == 0.0 and float(met["ppo/kl"]) == 0.0
    assert float(met["ppo/ratio_mean"]) == 1.0 and float(met["ppo/ratio_max"]) == 1.0
    assert float(met["loss/kl"]) == 0.0 and "kl/ref" not in met
    # token-mean at ratio 1 is −mean(A) over tokens
    np.testing.assert_allclose(float(loss), -(adv[:, None] * m).sum() / m.sum(), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_matches_finite_differences(mode):
    cfg = GRPOConfig(loss_agg=mode, kl_coef=0.1, kl_estimator="low_var_kl", dual_clip=3.0)
    logp, old, ref, adv, m = _inputs(4, B=3, T=5, spread=0.4)
    g = np.asarray(jax.grad(lambda lp: grpo_loss(lp, old, ref, adv, m, None, cfg)[0])(jnp.asarray(logp)))
    h = 1e-6
    fd = np.zeros_like(g, dtype=np.float64)
    base = logp.astype(np.float64)
    for idx in np.ndindex(*logp.shape):
        up, dn = base.copy(), base.copy()
        up[idx] += h
        dn[idx] -= h
        fd[idx] = (_np_loss(up, old, ref, adv, m, None, cfg)[0] - _np_loss(dn, old, ref, adv, m, None, cfg)[0]) / (
            2 * h
        )
    assert np.all(g[m == 0] == 0.0)
    np.testing.assert_allclose(g, fd, rtol=1e-3, atol=1e-5)
    assert np.abs(g).max() > 0


def test_tis_off_is_bitwise_noop():
    cfg = GRPOConfig(kl_coef=0.01)
    logp, old, ref, adv, m = _inputs(5)
    w, _ = tis_weights(old, old - 0.3, m, "off", 2.0)
    f = lambda lp, wt: grpo_loss(lp, old, ref, adv, m, wt, cfg)[0]
    l0, g0 = jax.value_and_grad(f)(jnp.asarray(logp), None)
    l1, g1 = jax.value_and_grad(f)(jnp.asarray(logp), w)
    assert np.asarray(l0).tobytes() == np.asarray(l1).tobytes()
    assert np.asarray(g0).tobytes() == np.asarray(g1).tobytes()


def test_token_mean_global_normaliser_splits_exactly():
    cfg = GRPOConfig(kl_coef=0.01)
    logp, old, ref, adv, m = _inputs(6, B=6)
    full, _ = grpo_loss(logp, old, ref, adv, m, None, cfg)
    n = m.sum()
    parts = [grpo_loss(logp[s], old[s], ref[s], adv[s], m[s], None, cfg, n)[0] for s in (slice(0, 2), slice(2, 6))]
    np.testing.assert_allclose(float(sum(parts)), float(full), rtol=1e-6)


def test_token_logprobs_and_entropy():
    rng = np.random.default_rng(7)
    B, T, V = 2, 6, 11
    logits = rng.normal(0, 3, (B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    lp = np.asarray(jax.jit(token_logprobs)(logits, tokens))
    ls = _np_log_softmax(logits)
    want = np.zeros((B, T))
    for b in range(B):
        for t in range(1, T):
            want[b, t] = ls[b, t - 1, tokens[b, t]]
    assert lp.dtype == np.float32 and np.all(lp[:, 0] == 0)
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
    ent = np.asarray(token_entropy(logits))
    want_e = np.pad(-(np.exp(ls) * ls).sum(-1)[:, :-1], ((0, 0), (1, 0)))
    np.testing.assert_allclose(ent, want_e, rtol=1e-5, atol=1e-5)
    lp16 = np.asarray(token_logprobs(jnp.asarray(logits, jnp.bfloat16), tokens))
    assert lp16.dtype == np.float32
    np.testing.assert_allclose(lp16, want, atol=0.1)


def test_kl_estimators_and_entropy_term():
    lp = jnp.array([[-1.0, -2.0, -30.0]])
    ref = jnp.array([[-1.5, -1.0, -1.0]])
    np.testing.assert_allclose(np.asarray(kl_penalty(lp, ref, "k1")), [[0.5, -1.0, -29.0]])
    d = np.array([-0.5, 1.0, 29.0])
    np.testing.assert_allclose(np.asarray(kl_penalty(lp, ref, "k3"))[0], np.minimum(np.exp(d) - d - 1, 10), rtol=1e-6)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k2")
    cfg = GRPOConfig(kl_coef=0.0, entropy_coeff=0.1)
    logp, old, _, adv, m = _inputs(8)
    ent = np.abs(logp)
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(logp, old, None, adv, m, None, cfg)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, None, adv, m, None, GRPOConfig(kl_coef=0.1))
    loss, met = grpo_loss(logp, old, None, adv, m, None, cfg, entropy=ent)
    np.testing.assert_allclose(float(loss), float(met["loss/pg"]) - 0.1 * (ent * m).sum() / m.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(met["policy/entropy"]), (ent * m).sum() / m.sum(), rtol=1e-6)
    with pytest.raises(ValueError, match="loss_agg"):
        agg_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), "sum")
