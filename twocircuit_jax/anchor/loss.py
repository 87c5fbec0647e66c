"""The anchor's loss (design §4.3) and its one dense forward/backward.

L = agg(−A·r·w_IS) + kl_coef·agg(KL(log π ‖ ℓ_ref)) − entropy_coeff·agg(H), with r = exp(log π − sg(log π)) ≡ 1:
the ratio-one policy gradient (∇L_pg = −A·∇log π·w_IS), no old log-probs, no clip. Same aggregation as the fast
loss (`grpo.loss_agg`, this batch's token count, `norm_len` = the response limit). Path tag `dense`: no codec hook
is ever installed, so the anchor sees the exact policy of the weights it is handed.

Every term is in the dense view, since the anchor is a dense participant: ℓ_ref is the reference policy's
log-prob with codecs off (`ref_logp_dense`, which the loop computes from the reference weights for the mini-batches
the anchor keeps; the codec-view ℓ_ref of the fast circuit would make the KL term KL(dense ‖ codec-view reference),
several nats); w_IS compares this pass's own log-probs with the sampler's, min(exp(ℓ_anchor − ℓ_s), C), about 1 in
a healthy run, never the fast circuit's codec ratio. A fire is one forward and one backward; nothing is
re-sampled or re-scored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from twocircuit_jax.grpo.loss import agg_loss, kl_penalty
from twocircuit_jax.grpo.tis import correction_weights
from twocircuit_jax.parallel import mesh as pmesh, micro_batch as accumulate, pipeline as pipe


def anchor_loss(
    model_cfg, grpo_cfg, max_new_tokens: int, params, batch, boundary_fn=None, pipeline=None, keep_logp=False
):
    """(loss scalar, metrics, hook aux) of the dense anchor pass on `batch` (tokens, attention_mask,
    response_mask, advantages; ref_logp_dense, the reference log-probs with codecs off, when kl_coef > 0;
    sampler_logp when TIS is on; token_count / seq_count, the whole mini-batch's normalisers, when the fire runs
    over micro-batches). `boundary_fn` (parallel/pipeline.forward) only observes: the anchor-owned low-rank
    basis sketches the activations, unchanged. `pipeline`: the staged forward (mesh.stage > 1). `keep_logp`: the
    pass's log-probs (stop-gradient) in metrics[LOGP], for the whole batch's TIS metrics after accumulation."""
    stats, aux = pipe.forward(
        model_cfg,
        params,
        batch["tokens"],
        batch["attention_mask"],
        pipeline=pipeline,
        boundary_fn=boundary_fn,
        entropy_grad=grpo_cfg.entropy_coeff != 0,
    )
    logp, ent = stats  # [B, T] fp32 each
    mask = batch["response_mask"].astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    adv = jax.lax.stop_gradient(batch["advantages"].astype(jnp.float32))[:, None]  # [B, 1]
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))  # ≡ 1, carries ∇log π
    pg = -adv * ratio
    tis = {}
    if grpo_cfg.corrects:
        if "sampler_logp" not in batch:
            raise ValueError("grpo.tis or grpo.is_mask is on but the replayed batch has no sampler_logp")
        w, tis = correction_weights(jax.lax.stop_gradient(logp), batch["sampler_logp"], mask, grpo_cfg)
        pg = pg * w
    agg = dict(norm_len=max_new_tokens, token_count=batch.get("token_count"), seq_count=batch.get("seq_count"))
    pg_loss = agg_loss(pg, mask, grpo_cfg.loss_agg, **agg)
    loss = pg_loss
    kl_loss = jnp.zeros((), jnp.float32)
    if grpo_cfg.kl_coef > 0:
        if "ref_logp_dense" not in batch:
            raise ValueError(f"grpo.kl_coef={grpo_cfg.kl_coef} but the replayed batch has no ref_logp_dense")
        ref = jax.lax.stop_gradient(batch["ref_logp_dense"].astype(jnp.float32))
        kl_mat = kl_penalty(logp, jnp.where(mask > 0, ref, logp), grpo_cfg.kl_estimator)
        kl_loss = agg_loss(kl_mat, mask, grpo_cfg.loss_agg, **agg)
        loss = loss + grpo_cfg.kl_coef * kl_loss
    if grpo_cfg.entropy_coeff != 0:
        loss = loss - grpo_cfg.entropy_coeff * agg_loss(ent, mask, grpo_cfg.loss_agg, **agg)
    metrics = {
        "anchor/pg_loss": pg_loss,
        "anchor/kl_loss": kl_loss,
        "anchor/ratio_mean": jnp.sum(ratio * mask) / count,
        "anchor/entropy": jnp.sum(ent * mask) / count,
        "anchor/loss": loss,
        **{f"anchor/{k}": v for k, v in tis.items()},
    }
    if keep_logp:
        metrics[LOGP] = jax.lax.stop_gradient(logp)
    return loss, metrics, aux


LOGP = "rows/logp"  # a per-row entry of the metrics: never leaves the fire


def anchor_batch_keys(grpo_cfg) -> list[str]:
    """The batch fields a fire reads. Dense view only (design §4.3): the reference log-probs with codecs off (the
    loop adds `ref_logp_dense` when the anchor is on), and the sampler's log-probs for the anchor's own TIS weights."""
    keys = ["tokens", "attention_mask", "response_mask", "advantages"]
    keys += ["ref_logp_dense"] if grpo_cfg.kl_coef > 0 else []
    keys += ["sampler_logp"] if grpo_cfg.corrects else []
    return keys


def make_anchor_grad(
    model_cfg, grpo_cfg, max_new_tokens: int, sketcher=None, pipeline=None, *, micro_batch: int = 0, mesh=None
):
    """(params, batch, sketch_state) -> (grads, metrics, aux): one dense forward and backward; XLA inserts the
    `dp` mean. `sketcher(sketch_state, attention_mask) -> (hook, layers)` adds the basis sketch (aux).
    `micro_batch` > 0 (train.micro_batch_per_device; `mesh` gives the replica count and keeps the batch sharding): the
    gradient is accumulated over micro-batches of that many rows per replica (parallel/micro_batch.py), normalised by
    the whole batch's counts; the sketch is summed, the loss terms summed, the token means weighted, and the TIS
    metrics taken once over the whole batch's log-probs (a ratio like the ESS does not split)."""
    split = bool(micro_batch)

    def loss(p, batch, sketch_state):
        boundary_fn = None
        if sketcher is not None:
            boundary_fn = lambda mb: (*sketcher(sketch_state, mb["attention_mask"]), {})  # noqa: E731
        return anchor_loss(model_cfg, grpo_cfg, max_new_tokens, p, batch, boundary_fn, pipeline, split)

    dp = pmesh.dp_size(mesh) if mesh is not None else 1
    vg = accumulate.value_and_grad(loss, micro_batch, dp=dp, mesh=mesh)

    def fn(params, batch, sketch_state=None):
        (_, metrics, aux), grads = vg(params, batch, sketch_state)
        logp = metrics.pop(LOGP, None)
        if logp is not None and grpo_cfg.corrects:
            _, tis = correction_weights(logp, batch["sampler_logp"], batch["response_mask"], grpo_cfg)
            metrics.update({f"anchor/{k}": v for k, v in tis.items()})
        metrics["anchor/grad_norm"] = jnp.sqrt(
            sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
        )
        return grads, metrics, aux

    return fn
