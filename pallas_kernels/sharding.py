"""Explicit shard_map around a row-wise Pallas kernel, so it composes with a batch-sharded train step.

A pallas_call is an opaque custom call to XLA's SPMD partitioner: on a sharded operand it would be gathered (or
refused). The codec kernels are row-wise (one token per row), so each device runs the kernel on its own rows:
row arguments are split over the batch mesh axes, the rest (a basis Q) replicated, and the output stays split.
No collective is added. check_vma is off: the interpret-mode lowering of jax 0.10 does not type-check under it.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")


def shard_rows(fn, mesh, n_row_args: int, axes=BATCH_AXES):
    """fn(*row_args, *replicated_args) -> rows [N, ...]; returns the same function run per device on its rows.

        With no mesh (or a single device) `fn` itself is returned; inside a shard_map that is already manual over the
    batch axes the kernel runs directly. Row arguments may be pytrees of [N, ...] arrays.
    """
    if mesh is None or mesh.size == 1:
        return fn
    axes = tuple(a for a in axes if a in mesh.axis_names)
    split = 1
    for a in axes:
        split *= mesh.shape[a]

    def call(*args):
        manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
        if set(axes) <= manual:  # already per device (e.g. inside PowerSGD's shard_map): run on the local rows
            return fn(*args)
        rows = jax.tree.leaves(args[:n_row_args])
        n = rows[0].shape[0]
        if n % split:
            raise ValueError(
                f"kernel rows: {n} rows do not split over the {split}-way batch axes {axes}; the "
                f"rollout rows (train.prompts_per_update * sampler.n) and the sequence length set this"
            )
        in_specs = tuple(jax.tree.map(lambda _: P(axes), a) for a in args[:n_row_args])
        in_specs += tuple(jax.tree.map(lambda _: P(), a) for a in args[n_row_args:])
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(axes), check_vma=False)(*args)

    return call
