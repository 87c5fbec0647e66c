"""Where a vLLM fleet's engines run (sampler.devices) and what the trainer's JAX is left with.

The host's GPUs are counted without starting JAX's CUDA backend (which would claim every visible GPU before the
engines get theirs): from the NVIDIA driver's /proc entries, else `nvidia-smi -L` when it is installed. Indices are
the host's (nvidia-smi's numbering); where the user set CUDA_VISIBLE_DEVICES, only those GPUs count as the host's.
`apply(sc)` then narrows the trainer to the GPUs no engine owns, before JAX's backend starts.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

from twocircuit_jax.config.base import ConfigError

_PROC_GPUS = "/proc/driver/nvidia/gpus/*"


def host_gpus() -> list[int]:
    """The host GPU indices this process may use (see the module doc); [] on a host without NVIDIA GPUs."""
    n = len(glob.glob(_PROC_GPUS))
    if not n and shutil.which("nvidia-smi"):
        try:  # bounded: a wedged driver must not hang the config check
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            n = 0
    gpus = list(range(n))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and n:
        try:
            gpus = [int(x) for x in visible.split(",") if x.strip()]
        except ValueError:  # UUIDs or MIG names: the indices of sampler.devices cannot be matched against them
            raise ConfigError(
                "sampler.devices",
                f"CUDA_VISIBLE_DEVICES={visible!r} names GPUs other than by index; unset it or list indices",
            ) from None
    return gpus


def trainer_gpus(sc, gpus: list[int] | None = None) -> list[int] | None:
    """The GPUs left to the trainer, or None when sampler.devices is not set (nothing is narrowed). ConfigError
    (naming sampler.devices) when a list names a GPU the host does not have, or no GPU is left for the trainer."""
    if sc.backend != "vllm" or not sc.devices:
        return None
    gpus = host_gpus() if gpus is None else gpus
    for k, lst in enumerate(sc.devices):
        missing = [d for d in lst if d not in gpus]
        if missing:
            raise ConfigError(
                "sampler.devices",
                f"engine {k} names GPU {missing[0]}, but this host has {len(gpus)} GPUs"
                + (f" ({gpus})" if gpus else "")
                + "; list GPUs the host has (nvidia-smi -L)",
            )
    owned = {d for lst in sc.devices for d in lst}
    left = [d for d in gpus if d not in owned]
    if not left:
        raise ConfigError(
            "sampler.devices",
            f"the engines take every GPU of this host ({gpus}); leave at least one for the trainer",
        )
    return left


def _backend_started() -> bool:
    """Whether JAX's backends are already initialised (then a visible-device change would have no effect). Read from
    jax's private registry: the public calls that answer it (jax.devices) would start the backend themselves."""
    import sys

    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(xb, "_backends", None))


def apply(sc) -> list[int] | None:
    """Check sampler.devices against this host and show the trainer's JAX only the GPUs no engine owns. Call it
    before the first JAX computation (the CLI does, right after the config is read; GRPOTrainer does on
    construction). ConfigError if JAX already started with other devices than these."""
    left = trainer_gpus(sc)
    if left is None:
        return None
    value = ",".join(map(str, left))
    if _backend_started():
        import jax

        seen = sorted({int(getattr(d, "id", -1)) for d in jax.devices() if d.platform == "gpu"})
        if len(seen) != len(left):
            raise ConfigError(
                "sampler.devices",
                f"JAX started before the engines' GPUs were set aside (it sees {len(seen)} GPUs, the trainer's "
                f"share is {left}); call twocircuit_jax.sampler.placement.apply(config.sampler) before using JAX",
            )
        return left
    import jax

    jax.config.update("jax_cuda_visible_devices", value)
    return left


def engine_env(devices) -> dict:
    """Environment of one engine process on `devices` (host GPU indices): {} when not placed."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))} if devices else {}
