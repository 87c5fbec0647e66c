"""GRPO through the trainer's view of the policy: the loss the train step differentiates (over step/passes.py's
forward) and the step's diagnostics (importance weights, mismatch, entropy).

The fast circuit enters only through `codec` (an object with `applies(tag)`, `hook(codec_state, tag, step, ...)`
and `summarize(aux)`; see fast/circuit.py); `cs` is the circuit state (step/circuit_state.py). With `codec=None`
no hook is installed at all, so the dense trainer is the plain GRPO step bit for bit. Path tags (design §3.1): `train`, `old_logprob`, `ref_logprob`, `dense`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from twocircuit_jax.grpo.loss import grpo_loss
from twocircuit_jax.grpo.tis import correction_weights
from twocircuit_jax.metrics.gauges import entropy_summary
from twocircuit_jax.metrics.mismatch import mismatch_metrics
from twocircuit_jax.names import TRAIN
from twocircuit_jax.step.passes import policy_pass


def make_grpo_loss(
    model_cfg, grpo_cfg, max_new_tokens: int, codec=None, pipeline=None, diagnose: bool = False, rows_over=None
):
    """loss_fn(params, batch, cs) -> (loss, metrics, aux) for train_step.make_train_step; aux is the codec's raw
    per-boundary outputs (the low-rank sketch, folded into cs.codec by the step), {} without a codec.

    batch carries old_logp (and ref_logp when kl_coef > 0), advantages, response_mask (loss mask applied),
    is_weight (importance weights; absent when TIS is off so that the loss is untouched bit for bit), and
    optionally token_count / seq_count (global normalisers, set by a data-parallel grad_fn; see `agg_loss`).

    cs.clock.first_minibatch (bool scalar, traced): on a step's first mini-batch the parameters are those that
    produced old_logp, so ℓ_old is taken as the stop-gradient of this forward's own log-probs. The ratio is then
    exactly 1 (PPO-KL and clip fraction exactly 0) instead of 1 ± a few ulp from a separately compiled pass.

    `diagnose`: the step's one tick is its first mini-batch, so the batch has no old_logp and this forward is the
    old-log-prob pass too: the TIS weights and the step's diagnostics (`make_diagnostics_fn`, over the batch's
    `full_mask` and `truncated`) come from it, and one program replaces three. A max or a correlation is not a
    mean over replicas, so where the loss runs per replica (`rows_over`: the mesh axes of a gradient codec's
    shard_map, fast/grad_fn.py) the diagnostics' inputs are gathered over them first: every replica computes the
    global TIS weights and metrics from [B, T] scalars (six such arrays on the wire, against a second forward
    pass saved) and keeps its own rows' weights. Not under the pipeline (its loss is one program already, but its
    passes are not fused; loop.py).
    """
    diagnostics = make_diagnostics_fn(grpo_cfg) if diagnose else None
    if diagnostics is not None and rows_over:
        diagnostics = _over_replicas(diagnostics, rows_over)

    def loss_fn(params, batch, cs):
        stats, aux = policy_pass(
            model_cfg, params, batch, cs, codec, TRAIN, pipeline, entropy_grad=grpo_cfg.entropy_coeff != 0
        )
        logp, ent = stats
        ref = batch.get("ref_logp") if grpo_cfg.kl_coef > 0 else None
        is_weight, diag = batch.get("is_weight"), {}
        if diagnostics is not None:
            old = jax.lax.stop_gradient(logp)
            is_weight, diag = diagnostics(
                old, batch["sampler_logp"], batch["response_mask"], batch["full_mask"], batch["truncated"], ent
            )
        else:
            old = jnp.where(cs.clock.first_minibatch, jax.lax.stop_gradient(logp), batch["old_logp"])
        loss, metrics = grpo_loss(
            logp,
            old,
            ref,
            batch["advantages"],
            batch["response_mask"],
            is_weight,
            grpo_cfg,
            token_count=batch.get("token_count"),
            seq_count=batch.get("seq_count"),
            entropy=ent,
            norm_len=max_new_tokens,
        )
        metrics.update(diag)
        if codec is None or not aux:
            return loss, metrics, {}
        metrics.update(codec.summarize(aux))
        return loss, metrics, aux

    return loss_fn


def _over_replicas(diagnostics, axes):
    """`diagnostics` inside a shard_map over the batch `axes`: on the gathered global rows, this replica's rows of
    the weights back (the tiled gather orders replicas by their linear index over `axes`)."""
    axes = tuple(axes)

    def fn(*xs):
        rows = xs[0].shape[0]
        glob = [jax.lax.all_gather(jax.lax.stop_gradient(x), axes, axis=0, tiled=True) for x in xs]
        w, metrics = diagnostics(*glob)
        if w is not None:
            w = jax.lax.dynamic_slice_in_dim(w, jax.lax.axis_index(axes) * rows, rows, axis=0)
        return w, metrics

    return fn


def make_diagnostics_fn(grpo_cfg):
    """(old_logp, sampler_logp, response_mask, full_mask, truncated, entropy) -> (TIS weights or None, metrics):
    the step's truncated-IS weights (grpo.tis) and its `tis/*`, `mismatch/*` and `policy/entropy*` scalars, to be
    jitted as one program. Called op by op they were ~70 tiny programs, each compiled on the first step (~2.5 s on
    2 cores) and dispatched on every step."""

    def diagnostics(old_logp, sampler_logp, response_mask, full_mask, truncated, entropy):
        out, w = {}, None
        w, corr = correction_weights(old_logp, sampler_logp, response_mask, grpo_cfg)
        out.update(corr)
        out.update(mismatch_metrics(old_logp, sampler_logp, full_mask, truncated, weights=w))
        out.update(entropy_summary(entropy, full_mask))
        return w, out

    return diagnostics
