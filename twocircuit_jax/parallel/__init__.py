"""Mesh construction and sharding rules."""

from twocircuit_jax.parallel.mesh import (
    AXES,
    BATCH_AXES,
    batch_sharding,
    batch_shardings,
    dp_size,
    make_mesh,
    mesh_shape,
    param_shardings,
    param_spec,
    replicated,
)

__all__ = [
    "AXES",
    "BATCH_AXES",
    "batch_sharding",
    "batch_shardings",
    "dp_size",
    "make_mesh",
    "mesh_shape",
    "param_shardings",
    "param_spec",
    "replicated",
]
