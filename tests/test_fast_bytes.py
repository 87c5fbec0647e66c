"""Byte accounting (design §3.6, §8 invariant 9): formulas, and the formulas vs collective bytes in compiled HLO."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from twocircuit_jax.config.sections import NoActivationCodec, NoGradCodec
from twocircuit_jax.fast.bytes import (
    activation_bytes,
    collective_bytes_from_hlo,
    combine,
    grad_allreduce_bytes,
    powersgd_plain_bytes,
)
from twocircuit_jax.fast.codecs.lowrank import LowRankConfig
from twocircuit_jax.fast.codecs.prf_mask import PrfMaskConfig, keep_count as exact_k
from twocircuit_jax.fast.codecs.sr_quant import SrQuantConfig
from twocircuit_jax.fast.powersgd import PowerSGDConfig, init_powersgd, powersgd_reduce, state_specs
from twocircuit_jax.parallel import dispatch

R = 8
PARAMS = {
    "embed": jnp.zeros((12, 8)),
    "layers": {"w": jnp.zeros((2, 24, 16)), "b": jnp.zeros((2, 16))},
    "head": jnp.zeros((20, 18)),
}


def _mesh(name):
    return Mesh(np.array(jax.devices()[:R]), (name,))


def test_activation_formulas():
    b = list(range(7))
    cfg = PrfMaskConfig(p=0.95, exact_k=True)
    assert exact_k(0.95, 1536) == 77
    m = activation_bytes(cfg, tokens=10, hidden=1536, boundaries=b)
    assert m["comm/bytes_compressed"] == 7 * 10 * 1232 / 8  # 77 values x 16 bits per token, no index bytes
    assert m["comm/bytes_dense"] == 7 * 10 * 1536 * 2
    assert abs(m["comm/bytes_ratio"] - 77 / 1536) < 1e-12
    bern = activation_bytes(dataclasses.replace(cfg, exact_k=False), tokens=10, hidden=1536, boundaries=b)
    assert abs(bern["comm/bytes_compressed"] - 7 * 10 * 0.05 * 1536 * 2) < 1e-6
    per_b = activation_bytes(dataclasses.replace(cfg, p_by_boundary=(0.5, 0.9)), tokens=4, hidden=20, boundaries=[1, 3])
    assert per_b["comm/elements_compressed"] == 4 * (10 + 2)
    lr = LowRankConfig(rank=77, update_cadence=2)
    m = activation_bytes(lr, tokens=10, hidden=1536, boundaries=b)
    assert m["comm/bytes_compressed"] == 7 * 10 * 77 * 2 + 7 * 1536 * 77 * 4 / 2
    sr = SrQuantConfig(quant_bits=1, quant_block=32)
    m = activation_bytes(sr, tokens=3, hidden=100, boundaries=b)
    assert m["comm/bytes_compressed"] == 7 * 3 * (100 + 4 * 16) / 8
    none = activation_bytes(NoActivationCodec(), tokens=3, hidden=100, boundaries=b)
    assert none["comm/bytes_ratio"] == 1.0
    tot = combine(m, none)
    assert tot["comm/bytes_dense"] == m["comm/bytes_dense"] + none["comm/bytes_dense"]


def test_grad_formulas():
    cfg = PowerSGDConfig(rank=2)
    d = grad_allreduce_bytes(PARAMS, cfg)
    dense = 4 * (12 * 8 + 2 * 24 * 16 + 2 * 16 + 20 * 18)
    assert d["comm/bytes_dense"] == dense
    # w: 2 layers x (24+16) x 2; head: (20+18) x 2; embed and bias uncompressed; +1 error-norm scalar.
    assert d["comm/bytes_compressed"] == 4 * (2 * 40 * 2 + 38 * 2 + 12 * 8 + 2 * 16 + 1)
    off = grad_allreduce_bytes(PARAMS, NoGradCodec())
    assert off["comm/bytes_compressed"] == dense and off["comm/bytes_ratio"] == 1.0
    bf = grad_allreduce_bytes(jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS), NoGradCodec())
    assert bf["comm/bytes_dense"] == dense / 2


def _grads():
    leaves, tree = jax.tree.flatten(PARAMS)
    return jax.tree.unflatten(tree, [jnp.ones((R,) + x.shape) for x in leaves])


def test_powersgd_formula_matches_hlo():
    for start_after in (0, 5):
        cfg = PowerSGDConfig(rank=2, start_after=start_after)
        st = init_powersgd(cfg, PARAMS, R)
        specs = state_specs(st, "data")
        f = dispatch.jit(
            jax.shard_map(
                lambda g, s: powersgd_reduce(jax.tree.map(lambda x: x[0], g), s, cfg, "data"),
                mesh=_mesh("data"),
                in_specs=(P("data"), specs),
                out_specs=(P(), specs, P()),
            )
        )
        got = collective_bytes_from_hlo(f.lower(_grads(), st).compile().as_text())
        want = grad_allreduce_bytes(PARAMS, cfg)["comm/bytes_compressed"]
        if start_after == 0:
            assert got["total"] == got["all-reduce"] == want, (got, want)
        else:  # lax.cond: both branches are compiled, so HLO holds the compressed and the plain collectives
            assert got["total"] == want + powersgd_plain_bytes(PARAMS), got
    # Dense reference: a plain pmean of the gradient tree moves exactly bytes_dense.
    dense = dispatch.jit(
        jax.shard_map(
            lambda g: jax.lax.pmean(jax.tree.map(lambda x: x[0], g), "data"),
            mesh=_mesh("data"),
            in_specs=P("data"),
            out_specs=P(),
        )
    )
    got = collective_bytes_from_hlo(dense.lower(_grads()).compile().as_text())
    assert got["total"] == grad_allreduce_bytes(PARAMS, cfg)["comm/bytes_dense"]


def test_pipeline_messages_match_hlo():
    # Emulate the wire: 8 stages on a "pipe" axis, each boundary ships its message to the next stage.
    N, H, r = 6, 40, 3
    bounds = list(range(R - 1))
    perm = [(i, i + 1) for i in range(R - 1)]
    Q = jnp.ones((H, r), jnp.float32)
    k = exact_k(0.9, H)
    lr = LowRankConfig(rank=r, update_cadence=1)
    pm = PrfMaskConfig(p=0.9, exact_k=True)

    def send_lowrank(h):
        return jax.lax.ppermute((h[0] @ Q.astype(h.dtype)), "pipe", perm)  # Y = M·Q, bf16 on the wire

    def send_mask(h):
        return jax.lax.ppermute(h[0][:, :k], "pipe", perm)  # k kept values per token, no indices

    h = jnp.ones((R, N, H), jnp.bfloat16)
    for fn, cfg, extra in ((send_lowrank, lr, len(bounds) * H * r * 4), (send_mask, pm, 0)):
        f = dispatch.jit(jax.shard_map(fn, mesh=_mesh("pipe"), in_specs=P("pipe"), out_specs=P("pipe")))
        # Unoptimised HLO: XLA:CPU's compiler widens bf16 collectives to f32, a CPU artefact, not wire bytes.
        got = collective_bytes_from_hlo(f.lower(h).compiler_ir("hlo").as_hlo_text())
        assert got["counts"]["collective-permute"] == 1
        want = activation_bytes(cfg, tokens=N, hidden=H, boundaries=bounds)["comm/bytes_compressed"]
        # HLO bytes are per participant = one boundary's message; the formula sums all boundaries + the basis.
        assert got["collective-permute"] * len(bounds) + extra == want, (got, want)


def test_hlo_parser_forms():
    text = """
  %p = f32[8,4]{1,0} parameter(0)
  %ar = f32[8,4]{1,0} all-reduce(f32[8,4]{1,0} %p), replica_groups={}, to_apply=%add
  %ags = (bf16[2,3]{1,0}, bf16[16,3]{1,0}) all-gather-start(bf16[2,3]{1,0} %x), dimensions={0}
  %agd = bf16[16,3]{1,0} all-gather-done(%ags)
  %t = (f32[10]{0}, s32[3]{0}) all-reduce(%p2, %q), to_apply=%add
  %p2 = f32[10]{0} parameter(1)
  %q = s32[3]{0} parameter(2)
"""
    got = collective_bytes_from_hlo(text)
    assert got["all-reduce"] == 8 * 4 * 4 + 40 + 12
    assert got["all-gather"] == 2 * 3 * 2 and got["counts"]["all-gather"] == 1
    assert got["total"] == 128 + 52 + 12


def test_bytes_count_the_channels_the_mask_keeps_on_half_cases():
    """One k: at H=10, p=0.75, (1-p)H = 2.5 and the mask keeps 3 channels per token; the bytes count 3 too."""
    from twocircuit_jax.fast.codecs.prf_mask import mask_bits

    for p, H in ((0.75, 10), (0.95, 30), (0.875, 4), (0.95, 1536)):
        cfg = PrfMaskConfig(p=p, exact_k=True)
        bits = mask_bits(
            cfg,
            [0],
            0,
            jnp.int32(1),
            jnp.arange(2, dtype=jnp.int32),
            jnp.tile(jnp.arange(5, dtype=jnp.int32), (2, 1)),
            H,
        )
        kept = np.asarray(bits).reshape(-1, H).sum(-1)
        assert len(set(kept.tolist())) == 1, kept
        m = activation_bytes(cfg, tokens=1, hidden=H, boundaries=[0])
        assert m["comm/bytes_compressed"] == kept[0] * 2, (p, H, kept[0], m)
