"""Starting `jax.distributed` for a run launched as several processes (one per host, or several on one host).

Where the process group comes from, first match wins:

1. explicit flags: `--coordinator HOST:PORT --num-processes N --process-id I` (all three, or none);
2. SLURM: `SLURM_NTASKS` > 1, i.e. inside `srun` with several tasks; JAX's own SLURM detection reads the rank,
   the task count and the first node of the step (coordinator port derived from the job id);
3. a TPU pod slice: `TPU_WORKER_HOSTNAMES` names more than one host, or `MEGASCALE_COORDINATOR_ADDRESS` is set;
   JAX asks the TPU runtime for the rest. `--distributed jax` forces this path (JAX's detection of any cluster it
   knows, e.g. a TPU VM whose worker list only the metadata server holds);
4. otherwise one process, and nothing is initialised.

`--distributed off` runs one process whatever the environment says. `--local-devices K` simulates K CPU devices in
each process (tests, or a laptop); it needs the CPU platform. Everything here must run before the first JAX
computation: the backend, its device count and its collectives are fixed when it starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from twocircuit_jax.config.base import ConfigError

MODES = ("auto", "jax", "off")


@dataclasses.dataclass(frozen=True)
class Launch:
    source: str  # "flags", "slurm", "tpu", "jax" (JAX's own detection) or "single"
    coordinator: Optional[str] = None  # HOST:PORT, "flags" only
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_devices: Optional[int] = None  # simulated CPU devices per process


def add_flags(parser) -> None:
    g = parser.add_argument_group("many processes (docs/scale.md)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address, reachable by all")
    g.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="this process, 0 .. N-1")
    g.add_argument("--local-devices", type=int, default=None, metavar="K", help="simulated CPU devices per process")
    g.add_argument(
        "--distributed",
        choices=MODES,
        default="auto",
        help="auto: the flags above, else SLURM or a TPU pod from the environment (default); jax: let "
        "jax.distributed.initialize() detect the cluster; off: one process",
    )


def resolve(args, env: Mapping[str, str] = os.environ) -> Launch:
    """The launch the flags and the environment describe. Raises ConfigError (naming the flag) on a bad combination."""
    explicit = {
        "--coordinator": args.coordinator,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    given = [k for k, v in explicit.items() if v is not None]
    k = args.local_devices
    if k is not None:
        if k < 1:
            raise ConfigError("--local-devices", f"got {k}; at least 1")
        plat = env.get("JAX_PLATFORMS", "")
        if plat not in ("", "cpu"):
            raise ConfigError("--local-devices", f"simulates CPU devices, but JAX_PLATFORMS={plat!r}")
    if given and args.distributed != "auto":
        raise ConfigError(given[0], f"explicit process flags need --distributed auto (got {args.distributed})")
    if given:
        if len(given) != 3:
            missing = [k for k in explicit if k not in given]
            raise ConfigError(given[0], f"needs {' and '.join(missing)} too (all three, or none)")
        n, i = args.num_processes, args.process_id
        if n < 1:
            raise ConfigError("--num-processes", f"got {n}; at least 1")
        if not 0 <= i < n:
            raise ConfigError("--process-id", f"got {i}; must be in 0 .. {n - 1} for --num-processes {n}")
        return Launch("flags", _check_address(args.coordinator), n, i, k)
    if args.distributed == "off":
        return Launch("single", local_devices=k)
    if args.distributed == "jax":
        return Launch("jax", local_devices=k)
    if _int(env, "SLURM_NTASKS") > 1:
        missing = [v for v in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST") if v not in env]
        if missing:  # SLURM_NTASKS alone is inherited by an sbatch script's own shell: not a task of a step
            raise ConfigError(
                "SLURM_NTASKS",
                f"is {env['SLURM_NTASKS']} but {', '.join(missing)} unset: start each task with srun, "
                "or pass --distributed off for one process",
            )
        return Launch("slurm", num_processes=_int(env, "SLURM_NTASKS"), process_id=_int(env, "SLURM_PROCID"))
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1 or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return Launch("tpu", local_devices=k)
    return Launch("single", local_devices=k)


def _int(env, name: str) -> int:
    v = env.get(name, "")
    if not v:
        return 0
    try:
        return int(v)
    except ValueError:
        raise ConfigError(name, f"got {v!r}; an integer") from None


def _check_address(addr: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("--coordinator", f"got {addr!r}; HOST:PORT with a port in 1 .. 65535")
    return addr


# XLA:CPU runs the independent collectives of one program concurrently, each holding a thread of a pool shared by
# every simulated device while it waits at its rendezvous. On 8 simulated devices a staged step (two circuits, the
# anchor firing) ended in that pool: seven devices waiting at a boundary `ppermute`, one at a `data` all-reduce, and
# the eighth device with no thread to reach either; XLA aborts after 40 s. Seen at steps 24 to 84 of 300 in four of
# five runs here. Without XLA's concurrency-optimised scheduler the same runs finish, with metrics bit-identical to
# the aborted runs' steps (the flag orders work; it changes no arithmetic). GPU and TPU backends ignore it.
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def cpu_xla_flags(env=os.environ) -> None:
    """Add CPU_SCHEDULER_FLAG to XLA_FLAGS unless the flag is set there already. XLA reads XLA_FLAGS when JAX starts
    its first backend: call before any JAX computation (the CLI does, in `initialize`)."""
    flags = env.get("XLA_FLAGS", "")
    if CPU_SCHEDULER_FLAG.split("=")[0] not in flags:
        env["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()


def initialize(launch: Launch) -> None:
    """Configure and start JAX for `launch`. Call once, before any JAX computation."""
    cpu_xla_flags()
    import jax

    if launch.local_devices is not None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", launch.local_devices)
    if launch.source == "single":
        return
    # Cross-process collectives on the CPU backend go through gloo over TCP (via the coordinator's key-value
    # store); without an implementation a multi-process CPU program has no way to all-reduce. GPU and TPU backends
    # ignore this setting. It is JAX 0.10's default, set here so an older default or a stray env cannot unset it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if launch.source == "flags":
        jax.distributed.initialize(launch.coordinator, launch.num_processes, launch.process_id)
    elif launch.source == "slurm":
        jax.distributed.initialize(cluster_detection_method="slurm")
    else:  # "tpu", "jax": JAX's detection finds the coordinator, the count and the rank
        jax.distributed.initialize()


def is_primary() -> bool:
    """The process that writes run-level files (metrics, exports, config): process 0."""
    import jax

    return jax.process_index() == 0
