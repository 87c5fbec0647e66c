"""Byte accounting (design §3.6): logical per-step bytes of each boundary codec and of the dp gradient all-reduce,
plus a parser of compiled HLO that sums collective operand bytes, to check the formulas (design §8 inv. 9).

All functions return plain Python floats: the numbers depend only on static shapes and the config, so they cost
nothing at run time and can be logged as `comm/bytes_compressed`, `comm/bytes_dense`, `comm/bytes_ratio`
(`comm/elements_*` too). Activation traffic counts the gradient-bearing forward only; activations are 16-bit on
the wire (`act_bytes`), bases fp32.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from twocircuit_jax.fast.codecs.base import make_activation_codec, make_grad_codec, wire_result as _result
from twocircuit_jax.fast.leaf_plan import flat_leaves, plan_leaves

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "s4": 0.5,
    "u4": 0.5,
}
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
ERROR_NORM_BYTES = 4  # powersgd packs one fp32 scalar (‖e‖²) into its uncompressed mean


def activation_bytes(codec_cfg, *, tokens: int, hidden: int, boundaries: Sequence[int], act_bytes: int = 2) -> dict:
    """Boundary traffic of one gradient-bearing forward of `tokens` tokens (N) under the codec section `codec_cfg`
    (`fast.codec`): the codec's own `wire_bytes`; no codec sends N·H·act_bytes per boundary (the dense figure)."""
    codec = make_activation_codec(codec_cfg, hidden=hidden, boundaries=boundaries)
    if codec is None:
        el_d = len(boundaries) * int(tokens) * int(hidden)
        return _result(el_d * act_bytes, el_d * act_bytes, el_d, el_d)
    return codec.wire_bytes(tokens, hidden, boundaries, act_bytes)


def grad_allreduce_bytes(params_like, cfg) -> dict:
    """Per-replica bytes of one dp gradient reduction (logical, as in design §3.6); `cfg` is the `fast.grad_codec`
    section: the registered codec's own `wire_bytes` (compressed branch); no codec sends every leaf at its dtype."""
    codec = make_grad_codec(cfg)
    if codec is None:
        return dense_grad_bytes(params_like)
    return codec.wire_bytes(params_like)


def dense_grad_bytes(params_like) -> dict:
    """XLA's plain mean: Σ size·bytes(dtype) per replica."""
    leaves = flat_leaves(params_like)
    dense = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves.values())
    el_d = sum(int(np.prod(x.shape)) for x in leaves.values())
    return _result(dense, dense, el_d, el_d)


def powersgd_bytes(params_like, cfg) -> dict:
    """PowerSGD's compressed branch (`cfg` a PowerSGDConfig): per compressible leaf L·(n+m)·r·4 (P sum + Q mean), plus
    every other leaf in fp32 and the 4-byte error-norm scalar that its packed mean carries."""
    d = dense_grad_bytes(params_like)
    el_c = 0
    for p in plan_leaves(cfg, params_like):
        el_c += p.layers * (p.n + p.m) * cfg.rank if p.compress else int(np.prod(p.shape))
    return _result(el_c * 4 + ERROR_NORM_BYTES, d["comm/bytes_dense"], el_c + 1, d["comm/elements_dense"])


def powersgd_plain_bytes(params_like) -> float:
    """Bytes of powersgd_reduce's warm-up (plain mean) branch: every leaf in fp32 plus the error-norm scalar."""
    return float(sum(int(np.prod(x.shape)) for x in flat_leaves(params_like).values()) * 4 + ERROR_NORM_BYTES)


def combine(*parts: dict) -> dict:
    """Sum several accounting dicts (activations + gradients) into one step total."""
    c = sum(p["comm/bytes_compressed"] for p in parts)
    d = sum(p["comm/bytes_dense"] for p in parts)
    ec = sum(p.get("comm/elements_compressed", 0.0) for p in parts)
    ed = sum(p.get("comm/elements_dense", 0.0) for p in parts)
    return _result(c, d, ec, ed)


_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)")


def shape_bytes(text: str) -> float:
    total = 0.0
    for dt, dims in _SHAPE.findall(text):
        if dt not in _DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dt]
    return total


def _operand_list(args: str) -> str:
    depth = 1
    for i, ch in enumerate(args):  # the operand list ends at the matching parenthesis
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return args[:i]
    return args


def collective_bytes_from_hlo(hlo_text: str) -> dict:
    """Sum operand bytes of collectives in HLO text, by kind, plus "total" and per-kind "counts".

    Counts `kind(` and async `kind-start(` instructions (never `-done`, which would double count). Compiled HLO
    prints operands by name only (`all-reduce(%fusion.3)`), so shapes come from a table of every instruction's
    result shape; typed operands (`f32[8]{0} %x`, pre-optimisation text) are read directly. Bytes are per
    participant (what one replica contributes), which is what the §3.6 formulas count.

    Accepts compiled (`.compile().as_text()`) and unoptimised (`.compiler_ir("hlo").as_hlo_text()`) text. Note:
    XLA:CPU widens bf16 collectives to f32 during compilation (no bf16 reductions on CPU), so on the fake CPU
    mesh bf16 wire bytes must be read from the unoptimised text; TPU/GPU compiled HLO keeps bf16.
    """
    defs, ops = {}, []
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        defs[name.lstrip("%")] = shape
        base = op[: -len("-start")] if op.endswith("-start") else op
        if base in COLLECTIVE_KINDS:
            ops.append((base, _operand_list(rest)))
    out = {k: 0.0 for k in COLLECTIVE_KINDS}
    counts = {k: 0 for k in COLLECTIVE_KINDS}
    for kind, args in ops:
        if _SHAPE.search(args):
            b = shape_bytes(args)
        else:
            b = sum(shape_bytes(defs.get(n, "")) for n in _NAME.findall(args))
        out[kind] += b
        counts[kind] += 1
    out["total"] = sum(out[k] for k in COLLECTIVE_KINDS)
    out["counts"] = counts
    return out
