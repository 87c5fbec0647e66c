"""The `prf_mask` codec (design §3.2): h~ = g * (h ⊙ m) at each pipeline boundary.

m[b, t, j] comes from the stateless PRF key (seed, boundary layer, step key, sample_id[b], position[b, t], j)
of `pallas_kernels/prf.py`. Nothing else enters the key (no path tag, no tick, no mesh coordinate), so the old-log-prob,
train and reference forwards, every mini-batch, any padding and `jax.checkpoint` recomputation regenerate the
same bits. The backward message is grad * g * m through ordinary autodiff (no straight-through estimator).

Stateless (every bit is regenerated from the key): pure functions; `make_mask_hook` closes over the traced per-batch
context.
`PrfMaskCodec` (bottom) is the registered codec, `PrfMaskConfig` its `fast.codec` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import prf
from pallas_kernels.prf_mask import MaskRows, prf_mask_kernel
from pallas_kernels.sharding import shard_rows
from twocircuit_jax.config.base import doc, require
from twocircuit_jax.config.sections import ActivationCodecConfig
from twocircuit_jax.fast.codecs.base import ActivationCodec, register_activation, wire_result
from twocircuit_jax.parallel.wire import Wire

RESCALE_MODES = ("none", "constant", "rms_match")
RMS_EPS = 1e-8


def _validate(cfg, boundaries):
    if cfg.rescale_mode not in RESCALE_MODES:
        raise ValueError(f"fast.codec.rescale_mode: got {cfg.rescale_mode!r}; allowed {', '.join(RESCALE_MODES)}")
    if cfg.prf_impl not in prf.IMPLS:
        raise ValueError(f"fast.codec.prf_impl: got {cfg.prf_impl!r}; allowed {', '.join(prf.IMPLS)}")
    if cfg.p_by_boundary and len(cfg.p_by_boundary) != len(boundaries):
        raise ValueError(
            f"fast.codec.p_by_boundary: got {len(cfg.p_by_boundary)} values for {len(boundaries)} "
            f"boundaries {tuple(boundaries)}; give one p per boundary or none"
        )


def layer_p(cfg, boundaries, layer: int) -> float:
    """Masked fraction at one boundary: p_by_boundary[i] for the i-th boundary, else cfg.p."""
    if layer not in boundaries:
        raise ValueError(f"prf_mask: layer {layer} is not a boundary; boundaries are {tuple(boundaries)}")
    return float(cfg.p_by_boundary[list(boundaries).index(layer)]) if cfg.p_by_boundary else float(cfg.p)


def keep_count(p: float, width: int) -> int:
    """Exact-k k = round((1-p) H), half up, at least 1 (H=1536, p=0.95 -> 77)."""
    return max(1, min(width, int(math.floor((1.0 - p) * width + 0.5))))


def bernoulli_threshold(p: float) -> int:
    """floor(p 2^53): exact, since multiplying a double by 2^53 only shifts its exponent."""
    return int(math.floor(p * 2.0**53))


def step_key(cfg, step):
    """(step key, odd flag): gs, or gs // 2 with antithetic; odd steps then use 2^53-1-u."""
    step = jnp.asarray(step, jnp.int32)
    if cfg.antithetic:
        return step // 2, (step % 2) == 1
    return step, jnp.asarray(False)


def flipped_u(cfg, layer, step, sample_ids, positions, width, direction=None) -> prf.U64:
    """u' [B, T, H]: the PRF u after the antithetic flip (XOR with 2^53-1 equals 2^53-1-u for u < 2^53)."""
    key, odd = step_key(cfg, step)
    u = prf.prf_u(cfg.prf_impl, cfg.seed, layer, key, sample_ids, positions, width, direction)
    f = jnp.where(odd, prf.u32(0xFFFFFFFF), prf.u32(0)).astype(jnp.uint32)
    return prf.U64(u.hi ^ (f & prf.u32(0x1FFFFF)), u.lo ^ f)


def exact_k_threshold_sort(u: prf.U64, k: int):
    """Per-row (thr, thr_j) = k-th largest (u, -j) via an XLA three-key sort: the reference `exact_k_threshold`
    is tested against. Cost: one sort of [N, H] with three uint32 operands (70 ms for 3072 x 128 on 2 CPU cores)."""
    j = jax.lax.broadcasted_iota(jnp.uint32, u.hi.shape, u.hi.ndim - 1)
    # ascending on (~hi, ~lo, j) = descending on u, ascending on j
    s_hi, s_lo, s_j = jax.lax.sort((~u.hi, ~u.lo, j), dimension=u.hi.ndim - 1, num_keys=3)
    return prf.U64(~s_hi[..., k - 1], ~s_lo[..., k - 1]), s_j[..., k - 1]


def _rth_largest(key, mask, r, nbits: int):
    """Per row, the r-th largest `key` (uint32 [..., H]) among the positions where `mask` holds, built bit by bit
    from the top: the largest t with #(mask & key >= t) >= r. r >= 1 and at most the row's mask count."""

    def bit(i, t):
        cand = t | (jnp.uint32(1) << (nbits - 1 - i).astype(jnp.uint32))
        ok = jnp.sum((mask & (key >= cand[..., None])).astype(jnp.int32), axis=-1) >= r
        return jnp.where(ok, cand, t)

    return jax.lax.fori_loop(0, nbits, bit, jnp.zeros(key.shape[:-1], jnp.uint32))


_SELECT_MAX_K = 12  # up to this k, k rounds of selection (4 reductions each) beat the counting search's ~60 passes


def exact_k_threshold(u: prf.U64, k: int):
    """Per-row (thr, thr_j) = k-th largest (u, -j), the same as `exact_k_threshold_sort`, without a sort: by
    selection for small k (`kth_by_selection`), else by counting (`kth_by_count`). Both are exact; which one runs
    depends on the static k only."""
    return kth_by_selection(u, k) if k <= _SELECT_MAX_K else kth_by_count(u, k)


def _split_u(u: prf.U64):
    """(top 32 bits, low 21 bits) of the 53-bit u, and back (`_join_u`)."""
    return (u.hi << 11) | (u.lo >> 21), u.lo & jnp.uint32(0x1FFFFF)


def _join_u(top, low) -> prf.U64:
    return prf.U64(top >> 11, ((top & jnp.uint32(0x7FF)) << 21) | low)


def kth_by_selection(u: prf.U64, k: int):
    """`exact_k_threshold` by k rounds of taking each row's largest (u, -j) and removing it: 4 reductions over
    [N, H] a round. For a keep of 5 % of 64 channels (k = 3) that is 12 passes against the counting search's 59
    (the demo's mask: 11 ms a boundary for 8192 x 64 by counting)."""
    width = u.hi.shape[-1]
    j = jax.lax.broadcasted_iota(jnp.uint32, u.hi.shape, u.hi.ndim - 1)
    top, low = _split_u(u)
    zero = jnp.zeros(u.hi.shape[:-1], jnp.uint32)

    def take(_, carry):
        alive = carry[0]
        t = jnp.max(jnp.where(alive, top, 0), axis=-1, keepdims=True)
        at_t = alive & (top == t)
        lo = jnp.max(jnp.where(at_t, low, 0), axis=-1, keepdims=True)
        jm = jnp.min(jnp.where(at_t & (low == lo), j, jnp.uint32(width)), axis=-1, keepdims=True)
        return alive & (j != jm), t[..., 0], lo[..., 0], jm[..., 0]

    _, t, lo, jm = jax.lax.fori_loop(0, k, take, (jnp.ones(u.hi.shape, bool), zero, zero, zero))
    return _join_u(t, lo), jm


def kth_by_count(u: prf.U64, k: int):
    """`exact_k_threshold` by counting: the k-th largest of u's top 32 bits, then among the rows' ties at that
    value the k'-th largest of u's low 21 bits, then among ties there the k''-th smallest j. Cost: 32 + 21 +
    log2(H) vectorised compare-and-count passes over [N, H] (~5 ms for 3072 x 128 here, against 70 ms for the
    sort)."""
    width = u.hi.shape[-1]
    j = jax.lax.broadcasted_iota(jnp.uint32, u.hi.shape, u.hi.ndim - 1)
    every = jnp.ones(u.hi.shape, bool)
    count = lambda m: jnp.sum(m.astype(jnp.int32), axis=-1)  # noqa: E731
    top, low = _split_u(u)  # u is 53 bits: hi holds 21, lo 32
    t1 = _rth_largest(top, every, k, 32)
    tie1 = top == t1[..., None]

    # ties at the k-th top value (rare for PRF words, but possible): rank them by the low bits, then by channel.
    # Done for every row, without a lax.cond: a conditional here changed XLA's fusion of the neighbouring layers
    # (an identity mask then moved the next boundary's activations by 1e-7), and costs only ~2 ms.
    r2 = k - count(top > t1[..., None])
    t2 = _rth_largest(low, tie1, r2, 21)
    tie2 = tie1 & (low == t2[..., None])
    r3 = r2 - count(tie1 & (low > t2[..., None]))
    flip = jnp.uint32(width - 1) - j  # the r3-th smallest j is the r3-th largest (H-1-j)
    thr_j = jnp.uint32(width - 1) - _rth_largest(flip, tie2, r3, max(1, (width - 1).bit_length()))
    return _join_u(t1, t2), thr_j


def thresholds(cfg, p: float, u: prf.U64 | None, row_shape):
    """(thr U64 [B, T], thr_j [B, T]) for Bernoulli or exact-k."""
    if cfg.exact_k:
        return exact_k_threshold(u, keep_count(p, u.hi.shape[-1]))
    t = prf.const64(bernoulli_threshold(p))
    full = lambda x: jnp.full(row_shape, x, jnp.uint32)
    return prf.U64(full(t.hi), full(t.lo)), full(0xFFFFFFFF)


def _keep(cfg, p: float, layer: int, step, sample_ids, positions, width: int):
    u = flipped_u(cfg, layer, step, sample_ids, positions, width)
    thr, thr_j = thresholds(cfg, p, u, u.hi.shape[:-1])
    j = jnp.arange(width, dtype=jnp.uint32)
    return prf.keep_rule(u, prf.U64(thr.hi[..., None], thr.lo[..., None]), thr_j[..., None], j)


def mask_bits(cfg, boundaries, layer: int, step, sample_ids, positions, width: int) -> jax.Array:
    """The boolean mask m [B, T, H] (True = channel sent) of one boundary."""
    _validate(cfg, boundaries)
    return _keep(cfg, layer_p(cfg, boundaries, layer), layer, step, sample_ids, positions, width)


def constant_gain(p: float):
    """1/(1-p) as float32; both the reference and the kernel multiply by this same number."""
    return np.float32(1.0 / (1.0 - p))


def _rms(x):
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=-1) + RMS_EPS)


def rescale(cfg, p: float, h, masked):
    """g * masked in h.dtype: none (g=1), constant (1/(1-p)), rms_match (per token, stop-gradient)."""
    if cfg.rescale_mode == "none":
        return masked
    if cfg.rescale_mode == "constant":
        return (masked.astype(jnp.float32) * constant_gain(p)).astype(h.dtype)
    h32, m32 = jax.lax.stop_gradient(h).astype(jnp.float32), jax.lax.stop_gradient(masked).astype(jnp.float32)
    g = jax.lax.stop_gradient(_rms(h32) / _rms(m32))[..., None]
    return (masked.astype(jnp.float32) * g).astype(h.dtype)


def _apply_reference(cfg, p, layer, step, sample_ids, positions, h):
    keep = _keep(cfg, p, layer, step, sample_ids, positions, h.shape[-1])
    masked = jnp.where(keep, h, jnp.zeros((), h.dtype))
    return rescale(cfg, p, h, masked), keep


def _apply_kernel(cfg, p, layer, step, sample_ids, positions, h, interpret, mesh=None, platform=None):
    if cfg.prf_impl == "threefry":
        raise ValueError(
            "fast.codec.use_kernel: the Pallas mask kernel hashes with u32pair; prf_impl 'threefry' "
            "is not available there (allowed with the kernel: u32pair, x64)"
        )
    b, t, width = h.shape
    key, odd = step_key(cfg, step)
    rk = prf.row_key(
        prf.prefix_key(cfg.seed, layer, key), jnp.asarray(sample_ids, jnp.int32), jnp.asarray(positions, jnp.int32)
    )
    u = flipped_u(cfg, layer, step, sample_ids, positions, width) if cfg.exact_k else None
    thr, thr_j = thresholds(cfg, p, u, (b, t))
    gain = constant_gain(p) if cfg.rescale_mode == "constant" else 1.0
    col = lambda x, dt=jnp.uint32: jnp.broadcast_to(jnp.asarray(x, dt), (b, t)).reshape(b * t, 1)
    flip = jnp.where(odd, prf.u32(0xFFFFFFFF), prf.u32(0)).astype(jnp.uint32)
    rows = MaskRows(col(rk.hi), col(rk.lo), col(thr.hi), col(thr.lo), col(thr_j), col(flip), col(gain, jnp.float32))
    kernel = shard_rows(lambda x, r: prf_mask_kernel(x, r, interpret=interpret, platform=platform), mesh, n_row_args=2)
    out = kernel(h.reshape(b * t, width), rows).reshape(b, t, width)
    if cfg.rescale_mode == "rms_match":
        g = jax.lax.stop_gradient(_rms(h.astype(jnp.float32)) / _rms(out.astype(jnp.float32)))[..., None]
        out = (out.astype(jnp.float32) * g).astype(h.dtype)
    return out


def make_mask_hook(
    cfg, boundaries, step, sample_ids, positions, attention_mask=None, *, interpret=False, mesh=None, platform=None
):
    """Build hook(layer, h [B, T, H]) -> (h~, {"mask_ratio": 1 - mean(m) over real tokens}).

    step: global step gs (int or traced int32 scalar); sample_ids [B] int32 global rows; positions [B, T] int32
    counted from each row's first real token (padding may hold anything); attention_mask [B, T] (1 = real token)
    only excludes padding from the metric. cfg.use_kernel selects the Pallas kernel (interpret=True on CPU); with a
    `mesh` the kernel runs per device on its own rows (pallas_kernels/sharding.py); `platform` names the kernel's
    lowering target when it is not the local backend (export only, pallas_kernels/platform.py)."""
    boundaries = tuple(int(x) for x in boundaries)
    _validate(cfg, boundaries)

    def hook(layer: int, h):
        p = layer_p(cfg, boundaries, layer)
        width = h.shape[-1]
        if cfg.use_kernel:
            out = _apply_kernel(cfg, p, layer, step, sample_ids, positions, h, interpret, mesh, platform)
            # exact-k: the ratio is static; Bernoulli: the metric re-hashes in XLA (one extra pass, metric only)
            keep = None if cfg.exact_k else _keep(cfg, p, layer, step, sample_ids, positions, width)
        else:
            out, keep = _apply_reference(cfg, p, layer, step, sample_ids, positions, h)
        if keep is None:
            ratio = jnp.float32(1.0 - keep_count(p, width) / width)
        else:
            dropped = jnp.mean((~keep).astype(jnp.float32), axis=-1)  # [B, T]; counts drops: p=0 gives exactly 0
            w = jnp.ones_like(dropped) if attention_mask is None else jnp.asarray(attention_mask, jnp.float32)
            ratio = jnp.sum(dropped * w) / jnp.maximum(jnp.sum(w), 1.0)
        return out, {"mask_ratio": ratio}

    return hook


# ----------------------------------------------------------------------------------------------- the codec
@dataclass(frozen=True)
class PrfMaskConfig(ActivationCodecConfig):
    """`fast.codec: {type: prf_mask}`: a random channel mask regenerated from a stateless PRF key (design §3.2)."""

    strength = ("p", "p")

    p: float = field(default=0.95, metadata=doc("masked fraction", "p"))
    exact_k: bool = field(default=True, metadata=doc("keep exactly k = round((1-p)H) channels per token"))
    rescale_mode: Literal["none", "constant", "rms_match"] = field(
        default="constant",
        metadata=doc("gain on kept channels: none = 1; constant = 1/(1-p); rms_match = restore each token's RMS"),
    )
    antithetic: bool = field(default=False, metadata=doc("odd steps use the complement of the even step's bits"))
    p_by_boundary: tuple[float, ...] = field(default=(), metadata=doc("one p per boundary; () = p everywhere"))
    prf_impl: Literal["u32pair", "x64", "threefry"] = field(
        default="u32pair",
        metadata=doc("PRF: u32pair (uint32 pairs), x64 (same bits in uint64), threefry (JAX fold_in, other bits)"),
    )
    seed: int = field(default=0, metadata=doc("PRF seed"))
    use_kernel: bool = field(default=False, metadata=doc("the Pallas mask kernel; error if it cannot run"))

    def check(self):
        require(0 <= self.p < 1, "p", f"got {self.p}; allowed [0, 1)")
        require(
            not (self.use_kernel and self.prf_impl == "threefry"),
            "prf_impl",
            "the Pallas mask kernel hashes with u32pair; with use_kernel: true allowed u32pair, x64",
        )
        for i, q in enumerate(self.p_by_boundary):
            require(0 <= q < 1, f"p_by_boundary[{i}]", f"got {q}; allowed [0, 1)")

    def check_fits(self, model, pp_size: int):
        if self.p_by_boundary:
            require(
                len(self.p_by_boundary) == pp_size - 1,
                "p_by_boundary",
                f"got {len(self.p_by_boundary)} values; need fast.pp_size - 1 = {pp_size - 1}",
            )


@register_activation("prf_mask")
class PrfMaskCodec(ActivationCodec):
    config = PrfMaskConfig
    has_kernel = True

    def hook(self, state, layer, h, path):
        fn = make_mask_hook(
            self.cfg,
            self.boundaries,
            path.step,
            path.sample_ids,
            path.positions,
            path.attention_mask,
            interpret=self.interpret,
            mesh=self.mesh,
            platform=self.platform,
        )
        return fn(self.check_layer(layer), h)

    def wire(self, state, layer, path):
        """k kept values per token; the receiver regenerates which channels they are (MaskWire below)."""
        layer, cfg = self.check_layer(layer), self.cfg
        if not cfg.exact_k:
            raise ValueError(
                "fast.codec.exact_k: false sends a varying number of values per token, which has no fixed-size "
                "message on a real stage boundary (mesh.stage > 1); set exact_k: true"
            )
        p, width = layer_p(cfg, self.boundaries, layer), self.hidden
        keep = lambda: _keep(cfg, p, layer, path.step, path.sample_ids, path.positions, width)  # noqa: E731
        return MaskWire(
            keep,
            lambda h: _apply_reference(cfg, p, layer, path.step, path.sample_ids, path.positions, h)[0],
            keep_count(p, width),
        )

    def wire_bytes(self, tokens, hidden, boundaries, act_bytes=2):
        """(1−p)·H values per token (exact_k: k values); no index bytes: the receiver regenerates the mask."""
        nb, N, H = len(boundaries), int(tokens), int(hidden)
        ps = list(self.cfg.p_by_boundary) or [self.cfg.p] * nb
        if len(ps) != nb:
            raise ValueError(f"p_by_boundary has {len(ps)} entries for {nb} boundaries")
        el_c = N * sum(keep_count(p, H) if self.cfg.exact_k else (1.0 - p) * H for p in ps)
        return wire_result(el_c * act_bytes, nb * N * H * act_bytes, el_c, nb * N * H)


# ------------------------------------------------------------------------------------- the wire format
class MaskWire(Wire):
    # prf_mask's format on a real stage boundary: k = round((1-p) H) values per token in channel order; both sides
    # regenerate the kept channels from the PRF key, so no index is sent (exact-k only).
    """prf_mask exact-k: the k kept values of each token, in channel order. `keep_fn()` regenerates the mask
    [mb, T, H] (bool, exactly k True per token) from the PRF key; `values_fn(h)` is the emulated codec's output
    (rescaled, zeros where dropped), whose kept entries are what is sent."""

    def __init__(self, keep_fn, values_fn, k: int):
        self.keep_fn, self.values_fn, self.k = keep_fn, values_fn, int(k)

    def _index(self):
        """(keep [mb, T, H], slot [mb, T, H]: a kept channel's place in the payload, channel [mb, T, k]: the
        payload's channels in order). Both are gathers along the channel axis only, which the partitioner keeps
        local to each data shard (a scatter with explicit row indices made it all-gather the microbatch)."""
        keep = self.keep_fn()
        slot = jnp.cumsum(keep.astype(jnp.int32), axis=-1) - 1  # rank of a kept channel among its token's kept ones
        channel = jnp.argsort(~keep, axis=-1, stable=True)[..., : self.k]  # kept channels first, in channel order
        return keep, jnp.clip(slot, 0, self.k - 1), channel

    def encode(self, h):
        _, _, channel = self._index()
        return jnp.take_along_axis(self.values_fn(h), channel, axis=-1)

    def decode(self, payload, like):
        keep, slot, _ = self._index()
        return jnp.where(keep, jnp.take_along_axis(payload, slot, axis=-1), jnp.zeros((), payload.dtype))
