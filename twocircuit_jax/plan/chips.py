"""The accelerator table of `twocircuit plan`: one row per chip, each number with its public source.

Units: bytes, FLOP/s, bytes/s, all per chip. A jax TPU device is one chip (v5p's two TensorCores form one megacore
device), so per chip is per device. HBM: Google's pages say "GB" for v5e and v6e and "GiB" for v5p; the chips carry
power-of-two HBM stacks, so all three are read as GiB (the compiler's own limit is a little below that). Interconnect:
the bidirectional ICI bandwidth per chip, the most a chip can move per second: dividing collective bytes by it gives a
lower bound on their time, never an estimate of it.

Sources (Google Cloud TPU documentation, system-architecture tables):
  v5e  "TPU v5e", https://cloud.google.com/tpu/docs/v5e : 197 TFLOPs bf16; 16 GB HBM2 at 819 GBps;
       bidirectional ICI 400 GBps per chip (1600 Gbps per direction)
  v5p  "TPU v5p", https://cloud.google.com/tpu/docs/v5p-training : 459 TFLOPs bf16; 95 GiB HBM2e at 2765 GBps;
       2 TensorCores per chip; bidirectional ICI 1200 GBps per chip (4800 Gbps)
  v6e  "TPU v6e", https://cloud.google.com/tpu/docs/v6e : 918 TFLOPs bf16; 32 GB HBM at 1600 GBps (an older revision
       of the page said 1640); bidirectional ICI 800 GBps per chip (3200 Gbps)
GPUs are not listed: nothing on this host can compile for them (`twocircuit plan` refuses gpu:* targets).
"""

from __future__ import annotations

from typing import NamedTuple

GiB = 2**30


class Chip(NamedTuple):
    name: str  # jax's device_kind for it
    hbm_bytes: float  # per chip
    peak_bf16_flops: float  # FLOP/s, dense bf16
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # bidirectional inter-chip interconnect per chip
    source: str


CHIPS = {
    "v5e": Chip("TPU v5 lite", 16 * GiB, 197e12, 819e9, 400e9, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("TPU v5", 95 * GiB, 459e12, 2765e9, 1200e9, "https://cloud.google.com/tpu/docs/v5p-training"),
    "v6e": Chip("TPU v6 lite", 32 * GiB, 918e12, 1600e9, 800e9, "https://cloud.google.com/tpu/docs/v6e"),
}


class TpuSlice(NamedTuple):
    chip: str  # key of CHIPS
    topology: str  # jax.experimental.topologies name
    bounds: tuple  # chips_per_host_bounds
    chips: int


# Cloud TPU accelerator types. v5p-N counts TensorCores (2 per chip): v5p-8 is 4 chips.
SLICES = {
    "v5e-4": TpuSlice("v5e", "v5e:2x2", (2, 2, 1), 4),
    "v5e-8": TpuSlice("v5e", "v5e:2x4", (2, 4, 1), 8),
    "v5p-8": TpuSlice("v5p", "v5p:2x2x1", (2, 2, 1), 4),
    "v5p-16": TpuSlice("v5p", "v5p:2x2x2", (2, 2, 2), 8),
    "v6e-4": TpuSlice("v6e", "v6e:2x2", (2, 2, 1), 4),
    "v6e-8": TpuSlice("v6e", "v6e:2x4", (2, 4, 1), 8),
}
