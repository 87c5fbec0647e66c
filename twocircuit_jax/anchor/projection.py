"""Rank-1 weight projection (design §4.5): forecast the generator's weights from a window of exact snapshots.

Host-side numpy: snapshots already live in host memory (sampler dtype), and the anchor forecasts once per fire.
Per floating tensor, in fp32 (products accumulated in fp64), streamed in 2^20-element chunks so that no full
fp32 copy of a large bf16 tensor or of the W−1 displacement rows is ever materialised:

  D_i = θ_i − θ_0,  G = D·Dᵀ,  (λ₁, u) top eigenpair,  σ = √λ₁,  c_i = σu_i,  v = Σ u_i D_i / σ,
  s = secant (W = 2) or least-squares slope of c_i on t_i (i ≥ 1, free intercept),
  θ̂ = θ_{W−1} + strength·s·(t_target − t_{W−1})·v.

The sign ambiguity of u cancels in s·v. Everything is computed before anything is returned, and a non-finite
value anywhere raises `FloatingPointError`, so a bad window cannot reach M or Q (the anchor then skips that fire and
counts it in `anchor/skipped`, anchor/circuit.py).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import jax
import numpy as np

CHUNK = 1 << 20  # elements per streamed slice
_MODES = ("sliding_window", "growing_fixed_base")


def _is_float(x) -> bool:
    return np.issubdtype(np.asarray(x).dtype, np.floating) or str(np.asarray(x).dtype) == "bfloat16"


def _chunks(n: int):
    for lo in range(0, n, CHUNK):
        yield lo, min(lo + CHUNK, n)


def _flat(x) -> np.ndarray:
    return np.asarray(x).reshape(-1)


def _gram(flats: List[np.ndarray]) -> np.ndarray:
    """(W−1)×(W−1) Gram of D_i = θ_i − θ_0, streamed over chunks."""
    k = len(flats) - 1
    g = np.zeros((k, k), np.float64)
    for lo, hi in _chunks(flats[0].size):
        base = flats[0][lo:hi].astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # inf - inf: caught as a non-finite Gram by the caller
            d = np.stack([f[lo:hi].astype(np.float32) - base for f in flats[1:]])
            g += d.astype(np.float64) @ d.T.astype(np.float64)
    return g


def _slope(t: np.ndarray, c: np.ndarray) -> Tuple[float, float]:
    """Slope of c on t and R². W=2: secant through (t₀, 0); else least squares over i ≥ 1, free intercept."""
    if len(t) == 2:
        return c[1] / (t[1] - t[0]), 1.0
    tt, cc = t[1:], c[1:]
    tm, cm = tt.mean(), cc.mean()
    var = np.sum((tt - tm) ** 2)
    if var <= 0:
        raise ValueError(f"snapshot ticks {t.tolist()} give no spread for the least-squares slope")
    s = np.sum((tt - tm) * (cc - cm)) / var
    ss_tot = np.sum((cc - cm) ** 2)
    ss_res = np.sum((cc - (cm + s * (tt - tm))) ** 2)
    return s, (1.0 - ss_res / ss_tot) if ss_tot > 0 else 1.0


def _forecast_leaf(flats, shape, t, t_target, strength, out_dtype):
    """(forecast or None for zero motion, evr, r2)."""
    gram = _gram(flats)
    if not np.all(np.isfinite(gram)):
        raise FloatingPointError("rank-1 projection: non-finite snapshot displacement")
    lam, vec = np.linalg.eigh(gram)
    pos = lam[lam > 0].sum()
    if pos <= 0:  # no motion at all: the newest exact snapshot is the forecast
        return None, 0.0, 0.0
    lam1, u = lam[-1], vec[:, -1]
    sigma = np.sqrt(lam1)
    c = np.concatenate([[0.0], sigma * u])
    s, r2 = _slope(t, c)
    coef = strength * s * (t_target - t[-1]) / sigma  # multiplies Σ u_i D_i
    out = np.empty(int(np.prod(shape)), out_dtype)
    for lo, hi in _chunks(out.size):
        base = flats[0][lo:hi].astype(np.float32)
        step = np.zeros(hi - lo, np.float64)
        for ui, f in zip(u, flats[1:]):
            step += ui * (f[lo:hi].astype(np.float32) - base)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught just below, as a clear error
            piece = flats[-1][lo:hi].astype(np.float32) + (coef * step).astype(np.float32)
        if not np.all(np.isfinite(piece)):
            raise FloatingPointError("rank-1 projection: non-finite forecast")
        out[lo:hi] = piece.astype(out_dtype)
    return out.reshape(shape), float(lam1 / pos), float(r2)


def rank1_forecast(
    snapshots: Sequence[Any], ticks: Sequence[int], target_tick: int, strength: float = 1.0, out_dtype=None
) -> Tuple[Any, Dict[str, float]]:
    """Forecast params at `target_tick` from W ≥ 2 snapshot pytrees at strictly increasing `ticks`.

    Floating leaves are forecast (returned in `out_dtype`, default the newest snapshot's dtype); other leaves
    and zero-motion tensors are the newest snapshot. Raises FloatingPointError on any non-finite value."""
    if len(snapshots) != len(ticks) or len(snapshots) < 2:
        raise ValueError(f"need W >= 2 snapshots with one tick each, got {len(snapshots)} and {len(ticks)}")
    t = np.asarray(ticks, np.float64)
    if np.any(np.diff(t) <= 0):
        raise ValueError(f"snapshot ticks must be strictly increasing, got {list(ticks)}")
    leaves = [jax.tree_util.tree_flatten(s) for s in snapshots]
    treedef = leaves[-1][1]
    if any(d != treedef for _, d in leaves):
        raise ValueError("snapshots have different pytree structures")
    out, evrs, r2s, zero = [], [], [], 0
    for parts in zip(*(ls for ls, _ in leaves)):
        newest = np.asarray(parts[-1])
        if not _is_float(newest):
            out.append(parts[-1])
            continue
        if not np.all(np.isfinite(newest.astype(np.float32))):
            raise FloatingPointError("rank-1 projection: non-finite newest snapshot")
        dtype = newest.dtype if out_dtype is None else np.dtype(out_dtype)
        fc, evr, r2 = _forecast_leaf(
            [_flat(p) for p in parts], newest.shape, t, float(target_tick), float(strength), dtype
        )
        if fc is None:
            zero += 1
            out.append(parts[-1])
        else:
            out.append(fc)
            evrs.append(evr)
            r2s.append(r2)
    metrics = {
        "rank1/evr": float(np.mean(evrs)) if evrs else 0.0,
        "rank1/r2": float(np.mean(r2s)) if r2s else 0.0,
        "rank1/horizon": float(target_tick - ticks[-1]),
        "rank1/window_span": float(ticks[-1] - ticks[0]),
        "rank1/zero_motion": float(zero),
    }
    return jax.tree_util.tree_unflatten(treedef, out), metrics


class SnapshotWindow:
    """History of exact snapshots for the projection (host memory; plain class on purpose).

    The base is the first generator snapshot; after it only exact delayed snapshots (each fire's snapshot) that
    are strictly newer than the newest held one enter. `sliding_window` keeps the newest `window`;
    `growing_fixed_base` keeps the base plus the newest ones, `max_snapshots` in all. Usable from `min_snapshots`.
    """

    def __init__(self, window: int = 4, min_snapshots: int = 2, mode: str = "sliding_window", max_snapshots: int = 8):
        if mode not in _MODES:
            raise ValueError(f"window_mode must be one of {_MODES}, got {mode!r}")
        cap = window if mode == "sliding_window" else max_snapshots
        if not 2 <= min_snapshots <= cap:
            raise ValueError(f"min_snapshots={min_snapshots} must lie in 2..{cap} for {mode}")
        self.mode, self.cap, self.min_snapshots = mode, cap, min_snapshots
        self._ticks: List[int] = []
        self._snaps: List[Any] = []

    @classmethod
    def from_config(cls, cfg) -> "SnapshotWindow":
        return cls(cfg.window, cfg.min_snapshots, cfg.window_mode, cfg.max_snapshots)

    def add_base(self, tick: int, params) -> bool:
        """The first generator snapshot; later calls are ignored (returns whether it was taken)."""
        if self._ticks:
            return False
        self._ticks.append(int(tick))
        self._snaps.append(params)
        return True

    def add_exact(self, tick: int, params) -> bool:
        """A fire's exact delayed snapshot; kept only if strictly newer than the newest held snapshot."""
        if not self._ticks:
            raise RuntimeError("SnapshotWindow: add_base (the first generator snapshot) must come first")
        if tick <= self._ticks[-1]:
            return False
        self._ticks.append(int(tick))
        self._snaps.append(params)
        while len(self._ticks) > self.cap:  # drop references so host memory is freed
            drop = 0 if self.mode == "sliding_window" else 1
            del self._ticks[drop], self._snaps[drop]
        return True

    @property
    def ticks(self) -> List[int]:
        return list(self._ticks)

    def copy(self) -> "SnapshotWindow":
        """A trial copy: its own tick and snapshot lists (the snapshots themselves shared, read-only), so adding to
        it leaves this window as it was."""
        out = SnapshotWindow(self.cap, self.min_snapshots, self.mode, self.cap)  # the same cap in either mode
        out.load_state_dict(self.state_dict())
        return out

    def state_dict(self) -> dict:
        """{"ticks": [int], "snaps": [params pytree of host arrays]}: the snapshots held, oldest first."""
        return {"ticks": list(self._ticks), "snaps": list(self._snaps)}

    def load_state_dict(self, d: dict) -> None:
        ticks, snaps = [int(t) for t in d["ticks"]], list(d["snaps"])
        if len(ticks) != len(snaps) or len(ticks) > self.cap:
            raise ValueError(
                f"SnapshotWindow: {len(ticks)} ticks and {len(snaps)} snapshots for a window of {self.cap}"
            )
        self._ticks, self._snaps = ticks, snaps

    @property
    def ready(self) -> bool:
        return len(self._ticks) >= self.min_snapshots

    def forecast(self, target_tick: int, strength: float = 1.0, out_dtype=None):
        if not self.ready:
            raise RuntimeError(f"SnapshotWindow holds {len(self._ticks)} < min_snapshots={self.min_snapshots}")
        return rank1_forecast(self._snaps, self._ticks, target_tick, strength, out_dtype)
