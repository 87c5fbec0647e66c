"""Truncated importance sampling weights (design §5).

The rollouts were drawn by the sampler (ℓ_s) while the loss treats ℓ_old (trainer, codec view) as the behaviour
policy. TIS re-weights each token's policy loss by w = min(exp(ℓ_old − ℓ_s), C) under stop-gradient:
- `token`:    per token, Δ_t = ℓ_old − ℓ_s;
- `sequence`: one weight per sequence, exp(Σ_t Δ_t) capped at C, broadcast over that row's tokens;
- `off`:      exactly ones (multiplying by 1.0 is bitwise the identity, so `off` is a true no-op).

Metrics: `tis/weight_mean`, `tis/weight_max`, `tis/weight_min`, `tis/clip_frac` (share whose raw weight exceeded C)
and `tis/ess` = (Σw)²/(N·Σw²) of the weights in use (design §5: always log ESS). They are taken over response
tokens in `token` mode and over sequences with at least one response token in `sequence` mode.

Masks (`grpo.is_mask`, `correction_weights`) drop what the mismatch makes untrustworthy, by ρ_t = exp(ℓ_old − ℓ_s):
- `geometric`: a sequence whose geometric-mean ratio exp(mean_t log ρ_t) leaves [low, high] gets weight 0 on every
  token; the rest keep their TIS weight (or 1). A per-sequence test that does not grow with the length, unlike the
  product of ratios that `sequence` TIS caps.
- `icepop`: a token whose ρ_t leaves [low, high] gets weight 0; a kept token gets ρ_t itself (IcePop's masked IS).
A dropped token stays in the loss's normaliser (token or sequence count): the mask removes its gradient without
rescaling the others, so the loss of a batch with nothing masked is the unmasked loss exactly. Metrics:
`tis/mask_token_frac`, `tis/mask_seq_frac` (sequences with every response token dropped), and the counts
`mismatch/masked_tokens`, `mismatch/masked_seqs`; with a mask, the `tis/weight_*` and `tis/ess` stats are taken over
response tokens of the final weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from twocircuit_jax.config.sections import GeometricMask, IcePopMask, NoMismatchMask

TIS_MODES = ("off", "token", "sequence")


def _capped_exp(log_w, cap: float):
    """min(exp(log_w), cap) without overflow: above log(cap) the weight is exactly `cap`. Returns (w, was_capped)."""
    log_cap = math.log(cap)
    over = log_w > log_cap
    return jnp.where(over, cap, jnp.exp(jnp.minimum(log_w, log_cap))), over


def _stats(w, valid):
    """Masked weight stats over entries where `valid` (bool); neutral values when nothing is valid."""
    v = valid.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(v), 1.0)
    s1 = jnp.sum(w * v)
    s2 = jnp.sum(w * w * v)
    anyv = jnp.any(valid)
    return {
        "tis/weight_mean": s1 / n,
        "tis/weight_max": jnp.where(anyv, jnp.max(jnp.where(valid, w, -jnp.inf)), 1.0),
        "tis/weight_min": jnp.where(anyv, jnp.min(jnp.where(valid, w, jnp.inf)), 1.0),
        "tis/ess": jnp.where(s2 > 0, s1 * s1 / (n * jnp.maximum(s2, 1e-30)), 1.0),
    }


def tis_weights(old_logp, sampler_logp, mask, mode: str = "off", cap: float = 2.0):
    """old_logp, sampler_logp, mask [B, T] -> (w [B, T] float32, stop-gradient; metrics dict of scalars).

    `mode` and `cap` are static (python values from GRPOConfig.tis / tis_cap). Off-mask positions get weight 1;
    the loss masks them anyway.
    """
    if mode not in TIS_MODES:
        raise ValueError(f"unknown tis mode {mode!r}; allowed {TIS_MODES}")
    if not cap > 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    if mode == "off":
        one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
        metrics = {
            "tis/weight_mean": one,
            "tis/weight_max": one,
            "tis/weight_min": one,
            "tis/clip_frac": zero,
            "tis/ess": one,
        }
        return jnp.ones(old_logp.shape, jnp.float32), metrics

    valid = mask > 0
    delta = jnp.where(valid, old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32), 0.0)
    delta = jax.lax.stop_gradient(delta)
    if mode == "token":
        w, over = _capped_exp(delta, cap)
        w = jnp.where(valid, w, 1.0)  # 1 off-mask (delta 0 there too)
        metrics = _stats(w, valid)
        metrics["tis/clip_frac"] = jnp.sum(over & valid) / jnp.maximum(jnp.sum(valid), 1)
    else:
        seq_valid = jnp.any(valid, axis=-1)  # [B]
        w_seq, over = _capped_exp(jnp.sum(delta, axis=-1), cap)  # [B]
        w_seq = jnp.where(seq_valid, w_seq, 1.0)
        metrics = _stats(w_seq, seq_valid)
        metrics["tis/clip_frac"] = jnp.sum(over & seq_valid) / jnp.maximum(jnp.sum(seq_valid), 1)
        w = jnp.broadcast_to(w_seq[:, None], delta.shape)
    metrics["tis/clip_frac"] = metrics["tis/clip_frac"].astype(jnp.float32)
    return jax.lax.stop_gradient(w), metrics


def correction_weights(old_logp, sampler_logp, mask, grpo_cfg):
    """old_logp, sampler_logp, mask [B, T] -> (w [B, T] float32 stop-gradient, or None; metrics): the importance
    weights the policy loss multiplies by, from `grpo.tis` and `grpo.is_mask` together. None (and no metrics) when
    neither is on, so that the loss is untouched."""
    if not grpo_cfg.corrects:
        return None, {}
    m = grpo_cfg.is_mask
    if isinstance(m, NoMismatchMask):
        return tis_weights(old_logp, sampler_logp, mask, grpo_cfg.tis, grpo_cfg.tis_cap)
    w, metrics = tis_weights(old_logp, sampler_logp, mask, grpo_cfg.tis, grpo_cfg.tis_cap)
    valid = mask > 0
    delta = jax.lax.stop_gradient(
        jnp.where(valid, old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32), 0.0)
    )
    lo, hi = math.log(m.low), math.log(m.high)
    if isinstance(m, GeometricMask):
        n_tok = jnp.maximum(jnp.sum(valid, axis=-1), 1)
        geo = jnp.sum(delta, axis=-1) / n_tok  # [B]: log of the geometric-mean ratio
        keep = jnp.broadcast_to(((geo >= lo) & (geo <= hi))[:, None], delta.shape)
    elif isinstance(m, IcePopMask):
        keep = (delta >= lo) & (delta <= hi)
        w = jnp.exp(jnp.clip(delta, lo, hi))  # ρ_t inside the band; the clip only keeps exp finite outside it
    else:
        raise ValueError(f"unknown grpo.is_mask section {type(m).__name__}")
    dropped = valid & ~keep
    w = jnp.where(valid & keep, w, jnp.where(valid, 0.0, 1.0))
    seq_valid = jnp.any(valid, axis=-1)
    seq_dropped = seq_valid & ~jnp.any(valid & keep, axis=-1)
    n_tok, n_seq = jnp.sum(dropped).astype(jnp.float32), jnp.sum(seq_dropped).astype(jnp.float32)
    metrics.update(_stats(w, valid))
    metrics["tis/mask_token_frac"] = n_tok / jnp.maximum(jnp.sum(valid), 1)
    metrics["tis/mask_seq_frac"] = n_seq / jnp.maximum(jnp.sum(seq_valid), 1)
    metrics["mismatch/masked_tokens"] = n_tok
    metrics["mismatch/masked_seqs"] = n_seq
    return jax.lax.stop_gradient(w), metrics
