"""Statistics for verdicts across seeds (rliable, Agarwal et al. 2021): pure numpy, no JAX, no I/O.

A verdict compares two groups of runs (arms), one scalar per run (its final accuracy, say). With 3-10 seeds a
group's mean is noisy and its distribution unknown, so every interval here is a percentile bootstrap:

- `bootstrap_ci`: stratified bootstrap. Each group is resampled with replacement *within itself* (its own size
  kept), the statistic is recomputed on each of `n_resamples` resamples, and the interval is the (2.5, 97.5)
  percentiles. `paired=True` resamples the seed indices once for all groups (the groups are aligned by seed), which
  keeps the pairing: a paired difference's interval is then that of the per-seed differences' mean.
- `iqm`: the interquartile mean (scipy's `trim_mean(x, 0.25)`, rliable's IQM): the mean of the middle half,
  robust to one collapsed seed yet less noisy than the median.
- `prob_improvement`: P(B > A) over all pairs (a, b) of runs, a tie counting 1/2 (the Mann-Whitney U statistic
  over m*n; rliable's probability of improvement for one task).
- `paired_difference`: B - A by seed where both groups have the seed, else unpaired.
- `score_profile` / `profile_band`: rliable's performance profile (run-score distribution): the fraction of a
  group's runs scoring above each threshold tau, with its bootstrap band. Where the IQM says "typically", the
  profile shows the spread: one collapsed seed in five is a step of 0.2 at the low end.

All of it is vectorised over the resamples (an array of shape [n_resamples, runs]): 10,000 resamples of 10 seeds
are milliseconds. The RNG is seeded (default 0), so a table is reproducible bit for bit.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np


def binomial_se(p: float, n: int) -> float:
    """The standard error of an accuracy p measured on n independent problems: sqrt(p(1-p)/n)."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else float("nan")


N_RESAMPLES = 10_000
LEVEL = 0.95


def iqm(x, axis: int = -1) -> np.ndarray:
    """Interquartile mean along `axis`: sort, cut floor(n/4) values from each end, average the rest (n < 4 cuts
    nothing: the plain mean)."""
    x = np.sort(np.asarray(x, dtype=np.float64), axis=axis)
    n = x.shape[axis]
    if n == 0:
        raise ValueError("iqm of an empty sample")
    cut = int(0.25 * n)
    return np.take(x, np.arange(cut, n - cut), axis=axis).mean(axis=axis)


def mean(x, axis: int = -1) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).mean(axis=axis)


def prob_improvement(a, b) -> np.ndarray:
    """P(B > A) over every pair of a run of A and a run of B, ties 1/2. Leading axes (resamples) broadcast: a is
    [..., m], b is [..., n]."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    gt = (b[..., :, None] > a[..., None, :]).astype(np.float64)
    eq = (b[..., :, None] == a[..., None, :]).astype(np.float64)
    return (gt + 0.5 * eq).mean(axis=(-2, -1))


def mean_difference(a, b) -> np.ndarray:
    """mean(B) - mean(A) (for paired groups, the mean of the per-seed differences: the same number)."""
    return mean(b) - mean(a)


class Interval(NamedTuple):
    point: float  # the statistic on the sample itself
    lo: float  # the interval's lower end (2.5th percentile of the bootstrap at 95%)
    hi: float


def bootstrap_ci(
    stat: Callable,
    *groups,
    paired: bool = False,
    n_resamples: int = N_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap interval of `stat(*groups)`. `stat` takes one array per group with a leading resample
    axis ([R, n_g]) and returns [R] (the helpers here all do). Stratified: each group is resampled within itself;
    `paired=True` draws one index set for all groups (equal sizes, aligned by seed)."""
    if not groups:
        raise ValueError("bootstrap_ci needs at least one group")
    gs = [np.asarray(g, dtype=np.float64).reshape(-1) for g in groups]
    if any(g.size == 0 for g in gs):
        raise ValueError("bootstrap_ci: an empty group")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    if paired:
        if len({g.size for g in gs}) != 1:
            raise ValueError(f"paired groups need equal sizes, got {[g.size for g in gs]}")
        idx = rng.integers(0, gs[0].size, size=(n_resamples, gs[0].size))
        samples = [g[idx] for g in gs]
    else:
        samples = [g[rng.integers(0, g.size, size=(n_resamples, g.size))] for g in gs]
    vals = np.asarray(stat(*samples), dtype=np.float64)
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(vals, [tail, 100.0 - tail])
    point = float(np.asarray(stat(*[g[None] for g in gs])).reshape(-1)[0])
    return Interval(point, float(lo), float(hi))


class Paired(NamedTuple):
    a: np.ndarray  # [n] group A's values (aligned with b by seed when paired)
    b: np.ndarray  # [n'] group B's values
    paired: bool
    seeds: tuple  # the common seeds when paired, else ()
    note: str  # what the table says about the pairing


def paired_difference(a: dict, b: dict) -> Paired:
    """Align two groups given as {seed: value}. Paired on the seeds both have when there are at least two of them
    (the seeds only one group has are left out, and the note says so); unpaired (every run of each group) otherwise.
    A seed here fixes the data order and sampling of both arms, so pairing removes that shared noise."""
    common = sorted(set(a) & set(b))
    if len(common) >= 2:
        left = sorted(set(a) ^ set(b))
        note = f"paired, {len(common)} seeds" + (f" (unpaired seeds {left} left out)" if left else "")
        return Paired(np.array([a[s] for s in common]), np.array([b[s] for s in common]), True, tuple(common), note)
    return Paired(np.array(list(a.values())), np.array(list(b.values())), False, (), f"unpaired, {len(a)} vs {len(b)}")


def difference_ci(p: Paired, **kw) -> Interval:
    """B - A with its bootstrap interval (paired resampling when the groups are paired)."""
    return bootstrap_ci(mean_difference, p.a, p.b, paired=p.paired, **kw)


def improvement_ci(p: Paired, **kw) -> Interval:
    """P(B > A) with its bootstrap interval: each group resampled within itself (rliable's stratified bootstrap;
    pairs of runs, not seeds, are what the statistic counts)."""
    return bootstrap_ci(prob_improvement, p.a, p.b, **kw)


def curve_band(values, **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds and its bootstrap interval at every step: values [seeds, steps] -> (mean, lo, hi), each
    [steps]. One draw of seed indices serves every step (a resampled seed keeps its whole curve)."""
    v = np.asarray(values, dtype=np.float64)
    n_resamples, level = kw.get("n_resamples", N_RESAMPLES), kw.get("level", LEVEL)
    rng = np.random.default_rng(kw.get("seed", 0))
    idx = rng.integers(0, v.shape[0], size=(n_resamples, v.shape[0]))
    boot = v[idx].mean(axis=1)  # [R, steps]
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(boot, [tail, 100.0 - tail], axis=0)
    return v.mean(axis=0), lo, hi


def score_profile(values, taus) -> np.ndarray:
    """Fraction of runs with a score strictly above each tau: values [..., runs], taus [T] -> [..., T]. Leading
    axes (resamples) broadcast."""
    v = np.asarray(values, dtype=np.float64)
    t = np.asarray(taus, dtype=np.float64)
    return (v[..., None, :] > t[:, None]).mean(axis=-1)


def profile_band(values, taus, **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The performance profile of one group's runs with its bootstrap band: (point, lo, hi), each [T]. The runs are
    resampled with replacement (one group: stratification is trivial); the band is the per-tau percentile interval."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise ValueError("profile_band of an empty group")
    n_resamples, level = kw.get("n_resamples", N_RESAMPLES), kw.get("level", LEVEL)
    rng = np.random.default_rng(kw.get("seed", 0))
    boot = score_profile(v[rng.integers(0, v.size, size=(n_resamples, v.size))], taus)  # [R, T]
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(boot, [tail, 100.0 - tail], axis=0)
    return score_profile(v, taus), lo, hi


# --- one run's accuracy curve -> the scalars a verdict compares ------------------------------------------------


def auc(steps, values) -> float:
    """Area under the curve by the trapezoid rule over step, divided by the step span: the curve's average height
    (the value itself for a single point)."""
    s, v = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if s.size == 0:
        raise ValueError("auc of an empty curve")
    if s.size == 1 or s[-1] == s[0]:
        return float(v.mean())
    return float(np.sum((v[1:] + v[:-1]) * np.diff(s)) / 2.0 / (s[-1] - s[0]))


def accuracy_summary(steps, acc, last_k: int = 3) -> dict:
    """final, mean of the last `last_k` evaluations, AUC, best accuracy of one run, its drop from the best to the
    final evaluation (what a collapse is: 0 for a run that ends at its best), and its gain over its first (step 0:
    the base model's) evaluation, None each when never evaluated (the gain: when step 0 was not evaluated)."""
    if last_k < 1:
        raise ValueError(f"last_k must be >= 1, got {last_k}")
    keys = ("final_accuracy", "last_k_accuracy", "auc_accuracy", "best_accuracy", "drop_from_best", "gain_over_base")
    if len(acc) == 0:
        return {**dict.fromkeys(keys), "last_k": last_k}
    best, final = float(np.max(acc)), float(acc[-1])
    return {
        "final_accuracy": final,
        "last_k_accuracy": float(np.mean(acc[-last_k:])),
        "auc_accuracy": auc(steps, acc),
        "best_accuracy": best,
        "drop_from_best": best - final,
        "gain_over_base": final - float(acc[list(steps).index(0)]) if 0 in list(steps) else None,
        "last_k": last_k,
    }
