"""Pallas kernel for the PRF mask (design §3.2, §3.6 "Kernels"), beside its pure-jnp reference.

out[n, j] = h[n, j] * keep[n, j] * gain[n], with keep regenerated in-kernel from the per-row key:
    u = mix(row_key[n] ^ j) >> 11, u' = u ^ flip[n] (antithetic), keep = keep_rule(u', thr[n], thr_j[n], j)
Per-row inputs (`MaskRows`) are computed in XLA outside the kernel: the row key after the position link, the
threshold (Bernoulli: floor(p 2^53) with thr_j = 2^32-1; exact-k: the k-th largest (u', -j), found by an XLA
sort because lax.sort/top_k have no Mosaic lowering), the antithetic flip and the stop-gradient gain.

Why a kernel: the mask is never materialised in HBM; the hash is recomputed where it is applied, forward and
backward. The backward message is grad * gain * m, i.e. the same kernel on the cotangent (custom_vjp), so
gradients match the reference exactly. `gain` is treated as a constant (stop-gradient), as rms_match requires.

Tiling: rows are padded to a multiple of `block_rows` and channels to a multiple of `block_cols` (power-of-two
blocks, full width when H is small) so no result depends on out-of-bounds reads (NaN in interpret mode).
The padding copy costs one extra pass over h when H or N is ragged; H % 128 == 0 with N % block_rows == 0 pads
nothing. Block defaults per target (pallas_kernels/platform.py): TPU and interpret mode up to [256, 512] (VMEM
holds it easily; fewer, larger steps); CUDA [16, 256] under Triton, whose blocks live in registers (each element
carries a dozen live uint32 temporaries of the hash, so a larger block would spill).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import platform as plat, prf


class MaskRows(NamedTuple):
    """Per-row (token) inputs of the mask kernel; N = B*T flattened tokens."""

    key_hi: jax.Array  # [N, 1] uint32, row key after the position link
    key_lo: jax.Array  # [N, 1] uint32
    thr_hi: jax.Array  # [N, 1] uint32, keep threshold on u (53 bits)
    thr_lo: jax.Array  # [N, 1] uint32
    thr_j: jax.Array  # [N, 1] uint32, tie-break index (2^32-1 for Bernoulli)
    flip: jax.Array  # [N, 1] uint32, 0 or 0xFFFFFFFF: antithetic u -> 2^53-1-u
    gain: jax.Array  # [N, 1] float32, g (constant, 1/(1-p) or rms_match factor); no gradient


def _keep(rows: MaskRows, j):
    """keep mask for row inputs broadcast against uint32 channel indices j."""
    u = prf.channel_u(prf.U64(rows.key_hi, rows.key_lo), j)
    u = prf.U64(u.hi ^ (rows.flip & prf.u32(0x1FFFFF)), u.lo ^ rows.flip)
    return prf.keep_rule(u, prf.U64(rows.thr_hi, rows.thr_lo), rows.thr_j, j)


def prf_mask_reference(h: jax.Array, rows: MaskRows) -> jax.Array:
    """Pure-jnp reference: h [N, H] -> h * keep * gain in h.dtype (computed in float32)."""
    j = jnp.arange(h.shape[-1], dtype=jnp.uint32)[None, :]
    keep = _keep(rows, j)
    g = jax.lax.stop_gradient(rows.gain)
    return jnp.where(keep, h.astype(jnp.float32) * g, 0.0).astype(h.dtype)


def _kernel(h_ref, khi_ref, klo_ref, thi_ref, tlo_ref, tj_ref, flip_ref, gain_ref, o_ref, *, block_cols):
    bn, bh = h_ref.shape
    col0 = pl.program_id(1) * block_cols
    j = (jax.lax.broadcasted_iota(jnp.int32, (bn, bh), 1) + col0).astype(jnp.uint32)
    rows = MaskRows(khi_ref[...], klo_ref[...], thi_ref[...], tlo_ref[...], tj_ref[...], flip_ref[...], gain_ref[...])
    keep = _keep(rows, j)
    x = h_ref[...].astype(jnp.float32)
    o_ref[...] = jnp.where(keep, x * rows.gain, 0.0).astype(o_ref.dtype)


def _blocks(tgt, n: int, h: int, block_rows, block_cols):
    if tgt == "cuda":
        cols = plat.pow2_divisor(h, 256)
        block_cols = block_cols or (cols if cols >= 32 else min(256, plat.pow2_at_least(h)))
        block_rows = block_rows or min(16, plat.pow2_at_least(n))
        if block_rows & (block_rows - 1) or block_cols & (block_cols - 1):
            raise ValueError(f"prf_mask kernel (cuda): blocks must be powers of two, got {block_rows}x{block_cols}")
        return block_rows, block_cols
    if block_cols is None:
        block_cols = next((b for b in (512, 256, 128) if h % b == 0), None) or min(512, plat.pow2_at_least(h))
    if block_rows is None:
        block_rows = min(256, max(8, plat.pow2_at_least(n)))
    return block_rows, block_cols


def _call(h, rows: MaskRows, interpret: bool, block_rows: int, block_cols: int, tgt):
    n, width = h.shape
    n_pad = -n % block_rows
    w_pad = -width % block_cols
    if n_pad or w_pad:
        h = jnp.pad(h, ((0, n_pad), (0, w_pad)))
        rows = MaskRows(*(jnp.pad(r, ((0, n_pad), (0, 0))) for r in rows))
    grid = (h.shape[0] // block_rows, h.shape[1] // block_cols)
    row_spec = pl.BlockSpec((block_rows, 1), lambda i, k: (i, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, block_cols=block_cols),
        out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
        grid=grid,
        in_specs=[pl.BlockSpec((block_rows, block_cols), lambda i, k: (i, k))] + [row_spec] * len(rows),
        out_specs=pl.BlockSpec((block_rows, block_cols), lambda i, k: (i, k)),
        interpret=interpret,
        name="prf_mask",
        compiler_params=plat.compiler_params(tgt, 2),
    )(h, *rows)
    return out[:n, :width]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _masked(h, rows, interpret, block_rows, block_cols, tgt):
    return _call(h, rows, interpret, block_rows, block_cols, tgt)


def _masked_fwd(h, rows, interpret, block_rows, block_cols, tgt):
    return _call(h, rows, interpret, block_rows, block_cols, tgt), rows


def _masked_bwd(interpret, block_rows, block_cols, tgt, rows, g):
    # backward wire message = g * gain * m: the same kernel on the cotangent; rows get no cotangent
    zero_rows = jax.tree.map(
        lambda r: jnp.zeros(r.shape, jax.dtypes.float0) if r.dtype != jnp.float32 else jnp.zeros_like(r), rows
    )
    return _call(g, rows, interpret, block_rows, block_cols, tgt), zero_rows


_masked.defvjp(_masked_fwd, _masked_bwd)


def prf_mask_kernel(
    h: jax.Array,
    rows: MaskRows,
    *,
    interpret: bool = False,
    block_rows: int | None = None,
    block_cols: int | None = None,
    platform: str | None = None,
) -> jax.Array:
    """Kernel version of `prf_mask_reference` (same values and gradients). h [N, H] float32/bfloat16.

    Raises RuntimeError on the CPU backend unless interpret=True or a lowering `platform` is named (export only):
    never a silent fallback."""
    tgt = plat.target(interpret, platform, "prf_mask_kernel")
    if h.ndim != 2:
        raise ValueError(f"prf_mask_kernel: h must be [N, H], got shape {h.shape}")
    block_rows, block_cols = _blocks(tgt, h.shape[0], h.shape[1], block_rows, block_cols)
    return _masked(h, rows, interpret, block_rows, block_cols, tgt)
