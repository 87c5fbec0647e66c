"""The trainer's forward passes over a batch: the policy's token log-probs and entropies along one path (design §3.1
tags: `train`, `old_logprob`, `ref_logprob`, `dense`), through the pipeline's stages when there are stages and through
the fast circuit's codec where it applies on that path. The GRPO loss over them is step/grpo_step.py."""

from __future__ import annotations

import jax

from twocircuit_jax.names import OLD
from twocircuit_jax.parallel import mesh as pmesh, micro_batch as accumulate, pipeline as pipe


def policy_pass(model_cfg, params, batch, cs, codec, tag, pipeline=None, entropy_grad=False):
    """(TokenStats, codec aux) of one path: `pipeline` (parallel/pipeline.Pipeline, mesh.stage > 1) or the
    one-program model."""
    boundary_fn = None
    if codec is not None and codec.applies(tag):
        boundary_fn = codec.boundary_fn(cs.codec, tag, cs.clock.step)
    return pipe.forward(
        model_cfg,
        params,
        batch["tokens"],
        batch["attention_mask"],
        pipeline=pipeline,
        rows={"sample_id": batch["sample_id"]} if "sample_id" in batch else None,
        boundary_fn=boundary_fn,
        entropy_grad=entropy_grad,
    )


def make_logp_fn(model_cfg, codec=None, tag: str = OLD, pipeline=None, *, micro_batch: int = 0, mesh=None):
    """(params, batch, cs) -> (logp [B,T], entropy [B,T], codec aux). No gradient is taken through it.
    `micro_batch` > 0 (train.micro_batch_per_device; `mesh` gives the replica count and keeps the batch sharding): the pass
    runs over micro-batches of that many rows per replica with `lax.map`, holding one micro-batch's activations;
    the rows come back in order and the aux is combined (sketches and token counts summed, the rest averaged)."""

    def one(params, batch, cs):
        stats, aux = policy_pass(model_cfg, params, batch, cs, codec, tag, pipeline)
        return jax.lax.stop_gradient(stats.logp), stats.entropy, aux

    if not micro_batch:
        return one
    dp = pmesh.dp_size(mesh) if mesh is not None else 1

    def fn(params, batch, cs):
        out, k = accumulate.map_rows(lambda rows: one(params, rows, cs), batch, micro_batch, dp=dp, mesh=mesh)
        if k == 1:
            return out
        logp, ent, aux = out
        return pipe.join_rows(logp), pipe.join_rows(ent), pipe.reduce_aux(aux)

    return fn
