"""The `health` and `guard` config sections: the live collapse gauges' thresholds and the collapse guard.

Defaults and why (docs/collapse.md has the research's numbers they come from):
- truncation: the research's collapse began with the truncated share passing 1% and climbing to 8% about ten steps
  before the reward fell; warn at 5%, alarm at 20%.
- length: mean length as a share of the generation cap; a run that settles uses 25-40% of it, one that balloons
  reaches the cap. Warn at 0.8, alarm at 0.95; the slope (share of the cap per step, over `window` steps) warns at
  0.02 and alarms at 0.05 (the cap reached in 20 steps).
- mismatch: the gap and the rollout-vs-trainer KL against their own early-run level (ratios, with a floor so a
  dense run's ~0 does not divide by zero), the correlation as a drop from its early level. The research's gap went
  0.7 -> 0.83 at the reward peak (x1.19) -> 0.93 in the collapse (x1.33), the correlation 0.14 -> 0, the KL 5-13 ->
  31 nats (x2.4-6): the gap warns at x1.2 and alarms at x1.4, the KL at x1.5 and x2.5, the correlation's drop at 0.1
  and 0.2. On this project's demo the compressed arm without the anchor at three boundaries crossed x1.4 when its
  held-out accuracy had fallen to about half the base (docs/collapse.md).
- grad: a gradient norm 3x (warn) or 10x (alarm) its median over the window; the research's crash had spikes of
  tens of times the settled norm.
- reward: the smoothed reward's drop from its running best, as a share of the best; 25% warns, 50% alarms.
- entropy: its relative distance from the early-run baseline (or from a named dense arm at the same step). The
  research found it separated healthy and failing arms early but stay flat through one collapse, so by default it
  warns and never alarms (`alarm_on` leaves it out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from twocircuit_jax.config.base import doc, require

GAUGES = ("entropy", "length", "truncation", "mismatch", "grad", "reward")
MITIGATIONS = ("anchor_cadence", "kl", "tis", "swap", "headroom")


@dataclass(frozen=True)
class HealthConfig:
    """Live health gauges (`health/*`), each ok / warn / alarm; computed on the host every step from its metrics."""

    baseline_steps: int = field(default=10, metadata=doc("early steps whose mean is each gauge's baseline"))
    window: int = field(default=10, metadata=doc("steps in the trend, slope and spike windows"))
    smooth: int = field(default=5, metadata=doc("steps in the reward's moving mean"))
    dense_run: str = field(default="", metadata=doc("a dense arm's run folder: entropy is compared to its entropy"))
    alarm_on: tuple[str, ...] = field(
        default=("length", "truncation", "mismatch", "grad", "reward"),
        metadata=doc("gauges whose alarm is the run's alarm (the others warn at most)"),
    )
    entropy_warn: float = field(
        default=0.25, metadata=doc("warn when entropy differs from its reference by this share")
    )
    entropy_alarm: float = field(
        default=0.5, metadata=doc("alarm level of the entropy's relative distance (not in alarm_on by default)")
    )
    length_share_warn: float = field(
        default=0.8, metadata=doc("warn when mean completion length reaches this share of the cap")
    )
    length_share_alarm: float = field(
        default=0.95, metadata=doc("alarm when mean completion length reaches this share of the cap")
    )
    length_slope_warn: float = field(
        default=0.02, metadata=doc("warn when the length share grows this much per step over window")
    )
    length_slope_alarm: float = field(
        default=0.05, metadata=doc("alarm when the length share grows this much per step over window")
    )
    truncated_warn: float = field(default=0.05, metadata=doc("warn when this share of completions hits the cap"))
    truncated_alarm: float = field(default=0.2, metadata=doc("alarm when this share of completions hits the cap"))
    gap_ratio_warn: float = field(
        default=1.2, metadata=doc("warn when the sampler-trainer prob gap reaches this multiple of its baseline")
    )
    gap_ratio_alarm: float = field(
        default=1.4, metadata=doc("alarm when the sampler-trainer prob gap reaches this multiple of its baseline")
    )
    gap_floor: float = field(default=0.01, metadata=doc("added to gap and baseline before the ratio"))
    corr_drop_warn: float = field(
        default=0.1, metadata=doc("warn when the sampler-trainer prob correlation falls this much below its baseline")
    )
    corr_drop_alarm: float = field(
        default=0.2, metadata=doc("alarm when the sampler-trainer prob correlation falls this much below its baseline")
    )
    kl_ratio_warn: float = field(
        default=1.5, metadata=doc("warn when the rollout-vs-trainer KL reaches this multiple of its baseline")
    )
    kl_ratio_alarm: float = field(
        default=2.5, metadata=doc("alarm when the rollout-vs-trainer KL reaches this multiple of its baseline")
    )
    kl_floor: float = field(default=0.01, metadata=doc("nats added to the KL and its baseline before the ratio"))
    grad_spike_warn: float = field(
        default=3.0, metadata=doc("warn when the gradient norm reaches this multiple of its median over window")
    )
    grad_spike_alarm: float = field(
        default=10.0, metadata=doc("alarm when the gradient norm reaches this multiple of its median over window")
    )
    reward_drop_warn: float = field(
        default=0.25, metadata=doc("warn when the smoothed reward falls this share below its best")
    )
    reward_drop_alarm: float = field(
        default=0.5, metadata=doc("alarm when the smoothed reward falls this share below its best")
    )
    reward_floor: float = field(default=0.05, metadata=doc("a best smoothed reward below this cannot drop"))

    def check(self):
        require(self.baseline_steps >= 1, "baseline_steps", f"got {self.baseline_steps}; must be >= 1")
        require(self.window >= 2, "window", f"got {self.window}; must be >= 2")
        require(self.smooth >= 1, "smooth", f"got {self.smooth}; must be >= 1")
        bad = [g for g in self.alarm_on if g not in GAUGES]
        require(not bad, "alarm_on", f"unknown gauge(s) {bad}; allowed {', '.join(GAUGES)}")
        for name in ("entropy", "length_share", "length_slope", "truncated", "gap_ratio", "corr_drop", "kl_ratio",
                     "grad_spike", "reward_drop"):  # fmt: skip
            w, a = getattr(self, f"{name}_warn"), getattr(self, f"{name}_alarm")
            require(0 <= w <= a, f"{name}_alarm", f"got warn {w}, alarm {a}; need 0 <= warn <= alarm")


@dataclass(frozen=True)
class GuardConfig:
    """The collapse guard: what to do when the health gauges stay in alarm (off by default)."""

    enabled: bool = field(
        default=False, metadata=doc("act on sustained health alarms (see action); false = the gauges are only logged")
    )
    action: Literal["warn", "stop", "rollback"] = field(
        default="rollback", metadata=doc("warn; stop cleanly; or roll back to the best checkpoint and mitigate")
    )
    patience: int = field(default=2, metadata=doc("consecutive alarm steps before the guard acts"))
    max_rollbacks: int = field(default=2, metadata=doc("rollbacks at most; past it the guard rolls back and stops"))
    mitigations: tuple[str, ...] = field(
        default=("tis", "kl"), metadata=doc("applied in order, one per rollback, and kept for the rest of the run")
    )
    kl_factor: float = field(default=10.0, metadata=doc("the kl mitigation multiplies grpo.kl_coef by this"))
    kl_min: float = field(default=1e-3, metadata=doc("the kl mitigation's coefficient when grpo.kl_coef is 0"))
    headroom: float = field(default=1.5, metadata=doc("the headroom mitigation multiplies the generation cap"))
    cooldown: int = field(default=0, metadata=doc("steps after a rollback before the guard may act again"))

    def check(self):
        require(self.patience >= 1, "patience", f"got {self.patience}; must be >= 1")
        require(self.max_rollbacks >= 0, "max_rollbacks", f"got {self.max_rollbacks}; must be >= 0")
        bad = [m for m in self.mitigations if m not in MITIGATIONS]
        require(not bad, "mitigations", f"unknown mitigation(s) {bad}; allowed {', '.join(MITIGATIONS)}")
        require(self.kl_factor >= 1, "kl_factor", f"got {self.kl_factor}; must be >= 1")
        require(self.headroom > 1, "headroom", f"got {self.headroom}; must be > 1")
        require(self.cooldown >= 0, "cooldown", f"got {self.cooldown}; must be >= 0")
