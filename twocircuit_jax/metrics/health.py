"""Live health gauges (`health/*`): is this run heading into the collapse the research describes?

Each step the loop hands `HealthMonitor.update` the step's scalar metrics; it keeps short host-side histories and
returns, per gauge, its value(s) and a state (0 ok, 1 warn, 2 alarm), plus `health/state`, the worst state among
the gauges in `health.alarm_on` (the others count up to warn). Thresholds and why: config/health.py. Everything is
plain floats on the host (no device work, no sync beyond the metrics the loop already fetched); the monitor's state
is JSON for the checkpoint meta, so a resumed run's gauges continue exactly.

Gauges (the metric each reads):
  entropy     policy/entropy: |H / H_ref - 1|, H_ref the baseline mean, or a dense arm's entropy at this step
  length      length/limit_share (level) and its least-squares slope over the window (share of the cap per step)
  truncation  length/truncated_frac
  mismatch    mismatch/prob_gap_mean and mismatch/kl_k3 as ratios to their baselines (floors added), and the drop
              of mismatch/prob_corr from its baseline; the worst of the three
  grad        grad/norm over the median of the previous `window` norms
  reward      reward/mean: 1 - (moving mean over `smooth` steps) / (best moving mean so far)
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.health import GAUGES

OK, WARN, ALARM = 0, 1, 2
STATE_NAMES = ("ok", "warn", "alarm")
_KEYS = {  # the histories the monitor keeps: gauge input -> metric key
    "entropy": "policy/entropy",
    "share": "length/limit_share",
    "trunc": "length/truncated_frac",
    "gap": "mismatch/prob_gap_mean",
    "corr": "mismatch/prob_corr",
    "kl": "mismatch/kl_k3",
    "grad": "grad/norm",
    "reward": "reward/mean",
}


def _level(value: Optional[float], warn: float, alarm: float) -> int:
    if value is None or not math.isfinite(value):
        return OK
    return ALARM if value >= alarm else WARN if value >= warn else OK


def _slope(y) -> float:
    y = np.asarray(y, np.float64)
    if y.size < 2:
        return 0.0
    x = np.arange(y.size, dtype=np.float64) - (y.size - 1) / 2
    return float(np.dot(x, y - y.mean()) / np.dot(x, x))


def read_dense_entropy(run_dir: str) -> dict[int, float]:
    """{step: policy/entropy} from a dense arm's metrics.jsonl (`health.dense_run`)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError("health.dense_run", f"{path} not found; name a run folder that holds a metrics.jsonl")
    out = {}
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError("health.dense_run", f"{path}:{i} is not a JSON line") from None
            if "policy/entropy" in rec and "step" in rec:
                out[int(rec["step"])] = float(rec["policy/entropy"])
    if not out:
        raise ConfigError("health.dense_run", f"{path} has no policy/entropy values")
    return out


class HealthMonitor:
    """Host-side gauges over the run's step metrics. `update(step, metrics) -> {health/...}`."""

    def __init__(self, cfg, dense_entropy: Optional[dict] = None):
        self.cfg = cfg
        self.dense_entropy = dense_entropy
        if dense_entropy is None and cfg.dense_run:
            self.dense_entropy = read_dense_entropy(cfg.dense_run)
        self.hist: dict[str, list] = {k: [] for k in _KEYS}  # recent values (at most baseline/window long)
        self.base: dict[str, list] = {k: [] for k in ("entropy", "gap", "corr", "kl")}  # the first baseline_steps
        self.best_reward: Optional[float] = None

    # --- state for checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"hist": self.hist, "base": self.base, "best_reward": self.best_reward}

    def load_state_dict(self, d: Optional[dict]) -> None:
        if d:
            self.hist = {k: list(d["hist"].get(k, [])) for k in _KEYS}
            self.base = {k: list(d["base"].get(k, [])) for k in self.base}
            self.best_reward = d.get("best_reward")

    def reset_trends(self) -> None:
        """After a rollback: the recent history belongs to the abandoned trajectory; the baselines (the run's early
        steps) and the best reward stay."""
        self.hist = {k: [] for k in _KEYS}

    # --- one step ---------------------------------------------------------------------------------------------
    def _push(self, metrics: dict) -> None:
        keep = max(self.cfg.window, self.cfg.smooth) + 1
        for name, key in _KEYS.items():
            v = metrics.get(key)
            if v is None or not math.isfinite(float(v)):
                continue
            self.hist[name] = (self.hist[name] + [float(v)])[-keep:]
            if name in self.base and len(self.base[name]) < self.cfg.baseline_steps:
                self.base[name].append(float(v))

    def _baseline(self, name) -> Optional[float]:
        b = self.base[name]
        return float(np.mean(b)) if b else None

    def recent(self, name, n) -> Optional[float]:
        h = self.hist[name]
        return float(np.mean(h[-n:])) if h else None

    def update(self, step: int, metrics: dict) -> dict:
        c = self.cfg
        grad_prev = list(self.hist["grad"][-c.window :])  # the spike is measured against the norms before it
        self._push(metrics)
        out, states = {}, {}

        # entropy: the recent mean against the baseline (or the dense arm at this step)
        ent = self.recent("entropy", c.smooth)
        ref = None
        if self.dense_entropy:
            ref = (
                self.dense_entropy.get(step) or self.dense_entropy[min(self.dense_entropy, key=lambda s: abs(s - step))]
            )
        elif len(self.base["entropy"]) >= c.baseline_steps:
            ref = self._baseline("entropy")
        if ent is not None and ref:
            out["health/entropy_ratio"] = ent / ref
            states["entropy"] = _level(abs(ent / ref - 1.0), c.entropy_warn, c.entropy_alarm)

        # length: level and slope of the mean length as a share of the cap
        if self.hist["share"]:
            share = self.hist["share"][-1]
            slope = _slope(self.hist["share"][-c.window :])
            out["health/length_share"], out["health/length_slope"] = share, slope
            states["length"] = max(
                _level(share, c.length_share_warn, c.length_share_alarm),
                _level(slope, c.length_slope_warn, c.length_slope_alarm) if len(self.hist["share"]) >= c.window else OK,
            )
        if self.hist["trunc"]:
            tr = self.recent("trunc", 2)
            out["health/truncated_frac"] = tr
            states["truncation"] = _level(tr, c.truncated_warn, c.truncated_alarm)

        # mismatch escalation: against the run's own early level, once that level is known
        ms = []
        if len(self.base["gap"]) >= c.baseline_steps and self.hist["gap"]:
            r = (self.recent("gap", c.smooth) + c.gap_floor) / (self._baseline("gap") + c.gap_floor)
            out["health/gap_ratio"] = r
            ms.append(_level(r, c.gap_ratio_warn, c.gap_ratio_alarm))
        if len(self.base["kl"]) >= c.baseline_steps and self.hist["kl"]:
            r = (max(self.recent("kl", c.smooth), 0.0) + c.kl_floor) / (max(self._baseline("kl"), 0.0) + c.kl_floor)
            out["health/rollout_kl_ratio"] = r
            ms.append(_level(r, c.kl_ratio_warn, c.kl_ratio_alarm))
        if len(self.base["corr"]) >= c.baseline_steps and self.hist["corr"]:
            d = self._baseline("corr") - self.recent("corr", c.smooth)
            out["health/corr_drop"] = d
            ms.append(_level(d, c.corr_drop_warn, c.corr_drop_alarm))
        if ms:
            states["mismatch"] = max(ms)

        # gradient-norm spike: this step's norm over the median of the window before it
        if self.hist["grad"] and len(grad_prev) >= 2 and "grad/norm" in metrics:
            med = float(np.median(grad_prev))
            if med > 0:
                spike = float(metrics["grad/norm"]) / med
                out["health/grad_spike"] = spike
                states["grad"] = _level(spike, c.grad_spike_warn, c.grad_spike_alarm)

        # reward: the moving mean's drop from its best
        if len(self.hist["reward"]) >= c.smooth:
            cur = self.recent("reward", c.smooth)
            self.best_reward = cur if self.best_reward is None else max(self.best_reward, cur)
            if self.best_reward >= c.reward_floor:
                drop = 1.0 - cur / self.best_reward
                out["health/reward_drop"] = drop
                states["reward"] = _level(drop, c.reward_drop_warn, c.reward_drop_alarm)

        worst = OK
        for g in GAUGES:
            if g in states:
                out[f"health/{g}_state"] = float(states[g])
                worst = max(worst, states[g] if g in c.alarm_on else min(states[g], WARN))
        out["health/state"] = float(worst)
        out["health/alarms"] = float(sum(1 for g, s in states.items() if s == ALARM and g in c.alarm_on))
        return out

    def alarming(self, health: dict) -> list[str]:
        """The gauges in alarm that count (`alarm_on`), by name."""
        return [g for g in self.cfg.alarm_on if health.get(f"health/{g}_state") == ALARM]


def replay(rows: list[dict], cfg, dense_entropy: Optional[dict] = None) -> dict:
    """Run the gauges over a finished run's metrics rows (metrics.jsonl order) with thresholds `cfg`: when each gauge
    first warned and first alarmed, when `health/state` first did, and when the reward's `smooth`-step mean first
    stood at half its best so far or less (`reward_half_step`). `lead` = reward_half_step - first alarm (steps of
    warning the alarm gave; None when either never happened). This is what `twocircuit health` prints."""
    mon = HealthMonitor(cfg, dense_entropy)
    first = {g: {"warn": None, "alarm": None} for g in (*GAUGES, "state")}
    best, half, acc = None, None, []
    for r in rows:
        step = int(r.get("step", 0))
        if "eval/accuracy" in r:
            acc.append((step, float(r["eval/accuracy"])))
        if step == 0:
            continue
        h = mon.update(step, r)
        for g in (*GAUGES, "state"):
            s = h.get("health/state" if g == "state" else f"health/{g}_state")
            for name, level in (("warn", WARN), ("alarm", ALARM)):
                if s is not None and s >= level and first[g][name] is None:
                    first[g][name] = step
        cur = mon.recent("reward", cfg.smooth) if len(mon.hist["reward"]) >= cfg.smooth else None
        if cur is not None:
            best = cur if best is None else max(best, cur)
            if half is None and best >= cfg.reward_floor and cur <= best / 2:
                half = step
    alarm = first["state"]["alarm"]
    return {
        "steps": max((int(r.get("step", 0)) for r in rows), default=0),
        "first": first,
        "reward_half_step": half,
        "lead": (half - alarm) if (half is not None and alarm is not None) else None,
        "accuracy": {
            "base": acc[0][1] if acc else None,
            "best": max((a for _, a in acc), default=None),
            "final": acc[-1][1] if acc else None,
        },  # fmt: skip
    }
