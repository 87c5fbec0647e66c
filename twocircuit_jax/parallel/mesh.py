"""Device mesh from config and partition rules mapping parameter paths to PartitionSpecs.

Axes: `data` (pure data parallel: replicated params), `stage` (pipeline stages: each holds its part of the layer
stack, parallel/pipeline.py), `fsdp` (params and optimizer state sharded, batch too), `tensor` (matrix columns/rows
split). A dimension that does not divide by its mesh axes stays replicated on them:
the tiny test models have vocab and hidden sizes that the 8-device mesh does not divide.

Fast and slow links (config MeshConfig): every axis is island size x `dcn_<axis>`, an island being the devices one
fast network joins (a TPU slice's ICI, a GPU node's NVLink) and `dcn_*` the islands it spans over the slow link
(DCN). Along each axis the island index is the major part: position i on `data` is island i // data, device
i % data inside it (MaxText's layout). On devices that report slices (TPU multi-slice, libtpu's compile-only
multi-slice topologies) the islands are the slices, arranged by `mesh_utils.create_hybrid_device_mesh`; on devices
that do not (CPU fake devices, a single GPU host) or report one slice only, the islands are contiguous groups of
the device list: devices [k*I, (k+1)*I) are island k, I = the devices of one island. The fast circuit's traffic on
the slow axes: stage boundaries on `dcn_stage` (the activation codec's messages) and the gradient reduction across
`data` replicas on `dcn_data` (PowerSGD reduces over all of `data`, island and slow parts together). fsdp and
tensor stay inside an island unless `mesh.allow_slow_sharding`: their traffic is uncompressed.
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


def island_shape(cfg: MeshConfig, n_devices: int) -> dict:
    """{axis: size inside one island}, -1 resolved against the devices of one island."""
    dcn = dcn_shape(cfg)
    islands = math.prod(dcn.values())
    if n_devices % islands:
        raise ConfigError(
            "mesh.dcn_data",
            f"dcn_data*dcn_stage*dcn_fsdp*dcn_tensor = {islands} islands do not divide {n_devices} devices",
        )
    per = n_devices // islands
    sizes = {"data": cfg.data, "stage": cfg.stage, "fsdp": cfg.fsdp, "tensor": cfg.tensor}
    known = math.prod(s for s in sizes.values() if s != -1)
    for k, s in sizes.items():
        if s == -1:
            if per % known:
                raise ConfigError(f"mesh.{k}", f"-1 cannot fill: {per} devices per island do not divide by {known}")
            sizes[k] = per // known
    if math.prod(sizes.values()) != per:
        where = f" in each of {islands} islands" if islands > 1 else ""
        raise ConfigError(
            "mesh",
            f"data*stage*fsdp*tensor = {sizes['data']}*{sizes['stage']}*{sizes['fsdp']}*{sizes['tensor']} = "
            f"{math.prod(sizes.values())}, but there are {per} devices{where}; sizes must multiply "
            f"to the device count (use -1 on one axis to take the rest)",
        )
    return sizes


def dcn_shape(cfg: MeshConfig) -> dict:
    """{axis: islands it spans over the slow link}."""
    return {"data": cfg.dcn_data, "stage": cfg.dcn_stage, "fsdp": cfg.dcn_fsdp, "tensor": cfg.dcn_tensor}


def mesh_shape(cfg: MeshConfig, n_devices: int) -> dict:
    """{axis: its whole size}: island size x dcn size."""
    ici, dcn = island_shape(cfg, n_devices), dcn_shape(cfg)
    return {a: ici[a] * dcn[a] for a in AXES}


def _slices(devices) -> int:
    """Distinct slices the devices report (0 where they carry no slice_index)."""
    if not all(hasattr(d, "slice_index") for d in devices):
        return 0
    return len({d.slice_index for d in devices})


def make_mesh(cfg: MeshConfig, devices: Sequence | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    ici, dcn = island_shape(cfg, len(devices)), dcn_shape(cfg)
    sizes = {a: ici[a] * dcn[a] for a in AXES}
    n_islands = math.prod(dcn.values())
    if n_islands == 1:
        return Mesh(np.array(devices).reshape([sizes[a] for a in AXES]), AXES)
    if _slices(devices) > 1:
        from jax.experimental import mesh_utils

        try:
            arr = mesh_utils.create_hybrid_device_mesh(
                [ici[a] for a in AXES], [dcn[a] for a in AXES], devices, allow_split_physical_axes=True
            )
        except ValueError as e:
            raise ConfigError("mesh.dcn_data", f"the devices' {_slices(devices)} slices: {e}") from None
        return Mesh(arr, AXES)
    # no slices: island k is devices [k*I, (k+1)*I); along each axis the island index is the major part
    arr = np.array(devices).reshape([dcn[a] for a in AXES] + [ici[a] for a in AXES])
    arr = arr.transpose([j for i in range(len(AXES)) for j in (i, i + len(AXES))])
    return Mesh(arr.reshape([sizes[a] for a in AXES]), AXES)


def islands(cfg: MeshConfig, mesh: Mesh) -> list:
    """The island of each device of `mesh` in its flat order (the compiled program's device ids): its slice where
    the devices report several, else its contiguous group (make_mesh)."""
    devs = list(mesh.devices.flat)
    if _slices(devs) > 1:
        return [int(d.slice_index) for d in devs]
    ici, dcn = island_shape(cfg, len(devs)), dcn_shape(cfg)
    coords = np.indices(mesh.devices.shape).reshape(len(AXES), -1)
    isl = coords // np.array([ici[a] for a in AXES])[:, None]
    return [int(x) for x in np.ravel_multi_index(tuple(isl), [dcn[a] for a in AXES])]


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
