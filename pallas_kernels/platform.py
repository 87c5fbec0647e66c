"""Which accelerator a Pallas kernel is built for, and the compiler parameters that go with it.

A kernel's tiling depends on its target: Mosaic TPU wants VMEM-sized blocks whose last two dims are multiples of
(8, 128) or the full array dims; Pallas Triton (CUDA) wants every in-kernel array to have power-of-two dims and small
enough blocks to live in registers. The target is
  - `platform` when given ("cuda" or "tpu"): the kernel is built for that platform whatever the local backend is.
    This only makes lowering possible (jax.export for another platform, on a CPU host); running such a kernel on the
    CPU backend still fails, in jax's own pallas_call lowering ("Only interpret mode is supported on CPU backend").
  - otherwise the local backend: "gpu" -> "cuda", "tpu" -> "tpu"; on "cpu" a kernel needs interpret=True and this
    raises otherwise (there is no silent fallback to the jnp references).
In interpret mode the target only picks the tiling (so a CUDA-tiled kernel can be checked on CPU); `None` there
means the TPU tiling, whose block shapes are also the natural ones for the interpreter.

On CUDA the Triton backend is chosen explicitly: jax 0.10 lowers a plain `pallas_call` with Mosaic GPU, which
stages whole blocks through shared memory (a [256, 512] f32 mask block alone exceeds the H200's 227 KiB) and is
deprecated for `pallas_call` in favour of `plgpu.kernel`.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu, triton as pltriton

PLATFORMS = ("cuda", "tpu")
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"  # what a Pallas Triton kernel lowers to (the export tests look for it)
TPU_CUSTOM_CALL = "tpu_custom_call"  # what a Mosaic TPU kernel lowers to
# Scoped VMEM a TPU kernel's double-buffered blocks may use: below the 16 MiB default limit of v4/v5e, so the
# kernels compile without raising vmem_limit_bytes on any current TPU generation.
TPU_VMEM_BUDGET = 12 * 1024 * 1024


def target(interpret: bool, platform: str | None, what: str) -> str | None:
    """The platform `what` is tiled for (None: interpret mode with the default tiling). Raises on the CPU backend
    without interpret mode or an explicit lowering platform."""
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"{what}: platform {platform!r} is not supported; allowed {', '.join(PLATFORMS)} or None")
    if interpret or platform is not None:
        return platform
    backend = jax.default_backend()
    if backend == "cpu":
        raise RuntimeError(
            f"{what}: the Pallas kernel cannot be compiled on the CPU backend. Pass interpret=True (tests), set "
            "use_kernel=false to use the jnp reference, or pass platform='cuda'/'tpu' to lower it for export only; "
            "there is no silent fallback."
        )
    if backend == "gpu":
        return "cuda"
    if backend == "tpu":
        return "tpu"
    raise RuntimeError(f"{what}: no Pallas kernel tiling for backend {backend!r}; allowed gpu (CUDA), tpu")


def compiler_params(tgt: str | None, n_grid: int, *, num_warps: int = 4):
    """Per-target compiler parameters: Triton's (which also selects the Triton backend on CUDA), or Mosaic TPU's
    with every grid axis parallel (row blocks are independent, so megacore chips may split them)."""
    if tgt == "cuda":
        return pltriton.CompilerParams(num_warps=num_warps, num_stages=2)
    if tgt == "tpu":
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_grid)
    return None


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n (1 when n is odd)."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def round_up(x: int, m: int) -> int:
    return -(-int(x) // m) * m
