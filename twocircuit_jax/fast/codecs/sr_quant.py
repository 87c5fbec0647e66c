"""The `sr_quant` codec (design §3.4, an ablation): blockwise stochastic-rounding quantizer at each boundary.

Per token and block of `quant_block` channels: s = max|h|; 2^bits evenly spaced levels on [-s, s] (1 bit: {-s, s});
h is rounded to one of its two neighbouring levels with probability proportional to proximity, so E[q] = h.
The uniforms come from the mask's PRF key extended with a direction link (0 forward, 1 backward): the backward
wire message (the cotangent) is quantized independently with fresh bits, via `jax.custom_vjp`. The backward pass
regenerates its uniforms from (step, sample_ids, positions), so no [B, T, H] residual is stored.
`rounding: rn` rounds to the nearest level (deterministic, biased baseline). `subset_k > 0` keeps only an exact-k
channel subset (chosen by the mask's u, never by value), quantizes it and rescales by H/k; other channels are 0.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import prf
from twocircuit_jax.config.base import doc, require
from twocircuit_jax.config.sections import ActivationCodecConfig
from twocircuit_jax.fast.codecs import prf_mask as mask_lib
from twocircuit_jax.fast.codecs.base import ActivationCodec, register_activation, row_sum, wire_result
from twocircuit_jax.parallel.wire import Wire, zeros_like as _zeros

ROUNDINGS = ("sr", "rn")
FORWARD, BACKWARD = 0, 1


def quantize(h: jax.Array, unif: jax.Array | None, bits: int, block: int, rounding: str = "sr") -> jax.Array:
    """Dequantized blockwise quantization of h [..., H] (float32 math, result in h.dtype).

    unif [..., H] float32 in [0, 1) drives stochastic rounding (ignored for rn). A ragged last block is padded with
    zeros, which never change max|h|."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"fast.codec.rounding: got {rounding!r}; allowed {', '.join(ROUNDINGS)}")
    codes, scales = quantize_codes(h, unif, bits, block, rounding)
    return dequantize_codes(codes, scales, bits, block, h.dtype)


def quantize_codes(h: jax.Array, unif: jax.Array | None, bits: int, block: int, rounding: str = "sr"):
    """`quantize` split at the wire: (codes uint8 [..., H] in [0, 2^bits - 1], block scales f32 [..., ceil(H/block)]),
    with dequantize_codes(quantize_codes(h, ...)) == quantize(h, ...) bit for bit (the same fp32 arithmetic)."""
    width = h.shape[-1]
    pad = -width % block
    x = h.astype(jnp.float32)
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    xb = x.reshape(x.shape[:-1] + (-1, block))
    s = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    levels = 2**bits - 1
    step = jnp.where(s > 0, 2.0 * s / levels, 1.0)
    t = (xb + s) / step
    if rounding == "rn":
        q = jnp.round(t)
    else:
        if pad:
            unif = jnp.pad(unif, [(0, 0)] * (unif.ndim - 1) + [(0, pad)])
        lower = jnp.floor(t)
        q = lower + (unif.reshape(xb.shape) < (t - lower)).astype(jnp.float32)
    q = jnp.clip(q, 0.0, float(levels)).astype(jnp.uint8).reshape(x.shape)[..., :width]
    return q, s[..., 0]


def dequantize_codes(codes: jax.Array, scales: jax.Array, bits: int, block: int, dtype) -> jax.Array:
    width = codes.shape[-1]
    pad = -width % block
    q = codes.astype(jnp.float32)
    if pad:
        q = jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, pad)])
    qb = q.reshape(q.shape[:-1] + (-1, block))
    s = scales[..., None]
    step = jnp.where(s > 0, 2.0 * s / (2**bits - 1), 1.0)
    out = jnp.where(s > 0, qb * step - s, 0.0).reshape(q.shape)[..., :width]
    return out.astype(dtype)


def _uniforms(cfg, layer, step, sample_ids, positions, width, direction):
    u = mask_lib.flipped_u(cfg, layer, step, sample_ids, positions, width, direction)
    return prf.u_to_unit_float(u)


def subset_keep(cfg, layer, step, sample_ids, positions, width):
    """Exact-k (k = subset_k) channel subset from the mask's own u (no direction link)."""
    if not 1 <= cfg.subset_k <= width:
        raise ValueError(f"fast.codec.subset_k: got {cfg.subset_k}; allowed 0 (off) or 1..H={width}")
    u = mask_lib.flipped_u(cfg, layer, step, sample_ids, positions, width)
    thr, thr_j = mask_lib.exact_k_threshold(u, cfg.subset_k)
    j = jnp.arange(width, dtype=jnp.uint32)
    return prf.keep_rule(u, prf.U64(thr.hi[..., None], thr.lo[..., None]), thr_j[..., None], j)


def encode(cfg, layer: int, step, sample_ids, positions, h, direction: int = FORWARD):
    """One direction of the codec without autodiff rules: h [B, T, H] -> dequantized message."""
    width = h.shape[-1]
    unif = None if cfg.rounding == "rn" else _uniforms(cfg, layer, step, sample_ids, positions, width, direction)
    if cfg.subset_k <= 0:
        return quantize(h, unif, cfg.quant_bits, cfg.quant_block, cfg.rounding)
    keep = subset_keep(cfg, layer, step, sample_ids, positions, width)
    zero = jnp.zeros((), h.dtype)
    q = quantize(jnp.where(keep, h, zero), unif, cfg.quant_bits, cfg.quant_block, cfg.rounding)
    gain = width / cfg.subset_k
    return jnp.where(keep, (q.astype(jnp.float32) * gain).astype(h.dtype), zero)


def _float0_like(tree):
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jax.dtypes.float0), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _codec(cfg, layer, h, ctx):
    return encode(cfg, layer, *ctx, h, FORWARD)


def _codec_fwd(cfg, layer, h, ctx):
    return encode(cfg, layer, *ctx, h, FORWARD), ctx


def _codec_bwd(cfg, layer, ctx, g):
    # the backward wire message is quantized on its own, with the direction-1 bits
    return encode(cfg, layer, *ctx, g, BACKWARD), _float0_like(ctx)


_codec.defvjp(_codec_fwd, _codec_bwd)


def sr_quant(cfg, layer: int, step, sample_ids, positions, h):
    """Differentiable codec: forward quantizes h with direction 0, backward the cotangent with direction 1."""
    ctx = (jnp.asarray(step, jnp.int32), jnp.asarray(sample_ids, jnp.int32), jnp.asarray(positions, jnp.int32))
    return _codec(cfg, int(layer), h, ctx)


def make_quant_hook(cfg, boundaries, step, sample_ids, positions, attention_mask=None):
    """Build hook(layer, h [B, T, H]) -> (h_q, {"quant_rel_err": ||h_q - h|| / ||h|| over real tokens})."""
    boundaries = tuple(int(x) for x in boundaries)
    if cfg.rounding not in ROUNDINGS:
        raise ValueError(f"fast.codec.rounding: got {cfg.rounding!r}; allowed {', '.join(ROUNDINGS)}")
    if cfg.prf_impl not in prf.IMPLS:
        raise ValueError(f"fast.codec.prf_impl: got {cfg.prf_impl!r}; allowed {', '.join(prf.IMPLS)}")

    def hook(layer: int, h):
        if layer not in boundaries:
            raise ValueError(f"sr_quant: layer {layer} is not a boundary; boundaries are {boundaries}")
        out = sr_quant(cfg, layer, step, sample_ids, positions, h)
        w = jnp.ones(h.shape[:-1], jnp.float32) if attention_mask is None else jnp.asarray(attention_mask, jnp.float32)
        h32 = jax.lax.stop_gradient(h).astype(jnp.float32)
        err = row_sum(jnp.square(jax.lax.stop_gradient(out).astype(jnp.float32) - h32), w)
        ref = row_sum(jnp.square(h32), w)
        rel = jnp.sqrt(err / jnp.maximum(ref, 1e-30))
        return out, {"quant_rel_err": rel}

    return hook


# ----------------------------------------------------------------------------------------------- the codec
@dataclass(frozen=True)
class SrQuantConfig(ActivationCodecConfig):
    """`fast.codec: {type: sr_quant}`: blockwise stochastic-rounding quantizer (design §3.4, an ablation). Its
    uniforms come from the prf_mask key, so it shares the mask's `seed`, `prf_impl` and `antithetic`."""

    strength = ("quant_bits", "bits")

    quant_bits: int = field(default=1, metadata=doc("bits per channel"))
    quant_block: int = field(default=32, metadata=doc("channels per scale"))
    rounding: Literal["sr", "rn"] = field(
        default="sr", metadata=doc("sr = stochastic rounding (unbiased); rn = round to nearest (deterministic, biased)")
    )
    subset_k: int = field(default=0, metadata=doc("quantize only k channels of a PRF subset; 0 = all"))
    prf_impl: Literal["u32pair", "x64", "threefry"] = field(
        default="u32pair", metadata=doc("PRF of the rounding uniforms: u32pair, x64 (same bits), threefry (other bits)")
    )
    antithetic: bool = field(default=False, metadata=doc("odd steps use the complement of the even step's uniforms"))
    seed: int = field(default=0, metadata=doc("PRF seed"))

    def check(self):
        require(self.quant_bits in (1, 2, 4, 8), "quant_bits", f"got {self.quant_bits}; allowed 1, 2, 4, 8")
        require(self.quant_block >= 1, "quant_block", f"got {self.quant_block}; must be >= 1")

    def check_fits(self, model, pp_size: int):
        if self.subset_k:
            require(self.subset_k <= model.hidden_size, "subset_k", "must not exceed model.hidden_size")


@register_activation("sr_quant")
class SrQuantCodec(ActivationCodec):
    config = SrQuantConfig

    def hook(self, state, layer, h, path):
        fn = make_quant_hook(self.cfg, self.boundaries, path.step, path.sample_ids, path.positions, path.attention_mask)
        out, aux = fn(self.check_layer(layer), h)
        return out, {"recon_rel_err": aux["quant_rel_err"]}

    def wire(self, state, layer, path):
        """Packed codes and fp32 block scales, each direction quantized on its own (fast/wire.py SrQuantWire)."""
        ctx = (path.step, path.sample_ids, path.positions)
        return SrQuantWire(self.cfg, self.check_layer(layer), ctx)

    def wire_bytes(self, tokens, hidden, boundaries, act_bytes=2):
        """Every channel at `quant_bits` each, plus one 16-bit scale per block of `quant_block` channels."""
        nb, N, H = len(boundaries), int(tokens), int(hidden)
        bits_tok = H * self.cfg.quant_bits + math.ceil(H / self.cfg.quant_block) * 16
        return wire_result(nb * N * bits_tok / 8.0, nb * N * H * act_bytes, nb * N * H, nb * N * H)


# ------------------------------------------------------------------------------- the real-stage format
def pack(codes, bits: int):
    """uint8 codes [..., n] < 2^bits -> [..., ceil(n * bits / 8)] bytes, 8/bits codes per byte (low bits first)."""
    per = 8 // bits
    pad = -codes.shape[-1] % per
    c = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)]) if pad else codes
    c = c.reshape(c.shape[:-1] + (-1, per)).astype(jnp.uint8)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.sum(jnp.left_shift(c, shifts), axis=-1, dtype=jnp.uint8)


def unpack(packed, bits: int, n: int):
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    c = jnp.right_shift(packed[..., None], shifts) & jnp.uint8(2**bits - 1)
    return c.reshape(packed.shape[:-1] + (-1,))[..., :n]


def _f0(x):
    return jnp.zeros(jnp.shape(x), jax.dtypes.float0)


class SrQuantWire(Wire):
    """sr_quant: (packed codes, fp32 block scales). Stochastic rounding is not linear, so the backward message is not
    the transpose of the forward one: `transfer` is a custom VJP whose backward quantizes the cotangent on the
    receiving stage (direction 1 bits, as the emulated codec's backward does) and sends those codes back."""

    def __init__(self, cfg, layer: int, ctx):
        self.cfg, self.layer = cfg, int(layer)
        self.ctx = tuple(jnp.asarray(c, jnp.int32) for c in ctx)  # (step, sample_ids [mb], positions [mb, T])

    def _keep(self, width):
        step, ids, pos = self.ctx
        return subset_keep(self.cfg, self.layer, step, ids, pos, width) if self.cfg.subset_k > 0 else None

    def encode_dir(self, h, direction: int):
        cfg, width = self.cfg, h.shape[-1]
        step, ids, pos = self.ctx
        unif = None if cfg.rounding == "rn" else _uniforms(cfg, self.layer, step, ids, pos, width, direction)
        keep = self._keep(width)
        x = h if keep is None else jnp.where(keep, h, jnp.zeros((), h.dtype))
        codes, scales = quantize_codes(x, unif, cfg.quant_bits, cfg.quant_block, cfg.rounding)
        if keep is not None:  # only the subset's codes travel, in channel order
            channel = jnp.argsort(~keep, axis=-1, stable=True)[..., : cfg.subset_k]
            codes = jnp.take_along_axis(codes, channel, axis=-1)
        return pack(codes, cfg.quant_bits), scales

    def decode(self, payload, like):
        cfg, width = self.cfg, like.shape[-1]
        packed, scales = payload
        keep = self._keep(width)
        codes = unpack(packed, cfg.quant_bits, cfg.subset_k if keep is not None else width)
        if keep is not None:
            slot = jnp.clip(jnp.cumsum(keep.astype(jnp.int32), axis=-1) - 1, 0, cfg.subset_k - 1)
            codes = jnp.take_along_axis(codes, slot, axis=-1)
        out = dequantize_codes(codes, scales, cfg.quant_bits, cfg.quant_block, like.dtype)
        if keep is None:
            return out
        gain = width / cfg.subset_k
        return jnp.where(keep, (out.astype(jnp.float32) * gain).astype(like.dtype), jnp.zeros((), like.dtype))

    def encode(self, h):
        return self.encode_dir(h, FORWARD)

    def transfer(self, y, is_sender, is_receiver, link):
        like = jax.ShapeDtypeStruct(y.shape, y.dtype)
        payload_like = jax.eval_shape(self.encode, like)

        cfg, layer = self.cfg, self.layer

        def one_way(x, src, dst, ctx, direction, send):
            w = SrQuantWire(cfg, layer, ctx)  # rebuilt from the arguments: the VJP closes over no traced value
            p = jax.lax.cond(src, lambda h: w.encode_dir(h, direction), lambda h: _zeros(payload_like), x)
            return jax.lax.cond(dst, lambda q: w.decode(q, like), lambda q: _zeros(like), send(p))

        @jax.custom_vjp
        def move(x, src, dst, ctx):
            return one_way(x, src, dst, ctx, FORWARD, link.send)

        def fwd(x, src, dst, ctx):
            return move(x, src, dst, ctx), (src, dst, ctx)

        def bwd(res, g):
            src, dst, ctx = res
            # the receiver quantizes the cotangent with the backward bits and sends the codes back to the sender
            gx = one_way(g, dst, src, ctx, BACKWARD, link.send_back)
            return gx, _f0(src), _f0(dst), jax.tree.map(_f0, ctx)

        move.defvjp(fwd, bwd)
        return move(y, is_sender, is_receiver, self.ctx)
