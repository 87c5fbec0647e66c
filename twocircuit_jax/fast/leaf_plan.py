"""Which gradient leaves PowerSGD compresses, in the fixed sorted-path order its collectives use.

Shared by the reducer (`fast/powersgd.py`) and the byte accounting (`fast/bytes.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from twocircuit_jax.names import path_str


class LeafPlan(NamedTuple):
    path: str
    shape: tuple
    compress: bool
    layers: int  # L of a stacked leaf, 1 for a matrix, 0 when not compressed
    n: int
    m: int


def flat_leaves(tree) -> dict:
    """{path: leaf}; the sorted path order is the collective order."""
    return {path_str(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def plan_leaves(cfg, params_like) -> list[LeafPlan]:
    """Sorted per-leaf decision: compress iff a matrix [n, m] or a stack of them and (n+m)·r·min_compression_rate < n·m.

    A leaf of the layer stack (`layers/...`) carries the layer axis first: [L, n, m] is L matrices, and [L, H] (a
    norm, a bias) is L vectors, never one L x H matrix. Compressing it as one would mix the layers in one low-rank
    factor and, with real pipeline stages, tie the stages' layers together."""
    out = []
    for path, x in sorted(flat_leaves(params_like).items()):
        shape = tuple(x.shape)
        is_embed = ("embed" in path) or ("lm_head" in path)
        stacked = path.startswith("layers/")
        if len(shape) >= 2 + stacked and not (is_embed and not cfg.compress_embeddings):
            n, m = shape[-2], shape[-1]
            L = 1
            for d in shape[:-2]:
                L *= d
            if (n + m) * cfg.rank * cfg.min_compression_rate < n * m:
                out.append(LeafPlan(path, shape, True, L, n, m))
                continue
        out.append(LeafPlan(path, shape, False, 0, 0, 0))
    return out
