"""PRF of design §3.2: u32pair and x64 must match the pure-Python integer oracle bit for bit."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prf

# Published splitmix64 outputs for state 0: next() adds the golden gamma then mixes, so output i = mix(i * gamma).
SPLITMIX_SEED0 = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]

# (seed, layer, step_key, sample_id, position, channel, direction) -> u, pinned so the oracle cannot drift.
GOLDEN = [
    ((0, 3, 0, 0, 0, 0, None), 6055041995386969),
    ((0, 3, 10, 5, 17, 1535, None), 5093101995063785),
    ((12345678901, 7, 42, 2**31 - 1, -1, 47, None), 60532517278599),
    ((0, 3, 10, 5, 17, 3, 1), 4407181698368083),
]


def _join(u: prf.U64):
    return (np.asarray(u.hi).astype(np.uint64) << np.uint64(32)) | np.asarray(u.lo).astype(np.uint64)


def _pairs(values):
    hi = np.array([(v >> 32) & 0xFFFFFFFF for v in values], np.uint32)
    lo = np.array([v & 0xFFFFFFFF for v in values], np.uint32)
    return prf.U64(jnp.asarray(hi), jnp.asarray(lo))


def test_oracle_mix_is_splitmix64():
    assert [prf.oracle_mix(i * prf.GOLDEN & prf.MASK64) for i in range(3)] == SPLITMIX_SEED0


@pytest.mark.parametrize("args,u", GOLDEN)
def test_oracle_golden(args, u):
    assert prf.oracle_u(*args) == u


def test_u32pair_primitives_match_python_ints():
    rng = random.Random(0)
    edge = [0, 1, 0xFFFFFFFF, 1 << 32, prf.MASK64, prf.GOLDEN, (1 << 63) | 0xFFFF, 0xFFFF0000FFFF0000]
    xs = edge + [rng.getrandbits(64) for _ in range(56)]
    ys = list(reversed(edge)) + [rng.getrandbits(64) for _ in range(56)]
    a, b = _pairs(xs), _pairs(ys)
    m = prf.MASK64
    np.testing.assert_array_equal(_join(prf.add64(a, b)), np.array([(x + y) & m for x, y in zip(xs, ys)], np.uint64))
    np.testing.assert_array_equal(_join(prf.mul64(a, b)), np.array([(x * y) & m for x, y in zip(xs, ys)], np.uint64))
    for n in (11, 27, 30, 31, 32, 40):
        np.testing.assert_array_equal(_join(prf.shr64(a, n)), np.array([x >> n for x in xs], np.uint64))
    np.testing.assert_array_equal(_join(prf.mix64(a)), np.array([prf.oracle_mix(x) for x in xs], np.uint64))


SID = np.array([0, 5, 2**31 - 1, -3], np.int32)
POS = np.array([[0, 1, 2], [7, 8, -1], [100, 2**31 - 1, -(2**31)], [3, 3, 3]], np.int32)
WIDTH = 6


def _oracle_grid(seed, layer, step, direction):
    return np.array(
        [
            [
                [prf.oracle_u(seed, layer, step, int(SID[b]), int(POS[b, t]), j, direction) for j in range(WIDTH)]
                for t in range(POS.shape[1])
            ]
            for b in range(len(SID))
        ],
        np.uint64,
    )


@pytest.mark.parametrize("impl", ["u32pair", "x64"])
@pytest.mark.parametrize(
    "seed,layer,step,direction",
    [(0, 3, 10, None), (12345678901, 27, 7, None), (2**64 - 1, 0, 2**31 - 1, 1), (5, 11, 0, 0)],
)
def test_prf_u_matches_oracle(impl, seed, layer, step, direction):
    fn = jax.jit(lambda s, sid, pos: prf.prf_u(impl, seed, layer, s, sid, pos, WIDTH, direction))
    got = _join(fn(jnp.int32(step), jnp.asarray(SID), jnp.asarray(POS)))
    np.testing.assert_array_equal(got, _oracle_grid(seed, layer, step, direction))
    assert not jax.config.jax_enable_x64, "x64 mode must not flip the global flag"


def test_direction_link_changes_bits():
    base = _join(prf.prf_u("u32pair", 0, 3, 1, jnp.asarray(SID), jnp.asarray(POS), WIDTH))
    fwd = _join(prf.prf_u("u32pair", 0, 3, 1, jnp.asarray(SID), jnp.asarray(POS), WIDTH, 0))
    bwd = _join(prf.prf_u("u32pair", 0, 3, 1, jnp.asarray(SID), jnp.asarray(POS), WIDTH, 1))
    assert (base != fwd).all() and (fwd != bwd).all()


def test_threefry_deterministic_in_range_and_keyed():
    fn = jax.jit(lambda s, sid, pos: prf.prf_u("threefry", 3, 5, s, sid, pos, WIDTH))
    a = _join(fn(jnp.int32(4), jnp.asarray(SID), jnp.asarray(POS)))
    b = _join(fn(jnp.int32(4), jnp.asarray(SID[::-1]), jnp.asarray(POS[::-1])))
    c = _join(fn(jnp.int32(5), jnp.asarray(SID), jnp.asarray(POS)))
    np.testing.assert_array_equal(a[::-1], b)  # a function of (sample_id, position, channel) only
    assert (a < 2**53).all() and (a != c).mean() > 0.99
    u32 = _join(prf.prf_u("u32pair", 3, 5, 4, jnp.asarray(SID), jnp.asarray(POS), WIDTH))
    assert (a != u32).mean() > 0.99  # documented: not bit-compatible


def test_unknown_impl_names_the_field():
    with pytest.raises(ValueError, match="prf_impl"):
        prf.prf_u("philox", 0, 0, 0, jnp.asarray(SID), jnp.asarray(POS), WIDTH)


def test_unit_float_is_top_24_bits():
    u = prf.prf_u("u32pair", 1, 2, 3, jnp.asarray(SID), jnp.asarray(POS), WIDTH)
    f = np.asarray(prf.u_to_unit_float(u), np.float64)
    want = (_oracle_grid(1, 2, 3, None) >> np.uint64(29)).astype(np.float64) / 2.0**24
    np.testing.assert_array_equal(f, want)
    assert f.min() >= 0 and f.max() < 1
