"""The train step's gradient through a gradient codec on the data axis (design §3.5): `grad_fn` for step/train_step.py.

Each replica takes value_and_grad of its own mini-batch slice inside `jax.shard_map` over the batch axes, then the
codec's `reduce` replaces XLA's implicit gradient mean (PowerSGD: three packed collectives, P sum, Q mean, the rest
mean). The loss and scalar metrics are pmean-ed; low-rank sketches and token counts in the activation codec's aux
are psum-ed (the sketch is a sum over the global batch). The codec's next state is returned as the circuit state's
`grad`, split over the batch axes as the codec's `state_specs` say (PowerSGD's error memory never travels).

Normalisation: each replica's loss is divided by the *global* loss-token count (and sequence count) over the
batch axes, times the replica count, so the mean over replicas is the global token mean of the dense step even when
response lengths differ across replicas (the normal case in GRPO). A mean of per-replica means would weight a
replica's tokens by 1/its own count and bias the gradient from the first tick on. Cost: two scalar psums.

Axes: with fsdp = tensor = 1 the shard_map is manual over every mesh axis (parameters replicated). A codec with
`replica_axes` (hierarchical PowerSGD, fsdp or tensor > 1) is manual over those alone (`data`): inside, each data
replica's value_and_grad is XLA's fsdp/tensor-sharded program, and the parameters, gradients and the codec's
error memory keep their fsdp/tensor shardings (fast/powersgd.py). XLA:CPU aborts on a bf16 all-reduce inside a
partially manual shard_map, so the codec's collectives there are fp32 (PowerSGD packs fp32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from twocircuit_jax.names import key_name
from twocircuit_jax.parallel import micro_batch as accumulate
from twocircuit_jax.parallel.mesh import BATCH_AXES
from twocircuit_jax.parallel.pipeline import summed_aux_keys


def _reduce_metrics(metrics, axes):
    """Inside shard_map: the loss's scalar metrics averaged over the replicas of `axes`."""
    return {k: jax.lax.pmean(jnp.asarray(v, jnp.float32), axes) for k, v in metrics.items()}


def _reduce_aux(aux, axes):
    """Inside shard_map: the codec's per-boundary aux over the replicas of `axes`: the leaves the codec registry
    declares summed (`summed_aux`: the low-rank sketch, a sum over the global batch, and its token count) psum-ed,
    every other leaf averaged."""
    summed = summed_aux_keys()
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (
            jax.lax.psum(x, axes) if key_name(p[-1]) in summed else jax.lax.pmean(jnp.asarray(x, jnp.float32), axes)
        ),
        aux,
    )


def global_normalisers(response_mask, axes) -> dict:
    """Inside shard_map: {token_count, seq_count} such that a replica's Σ/count, averaged over replicas, is the
    global Σ / global count (see `grpo.loss.agg_loss`)."""
    mask = response_mask.astype(jnp.float32)
    n_rep = jax.lax.psum(jnp.float32(1.0), axes)
    tokens = jax.lax.psum(jnp.sum(mask), axes)
    seqs = jax.lax.psum(jnp.sum((jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)), axes)
    return {"token_count": tokens / n_rep, "seq_count": seqs / n_rep}


def make_codec_grad_fn(codec, mesh, *, axes=BATCH_AXES, micro_batch: int = 0, phase: str | None = None):
    """factory(loss_fn) -> fn(params, batch, cs) -> (mean grads, loss, metrics, aux, cs with the next cs.grad);
    `codec` is the registered gradient codec (fast/codecs/base.GradCodec). `micro_batch` > 0: each replica accumulates its
    gradient over micro-batches of that many of its rows (parallel/micro_batch.py) and the codec reduces the sum once.
    `phase`: the codec's warm-up ("plain") or steady ("compressed") reduction alone; None, the codec picks on device."""

    hier = getattr(codec, "replica_axes", None)
    axes = hier or axes
    part_manual = hier is not None or mesh.shape.get("stage", 1) > 1

    def factory(loss_fn):
        def fn(params, batch, cs):
            sspec = codec.state_specs(cs.grad, axes)
            cs_spec = jax.tree.map(lambda _: P(), cs)._replace(grad=sspec)
            batch_spec = jax.tree.map(lambda x: P(axes) if jnp.ndim(x) else P(), batch)
            # With real stages only cs.grad enters as an input; the replicated fields are closed over. An input
            # of this shard_map has its context (manual over the batch axes) in its type, and the pipeline's nested
            # shard_map refuses such a value where its boundary functions read it (the codec's step key and basis:
            # "context mesh ... should match the aval mesh"); a value from outside both shard_maps is accepted.
            staged = mesh.shape.get("stage", 1) > 1
            cs_in, cs_spec_in = (cs.grad, sspec) if staged else (cs, cs_spec)
            unpack = (lambda g: cs._replace(grad=g)) if staged else (lambda c: c)

            def body(params, batch, cs):
                cs = unpack(cs)
                batch = dict(batch, **global_normalisers(batch["response_mask"], axes))
                (loss, metrics, aux), grads = accumulate.value_and_grad(loss_fn, micro_batch)(params, batch, cs)
                phased = {} if phase is None else {"phase": phase}  # only a codec with a warm-up takes a phase
                mean, new_state, pm = codec.reduce(grads, cs.grad, axes, **phased)
                metrics = _reduce_metrics(dict(metrics), axes)
                metrics.update(pm)
                return mean, jax.lax.pmean(loss, axes), metrics, _reduce_aux(aux, axes), new_state

            # P() is a pytree prefix: grads, loss, every metric and aux leaf come out replicated (reduced).
            rep_params = jax.tree.map(lambda _: P(), params)
            out_specs = (P(), P(), P(), P(), sspec)
            # With real stages, manual over the batch axes only: `stage` stays with the partitioner, so the
            # pipeline's own shard_map (manual over `stage`) nests inside this one. Otherwise manual over every axis
            # (XLA:CPU aborts on a bf16 all-reduce inside a partially manual shard_map; a codec may reduce in bf16).
            # Hierarchical (`hier`): manual over `data` only, fsdp/tensor left to the partitioner.
            mean, loss, metrics, aux, new_state = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(rep_params, batch_spec, cs_spec_in),
                out_specs=out_specs,
                axis_names=set(axes) if part_manual else set(mesh.axis_names),
                check_vma=False,
            )(params, batch, cs_in)
            return mean, loss, dict(metrics), aux, cs._replace(grad=new_state)

        return fn

    return factory
