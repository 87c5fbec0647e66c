"""Ahead-of-time planning: compile a config's GRPO step for a target from shapes alone and report whether it fits
(memory per device against the chip's HBM) and its roofline bound (`twocircuit plan`, plan/report.py)."""

from __future__ import annotations

import json

FITS, DOES_NOT_FIT = 0, 1


def run_plan(
    cfg, topology: str, json_path: str = "", print_fn=print, sampler_chip: str = "", dcn_gbps: tuple = (),
    dense: bool = False,
) -> int:  # fmt: skip
    """Plan `cfg` on the target named `topology` (plan/targets.py); print the table, write `json_path` if given.
    With `sampler_chip` (required when sampler.backend is vllm) also the vLLM engines on that GPU (plan/engines.py).
    On a mesh of several islands (or with `dcn_gbps` or `dense`) also the links table (plan/links.py): the step at
    each slow-link bandwidth of `dcn_gbps` (Gbit/s per device; default links.DEFAULT_GBPS), beside the dense twin's
    with `dense` (compiled too: twice the time). The main table's roofline takes the first bandwidth.
    Returns 0 when it fits (or the target has no chip memory: cpu:N), 1 when the step or one engine does not.
    Bad input raises ConfigError."""
    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.plan import engines, links, targets
    from twocircuit_jax.plan.report import make_plan
    from twocircuit_jax.plan.table import render

    target = targets.parse(topology)
    targets.check_mesh(cfg, target)  # before any device or compile
    with_engines = bool(sampler_chip) or cfg.sampler.backend == "vllm"
    if with_engines:
        engines.gpu(sampler_chip)  # the flag checked before any compile too
    devices = targets.devices(target)
    n_islands = len(set(pmesh.islands(cfg.mesh, pmesh.make_mesh(cfg.mesh, devices))))
    with_links = n_islands > 1 or bool(dcn_gbps) or dense
    gbps = tuple(dcn_gbps) or (links.DEFAULT_GBPS if with_links else ())
    plan = make_plan(cfg, target, devices, gbps)
    print_fn(render(plan))
    if with_links:
        twin = make_plan(links.dense_twin(cfg), target, devices, gbps) if dense else None
        plan["links"] = links.summary(plan, gbps, twin)
        print_fn(links.render(plan["links"]))
    if with_engines:
        step = plan["step"]
        plan["engines"] = engines.engine_plan(cfg, sampler_chip, step.get("train_bound_s", step.get("step_bound_s")))
        print_fn(engines.render_engines(plan["engines"]))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(plan, fh, indent=1)
    if plan["peak"]["fits"] is False or plan.get("engines", {}).get("fits") is False:
        return DOES_NOT_FIT
    return FITS
