"""Error-feedback projection kernel of gradient PowerSGD (design §3.5): P = (G + E)·Q, beside its jnp reference.

G [n, m] is the replica's gradient (any float dtype), E [n, m] the fp32 error memory, Q [m, r] fp32; P [n, r] is
fp32. Fusing the add into the matmul saves one [n, m] fp32 write and read per leaf per tick (M = G + E is still
formed later for Mᵀ·P̂ and the new error, but it never round-trips through HBM before the projection).

Rows of G/E are tiled; Q stays whole (m·r small) and enters transposed, [r, m], so its long side is the lane
dimension (a [m, 8] Q would pad each row to 128 lanes of TPU VMEM). Ragged n is zero-padded in the wrapper and
sliced after, so no result depends on out-of-bounds reads (NaN in interpret mode). Stacked leaves [L, n, m] are one
grid axis more. Not differentiated: PowerSGD runs on gradients, after autodiff.

Tiling per target (pallas_kernels/platform.py): TPU and interpret mode take [bn, m] blocks and one product, bn
bounded by the VMEM budget; CUDA (Pallas Triton: power-of-two arrays, register-sized tiles) pads r to a power of
two >= 16 and walks m in power-of-two chunks, accumulating in fp32 (same sum, another summation order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import platform as plat
from pallas_kernels.lowrank import call_kernel

_DN_T = (((1,), (1,)), ((), ()))  # x[bn, m] · qt[r, m] -> [bn, r]: contract the last dims


def ef_project_reference(G: jax.Array, E: jax.Array, Q: jax.Array) -> jax.Array:
    """P = (G + E)·Q in fp32. G, E [.., n, m], Q [.., m, r] -> [.., n, r] f32 (leading dims batched)."""
    M = G.astype(jnp.float32) + E.astype(jnp.float32)
    return jnp.einsum("...nm,...mr->...nr", M, Q.astype(jnp.float32), preferred_element_type=jnp.float32)


def _kernel(g_ref, e_ref, qt_ref, p_ref, *, mc):
    m = g_ref.shape[-1]

    def part(sl):
        x = g_ref[:, sl].astype(jnp.float32) + e_ref[:, sl].astype(jnp.float32)
        return jax.lax.dot_general(x, qt_ref[:, sl].astype(jnp.float32), _DN_T, preferred_element_type=jnp.float32)

    if mc == m:
        p_ref[...] = part(slice(None))
        return
    acc = jax.lax.fori_loop(
        0, m // mc, lambda c, a: a + part(pl.ds(pl.multiple_of(c * mc, mc), mc)), jnp.zeros(p_ref.shape, jnp.float32)
    )
    p_ref[...] = acc


def _tiling(tgt, n: int, m: int, r: int, item: int, block_rows):
    """(bn, m_pad, r_pad, mc): row block, padded widths and the m chunk the kernel walks."""
    if tgt == "cuda":
        bn = block_rows or 32
        if bn & (bn - 1) or bn < 16:
            raise ValueError(f"ef_project kernel (cuda): block_rows must be a power of two >= 16, got {bn}")
        bn = min(bn, plat.pow2_at_least(max(n, 16)))
        mp = m if plat.pow2_divisor(m, 128) >= 16 else plat.round_up(m, 16)  # ragged m: zero-padded (one copy)
        return bn, mp, max(16, plat.pow2_at_least(r)), plat.pow2_divisor(mp, 128)
    bn = min(block_rows or 128, plat.round_up(max(n, 1), 16))
    if tgt == "tpu":  # double-buffered G, E (and P) blocks plus Qᵀ within the VMEM budget
        per_row = 2 * (2 * m * item + 128 * 4)
        fit = (plat.TPU_VMEM_BUDGET - 2 * plat.round_up(r, 8) * m * 4) // per_row // 16 * 16
        if fit < 16:
            raise ValueError(f"ef_project kernel (tpu): m={m}, r={r} leave no 16-row block within the VMEM budget")
        bn = min(bn, fit)
    return bn, m, r, m


def _ef_project_3d(G, E, Q, interpret, block_rows, tgt):
    L, n, m = G.shape
    r = Q.shape[-1]
    item = max(G.dtype.itemsize, E.dtype.itemsize)
    bn, mp, rp, mc = _tiling(tgt, n, m, r, item, block_rows)
    n_pad = plat.round_up(max(n, 1), bn)
    if (n_pad, mp) != (n, m):
        G = jnp.pad(G, ((0, 0), (0, n_pad - n), (0, mp - m)))
        E = jnp.pad(E, ((0, 0), (0, n_pad - n), (0, mp - m)))
    Qt = jnp.pad(jnp.swapaxes(Q, -1, -2), ((0, 0), (0, rp - r), (0, mp - m)))
    (P,) = call_kernel(
        functools.partial(_kernel, mc=mc),
        grid=(L, n_pad // bn),
        in_specs=[
            pl.BlockSpec((None, bn, mp), lambda l, i: (l, i, 0)),
            pl.BlockSpec((None, bn, mp), lambda l, i: (l, i, 0)),
            pl.BlockSpec((None, rp, mp), lambda l, i: (l, 0, 0)),
        ],
        out_specs=[pl.BlockSpec((None, bn, rp), lambda l, i: (l, i, 0))],
        out_shapes=[((L, n_pad, rp), jnp.float32)],
        args=(G, E, Qt),
        interpret=interpret,
        name="powersgd_ef_project",
        compiler_params=plat.compiler_params(tgt, 2),
    )
    return P[:, :n, :r]


def ef_project(
    G: jax.Array,
    E: jax.Array,
    Q: jax.Array,
    *,
    interpret: bool = False,
    block_rows: int | None = None,
    platform: str | None = None,
) -> jax.Array:
    """Kernel P = (G + E)·Q. Accepts [n, m] or stacked [L, n, m] (with Q [m, r] or [L, m, r]). `platform` names a
    lowering target (export only) when the local backend is not it; block_rows None: the target's default."""
    tgt = plat.target(interpret, platform, "ef_project")
    if G.shape != E.shape or G.shape[-1] != Q.shape[-2]:
        raise ValueError(f"ef_project: expected G, E [.., n, m] and Q [.., m, r]; got {G.shape}, {E.shape}, {Q.shape}")
    if G.ndim == 2:
        return _ef_project_3d(G[None], E[None], Q[None], interpret, block_rows, tgt)[0]
    if G.ndim == 3:
        Q = Q if Q.ndim == 3 else jnp.broadcast_to(Q, (G.shape[0],) + Q.shape)
        return _ef_project_3d(G, E, Q, interpret, block_rows, tgt)
    raise ValueError(f"ef_project: expected a 2-D or stacked 3-D leaf; got {G.shape}")
