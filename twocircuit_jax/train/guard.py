"""The collapse guard: what the loop does when the health gauges (metrics/health.py) stay in alarm.

`guard.action`:
  warn      log it (`guard/action` 1, a line on stderr and in guard.jsonl) and go on;
  stop      save a checkpoint and end the run cleanly (`guard/action` 2);
  rollback  restore the best held-out checkpoint (always kept while the guard is on, from step 0), apply the next
            mitigation of `guard.mitigations`, and continue with the step after the alarm (`guard/action` 3); the
            data order goes on, the weights, optimizer and circuit state are the best step's. Past
            `guard.max_rollbacks` it restores the best checkpoint one last time and stops.

Mitigations (pure functions of the run config; each applied one stays for the rest of the run and is re-applied on
resume from the checkpoint's meta):
  anchor_cadence  anchor.cadence halved (more dense fires)      kl        grpo.kl_coef x guard.kl_factor
  tis             grpo.tis token (unless icepop weights already)  swap      anchor.swap.cadence = anchor.cadence
  headroom        the generation cap x guard.headroom

The guard's host state (`state_dict`) rides in the checkpoint meta; every action is also one line of
`guard.jsonl` in the run folder, rewritten whole from that state so a resumed run's file matches its checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.sections import IcePopMask

WARN, STOP, ROLLBACK = 1, 2, 3
ACTION_CODES = {"warn": WARN, "stop": STOP, "rollback": ROLLBACK}


def mitigate(cfg, name: str):
    """(cfg', what changed) for one mitigation; cfg is a RunConfig (frozen), returned anew."""
    g, rep = cfg.guard, dataclasses.replace
    if name == "anchor_cadence":
        a = cfg.anchor
        cadence = max(1, a.cadence // 2)
        # keep the config valid: the merger cadence must divide the fire cadence
        mc = a.merger_cadence if cadence % a.merger_cadence == 0 else 1
        merger = rep(a.merger, cadence=mc) if hasattr(a.merger, "cadence") else a.merger
        return rep(cfg, anchor=rep(a, cadence=cadence, merger=merger)), f"anchor.cadence {a.cadence} -> {cadence}"
    if name == "kl":
        k = cfg.grpo.kl_coef
        new = k * g.kl_factor if k > 0 else g.kl_min
        return rep(cfg, grpo=rep(cfg.grpo, kl_coef=new)), f"grpo.kl_coef {k:g} -> {new:g}"
    if name == "tis":
        old = cfg.grpo.tis
        if isinstance(cfg.grpo.is_mask, IcePopMask):  # its kept tokens carry ρ already; token TIS would square it
            return cfg, "grpo.tis stays off: grpo.is_mask icepop weights every kept token by its ratio"
        return rep(cfg, grpo=rep(cfg.grpo, tis="token" if old == "off" else old)), f"grpo.tis {old} -> token"
    if name == "swap":
        old = cfg.anchor.swap.cadence
        new = old or cfg.anchor.cadence
        return rep(
            cfg, anchor=rep(cfg.anchor, swap=rep(cfg.anchor.swap, cadence=new))
        ), f"anchor.swap.cadence {old} -> {new}"
    if name == "headroom":
        s = cfg.sampler.sampling
        cap = int(math.ceil(s.max_new_tokens * g.headroom))
        new = rep(cfg.sampler, sampling=rep(s, max_new_tokens=cap))
        return rep(cfg, sampler=new), f"sampler.sampling.max_new_tokens {s.max_new_tokens} -> {cap}"
    raise ConfigError("guard.mitigations", f"unknown mitigation {name!r}")


def apply_mitigations(cfg, names):
    for n in names:
        cfg = mitigate(cfg, n)[0]
    cfg.check()  # a mitigated config is still a valid one
    return cfg


class Guard:
    """Host-side decisions: `decide(step, health, alarming)` -> None or the action to take now."""

    def __init__(self, cfg, run_dir: str, write: bool = True):
        self.cfg, self.path = cfg, os.path.join(run_dir, "guard.jsonl")
        self.writes = write  # False on every process but 0 of a multi-process run: one guard.jsonl, one writer
        self.streak = 0  # consecutive steps in alarm
        self.rollbacks = 0
        self.applied: list[str] = []  # mitigations in force
        self.quiet_until = 0  # no action before this step (guard.cooldown after a rollback)
        self.actions: list[dict] = []

    def state_dict(self) -> dict:
        return {
            "streak": self.streak,
            "rollbacks": self.rollbacks,
            "applied": list(self.applied),
            "quiet_until": self.quiet_until,
            "actions": list(self.actions),
        }

    def load_state_dict(self, d) -> None:
        if d:
            self.streak, self.rollbacks = int(d["streak"]), int(d["rollbacks"])
            self.applied, self.quiet_until = list(d["applied"]), int(d["quiet_until"])
            self.actions = list(d["actions"])
        self._write()

    def decide(self, step: int, health: dict, alarming: list[str]):
        """'warn' | 'stop' | 'rollback' | 'final' (roll back and stop: rollbacks exhausted) | None."""
        self.streak = self.streak + 1 if health.get("health/state", 0) >= 2 else 0
        if self.streak < self.cfg.patience or step < self.quiet_until:
            return None
        self.streak = 0
        if self.cfg.action != "rollback":
            return self.cfg.action
        return "rollback" if self.rollbacks < self.cfg.max_rollbacks else "final"

    def next_mitigation(self):
        """The mitigation the next rollback applies (None when the list is used up)."""
        rest = [m for m in self.cfg.mitigations if m not in self.applied]
        return rest[0] if rest else None

    def record(self, step: int, action: str, alarming: list[str], **extra) -> dict:
        """Log one action: returns the `guard/*` metrics of this step and appends it to guard.jsonl."""
        if action == "rollback":
            self.rollbacks += 1
            self.quiet_until = step + 1 + self.cfg.cooldown
            if extra.get("mitigation"):
                self.applied.append(extra["mitigation"])
        entry = {"step": step, "action": action, "gauges": alarming, **extra}
        self.actions.append(entry)
        self._write()
        print(f"guard: step {step}: {action} ({', '.join(alarming) or 'alarm'} in alarm)"
              + "".join(f"; {k} {v}" for k, v in extra.items() if v is not None), file=sys.stderr)  # fmt: skip
        code = ROLLBACK if action in ("rollback", "final") else ACTION_CODES[action]
        out = {"guard/action": float(code), "guard/rollbacks": float(self.rollbacks)}
        if "rollback_to" in extra:
            out["guard/rollback_to"] = float(extra["rollback_to"])
        return out

    def _write(self) -> None:
        if not self.writes:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            for a in self.actions:
                fh.write(json.dumps(a) + "\n")
        os.replace(tmp, self.path)  # whole or not at all
