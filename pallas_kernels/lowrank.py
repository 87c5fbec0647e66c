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

Tiling per target (pallas_kernels/platform.py). TPU and interpret mode: the block is [bn, H] with Q whole and one
product each way, bn bounded by the VMEM budget. CUDA (Pallas Triton, which needs power-of-two arrays and register-
sized tiles): r is zero-padded to a power of two >= 16 (zero columns of Q add nothing to either product, and the
padded Y columns are sliced off), and the kernel walks H in power-of-two chunks: Y accumulates over the chunks in
fp32, then each chunk of M̂ is one Y·Q_chunkᵀ product. The chunked sum differs from the single product only in fp32
summation order, so the CUDA tiling matches the reference to round-off, not bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import platform as plat

_DN_T = (((1,), (1,)), ((), ()))  # contract the last dims: y[bn, r] · q[H, r] -> [bn, H] without a transpose


def check_can_run(interpret: bool, what: str, platform: str | None = None) -> None:
    """Raise when a compiled Pallas kernel is requested where it cannot run (CPU without interpret mode), unless an
    explicit lowering `platform` is named (pallas_kernels/platform.py)."""
    plat.target(interpret, platform, what)


def match_vma(*xs):
    """Cast inputs to vary over the union of their manual axes: inside a pallas body a replicated Q times a
    per-replica block must type-check under shard_map's check_vma (no data moves; a no-op outside shard_map)."""
    axes = frozenset().union(*(jax.typeof(x).mat.varying for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(axes - jax.typeof(x).mat.varying))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return out, axes


def call_kernel(kernel, *, grid, in_specs, out_specs, out_shapes, args, interpret, name, compiler_params=None):
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
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=structs,
            interpret=interpret,
            name=name,
            compiler_params=compiler_params,
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
        compiler_params=compiler_params,
        input_output_aliases={k_in + i: i for i in range(len(seeds))},
    )(*args, *seeds)


def lowrank_reference(M: jax.Array, Q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference. M [N, H] (activation dtype), Q [H, r] f32 -> (Y [N, r], M̂ [N, H]) in M's dtype."""
    Qc = Q.astype(M.dtype)
    Y = jnp.dot(M, Qc, preferred_element_type=jnp.float32).astype(M.dtype)
    Mh = jax.lax.dot_general(Y, Qc, _DN_T, preferred_element_type=jnp.float32).astype(M.dtype)
    return Y, Mh


def _kernel(m_ref, q_ref, y_ref, mh_ref, *, hc):
    H = m_ref.shape[1]
    dt = m_ref.dtype
    if hc == H:  # one chunk: the reference's two products as they are
        m = m_ref[...]
        q = q_ref[...].astype(dt)
        y = jnp.dot(m, q, preferred_element_type=jnp.float32).astype(y_ref.dtype)
        y_ref[...] = y
        mh_ref[...] = jax.lax.dot_general(y, q, _DN_T, preferred_element_type=jnp.float32).astype(mh_ref.dtype)
        return

    def chunk(c):
        return pl.ds(pl.multiple_of(c * hc, hc), hc)

    def project(c, acc):
        sl = chunk(c)
        return acc + jnp.dot(m_ref[:, sl], q_ref[sl, :].astype(dt), preferred_element_type=jnp.float32)

    y = jax.lax.fori_loop(0, H // hc, project, jnp.zeros(y_ref.shape, jnp.float32)).astype(y_ref.dtype)
    y_ref[...] = y

    def reconstruct(c, carry):
        sl = chunk(c)
        q = q_ref[sl, :].astype(dt)
        mh_ref[:, sl] = jax.lax.dot_general(y, q, _DN_T, preferred_element_type=jnp.float32).astype(mh_ref.dtype)
        return carry

    jax.lax.fori_loop(0, H // hc, reconstruct, 0)


def _tiling(tgt, N: int, H: int, r: int, item: int, block_rows):
    """(bn, H_pad, r_pad, hc) for the target: row block, padded widths and the H chunk the kernel walks."""
    if tgt == "cuda":
        bn = block_rows or 32
        if bn & (bn - 1) or bn < 16:
            raise ValueError(f"lowrank kernel (cuda): block_rows must be a power of two >= 16, got {bn}")
        bn = min(bn, plat.pow2_at_least(max(N, 16)))
        # Triton: power-of-two chunks of H, 16 at least (its dot's minimum); a ragged H is zero-padded (one copy)
        Hp = H if plat.pow2_divisor(H, 128) >= 16 else plat.round_up(H, 16)
        return bn, Hp, max(16, plat.pow2_at_least(r)), plat.pow2_divisor(Hp, 128)
    bn = min(block_rows or 128, plat.round_up(max(N, 1), 16))  # 16: bf16 sublane packing
    if tgt == "tpu":  # double-buffered M, M̂ and Y blocks plus Q (lanes padded to 128) within the VMEM budget
        lanes = plat.round_up(r, 128)
        per_row = 2 * (2 * H + lanes) * item
        fit = (plat.TPU_VMEM_BUDGET - 2 * H * lanes * 4) // per_row // 16 * 16
        if fit < 16:
            raise ValueError(f"lowrank kernel (tpu): H={H}, r={r} leave no 16-row block within the VMEM budget")
        bn = min(bn, fit)
    return bn, H, r, H


def lowrank_fused(
    M: jax.Array, Q: jax.Array, *, interpret: bool = False, block_rows: int | None = None, platform: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Kernel version of `lowrank_reference` (not differentiable; see `project_reconstruct`). `platform` names a
    lowering target (export only) when the local backend is not it; block_rows None: the target's default."""
    tgt = plat.target(interpret, platform, "lowrank_fused")
    if M.ndim != 2 or Q.ndim != 2 or M.shape[1] != Q.shape[0]:
        raise ValueError(f"lowrank_fused: expected M [N, H] and Q [H, r]; got {M.shape} and {Q.shape}")
    N, H = M.shape
    r = Q.shape[1]
    bn, Hp, rp, hc = _tiling(tgt, N, H, r, M.dtype.itemsize, block_rows)
    Np = plat.round_up(max(N, 1), bn)
    Mp = jnp.pad(M, ((0, Np - N), (0, Hp - H))) if (Np, Hp) != (N, H) else M
    Qp = jnp.pad(Q, ((0, Hp - H), (0, rp - r))) if (Hp, rp) != (H, r) else Q
    Y, Mh = call_kernel(
        functools.partial(_kernel, hc=hc),
        grid=(Np // bn,),
        in_specs=[pl.BlockSpec((bn, Hp), lambda i: (i, 0)), pl.BlockSpec((Hp, rp), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((bn, rp), lambda i: (i, 0)), pl.BlockSpec((bn, Hp), lambda i: (i, 0))],
        out_shapes=[((Np, rp), M.dtype), ((Np, Hp), M.dtype)],
        args=(Mp, Qp),
        interpret=interpret,
        name="lowrank_project_reconstruct",
        compiler_params=plat.compiler_params(tgt, 1),
    )
    return Y[:N, :r], Mh[:N, :H]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _pr(M, Q, interpret, block_rows, platform):
    return lowrank_fused(M, Q, interpret=interpret, block_rows=block_rows, platform=platform)[1]


def _pr_fwd(M, Q, interpret, block_rows, platform):
    return _pr(M, Q, interpret, block_rows, platform), (M, Q)


def _pr_bwd(interpret, block_rows, platform, res, g):
    M, Q = res
    dM = lowrank_fused(g.astype(M.dtype), Q, interpret=interpret, block_rows=block_rows, platform=platform)[1]
    M32, g32, Q32 = M.astype(jnp.float32), g.astype(jnp.float32), Q.astype(jnp.float32)
    dQ = M32.T @ (g32 @ Q32) + g32.T @ (M32 @ Q32)
    return dM, dQ.astype(Q.dtype)


_pr.defvjp(_pr_fwd, _pr_bwd)


def project_reconstruct(
    M: jax.Array, Q: jax.Array, *, interpret: bool = False, block_rows: int | None = None, platform: str | None = None
) -> jax.Array:
    """Differentiable M̂ = (M·Q)·Qᵀ through the fused kernel. M [..., H] -> M̂ [..., H] in M's dtype."""
    check_can_run(interpret, "project_reconstruct", platform)
    lead = M.shape[:-1]
    out = _pr(M.reshape(-1, M.shape[-1]), Q, interpret, block_rows, platform)
    return out.reshape(*lead, M.shape[-1])
