"""Where a word of our parameter pytree lives inside vLLM's Qwen2/Qwen3 parameters, for in-place delta updates.

vLLM stores every kernel as [out, in] (ours: [in, out], stacked over layers [L, in, out]) and fuses two groups of
projections into one parameter per layer:

    qkv_proj.weight  [(Nh + 2 Nkv) D, H]   rows: q, then k, then v   (and qkv_proj.bias the same way)
    gate_up_proj.weight  [2 I, H]          rows: gate, then up

`targets(cfg, leaf, shape, idx)` maps a leaf's changed flat positions (sorted, as weight_publish finds them) to
(vLLM parameter name, flat positions in it, the slice of `idx` that lands there). It builds no tensor: the cost is
O(changed words), so a sampler can write a delta straight into the engine's weights instead of reloading (and, on
vLLM's CPU build, repacking) whole modules.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from twocircuit_jax.model.hf_io import HF_NORMS, HF_TOP

_MODULE = {  # our projection -> vLLM module under model.layers.{i}
    "q_proj": "self_attn.qkv_proj",
    "k_proj": "self_attn.qkv_proj",
    "v_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_up_proj",
    "up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}


class Target(NamedTuple):
    name: str  # vLLM parameter name, e.g. "model.layers.3.self_attn.qkv_proj.weight"
    pos: np.ndarray  # int32 (int64 for leaves of 2^31+ words) [k]: flat positions in that parameter
    lo: int  # idx[lo:hi] (and the matching new words) land at `pos`
    hi: int


def _row_offset(cfg, proj: str) -> int:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"k_proj": q, "v_proj": q + kv, "up_proj": cfg.intermediate_size}.get(proj, 0)


def _rows(cfg, module: str) -> int:
    if module.endswith("qkv_proj"):
        return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if module.endswith("gate_up_proj"):
        return 2 * cfg.intermediate_size
    return 0  # unfused: the kernel's own out dimension


def targets(cfg, leaf: str, shape: tuple, idx: np.ndarray) -> list[Target]:
    """Engine positions of `idx` (sorted flat positions of leaf `leaf`, shape `shape`); see the module doc."""
    idx = np.asarray(idx)
    # int32 arithmetic where the leaf allows it: numpy's int32 divmod is ~4x faster than int64's
    big = max(int(np.prod(shape, dtype=np.int64)), int(np.prod(engine_shape(cfg, leaf, shape), dtype=np.int64)))
    it = np.int32 if big < 2**31 else np.int64
    if leaf in ("embed", "final_norm"):  # same layout on both sides
        return [Target(HF_TOP[leaf], idx.astype(it), 0, idx.size)]
    if leaf == "lm_head":  # ours [H, V] -> vLLM [V, H]
        h, v = shape
        i, o = np.divmod(idx.astype(it), it(v))
        return [Target(HF_TOP[leaf], o * it(h) + i, 0, idx.size)]
    parts = leaf.split("/")
    if parts[0] != "layers" or len(parts) not in (2, 3) or (len(parts) == 3 and parts[1] not in _MODULE):
        raise ValueError(f"no vLLM parameter for {leaf!r}")
    per = int(np.prod(shape[1:], dtype=np.int64))
    cuts = np.searchsorted(idx, np.arange(shape[0] + 1, dtype=np.int64) * per)  # idx is sorted: one range per layer
    out = []
    for layer in range(shape[0]):
        lo, hi = int(cuts[layer]), int(cuts[layer + 1])
        if lo == hi:
            continue
        r = idx[lo:hi].astype(it) - it(layer * per)
        pre = f"model.layers.{layer}."
        if len(parts) == 2:  # a per-layer norm vector
            out.append(Target(pre + HF_NORMS[parts[1]] + ".weight", r, lo, hi))
            continue
        module, off = _MODULE[parts[1]], _row_offset(cfg, parts[1])
        if parts[2] == "bias":
            out.append(Target(pre + module + ".bias", r + off, lo, hi))
        else:
            fan_in, fan_out = shape[1], shape[2]
            i, o = np.divmod(r, it(fan_out))
            out.append(Target(pre + module + ".weight", (o + it(off)) * it(fan_in) + i, lo, hi))
    return out


def engine_shape(cfg, leaf: str, shape: tuple) -> tuple:
    """The shape vLLM gives the parameter(s) that leaf `leaf` (of shape `shape`) lands in, per layer."""
    if leaf in ("embed", "final_norm"):
        return tuple(shape)
    if leaf == "lm_head":
        return (shape[1], shape[0])
    parts = leaf.split("/")
    if len(parts) == 2:
        return tuple(shape[1:])
    rows = _rows(cfg, _MODULE[parts[1]]) or shape[-1]
    return (rows,) if parts[2] == "bias" else (rows, shape[1])
