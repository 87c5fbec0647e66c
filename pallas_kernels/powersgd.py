"""Error-feedback projection kernel of gradient PowerSGD (design §3.5): P = (G + E)·Q, beside its jnp reference.

G [n, m] is the replica's gradient (any float dtype), E [n, m] the fp32 error memory, Q [m, r] fp32; P [n, r] is
fp32. Fusing the add into the matmul saves one [n, m] fp32 write and read per leaf per tick (M = G + E is still
formed later for Mᵀ·P̂ and the new error, but it never round-trips through HBM before the projection).

Rows of G/E are tiled; Q stays whole (m·r small). Ragged n is zero-padded in the wrapper and sliced after, so no
result depends on out-of-bounds reads (NaN in interpret mode). Stacked leaves [L, n, m] go through `jax.vmap`.
Not differentiated: PowerSGD runs on gradients, after autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.lowrank import call_kernel, check_can_run


def ef_project_reference(G: jax.Array, E: jax.Array, Q: jax.Array) -> jax.Array:
    """P = (G + E)·Q in fp32. G, E [.., n, m], Q [.., m, r] -> [.., n, r] f32 (leading dims batched)."""
    M = G.astype(jnp.float32) + E.astype(jnp.float32)
    return jnp.einsum("...nm,...mr->...nr", M, Q.astype(jnp.float32), preferred_element_type=jnp.float32)


def _kernel(g_ref, e_ref, q_ref, p_ref):
    m = g_ref[...].astype(jnp.float32) + e_ref[...].astype(jnp.float32)
    p_ref[...] = jnp.dot(m, q_ref[...].astype(jnp.float32), preferred_element_type=jnp.float32)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _ef_project_2d(G, E, Q, interpret, block_rows):
    n, m = G.shape
    r = Q.shape[1]
    bn = min(block_rows, _round_up(max(n, 1), 16))
    n_pad = _round_up(max(n, 1), bn)
    if n_pad != n:
        G = jnp.pad(G, ((0, n_pad - n), (0, 0)))
        E = jnp.pad(E, ((0, n_pad - n), (0, 0)))
    (P,) = call_kernel(
        _kernel,
        grid=(n_pad // bn,),
        in_specs=[
            pl.BlockSpec((bn, m), lambda i: (i, 0)),
            pl.BlockSpec((bn, m), lambda i: (i, 0)),
            pl.BlockSpec((m, r), lambda i: (0, 0)),
        ],
        out_specs=[pl.BlockSpec((bn, r), lambda i: (i, 0))],
        out_shapes=[((n_pad, r), jnp.float32)],
        args=(G, E, Q),
        interpret=interpret,
        name="powersgd_ef_project",
    )
    return P[:n]


def ef_project(
    G: jax.Array, E: jax.Array, Q: jax.Array, *, interpret: bool = False, block_rows: int = 128
) -> jax.Array:
    """Kernel P = (G + E)·Q. Accepts [n, m] or stacked [L, n, m] (with Q [m, r] or [L, m, r])."""
    check_can_run(interpret, "ef_project")
    if G.shape != E.shape or G.shape[-1] != Q.shape[-2]:
        raise ValueError(f"ef_project: expected G, E [.., n, m] and Q [.., m, r]; got {G.shape}, {E.shape}, {Q.shape}")
    if G.ndim == 2:
        return _ef_project_2d(G, E, Q, interpret, block_rows)
    if G.ndim == 3:
        return jax.vmap(lambda g, e, q: _ef_project_2d(g, e, q, interpret, block_rows))(G, E, Q)
    raise ValueError(f"ef_project: expected a 2-D or stacked 3-D leaf; got {G.shape}")
