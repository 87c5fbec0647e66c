"""The train step's gradient with PowerSGD on the data axis (SPEC §3.5): `grad_fn` for train.step.make_train_step.

Each replica takes value_and_grad of its own mini-batch slice inside `jax.shard_map` over the batch axes, then
`powersgd_reduce` replaces XLA's implicit gradient mean with three packed collectives (P sum, Q mean, the rest
mean). The loss and scalar metrics are pmean-ed; low-rank sketches and token counts in "codec/aux" are psum-ed
(the sketch is a sum over the global batch). The next PowerSGD state leaves the step in metrics[NEW_STATE]; the
error memory keeps its P(batch axes) split, so it never travels (the loop jits ctx/metrics with free shardings).

Per-replica losses are means over each replica's own tokens, so the result equals the XLA path's global token
mean only when every replica holds the same number of loss tokens (what the full-rank test arranges); with ragged
rows it is the mean of per-replica means, as in any data-parallel PowerSGD.
Requires fsdp = tensor = 1 (parameters replicated), checked by FastCircuit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from twocircuit_jax.fast import powersgd as psgd
from twocircuit_jax.parallel.mesh import BATCH_AXES

NEW_STATE = "codec/new_state"
_SUMMED = ("sketch", "tokens")  # aux leaves that add up over replicas; every other aux leaf is averaged


def _key_name(k):
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def _reduce_metrics(metrics, axes):
    out = {}
    for k, v in metrics.items():
        if k == "codec/aux":
            out[k] = jax.tree_util.tree_map_with_path(
                lambda p, x: jax.lax.psum(x, axes) if _key_name(p[-1]) in _SUMMED
                else jax.lax.pmean(jnp.asarray(x, jnp.float32), axes), v)
        else:
            out[k] = jax.lax.pmean(jnp.asarray(v, jnp.float32), axes)
    return out


def make_powersgd_grad_fn(fcfg, mesh, *, interpret: bool = False, axes=BATCH_AXES):
    """factory(loss_fn) -> fn(params, batch, ctx) -> (mean grads, loss, metrics incl. NEW_STATE)."""

    def factory(loss_fn):
        def fn(params, batch, ctx):
            state = ctx["codec"]["powersgd"]
            sspec = psgd.state_specs(state, axes)
            ctx_spec = jax.tree.map(lambda _: P(), ctx)
            ctx_spec["codec"] = dict(ctx_spec["codec"], powersgd=sspec)
            batch_spec = jax.tree.map(lambda x: P(axes) if jnp.ndim(x) else P(), batch)

            def body(params, batch, ctx):
                (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, ctx)
                mean, new_state, pm = psgd.powersgd_reduce(grads, ctx["codec"]["powersgd"], fcfg, axes,
                                                           interpret=interpret)
                metrics = _reduce_metrics(dict(metrics), axes)
                metrics.update(pm)
                return mean, jax.lax.pmean(loss, axes), metrics, new_state

            # P() is a pytree prefix: grads, loss and every metric leaf come out replicated (reduced).
            rep_params = jax.tree.map(lambda _: P(), params)
            out_specs = (P(), P(), P(), sspec)
            mean, loss, metrics, new_state = jax.shard_map(
                body, mesh=mesh, in_specs=(rep_params, batch_spec, ctx_spec), out_specs=out_specs,
                check_vma=False)(params, batch, ctx)
            metrics = dict(metrics)
            metrics[NEW_STATE] = new_state
            return mean, loss, metrics

        return fn

    return factory

