"""The programs one GRPO step runs, built from shapes alone, and how often each runs per step.

`programs(cfg, devices, platform)` is step/abstract_step.py `abstract_programs`: the trainer's own programs from
its one builder (step/programs.py), so what the plan compiles is what a run executes: the train step (with the fused
ℓ_old diagnostics, the gradient codec and the anchor's merger when the config has them), the ℓ_old pass and the
diagnostics unless the train forward is the ℓ_old pass, ℓ_ref with a KL term, the probe's passes, the anchor's fire
and its dense ℓ_ref. `usage` says how often each runs in a GRPO step and over how many rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Usage(NamedTuple):
    runs: float  # calls per GRPO step
    rows: int  # sequences per call (global)
    backward: bool  # a gradient is taken (model flops 6N per token, else 2N)


def usage(cfg, names) -> dict:
    """{name: Usage} for the programs `programs` returned."""
    t, s = cfg.train, cfg.sampler
    ticks = cfg.ticks_per_step * t.ppo_epochs
    mini, step = t.mini_batch * s.n, t.train_batch * s.n
    fires = ticks / cfg.anchor.cadence if cfg.anchor.enabled else 0.0
    probe = 1 / t.probe_every if t.probe_every else 0.0
    table = {
        "train_step": Usage(ticks, mini, True),
        "logp_old": Usage(1, step, False),
        "diagnostics": Usage(1, 0, False),  # [B, T] scalars only: no model flops
        "logp_ref": Usage(1, step, False),
        "logp_dense": Usage(probe, step, False),
        "probe_sums": Usage(probe, 0, False),
        "fidelity": Usage(probe, mini, True),
        "anchor_fire": Usage(fires, mini, True),
        # the kept mini-batches: one per fire, and the retained one when the delay is not a multiple of the cadence
        "logp_anchor_ref": Usage(fires * (1 if cfg.anchor.delay % cfg.anchor.cadence == 0 else 2), mini, False),
    }
    return {n: table[n] for n in names}


class _Bound(NamedTuple):
    """A program with its static keyword arguments bound, lowered like a jitted function (plan/measure.py)."""

    jitted: Any
    kwargs: dict

    def lower(self, *args):
        return self.jitted.lower(*args, **self.kwargs)

    @property
    def wrapped(self):
        return _Bound(getattr(self.jitted, "wrapped", self.jitted), self.kwargs)


def programs(cfg, devices, platform: str) -> dict:
    """{name: (jitted, args)}: every program one GRPO step of `cfg` runs on `devices`, from shapes alone (the
    trainer's own, step/abstract_step.py). `platform` ("tpu" or "cpu") is what the Pallas kernels are built for."""
    from twocircuit_jax.step.abstract_step import abstract_programs

    progs = abstract_programs(cfg, devices, lowering_platform=platform if platform != "cpu" else None)
    return {n: ((_Bound(p.jitted, p.kwargs) if p.kwargs else p.jitted), p.args) for n, p in progs.items()}
