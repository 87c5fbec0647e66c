"""Device mesh from config and partition rules mapping parameter paths to PartitionSpecs.

Axes: `data` (pure data parallel: replicated params), `stage` (pipeline stages: each holds its part of the layer
stack, parallel/pipeline.py), `fsdp` (params and optimizer state sharded, batch too), `tensor` (matrix columns/rows
split). A dimension that does not divide by its mesh axes stays replicated on them:
the tiny test models have vocab and hidden sizes that the 8-device mesh does not divide.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.sections import MeshConfig
from twocircuit_jax.names import path_str

AXES = ("data", "stage", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both

# (regex on the '/'-joined param path, spec for the array). Stacked layer arrays lead with the layer axis, split
# over `stage` (contiguous: stage s holds layers s*L/S .. (s+1)*L/S - 1; with stage = 1 it is not split).
PARAM_RULES: list[tuple[str, tuple]] = [
    (r"^embed$", ("tensor", "fsdp")),
    (r"^lm_head$", ("fsdp", "tensor")),
    (r"^layers/(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", ("stage", "fsdp", "tensor")),
    (r"^layers/(o_proj|down_proj)/kernel$", ("stage", "tensor", "fsdp")),
    (r"^layers/(q_proj|k_proj|v_proj)/bias$", ("stage", "tensor")),
    (r"^layers/", ("stage",)),  # per-layer norms
    (r".*", ()),  # final norm and anything else: replicated
]


def mesh_shape(cfg: MeshConfig, n_devices: int) -> dict:
    sizes = {"data": cfg.data, "stage": cfg.stage, "fsdp": cfg.fsdp, "tensor": cfg.tensor}
    known = math.prod(s for s in sizes.values() if s != -1)
    for k, s in sizes.items():
        if s == -1:
            if n_devices % known:
                raise ConfigError(f"mesh.{k}", f"-1 cannot fill: {n_devices} devices do not divide by {known}")
            sizes[k] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(
            "mesh",
            f"data*stage*fsdp*tensor = {sizes['data']}*{sizes['stage']}*{sizes['fsdp']}*{sizes['tensor']} = "
            f"{math.prod(sizes.values())}, but there are {n_devices} devices; sizes must multiply "
            f"to the device count (use -1 on one axis to take the rest)",
        )
    return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_shape(cfg, len(devices))
    return Mesh(np.array(devices).reshape([sizes[a] for a in AXES]), AXES)


def _fit(spec: tuple, shape: tuple, mesh: Mesh) -> P:
    """Drop mesh axes that do not divide the dimension (or are absent from the array's rank)."""
    out = []
    for dim, ax in zip(shape, spec + (None,) * (len(shape) - len(spec))):
        if ax is not None and (ax not in mesh.shape or dim % mesh.shape[ax] != 0):
            ax = None
        out.append(ax)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_spec(path: str, shape: tuple, mesh: Mesh) -> P:
    for pattern, spec in PARAM_RULES:
        if re.match(pattern, path):
            return _fit(tuple(spec)[: len(shape)], tuple(shape), mesh)
    return P()


def param_shardings(params, mesh: Mesh):
    """NamedSharding per leaf of a param-shaped pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, param_spec(path_str(p), tuple(x.shape), mesh)), params
    )


def decode_param_shardings(params, mesh: Mesh):
    """Parameters as the embedded sampler reads them: whole on every device of the batch and stage axes, split over
    `tensor` only. Each device decodes its own rows, so it reads every weight at every token: gathered once per
    generate call (one all-gather of the weights in the compute dtype), not once per token and layer as the
    trainer's FSDP layout would (an all-gather per layer per token)."""

    def one(p, x):
        spec = param_spec(path_str(p), tuple(x.shape), mesh)
        return NamedSharding(mesh, P(*[a if a == "tensor" else None for a in spec]))

    return jax.tree_util.tree_map_with_path(one, params)


def row_spec(rows: int, mesh: Mesh, ndim: int) -> P:
    """A row-major array's spec: the leading axis split over the batch axes when they divide it, else replicated
    (a call with fewer rows than devices, e.g. a prefill of a few prompts)."""
    return P(BATCH_AXES, *([None] * (ndim - 1))) if rows % dp_size(mesh) == 0 else P()


def like_param_shardings(tree, params, mesh: Mesh):
    """Shardings for a pytree whose leaves either mirror a parameter (optimizer moments: same path suffix and
    shape) or are small extras (counts: replicated)."""
    by_shape_path = {}
    for p, x in jax.tree_util.tree_leaves_with_path(params):
        by_shape_path[(path_str(p), tuple(x.shape))] = param_spec(path_str(p), tuple(x.shape), mesh)

    def one(path, x):
        s = path_str(path)
        for (pp, shape), spec in by_shape_path.items():
            if tuple(x.shape) == shape and (s == pp or s.endswith("/" + pp)):
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shardings(batch, mesh: Mesh):
    """Leading (batch) axis split over data x fsdp; scalars replicated."""
    return jax.tree.map(lambda x: batch_sharding(mesh, x.ndim) if x.ndim else NamedSharding(mesh, P()), batch)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def dp_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]
