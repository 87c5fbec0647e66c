"""Ahead-of-time planning: compile a config's GRPO step for a target from shapes alone and report whether it fits
(memory per device against the chip's HBM) and its roofline bound (`twocircuit plan`, plan/report.py)."""

from __future__ import annotations

import json

FITS, DOES_NOT_FIT = 0, 1


def run_plan(cfg, topology: str, json_path: str = "", print_fn=print) -> int:
    """Plan `cfg` on the target named `topology` (plan/targets.py); print the table, write `json_path` if given.
    Returns 0 when it fits (or the target has no chip memory: cpu:N), 1 when not. Bad input raises ConfigError."""
    from twocircuit_jax.plan import targets
    from twocircuit_jax.plan.report import make_plan
    from twocircuit_jax.plan.table import render

    target = targets.parse(topology)
    targets.check_mesh(cfg, target)  # before any device or compile
    plan = make_plan(cfg, target, targets.devices(target))
    print_fn(render(plan))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(plan, fh, indent=1)
    return DOES_NOT_FIT if plan["peak"]["fits"] is False else FITS
