"""Stateless counter PRF for the fast-circuit codecs (design §3.2).

Key chain (all arithmetic mod 2^64, logical shifts):
    a = 0; a = mix(a ^ c) for c in (seed, boundary layer, step key[, direction])
    a = mix(sample_id ^ a); a = mix(a ^ position); h_j = mix(a ^ j); u_j = h_j >> 11   (53 bits)

The optional `direction` link is the quantizer's extension (0 forward, 1 backward); the mask itself has none.
Signed inputs (a padded position may be negative) are sign-extended to 64 bits, as `x & (2^64-1)` in the oracle.

Three implementations, chosen by the codec config's `prf_impl`:
- `u32pair` (mandated): every 64-bit word is a (hi, lo) uint32 pair, so the default 32-bit JAX mode suffices
  and TPUs never see 64-bit integers. Cost: one mix is ~40 uint32 vector ops (the 64x64 low product takes four
  16x16 limb products plus two wrapping 32-bit products).
- `x64`: the same bits computed with uint64 inside a local `jax.enable_x64` context; never flips the global flag.
- `threefry`: nested `fold_in` over the same fields; deterministic but not bit-compatible with the other two.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
U53_MAX = (1 << 53) - 1
IMPLS = ("u32pair", "x64", "threefry")


# ---------------------------------------------------------------- pure-Python integer oracle


def oracle_mix(x: int) -> int:
    x = (x + GOLDEN) & MASK64
    x ^= x >> 30
    x = (x * MUL1) & MASK64
    x ^= x >> 27
    x = (x * MUL2) & MASK64
    return x ^ (x >> 31)


def oracle_u(seed, layer, step_key, sample_id, position, channel, direction=None) -> int:
    """The 53-bit u of design §3.2 with Python integers: the reference every JAX mode must match."""
    a = 0
    links = (seed, layer, step_key) if direction is None else (seed, layer, step_key, direction)
    for c in links:
        a = oracle_mix(a ^ (c & MASK64))
    a = oracle_mix((sample_id & MASK64) ^ a)
    a = oracle_mix(a ^ (position & MASK64))
    return oracle_mix(a ^ (channel & MASK64)) >> 11


# ---------------------------------------------------------------- u32pair arithmetic


class U64(NamedTuple):
    """A 64-bit word as two uint32 arrays of the same shape."""

    hi: jax.Array  # [...] uint32, bits 63..32
    lo: jax.Array  # [...] uint32, bits 31..0


def u32(x: int):
    return np.uint32(x & 0xFFFFFFFF)


def const64(x: int) -> U64:
    """A Python int (taken mod 2^64) as a scalar pair of numpy uint32 (safe to close over inside Pallas kernels)."""
    x &= MASK64
    return U64(u32(x >> 32), u32(x))


def from_int(x) -> U64:
    """Sign-extend an integer array (int32/uint32) or a Python int to a pair."""
    if isinstance(x, (int, np.integer)):
        return const64(int(x))
    x = jnp.asarray(x)
    lo = x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        hi = jnp.where(x < 0, u32(0xFFFFFFFF), u32(0)).astype(jnp.uint32)
    else:
        hi = jnp.zeros_like(lo)
    return U64(hi, lo)


def xor64(a: U64, b: U64) -> U64:
    return U64(a.hi ^ b.hi, a.lo ^ b.lo)


def add64(a: U64, b: U64) -> U64:
    lo = a.lo + b.lo  # wraps mod 2^32
    carry = (lo < a.lo).astype(jnp.uint32)
    return U64(a.hi + b.hi + carry, lo)


def shr64(a: U64, n: int) -> U64:
    """Logical right shift by a static 0 < n < 64."""
    if n >= 32:
        return U64(jnp.zeros_like(a.hi), a.hi >> u32(n - 32))
    return U64(a.hi >> u32(n), (a.lo >> u32(n)) | (a.hi << u32(32 - n)))


def _mul32_wide(a, b) -> U64:
    """Full 64-bit product of two uint32 arrays from 16-bit limbs (each partial product fits in 32 bits)."""
    m16 = u32(0xFFFF)
    a0, a1 = a & m16, a >> u32(16)
    b0, b1 = b & m16, b >> u32(16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(jnp.uint32)  # the lost 2^32 of mid is 2^48 of the product
    lo = p00 + (mid << u32(16))
    lo_carry = (lo < p00).astype(jnp.uint32)
    hi = p11 + (mid >> u32(16)) + (mid_carry << u32(16)) + lo_carry
    return U64(hi, lo)


def mul64(a: U64, b: U64) -> U64:
    """Low 64 bits of a*b: lo*lo in full, the cross terms only mod 2^32 (they land in the high word)."""
    w = _mul32_wide(a.lo, b.lo)
    return U64(w.hi + a.hi * b.lo + a.lo * b.hi, w.lo)


def mix64(x: U64) -> U64:
    """splitmix64 finaliser on pairs."""
    x = add64(x, const64(GOLDEN))
    x = xor64(x, shr64(x, 30))
    x = mul64(x, const64(MUL1))
    x = xor64(x, shr64(x, 27))
    x = mul64(x, const64(MUL2))
    return xor64(x, shr64(x, 31))


def u53(x: U64) -> U64:
    return shr64(x, 11)


def keep_rule(u: U64, thr: U64, thr_j, j):
    """Keep iff (u, -j) >= (thr, -thr_j) lexicographically. Bernoulli: thr_j = 2^32-1 (plain u >= thr);
    exact-k: (thr, thr_j) is the k-th largest (u, -j), so exactly k survive and ties go to the lower index."""
    above = (u.hi > thr.hi) | ((u.hi == thr.hi) & (u.lo > thr.lo))
    tie = (u.hi == thr.hi) & (u.lo == thr.lo) & (j <= thr_j)
    return above | tie


def _bcast(x: U64, shape) -> U64:
    return U64(jnp.broadcast_to(x.hi, shape), jnp.broadcast_to(x.lo, shape))


# ---------------------------------------------------------------- key chain, per implementation


def prefix_key(seed: int, layer: int, step_key, direction: int | None = None) -> U64:
    """The scalar part of the chain (u32pair/x64 share it; `step_key` may be traced)."""
    a = U64(jnp.uint32(0), jnp.uint32(0))  # jnp scalars: numpy uint32 would warn on the intended wrap-around
    links = (seed, layer, step_key) if direction is None else (seed, layer, step_key, direction)
    for c in links:
        a = mix64(xor64(a, from_int(c)))
    return a


def row_key(prefix: U64, sample_ids, positions) -> U64:
    """Per-token key a after the position link: [B, T] pairs (what the Pallas kernel consumes)."""
    a = mix64(xor64(from_int(sample_ids), _bcast(prefix, sample_ids.shape)))  # [B]
    pos = from_int(positions)
    a = U64(a.hi[:, None], a.lo[:, None])
    return mix64(xor64(_bcast(a, positions.shape), pos))


def channel_u(rk: U64, channel) -> U64:
    """u_j = mix(a ^ j) >> 11 for row keys broadcast against uint32 channel indices."""
    return u53(mix64(xor64(rk, U64(jnp.zeros_like(channel), channel))))


def _u_u32pair(prefix, sample_ids, positions, width):
    rk = row_key(prefix, sample_ids, positions)
    j = jnp.arange(width, dtype=jnp.uint32)
    return channel_u(U64(rk.hi[..., None], rk.lo[..., None]), j)


def _u_x64(seed, layer, step_key, direction, sample_ids, positions, width):
    with jax.enable_x64(True):
        u64 = jnp.uint64

        def mix(x):
            x = x + u64(GOLDEN)
            x = x ^ (x >> u64(30))
            x = x * u64(MUL1)
            x = x ^ (x >> u64(27))
            x = x * u64(MUL2)
            return x ^ (x >> u64(31))

        def ext(v):  # sign-extend int32 to 64 bits, then view as unsigned
            v = jnp.asarray(v)
            return v.astype(jnp.int64).astype(u64) if jnp.issubdtype(v.dtype, jnp.signedinteger) else v.astype(u64)

        a = u64(0)
        links = (seed, layer, step_key) if direction is None else (seed, layer, step_key, direction)
        for c in links:
            c = u64(c & MASK64) if isinstance(c, int) else ext(c)
            a = mix(a ^ c)
        a = mix(ext(sample_ids) ^ a)[:, None]
        a = mix(a ^ ext(positions))[..., None]
        h = mix(a ^ jnp.arange(width, dtype=u64)) >> u64(11)
        return U64((h >> u64(32)).astype(jnp.uint32), h.astype(jnp.uint32))


def _u_threefry(seed, layer, step_key, direction, sample_ids, positions, width):
    key = jax.random.key(seed & 0xFFFFFFFF, impl="threefry2x32")
    links = ((seed & MASK64) >> 32, layer, step_key) if direction is None else (layer, step_key, direction)
    for c in links:
        key = jax.random.fold_in(key, jnp.asarray(c).astype(jnp.uint32))
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    k_b = fold(key, sample_ids.astype(jnp.uint32))  # [B]
    k_bt = jax.vmap(fold)(k_b, positions.astype(jnp.uint32))  # [B, T]
    j = jnp.arange(width, dtype=jnp.uint32)
    per_row = lambda k: fold(k, j)  # [H] keys: one threefry per element
    k_btj = jax.vmap(jax.vmap(per_row))(k_bt)  # [B, T, H]
    data = jax.random.key_data(k_btj)  # [B, T, H, 2] uint32
    return u53(U64(data[..., 0], data[..., 1]))


def prf_u(
    impl: str, seed: int, layer: int, step_key, sample_ids, positions, width: int, direction: int | None = None
) -> U64:
    """53-bit uniforms u[b, t, j] as a pair of uint32 [B, T, width]."""
    sample_ids = jnp.asarray(sample_ids, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    if impl == "u32pair":
        return _u_u32pair(prefix_key(seed, layer, step_key, direction), sample_ids, positions, width)
    if impl == "x64":
        return _u_x64(seed, layer, step_key, direction, sample_ids, positions, width)
    if impl == "threefry":
        return _u_threefry(seed, layer, step_key, direction, sample_ids, positions, width)
    raise ValueError(f"fast.prf_impl: got {impl!r}; allowed {', '.join(IMPLS)}")


def u_to_unit_float(u: U64):
    """Top 24 of the 53 bits as float32 in [0, 1) (exact: 24 bits fit the mantissa)."""
    top = (u.hi << u32(3)) | (u.lo >> u32(29))
    return top.astype(jnp.float32) * np.float32(2.0**-24)
