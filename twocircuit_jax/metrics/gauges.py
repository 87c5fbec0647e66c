"""Health gauges (design §6): policy entropy, response lengths and the length slope, plus host-side cleanup.

Entropy works on device arrays (jnp, jit-safe); length statistics run on the host over the rollout's python
lists (numpy), since lengths are known there before any device work.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np


def entropy_summary(entropy, mask, prefix: str = "policy/") -> dict:
    """Token-mean entropy over the mask (`policy/entropy`) with its std and max; NaN when the mask is empty."""
    e = jnp.asarray(entropy, jnp.float32)
    m = jnp.asarray(mask, jnp.float32)
    n = jnp.sum(m)
    mean = jnp.sum(e * m) / jnp.maximum(n, 1.0)
    std = jnp.sqrt(jnp.sum((e - mean) ** 2 * m) / jnp.maximum(n, 1.0))
    mx = jnp.max(jnp.where(m > 0, e, -jnp.inf))
    out = {"entropy": mean, "entropy_std": std, "entropy_max": mx}
    return {prefix + k: jnp.where(n > 0, v, jnp.nan) for k, v in out.items()}


def length_stats(lengths: Sequence[int], truncated: Sequence[bool], limit: int) -> dict:
    """`length/mean`, `length/max`, `length/limit_share` (mean / limit) and `length/truncated_frac`."""
    if limit <= 0:
        raise ValueError(f"length_stats: limit must be > 0 (sampling.max_new_tokens), got {limit}")
    lens = np.asarray(lengths, np.float64)
    if lens.size == 0:
        return {}
    trunc = np.asarray(truncated, bool)
    if trunc.shape != lens.shape:
        raise ValueError(f"length_stats: {lens.size} lengths but {trunc.size} truncated flags")
    mean = float(lens.mean())
    return {
        "length/mean": mean,
        "length/max": float(lens.max()),
        "length/limit_share": mean / limit,
        "length/truncated_frac": float(trunc.mean()),
    }


def length_slope(history: Sequence[float], window: int = 10) -> float:
    """Least-squares slope (tokens/step) of the last `window` values of `length/mean`; 0.0 with < 2 points."""
    y = np.asarray([v for v in history][-window:], np.float64)
    if y.size < 2:
        return 0.0
    x = np.arange(y.size, dtype=np.float64)
    x -= x.mean()
    return float(np.dot(x, y - y.mean()) / np.dot(x, x))


def to_floats(metrics: Mapping, drop_nan: bool = True) -> dict:
    """Device scalars -> python floats for metrics.jsonl; NaN (a split with no data) is dropped, not written."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, str):
            out[k] = v
            continue
        f = float(np.asarray(v))
        if drop_nan and math.isnan(f):
            continue
        out[k] = f
    return out
