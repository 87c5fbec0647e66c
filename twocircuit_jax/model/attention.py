"""The training path's causal self-attention kernels (`model.attention`), all on the same inputs.

q [B, T, Nq, D], k and v [B, T, Nkv, D] (RoPE applied, compute dtype) and the key mask [B, T] (1 = real token).
Rows are left-padded prompts followed by right-padded responses: a query attends the real keys at or before it.
Every path returns [B, T, Nq, D] in the compute dtype and never builds a [B, T, T] mask; only `xla` (qwen2.py, the
reference, kept bit-for-bit as it was) holds [B, Nkv, g, T, T] scores. A query row with no real key (left padding)
gets some finite average of values: its output feeds no real token, so only its finiteness matters.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

_NEG = -1e30  # the finite "minus infinity" of qwen2.py: a fully masked row stays finite
IMPLS = ("xla", "blockwise", "cudnn", "flash_tpu")
# `auto` on CPU: the [T, T] scores path below this many tokens (the tiny demo stays on it; there the blocks' extra
# programs cost more than the scores save), the blockwise one from here (a [B, 12, 2048, 2048] fp32 score tensor
# is 200 MB a row and layer).
AUTO_BLOCKWISE_FROM = 2048
BATCH_AXES = ("data", "fsdp")  # parallel/mesh.py BATCH_AXES: the mesh axes the batch dimension is split over


class KeyMask(NamedTuple):
    """What a non-`xla` layer receives instead of the [B, T, T] bias: the key mask and the kernel to use."""

    valid: jax.Array  # [B, T] int or bool: 1 = a real token
    impl: str  # one of IMPLS other than "xla" (static)
    block: int  # query rows per block (blockwise)


FLASH_BLOCK = 128  # jax.experimental.pallas.ops.tpu.flash_attention's default block (q and kv)


def resolve(cfg, seq_len: int, backend: str | None = None) -> str:
    """The kernel `cfg.attention` names, with `auto` resolved for `backend` (default: jax's default backend; "cuda"
    counts as "gpu") and this length."""
    if cfg.attention != "auto":
        return cfg.attention
    backend = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend) or jax.default_backend()
    if backend == "tpu" and seq_len % FLASH_BLOCK == 0:
        return "flash_tpu"  # the kernel's blocks: 128 rows (shorter or ragged lengths take the rules below)
    if backend == "gpu" and cfg.compute_dtype != "float32":
        return "cudnn"
    return "blockwise" if seq_len >= AUTO_BLOCKWISE_FROM else "xla"


def attend(mask: KeyMask, q, k, v):
    B, T, nq, D = q.shape
    fn = {"blockwise": blockwise, "cudnn": cudnn, "flash_tpu": flash_tpu}[mask.impl]
    kw = {"block": mask.block} if mask.impl == "blockwise" else {}
    return fn(q, k, v, mask.valid, **kw).reshape(B, T, nq * D)


def _block(q, k, v, valid, start: int, stop: int):
    """Query rows [start, stop) against keys [0, stop) (the causal prefix): exact softmax over the block's rows."""
    B, Tb, nkv, g, D = q.shape
    k, v, valid = k[:, :, :stop], v[:, :, :stop], valid[:, :stop] > 0
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k.astype(q.dtype)).astype(jnp.float32) / jnp.sqrt(float(D))
    allowed = (jnp.arange(stop)[None, :] <= jnp.arange(start, stop)[:, None])[None] & valid[:, None, :]
    scores = jnp.where(allowed[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v.astype(q.dtype))
    return out.transpose(0, 3, 1, 2, 4)  # [B, Tb, Nkv, g, D]


def blockwise(q, k, v, valid, *, block: int):
    """Pure jnp: a static loop over query blocks of `block` rows, each against its causal key prefix (about half
    the flops of the full [T, T] product). Each block is a jax.checkpoint: the backward keeps only q, k, v and the
    mask (shared by all blocks) and recomputes one block's [block, prefix] scores at a time, so the peak score
    memory is [B, Nq, block, T] fp32 instead of [B, Nq, T, T]. Cost: the blocks' scores are computed twice."""
    B, T, nq, D = q.shape
    nkv = k.shape[2]
    q = q.reshape(B, T, nkv, nq // nkv, D)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Nkv, S, D], the layout the dots read
    outs = []
    for start in range(0, T, block):
        stop = min(start + block, T)
        body = jax.checkpoint(functools.partial(_block, start=start, stop=stop))
        outs.append(body(q[:, start:stop], k, v, valid))
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    return out.reshape(B, T, nq, D)


def cudnn(q, k, v, valid, implementation: str = "cudnn"):
    """cuDNN fused attention (GPU, bf16/fp16). cuDNN masks padding by lengths only (real tokens first), so each row
    is rotated left by its count of left pads, run causal with query and key lengths = its real tokens, and rotated
    back (four [B, T, N, D] gathers). Assumes a row's real tokens are contiguous (prompt then response, as the
    trainer builds them). Padding query rows are zeroed: what cuDNN writes there is not specified."""
    B, T, nq, D = q.shape
    real = valid > 0
    lead = jnp.argmax(real, axis=1)  # first real token (0 for a row of padding)
    lengths = jnp.maximum(jnp.sum(real, axis=1), 1).astype(jnp.int32)
    idx = (jnp.arange(T)[None, :] + lead[:, None]) % T

    def gather(x, index):
        return jnp.take_along_axis(x, index[:, :, None, None], axis=1)

    out = jax.nn.dot_product_attention(
        gather(q, idx),
        gather(k, idx),
        gather(v, idx),
        scale=1.0 / float(D) ** 0.5,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,  # "xla": the same masking run by XLA (the CPU tests)
    )
    out = gather(out, (jnp.arange(T)[None, :] - lead[:, None]) % T)
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))


def flash_tpu(q, k, v, valid):
    """The Pallas TPU flash kernel (jax.experimental.pallas.ops.tpu.flash_attention): causal, with padding as
    segment ids (real = 1, pad = 0; a query attends keys of its own segment, so a padding query attends padding and
    its own slot: finite). The kernel has no grouped-query form: k and v are repeated to Nq heads ([B, Nq, T, D],
    g times their size). T must be a multiple of the kernel's 128-row blocks. A Mosaic kernel is not partitioned by
    XLA: under a context mesh (jax.set_mesh) with the batch axes it runs in a shard_map over them."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    B, T, nq, D = q.shape
    g = nq // k.shape[2]
    seg = (valid > 0).astype(jnp.int32)

    def kernel(q, k, v, seg):
        out = fa.flash_attention(
            q.transpose(0, 2, 1, 3),
            jnp.repeat(k.transpose(0, 2, 1, 3), g, axis=1),
            jnp.repeat(v.transpose(0, 2, 1, 3), g, axis=1),
            segment_ids=fa.SegmentIds(q=seg, kv=seg),
            causal=True,
            sm_scale=1.0 / float(D) ** 0.5,
        )
        return out.transpose(0, 2, 1, 3)

    mesh = jax.sharding.get_abstract_mesh()
    free = set() if mesh.empty else set(mesh.axis_names) - set(mesh.manual_axes)
    if not free:  # no context mesh, or every axis manual already (inside a shard_map over all of them)
        return kernel(q, k, v, seg)
    # Manual over every axis the partitioner still owns, not only the batch ones: a Mosaic call may not sit under
    # any automatic axis (size 1 included); the rows split over the free batch axes, replicated over the others.
    # Rows that do not divide over a batch axis stay whole on it (each device runs those rows: correct, redundant);
    # only a shapes-only trace of one micro-batch outside its replica's shard_map meets that (parallel/micro_batch.py).
    axes, size = [], 1
    for a in BATCH_AXES:
        if a in free and q.shape[0] % (size * mesh.shape[a]) == 0:
            axes.append(a)
            size *= mesh.shape[a]
    spec = P(tuple(axes) or None)
    return jax.shard_map(
        kernel, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec, axis_names=free, check_vma=False
    )(q, k, v, seg)
