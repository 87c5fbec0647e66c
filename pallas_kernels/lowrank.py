"""Fused low-rank project / reconstruct kernel (design §3.3): Y = M·Q, M̂ = Y·Qᵀ, beside its jnp reference.

Rounding contract (kernel and reference agree bit for bit in interpret mode): Q is cast to the activation dtype,
each product accumulates in fp32 (`preferred_element_type`) and is rounded to the activation dtype, so the wire
message Y really is activation-dtype data, as it would be on a pipeline link.

The kernel tiles rows of M (N tokens) and keeps Q whole in VMEM/SMEM: H·r is small (1536×77 f32 = 473 KB).
Ragged N is padded with zeros inside the wrapper and sliced off after, so no block ever reads past the array
(interpret mode would return NaN there; hardware would return garbage). Block sizes equal to the full H and r
dims are always legal tile shapes, so only N needs padding.

Differentiation: `project_reconstruct` has a custom VJP. For M̂ = M·Q·Qᵀ the cotangent of M is g·Q·Qᵀ, which is
the same fused kernel applied to g (one kernel, no second design); the cotangent of Q (zero in the codec, where Q
is stop-gradient, but kept correct for other users) is Mᵀ(gQ) + gᵀ(MQ), computed in fp32 with jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_DN_T = (((1,), (1,)), ((), ()))  # contract the last dims: y[bn, r] · q[H, r] -> [bn, H] without a transpose


def check_can_run(interpret: bool, what: str) -> None:
    """Raise when a compiled Pallas kernel is requested where it cannot run (CPU without interpret mode)."""
    if not interpret and jax.default_backend() == "cpu":
        raise RuntimeError(
            f"{what}: the Pallas kernel cannot be compiled on the CPU backend. Pass interpret=True (tests) or set "
            "use_kernel=false to use the jnp reference; there is no silent fallback."
        )


def match_vma(*xs):
    """Cast inputs to vary over the union of their manual axes: inside a pallas body a replicated Q times a
    per-replica block must type-check under shard_map's check_vma (no data moves; a no-op outside shard_map)."""
    axes = frozenset().union(*(jax.typeof(x).mat.varying for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(axes - jax.typeof(x).mat.varying))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return out, axes


def call_kernel(kernel, *, grid, in_specs, out_specs, out_shapes, args, interpret, name):
    """pallas_call that also type-checks inside `jax.shard_map(check_vma=True)` (jax 0.10, version pinned).

    Outputs are declared varying over the union of the inputs' manual axes. Interpret mode on jax 0.10 seeds its
    output loop carry with an invariant buffer, which check_vma rejects; there (only) each output gets a varying
    zero buffer aliased in through input_output_aliases. Cost: one output-sized zero fill, interpret mode only.
    """
    args, axes = match_vma(*args)
    mat = jax.typeof(args[0]).mat
    structs = [jax.ShapeDtypeStruct(s, d, manual_axis_type=mat) for s, d in out_shapes]
    if not (interpret and axes):
        return pl.pallas_call(
            kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=structs, interpret=interpret, name=name
        )(*args)
    k_in = len(args)
    seeds = [jax.lax.pcast(jnp.zeros(s, d), tuple(sorted(axes)), to="varying") for s, d in out_shapes]

    def body(*refs):  # drop the aliased seed refs: the kernel writes its outputs, never reads them
        kernel(*refs[:k_in], *refs[k_in + len(seeds) :])

    return pl.pallas_call(
        body,
        grid=grid,
        in_specs=list(in_specs) + list(out_specs),
        out_specs=out_specs,
        out_shape=structs,
        interpret=interpret,
        name=name,
        input_output_aliases={k_in + i: i for i in range(len(seeds))},
    )(*args, *seeds)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def lowrank_reference(M: jax.Array, Q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference. M [N, H] (activation dtype), Q [H, r] f32 -> (Y [N, r], M̂ [N, H]) in M's dtype."""
    Qc = Q.astype(M.dtype)
    Y = jnp.dot(M, Qc, preferred_element_type=jnp.float32).astype(M.dtype)
    Mh = jax.lax.dot_general(Y, Qc, _DN_T, preferred_element_type=jnp.float32).astype(M.dtype)
    return Y, Mh


def _kernel(m_ref, q_ref, y_ref, mh_ref):
    m = m_ref[...]
    q = q_ref[...].astype(m.dtype)
    y = jnp.dot(m, q, preferred_element_type=jnp.float32).astype(y_ref.dtype)
    y_ref[...] = y
    mh_ref[...] = jax.lax.dot_general(y, q, _DN_T, preferred_element_type=jnp.float32).astype(mh_ref.dtype)


def lowrank_fused(
    M: jax.Array, Q: jax.Array, *, interpret: bool = False, block_rows: int = 128
) -> tuple[jax.Array, jax.Array]:
    """Kernel version of `lowrank_reference` (not differentiable; see `project_reconstruct`)."""
    check_can_run(interpret, "lowrank_fused")
    if M.ndim != 2 or Q.ndim != 2 or M.shape[1] != Q.shape[0]:
        raise ValueError(f"lowrank_fused: expected M [N, H] and Q [H, r]; got {M.shape} and {Q.shape}")
    N, H = M.shape
    r = Q.shape[1]
    bn = min(block_rows, _round_up(max(N, 1), 16))  # 16: bf16 sublane packing
    Np = _round_up(max(N, 1), bn)
    Mp = jnp.pad(M, ((0, Np - N), (0, 0))) if Np != N else M
    Y, Mh = call_kernel(
        _kernel,
        grid=(Np // bn,),
        in_specs=[pl.BlockSpec((bn, H), lambda i: (i, 0)), pl.BlockSpec((H, r), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((bn, r), lambda i: (i, 0)), pl.BlockSpec((bn, H), lambda i: (i, 0))],
        out_shapes=[((Np, r), M.dtype), ((Np, H), M.dtype)],
        args=(Mp, Q),
        interpret=interpret,
        name="lowrank_project_reconstruct",
    )
    return Y[:N], Mh[:N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _pr(M, Q, interpret, block_rows):
    return lowrank_fused(M, Q, interpret=interpret, block_rows=block_rows)[1]


def _pr_fwd(M, Q, interpret, block_rows):
    return _pr(M, Q, interpret, block_rows), (M, Q)


def _pr_bwd(interpret, block_rows, res, g):
    M, Q = res
    dM = lowrank_fused(g.astype(M.dtype), Q, interpret=interpret, block_rows=block_rows)[1]
    M32, g32, Q32 = M.astype(jnp.float32), g.astype(jnp.float32), Q.astype(jnp.float32)
    dQ = M32.T @ (g32 @ Q32) + g32.T @ (M32 @ Q32)
    return dM, dQ.astype(Q.dtype)


_pr.defvjp(_pr_fwd, _pr_bwd)


def project_reconstruct(M: jax.Array, Q: jax.Array, *, interpret: bool = False, block_rows: int = 128) -> jax.Array:
    """Differentiable M̂ = (M·Q)·Qᵀ through the fused kernel. M [..., H] -> M̂ [..., H] in M's dtype."""
    check_can_run(interpret, "project_reconstruct")
    lead = M.shape[:-1]
    out = _pr(M.reshape(-1, M.shape[-1]), Q, interpret, block_rows)
    return out.reshape(*lead, M.shape[-1])
