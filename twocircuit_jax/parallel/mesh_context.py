"""The mesh a program is traced under, for the code inside it that must name mesh axes without holding the mesh.

Two things in the model need the mesh while its program is traced, and neither can take it as an argument without
threading it through every pass:
  - the hidden state's rows stay split over the batch axes between layers (`constrain_rows`). Left alone, XLA's
    partitioner resolves a [rows, T, H] @ [H, F] whose rows are split over `fsdp` and whose weight is split over
    `fsdp` on H by gathering the activations (every device holds every row's [T, H]: rows times the memory) rather
    than the weight, the FSDP schedule the sharding rules mean;
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
