"""The mesh a program is traced under, for the code inside it that must name mesh axes without holding the mesh.

Three things in the model need the mesh while its program is traced, and none can take it as an argument without
threading it through every pass:
  - the hidden state's rows stay split over the batch axes between layers (`constrain_rows`). Left alone, XLA's
    partitioner resolves a [rows, T, H] @ [H, F] whose rows are split over `fsdp` and whose weight is split over
    `fsdp` on H by gathering the activations (every device holds every row's [T, H]: rows times the memory) rather
    than the weight, the FSDP schedule the sharding rules mean;
  - the embedding lookup (`embed_lookup`): its backward scatter-add has no efficient reshard from row-split rows to
    the H-split table, and XLA replicates the cotangent unless the lookup is laid out H-split per data replica;
  - a Mosaic kernel (the TPU flash attention, model/attention.py) is not partitioned by XLA: it runs in a
    `shard_map` over the batch axes of the context mesh.
`under(mesh, fn)` traces `fn` with `mesh`'s abstract mesh as the context (`jax.sharding.use_abstract_mesh`, which,
unlike `jax.set_mesh`, may be entered inside a jit). Inside a `shard_map` the context is the map's own, with its
manual axes; `constrain_rows` then constrains only over the batch axes still left to the partitioner. Without a
context (a program jitted without `under`, a single device) it is the identity: the traced program is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from twocircuit_jax.parallel.mesh import BATCH_AXES


def under(mesh, fn):
    """`fn` traced with `mesh` as the context mesh (a no-op wrapper for a one-device mesh)."""
    if mesh is None or mesh.size == 1:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def free_batch_axes() -> tuple:
    """The context mesh's batch axes of size > 1 that the partitioner still owns (not manual); () without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "stage" in mesh.manual_axes:
        # Inside the pipeline's shard_map (manual over `stage`) each stage's rows are left to the partitioner as
        # before: XLA:CPU aborts on a sharding constraint inside that partially manual program.
        return ()
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names and a not in mesh.manual_axes and mesh.shape[a] > 1)


def constrain_rows(x):
    """x [rows, ...] with its rows split over the context's free batch axes (identity without a context, or when
    the rows do not divide)."""
    axes = free_batch_axes()
    if not axes:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    if x.shape[0] % size:
        return x
    return jax.lax.with_sharding_constraint(x, P(axes, *([None] * (x.ndim - 1))))


def embed_lookup(table, tokens):
    """`jnp.take(table, tokens, axis=0)` for an embedding table [V, H] laid out by the FSDP rule (H split over
    `fsdp`, parallel/mesh.py) under a context whose rows are split over the batch axes. Left to the partitioner, the
    lookup's transpose (a scatter-add of the [rows, T, H] cotangent, rows over data x fsdp, into the H-split table)
    has no efficient reshard: XLA replicates the cotangent on every device ("Involuntary full rematerialization").
    Here the tokens go whole over `fsdp` (int ids: small), each device looks its H-slice up for its data replica's
    rows, and the result is [rows over the other batch axes, T, H over fsdp]; the callers' `constrain_rows` moves it
    to rows over every batch axis (an all-to-all), and the backward runs the same way back, the scatter-add local to
    each device's H-slice. Identity layout (a plain take) without a context, inside the pipeline's shard_map, or
    when the table is not split over `fsdp` (fsdp 1, H not divisible, or V split over `tensor`)."""
    axes = free_batch_axes()
    mesh = jax.sharding.get_abstract_mesh()
    rows = tuple(a for a in axes if a != "fsdp")
    size = 1
    for a in rows:
        size *= mesh.shape[a]
    if (
        "fsdp" not in axes
        or table.shape[1] % mesh.shape["fsdp"]
        or ("tensor" in mesh.axis_names and mesh.shape["tensor"] > 1)
        or tokens.shape[0] % size
    ):
        return jnp.take(table, tokens, axis=0)
    lead = rows or None
    tokens = jax.lax.with_sharding_constraint(tokens, P(lead, *([None] * (tokens.ndim - 1))))
    x = jnp.take(table, tokens, axis=0)
    return jax.lax.with_sharding_constraint(x, P(lead, *([None] * (x.ndim - 2)), "fsdp"))
