"""`--topology` targets of `twocircuit plan`: a name -> compile-only devices, the chip they stand for, and the checks a
config must pass against them (its mesh multiplies to the device count).

  tpu:<slice>  a Cloud TPU slice of chips.SLICES: compile-only devices from libtpu's topology description
               (jax.experimental.topologies), so the real TPU compiler runs on this host and nothing executes
  tpu:<k>x<slice>  k such slices joined by the slow link (TPU multi-slice over DCN): libtpu's compile-only devices
               with num_slices=k, each carrying its slice_index (the islands of parallel/mesh.py)
  cpu:<N>      N fake host devices (XLA's --xla_force_host_platform_device_count, read when jax's CPU backend starts):
               the memory of the CPU compiler's program, with no chip to compare it to
  gpu:*        refused: jax compiles for CUDA only with a GPU attached
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.plan.chips import CHIPS, SLICES, Chip

_FLAG = "--xla_force_host_platform_device_count"


class Target(NamedTuple):
    name: str  # as given, e.g. "tpu:v5e-8"
    platform: str  # "tpu" or "cpu"
    count: int  # devices
    chip: Chip | None  # None for cpu:N (no HBM to fit into)
    slice: Any  # chips.TpuSlice for tpu:*, else None
    slices: int = 1  # TPU slices joined by the slow link (tpu:<k>x<slice>)


def parse(name: str) -> Target:
    kind, _, rest = name.partition(":")
    allowed = ", ".join([f"tpu:{s}" for s in SLICES] + ["tpu:<k>x<slice> (k slices)", "cpu:N"])
    if kind == "gpu":
        raise ConfigError(
            "--topology",
            f"got {name!r}: GPU programs cannot be compiled on this host (jax's CUDA compiler needs a GPU attached); "
            f"allowed: {allowed}",
        )
    if kind == "tpu" and rest in SLICES:
        s = SLICES[rest]
        return Target(name, "tpu", s.chips, CHIPS[s.chip], s)
    k, x, one = rest.partition("x")
    if kind == "tpu" and x and k.isdigit() and int(k) >= 1 and one in SLICES:
        s = SLICES[one]
        return Target(name, "tpu", int(k) * s.chips, CHIPS[s.chip], s, int(k))
    if kind == "cpu" and rest.isdigit() and int(rest) >= 1:
        return Target(name, "cpu", int(rest), None, None)
    raise ConfigError("--topology", f"got {name!r}; allowed: {allowed}")


def prepare_cpu(target: Target) -> None:
    """Ask XLA for the target's fake host devices; effective only before jax's CPU backend starts (checked later
    by `devices`). Called as early as the command line allows."""
    if target.platform != "cpu":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={target.count}".strip()


def devices(target: Target) -> list:
    import jax

    if target.platform == "tpu":
        from jax.experimental import topologies

        # libtpu takes a machine-wide lock for the chips it drives; compile-only devices drive none, so several
        # planning processes (or a test run beside one) may load it at once
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        s = target.slice
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=s.topology, chips_per_host_bounds=s.bounds, num_slices=target.slices
        )
        return list(topo.devices)
    have = jax.devices("cpu")
    if len(have) < target.count:
        raise ConfigError(
            "--topology",
            f"got {target.name!r} but jax's CPU backend started with {len(have)} devices "
            f"(XLA_FLAGS={_FLAG}=N must be set before jax starts; run `twocircuit plan` in its own process)",
        )
    return list(have[: target.count])


def check_mesh(cfg, target: Target) -> dict:
    """The config's mesh must use exactly the target's devices (one -1 axis takes the rest): a ConfigError naming
    the mesh and the target otherwise. Returns the resolved sizes."""
    from twocircuit_jax.parallel.mesh import mesh_shape

    try:
        return mesh_shape(cfg.mesh, target.count)
    except ConfigError as e:
        raise ConfigError(e.path, f"{e.message}; target {target.name} has {target.count} devices") from None
