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

GPUs (GPUS) are here only for the vLLM sampler's engines (plan/engines.py): nothing on this host compiles for them, so
`--topology gpu:*` stays refused. NVIDIA's datasheets write decimal units: GB = 1e9 bytes, TB/s = 1e12 bytes/s. For
capacity that is the cautious reading: the HBM parts carry power-of-two stacks and show the driver about as many GiB
as the datasheet says GB (an H100 80GB about 80 GiB), so the engine rows planned from these numbers undercount a little. The datasheets quote the
tensor-core rates with 2:4 sparsity; the dense rate is half of that, and is what is listed. fp32 is the plain
(CUDA core, no TF32) rate: PyTorch's default for float32 matmuls, which a float32 engine runs. Link: NVLink per GPU,
bidirectional; the L40S has none, so its PCIe Gen4 x16 link stands in (the engines do not use it).
  h100-80gb  "NVIDIA H100 Tensor Core GPU", https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM column):
             80 GB HBM3 at 3.35 TB/s; BF16 tensor 1,979 TFLOPS with sparsity (989 dense); FP32 67 TFLOPS;
             NVLink 900 GB/s
  h200       "NVIDIA H200 Tensor Core GPU", https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM column):
             141 GB HBM3e at 4.8 TB/s; BF16 tensor 1,979 TFLOPS with sparsity (989 dense); FP32 67 TFLOPS;
             NVLink 900 GB/s
  a100-80gb  "NVIDIA A100 Tensor Core GPU", https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB SXM column):
             80 GB HBM2e at 2,039 GB/s; BF16 tensor 312 TFLOPS dense (624 with sparsity); FP32 19.5 TFLOPS;
             NVLink 600 GB/s
  l40s       "NVIDIA L40S GPU", https://www.nvidia.com/en-us/data-center/l40s/ : 48 GB GDDR6 at 864 GB/s; BF16 tensor
             362.05 TFLOPS dense (733 with sparsity); FP32 91.6 TFLOPS; PCIe Gen4 x16 64 GB/s bidirectional
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


class GpuChip(NamedTuple):
    name: str  # NVIDIA's product name
    memory_bytes: float  # per GPU (HBM, or GDDR6 on the L40S)
    peak_bf16_flops: float  # FLOP/s, dense bf16 tensor cores
    peak_fp32_flops: float  # FLOP/s, plain fp32 (no TF32)
    memory_bytes_per_s: float
    link_bytes_per_s: float  # bidirectional NVLink per GPU (L40S: PCIe); not used by the engine plan
    source: str


GB = 1e9  # NVIDIA's datasheets count in decimal units

GPUS = {
    "h100-80gb": GpuChip(
        "NVIDIA H100 SXM 80GB",
        80 * GB,
        989e12,
        67e12,
        3.35e12,
        900 * GB,
        "https://www.nvidia.com/en-us/data-center/h100/",
    ),
    "h200": GpuChip(
        "NVIDIA H200 SXM", 141 * GB, 989e12, 67e12, 4.8e12, 900 * GB, "https://www.nvidia.com/en-us/data-center/h200/"
    ),
    "a100-80gb": GpuChip(
        "NVIDIA A100 80GB SXM",
        80 * GB,
        312e12,
        19.5e12,
        2039 * GB,
        600 * GB,
        "https://www.nvidia.com/en-us/data-center/a100/",
    ),
    "l40s": GpuChip(
        "NVIDIA L40S", 48 * GB, 362.05e12, 91.6e12, 864 * GB, 64 * GB, "https://www.nvidia.com/en-us/data-center/l40s/"
    ),
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
