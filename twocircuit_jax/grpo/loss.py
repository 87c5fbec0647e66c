"""GRPO/PPO policy loss, KL estimators, token log-probs and entropy (design §5). Pure jnp, jittable.

Conventions (docs/architecture.md): `logp[b, t] = log p(tokens[b, t] | tokens[b, :t])`, `logp[:, 0] = 0`; every
per-token quantity is aligned the same way and everything entering a loss or a metric is multiplied by
`response_mask`. All arithmetic is float32 whatever the logits dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k3", "low_var_kl")
# Log-ratio clamp before exp: keeps exp finite in fp32 when a stale token drifted far; gradients beyond ±20 nats
# are zero, which only matters for tokens the clip would already have cut.
_LOG_RATIO_CLAMP = 20.0


def _shift_right(x):
    """[B, T-1] values for positions 1..T-1 -> [B, T] with a 0 in column 0 (the alignment convention)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def token_logprobs(logits, tokens):
    """logits [B, T, V] (any float dtype), tokens [B, T] int -> logp [B, T] float32, logp[:, 0] = 0.

    The prediction for tokens[:, t] is logits[:, t-1]. Only logsumexp over V and one gathered logit per position
    are kept in fp32; the fused cast+reduce avoids holding a full fp32 log-softmax [B, T, V] under jit.
    """
    if logits.ndim != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, T, V] and tokens [B, T]; got {logits.shape} and {tokens.shape}")
    pred = logits[:, :-1].astype(jnp.float32)  # [B, T-1, V]
    nxt = tokens[:, 1:].astype(jnp.int32)  # [B, T-1]
    picked = jnp.take_along_axis(pred, nxt[..., None], axis=-1)[..., 0]  # [B, T-1]
    lse = jax.nn.logsumexp(pred, axis=-1)  # [B, T-1]
    return _shift_right(picked - lse)


def token_entropy(logits):
    """logits [B, T, V] -> entropy [B, T] float32 of the distribution that predicts tokens[:, t]; column 0 is 0."""
    pred = logits[:, :-1].astype(jnp.float32)
    lse = jax.nn.logsumexp(pred, axis=-1, keepdims=True)
    p = jnp.exp(pred - lse)
    ent = lse[..., 0] - jnp.sum(p * pred, axis=-1)  # H = lse - E_p[logit]
    return _shift_right(ent)


def kl_penalty(logp, ref_logp, estimator: str = "low_var_kl"):
    """Per-token KL(π_θ ‖ π_ref) estimate [B, T]. k1 = ℓθ − ℓref; k3/low_var_kl = e^{d} − d − 1, d = ℓref − ℓθ,
    clamped to [−10, 10] (k3 is ≥ 0 in exact arithmetic; the clamp bounds blow-ups when d is large)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator in ("k3", "low_var_kl"):
        d = ref_logp - logp
        return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown kl_estimator {estimator!r}; allowed {KL_ESTIMATORS}")


def agg_loss(loss_mat, mask, mode: str, token_count=None, seq_count=None, norm_len=None):
    """Reduce a per-token loss [B, T] to a scalar.

    token-mean:              Σ m·ℓ / token_count. Pass the *global* response-token count (all mini-batches of the
                             step or all dp shards, as the caller's reduction requires) so that shard losses add up
                             to the global mean; default: this batch's Σ m.
    seq-mean-token-sum:      mean over sequences of Σ_t m·ℓ.
    seq-mean-token-mean:     mean over sequences of Σ_t m·ℓ / Σ_t m.
    seq-mean-token-sum-norm: mean over sequences of Σ_t m·ℓ / norm_len (Dr. GRPO; norm_len defaults to T, pass
                             the response length limit). Note verl's variant omits the 1/num_seqs factor.
    The sequence modes average over sequences with at least one response token; `seq_count` overrides that count
    (for a global normaliser).
    """
    mask = mask.astype(jnp.float32)
    masked = loss_mat * mask
    if mode == "token-mean":
        denom = jnp.sum(mask) if token_count is None else jnp.asarray(token_count, jnp.float32)
        return jnp.sum(masked) / _positive(denom)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg {mode!r}; allowed {AGG_MODES}")
    tok_per_seq = jnp.sum(mask, axis=-1)  # [B]
    seq_sum = jnp.sum(masked, axis=-1)  # [B]
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / jnp.maximum(tok_per_seq, 1.0)
    else:
        per_seq = seq_sum / float(loss_mat.shape[-1] if norm_len is None else norm_len)
    n_seq = jnp.sum(tok_per_seq > 0) if seq_count is None else seq_count
    return jnp.sum(per_seq) / _positive(jnp.asarray(n_seq, jnp.float32))


def _positive(count):
    """A normaliser that is never 0 (an empty batch sums to 0 anyway). Not max(count, 1): a data-parallel
    normaliser (global count / replicas) may be fractional."""
    return jnp.where(count > 0, count, 1.0)


def _masked_mean(x, mask, count):
    return jnp.sum(x * mask) / count


def grpo_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    response_mask,
    weights,
    cfg,
    token_count=None,
    *,
    entropy=None,
    seq_count=None,
    norm_len=None,
):
    """Clipped GRPO objective. Returns (loss scalar, metrics dict of scalars).

    logp [B, T]: trainer log-probs (the differentiated input); old_logp, ref_logp [B, T]: stop-gradient inputs
    (ref_logp may be None when cfg.kl_coef == 0); advantages [B]; response_mask [B, T]; weights [B, T] per-token
    multiplier of the policy loss (e.g. TIS weights), stop-gradient, or None for none (identical to ones, bit for
    bit); cfg: GRPOConfig (clip_low, clip_high, dual_clip, kl_coef, kl_estimator, entropy_coeff, loss_agg);
    token_count / seq_count / norm_len: normalisers, see `agg_loss`; entropy [B, T]: token entropy from
    `token_entropy`, required when cfg.entropy_coeff != 0, logged as `policy/entropy` when given.

    Metrics are masked means over this batch's response tokens (not the global normaliser).
    """
    mask = response_mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    any_tok = jnp.any(mask > 0)
    logp = logp.astype(jnp.float32)
    old_logp = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))[:, None]  # [B, 1]

    # Off-mask positions get log-ratio 0 so padding can never produce inf/NaN that leaks through `* mask`.
    log_ratio = jnp.where(mask > 0, logp - old_logp, 0.0)
    ratio = jnp.exp(jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = jnp.maximum(pg1, pg2)
    clipped = (pg2 > pg1).astype(jnp.float32)
    if cfg.dual_clip:
        # Dual clip: for A < 0 the loss −A·r grows without bound in r; cap it at −A·c.
        pg3 = -adv * cfg.dual_clip
        dual = ((adv < 0) & (pg > pg3)).astype(jnp.float32)
        pg = jnp.where(adv < 0, jnp.minimum(pg, pg3), pg)
    if weights is not None:
        pg = pg * jax.lax.stop_gradient(weights.astype(jnp.float32))

    agg = dict(token_count=token_count, seq_count=seq_count, norm_len=norm_len)
    pg_loss = agg_loss(pg, mask, cfg.loss_agg, **agg)
    loss = pg_loss
    metrics = {
        "loss/pg": pg_loss,
        "ppo/ratio_mean": _masked_mean(ratio, mask, count),
        "ppo/ratio_max": jnp.where(any_tok, jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)), 1.0),
        "ppo/ratio_min": jnp.where(any_tok, jnp.min(jnp.where(mask > 0, ratio, jnp.inf)), 1.0),
        "ppo/clip_frac": _masked_mean(clipped, mask, count),
        "ppo/kl": _masked_mean(jnp.where(mask > 0, old_logp - logp, 0.0), mask, count),
    }
    if cfg.dual_clip:
        metrics["ppo/dual_clip_frac"] = _masked_mean(dual, mask, count)

    if ref_logp is None:
        if cfg.kl_coef != 0:
            raise ValueError(f"grpo.kl_coef={cfg.kl_coef} needs ref_logp; got None")
        metrics["loss/kl"] = jnp.zeros((), jnp.float32)  # stable key set; `kl/ref` is absent (not measured)
    else:
        ref = jax.lax.stop_gradient(ref_logp.astype(jnp.float32))
        kl_mat = kl_penalty(logp, jnp.where(mask > 0, ref, logp), cfg.kl_estimator)
        kl_loss = agg_loss(kl_mat, mask, cfg.loss_agg, **agg)
        metrics["kl/ref"] = _masked_mean(kl_mat, mask, count)
        metrics["loss/kl"] = kl_loss
        if cfg.kl_coef != 0:  # kl_coef 0: logged only, the loss graph is untouched
            loss = loss + cfg.kl_coef * kl_loss

    if entropy is not None:
        ent_agg = agg_loss(entropy.astype(jnp.float32), mask, cfg.loss_agg, **agg)
        metrics["policy/entropy"] = _masked_mean(entropy.astype(jnp.float32), mask, count)
        if cfg.entropy_coeff != 0:
            loss = loss - cfg.entropy_coeff * ent_agg
            metrics["loss/entropy"] = ent_agg
    elif cfg.entropy_coeff != 0:
        raise ValueError(f"grpo.entropy_coeff={cfg.entropy_coeff} needs the entropy input; got None")
    metrics["loss/total"] = loss
    return loss, metrics
