"""Micro-batched gradient accumulation inside one jitted pass (`train.micro_batch_per_device`).

A mini-batch of R rows per device is cut into K = R / micro_batch micro-batches; a `lax.scan` runs forward and
backward over one at a time and adds its gradient into an fp32 carry, so a pass holds one micro-batch's activations
instead of the whole mini-batch's (the point: Qwen2.5-1.5B at 256 rows x 4,096 tokens per device does not fit).
Micro-batch j takes rows j, j+K, j+2K, ... (parallel/pipeline.split_rows): each device's contiguous block of rows
holds an equal part of every micro-batch, so the split moves no data; the per-micro-batch arrays keep the batch
sharding (constrained when a mesh is given, the SPMD path; inside a gradient codec's shard_map rows are local).

Normalisation is the whole mini-batch's: before the split the batch gets `token_count` / `seq_count` (grpo/loss.py
agg_loss) of the whole mini-batch unless the caller set them already (a gradient codec's `global_normalisers`), so
the micro-batch losses, and their gradients, add up to the mini-batch's for every `loss_agg` mode, KL and entropy
terms included. Metrics combine to the unaccumulated values: `loss/*` (and the anchor's loss terms) summed, `*_max`
/ `*_min` maxed / minned, codec summaries averaged like their aux, every other scalar (a masked mean over response
tokens) weighted by the micro-batch's response tokens; a per-row array is joined back in row order. The loss's
third output, the codec's per-boundary aux, is combined on its own: the leaves the codec registry declares summed
(`summed_aux`: sketches, token counts) added up, the rest averaged (parallel/pipeline.reduce_aux).

micro_batch = 0 (or K = 1) returns the plain `jax.value_and_grad`: no scan, today's program exactly. Cost of K > 1:
the parameters are read K times per pass and the fp32 gradient carry (4 bytes a parameter) lives through the scan.
Communication: the gradient is summed over data replicas once per pass, after the loop, never per micro-batch
(left to the partitioner, XLA:CPU and the TPU compiler both keep that all-reduce inside the loop: K a pass, and
`data` is the axis that crosses the slow link between islands). On a data-only mesh (parameters replicated) each
replica accumulates its own rows inside a shard_map manual over every axis; with parameters sharded over fsdp, inside
a shard_map manual over `data` alone, the fsdp gathers and reduce-scatters per micro-batch staying inside the
island. fp32 on the wire, twice a bf16 parameter's bytes. With tensor > 1 and data > 1 the scan runs under the
partitioner and pays the per-micro-batch data reduce (XLA's SPMD partitioner aborts on the vocab-split gathers inside
a shard_map manual over `data`). Under a gradient codec each replica accumulates locally and the codec reduces once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.parallel import mesh as pmesh
from twocircuit_jax.parallel.pipeline import join_rows, reduce_aux, split_rows

F32 = jnp.float32
SUMMED = ("anchor/pg_loss", "anchor/kl_loss", "anchor/loss")  # besides every `loss/*`: terms of the loss, additive


def count(rows: int, micro_batch: int, dp: int = 1) -> int:
    """K micro-batches of a pass over `rows` global rows split over `dp` replicas (1 when micro_batch is 0)."""
    if not micro_batch:
        return 1
    if rows % dp or (rows // dp) % micro_batch:
        raise ValueError(
            f"train.micro_batch_per_device={micro_batch} must divide a device's rows of every pass: {rows} rows over {dp} "
            "data-parallel replicas"
        )
    return rows // dp // micro_batch


def check(run_cfg, dp: int) -> int:
    """`train.micro_batch_per_device` against the run (ConfigError naming the field); returns it (0 = off). The pipeline's
    GPipe microbatches (mesh.stage > 1, train.pipeline_microbatches) are not accumulated around: refused."""
    t = run_cfg.train
    mb = t.micro_batch_per_device
    if not mb:
        return 0
    if run_cfg.mesh.stages > 1:
        raise ConfigError(
            "train.micro_batch_per_device",
            f"got {mb}; mesh.stage={run_cfg.mesh.stages} splits the forward into train.pipeline_microbatches already "
            "(accumulation around the pipeline is not built); set it 0",
        )
    rows = t.prompts_per_update * run_cfg.sampler.n
    if rows % dp or (rows // dp) % mb:
        raise ConfigError(
            "train.micro_batch_per_device",
            f"got {mb}; must divide a device's rows of the mini-batch: prompts_per_update*sampler.n / dp = {rows}/{dp}",
        )
    return mb


def with_normalisers(batch: dict) -> dict:
    """The whole batch's loss normalisers (`agg_loss`), unless a grad_fn set global ones already."""
    if "token_count" in batch:
        return batch
    mask = batch["response_mask"].astype(F32)
    seqs = jnp.sum((jnp.sum(mask, axis=-1) > 0).astype(F32))
    return dict(batch, token_count=jnp.sum(mask), seq_count=seqs)


def split(batch: dict, k: int, mesh=None):
    """(per-row entries [K, rows/K, ...] in split_rows order, the shared entries: scalars)."""
    rows = batch["response_mask"].shape[0]
    per_row = {n: x for n, x in batch.items() if jnp.ndim(x) and x.shape[0] == rows}
    shared = {n: x for n, x in batch.items() if n not in per_row}
    stacked = {n: split_rows(x, k) for n, x in per_row.items()}
    if mesh is not None:
        stacked = {n: _constrain(x, mesh, 1) for n, x in stacked.items()}
    return stacked, shared


def _constrain(x, mesh, axis: int, axes=pmesh.BATCH_AXES):
    spec = [None] * x.ndim
    spec[axis] = axes
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def combine_metrics(stacked: dict, tokens) -> dict:
    """{name: [K] per micro-batch} -> the mini-batch's values (module docstring); `tokens` [K] response tokens."""
    w = tokens.astype(F32)
    out = {}
    for n, v in stacked.items():
        if v.ndim > 1:  # a per-row output [K, rows/K, ...]: back in batch row order
            out[n] = join_rows(v)
        elif n.startswith("loss/") or n in SUMMED:
            out[n] = jnp.sum(v, axis=0)
        elif n.endswith("_max"):
            out[n] = jnp.max(v, axis=0)
        elif n.endswith("_min"):
            out[n] = jnp.min(v, axis=0)
        elif n.startswith("codec/"):
            out[n] = jnp.mean(v.astype(F32), axis=0)
        else:  # a masked mean over response tokens: Σ_j n_j m_j / max(Σ n_j, 1) = the whole batch's
            out[n] = jnp.sum(v.astype(F32) * w, axis=0) / jnp.maximum(jnp.sum(w), 1.0)
    return out


def plain_value_and_grad(loss_fn):
    """`jax.value_and_grad(has_aux=True)` over a loss fn(params, ...) -> (loss, metrics, aux): metrics and aux are
    its has_aux pair, neither differentiated. fn(params, ...) -> ((loss, metrics, aux), grads)."""

    def pair(*args):  # jax's has_aux wants (value, aux): the two outputs that are not differentiated go as one
        loss, metrics, aux = loss_fn(*args)
        return loss, (metrics, aux)

    vg = jax.value_and_grad(pair, has_aux=True)

    def fn(*args):
        (loss, (metrics, aux)), grads = vg(*args)
        return (loss, metrics, aux), grads

    return fn


def value_and_grad(loss_fn, micro_batch: int = 0, *, dp: int = 1, mesh=None):
    """`plain_value_and_grad(loss_fn)`: fn(params, batch, *rest) -> ((loss, metrics, aux), grads) of a loss that
    returns (loss, metrics, aux), accumulated over micro-batches of `micro_batch` rows per replica (`dp` replicas
    hold the batch's rows; inside a shard_map the rows are local: dp = 1). `mesh`: the SPMD path. On a data-only
    mesh (parameters replicated) each replica accumulates its own rows inside a shard_map manual over every axis;
    with parameters sharded over fsdp and data > 1, manual over `data` alone; either way the gradient is summed over
    the replicas once, after the loop (`_over_replicas`). Otherwise (data 1, or tensor > 1) the scan runs under the
    partitioner, the carry on the parameter shardings. Gradients come back in the parameters' dtype, as
    unaccumulated; the aux combined by `reduce_aux` (summed or averaged leaf by leaf, as the codec declares)."""
    plain = plain_value_and_grad(loss_fn)
    if not micro_batch:
        return plain

    def fn(params, batch, *rest):
        k = count(batch["response_mask"].shape[0], micro_batch, dp)
        if k == 1:
            return plain(params, batch, *rest)
        batch = with_normalisers(batch)
        if mesh is not None and _replicated_params(mesh):
            return _over_replicas(plain, micro_batch, mesh, pmesh.BATCH_AXES, params, batch, rest)
        if mesh is not None and mesh.shape["data"] > 1 and mesh.shape["tensor"] == 1:
            return _over_replicas(plain, micro_batch, mesh, "data", params, batch, rest)
        stacked, shared = split(batch, k, mesh)
        rows = (lambda x, axis: x) if mesh is None else (lambda x, axis: _constrain(x, mesh, axis))
        pin = (lambda t: t) if mesh is None else _param_pin(params, mesh)
        acc, (losses, metrics, aux, tokens) = _accumulate(plain, params, stacked, shared, rest, rows, pin)
        grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)
        return (jnp.sum(losses), combine_metrics(metrics, tokens), reduce_aux(aux)), grads

    return fn


def _accumulate(plain, params, stacked, shared, rest, rows, pin):
    """The scan over micro-batches: (fp32 gradient sum, (losses, metrics, aux, response tokens), each stacked [K]).
    `rows(x, axis)` places a micro-batch's rows (axis 0) or the stack's (axis 1); `pin` the fp32 carry."""

    def body(acc, mb):
        mb = {n: rows(x, 0) for n, x in mb.items()}
        (loss, metrics, aux), g = plain(params, {**shared, **mb}, *rest)
        acc = pin(jax.tree.map(lambda a, x: a + x.astype(F32), acc, g))
        return acc, (loss, metrics, aux, jnp.sum(mb["response_mask"].astype(F32)))

    zeros = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, F32), params))
    return jax.lax.scan(body, zeros, stacked)


def _replicated_params(mesh) -> bool:
    """A data-only mesh: every parameter whole on every device (fsdp, tensor and stage of size 1)."""
    return all(mesh.shape[a] == 1 for a in mesh.axis_names if a != "data")


def _over_replicas(plain, micro_batch, mesh, axes, params, batch, rest):
    """The scan inside a shard_map over the replicas of `axes`, whose gradient and loss are summed once, after the
    loop (the loss is normalised by the global counts, so the sum is the global value); the per-micro-batch metrics
    and aux of every replica gathered ([R*K] scalars, tiny; the aux is small: a sketch per boundary) and combined as
    over micro-batches, exactly; per-row outputs stay with their rows.

    axes = BATCH_AXES (a data-only mesh): manual over every axis, each replica's rows and parameters local.
    axes = "data" (parameters sharded over fsdp): manual over `data` alone. Inside, each data replica's scan is the
    partitioner's fsdp program over its own rows (rows split over `fsdp`, the fp32 carry on the parameters'
    shardings), so the only collectives in the loop stay inside a replica (fsdp's gathers and reduce-scatters, on the
    island's fast links when `data` is the axis that crosses the slow one)."""
    partial = axes == "data"

    def body(params, batch, rest):
        rows, pin, dp = (lambda x, axis: x), (lambda t: t), 1
        if partial:
            am = jax.sharding.get_abstract_mesh()
            rows = lambda x, axis: _constrain(x, am, axis, ("fsdp",))  # noqa: E731
            pin, dp = _param_pin(params, am), mesh.shape["fsdp"]
        stacked, shared = split(batch, count(batch["response_mask"].shape[0], micro_batch, dp))
        stacked = {n: rows(x, 1) for n, x in stacked.items()}
        acc, (losses, metrics, aux, tokens) = _accumulate(plain, params, stacked, shared, rest, rows, pin)
        gather = lambda x: jax.lax.all_gather(x, axes, axis=0, tiled=True)  # noqa: E731  [K, ...] -> [R*K, ...]
        per_row = {n: join_rows(v) for n, v in metrics.items() if v.ndim > 1}
        summary = {n: gather(v) for n, v in metrics.items() if n not in per_row}
        metrics = {**combine_metrics(summary, gather(tokens)), **per_row}
        aux = reduce_aux(jax.tree.map(gather, aux))
        return pin(jax.lax.psum(acc, axes)), jax.lax.psum(jnp.sum(losses), axes), metrics, aux

    # which metrics are per-row (split over the replicas like the batch) and which are scalars (replicated)
    (_, whole, _), _ = jax.eval_shape(lambda p, b, r: plain(p, b, *r), params, batch, rest)
    metric_spec = {n: P(axes) if v.ndim else P() for n, v in whole.items()}
    batch_spec = jax.tree.map(lambda x: P(axes) if jnp.ndim(x) else P(), batch)
    acc, loss, metrics, aux = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(), params), batch_spec, jax.tree.map(lambda _: P(), rest)),
        out_specs=(P(), P(), metric_spec, P()),
        axis_names={"data"} if partial else set(mesh.axis_names),
        check_vma=False,
    )(params, batch, rest)
    return (loss, metrics, aux), jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)


def _param_pin(params, mesh):
    sh = pmesh.param_shardings(params, mesh)
    return lambda tree: jax.tree.map(jax.lax.with_sharding_constraint, tree, sh)


def map_rows(fn, batch: dict, micro_batch: int, *, dp: int = 1, mesh=None):
    """fn(rows) over K micro-batches with `lax.map` (one micro-batch's activations at a time), for forward-only
    passes; returns (outputs stacked [K, ...], K). K = 1: fn(batch) unstacked. `join_rows` puts per-row outputs back
    in batch row order; `reduce_aux` combines a codec's aux."""
    rows = next(x.shape[0] for x in jax.tree.leaves(batch) if jnp.ndim(x))
    k = count(rows, micro_batch, dp)
    if k == 1:
        return fn(batch), 1
    per_row = {n: split_rows(x, k) for n, x in batch.items() if jnp.ndim(x) and x.shape[0] == rows}
    shared = {n: x for n, x in batch.items() if n not in per_row}
    if mesh is not None:
        per_row = {n: _constrain(x, mesh, 1) for n, x in per_row.items()}

    def one(mb):
        if mesh is not None:
            mb = {n: _constrain(x, mesh, 0) for n, x in mb.items()}
        return fn({**shared, **mb})

    return jax.lax.map(one, per_row), k
