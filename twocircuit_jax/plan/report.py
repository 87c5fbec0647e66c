"""`twocircuit plan`: compile one GRPO step's programs for a target and say whether the run fits, and how fast it
could be at best.

Memory, per device. The state that stays resident through a step:
    train state (params, optimizer moments, counters)   the train step's first argument
    circuit state                                        its second argument
    reference params                                     the loop's frozen copy (sharded like the params)
    step batch                                           the step's rows (ticks_per_step mini-batches)
    anchor batches                                       the mini-batches the anchor keeps for later fires
Each program adds its transient bytes on top: its arguments that are not resident (RESIDENT_ARGS), its outputs not
aliased to a donated input, and its temporaries. The peak that must fit is resident + the largest transient, against
the chip's HBM (plan/chips.py). The anchor's weight snapshots are host memory (anchor/retention.py): at most
delay // cadence + 1 retained batches, each pinning its step's snapshot, plus the current step's, plus the
projection window's snapshots when on; each a full copy of the parameters in their dtype.
"""

from __future__ import annotations

import math

import jax

from twocircuit_jax.plan import measure as pm, roofline
from twocircuit_jax.plan.programs import generation_programs, programs, usage

# Which top-level arguments of each program are resident state (counted once, in the resident total): the rest are
# the program's own inputs, made for it (a mini-batch slice, the snapshot weights the anchor replays).
RESIDENT_ARGS = {
    "train_step": (0, 1),  # state, circuit state (the mini-batch is sliced from the step batch for the call)
    "train_step_warmup": (0, 1),
    "logp_old": (0, 1, 2),  # live params, the step's rows, circuit state
    "logp_ref": (0, 1, 2),  # reference params, the step's rows, circuit state
    "logp_dense": (0, 1, 2),
    "fidelity": (0, 1, 2, 3),  # params, reference params, a mini-batch of the step, circuit state
    "anchor_fire": (1, 2, 3),  # a kept mini-batch, the merger and moments (circuit state), the basis; its weights
    # are a host snapshot put on device for the fire, in the compute dtype
    "logp_anchor_ref": (0, 1, 2),
    "generate": (0,),  # the live params (the sampler's gathered compute-dtype copy is the call's own temporary)
    "generate_eval": (0,),
}


def _host(cfg, params) -> dict:
    a = cfg.anchor
    if not a.enabled:
        return {"anchor_snapshot_bytes": 0.0, "anchor_snapshots": 0, "anchor_batches": 0}
    batches = a.delay // a.cadence + 1
    p = a.projection
    snaps = batches + 1 + ((p.window if p.window_mode == "sliding_window" else p.max_snapshots) if p.enabled else 0)
    one = float(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))
    return {"anchor_snapshot_bytes": snaps * one, "anchor_snapshots": snaps, "anchor_batches": batches}


def _reference_bytes(param_leaf_bytes, params, cfg) -> float:
    """Per-device bytes of the reference copy: the params' per-device bytes, each leaf in the compute dtype where
    that is narrower (step/train_step.py reference_copy)."""
    from twocircuit_jax.step.train_step import reference_copy

    ref = jax.tree.leaves(reference_copy(params, cfg.model.compute_dtype))
    leaves = jax.tree.leaves(params)
    return float(sum(b * r.dtype.itemsize / p.dtype.itemsize for b, r, p in zip(param_leaf_bytes, ref, leaves)))


def make_plan(cfg, target, devices, dcn_gbps: tuple = ()) -> dict:
    """Compile every program of a step of `cfg` on `devices` (the target's) and assemble the report (a dict).
    Collectives are split by link (fast inside an island, slow between islands: parallel/mesh.py islands); the
    roofline puts the slow-link bytes at `dcn_gbps[0]` Gbit/s per device when given, else at the ICI bandwidth."""
    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.plan.targets import check_mesh

    mesh = check_mesh(cfg, target)
    replicas = mesh["data"] * mesh["fsdp"]
    isl = pmesh.islands(cfg.mesh, pmesh.make_mesh(cfg.mesh, devices))
    n_islands = len(set(isl))
    isl = isl if n_islands > 1 else None
    dcn = roofline.gbps_bytes(dcn_gbps[0]) if dcn_gbps else None
    progs = programs(cfg, devices, target.platform)
    use = usage(cfg, progs)
    T = cfg.train.max_prompt_len + cfg.sampler.sampling.max_new_tokens
    measured = {name: pm.measure(j, args, target.platform, replicas, isl) for name, (j, args) in progs.items()}
    train_args, train = progs["train_step"][1], measured["train_step"]
    params = train_args[0].params
    n_params = int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
    resident = {
        "train_state": train["args"][0],
        "circuit_state": train["args"][1],
        # the loop's frozen copy in the compute dtype (step/train_step.py reference_copy), sharded like the params
        "reference_params": _reference_bytes(train["arg_leaves"][0][: len(jax.tree.leaves(params))], params, cfg),
        "step_batch": train["args"][2] * cfg.ticks_per_step,
        "anchor_batches": 0.0,
    }
    host = _host(cfg, params)
    if "anchor_fire" in measured:
        resident["anchor_batches"] = host["anchor_batches"] * measured["anchor_fire"]["args"][1]
    resident["total"] = sum(resident.values())
    chip = target.chip
    # Generation runs beside the resident state: `auto` sizes its calls from what that leaves of the chip.
    gens = generation_programs(cfg, params, chip.hbm_bytes - resident["total"] if chip else None)
    for name, g in gens.items():
        measured[name] = pm.measure(g.program, g.args, target.platform, replicas, isl)
        use[name] = g.usage
    rows, flops_step, coll_step, slow_step = {}, 0.0, 0.0, 0.0
    bound = {"train": 0.0, "generation": 0.0}
    for name, m in measured.items():
        mem, u = m["memory"], use[name]
        own = sum(b for i, b in enumerate(m["args"]) if i not in RESIDENT_ARGS.get(name, ()))
        # a program the compiler refused (m["oom"]): its outputs are unknown, so its transient is a lower bound
        transient = own + (mem["output"] or 0.0) - (mem["alias"] or 0.0) + mem["temp"]
        r = {
            "runs_per_step": u.runs,
            "rows": u.rows,
            "memory": mem,
            "own_arguments": own,
            "transient": transient,
            "peak": resident["total"] + transient,
            "cost": m["cost"],
            "collectives": m["collectives"],
            "collective_bytes": m["collective_bytes"],
            "slow_bytes": m["slow_bytes"],
            "collective_kinds": m["collective_kinds"],
            "model_flops": roofline.model_flops(n_params, u.rows * T, u.backward),
            "largest": m["largest"],
            "note": m["note"],
            "oom": m["oom"],
        }
        if name in gens:
            g = gens[name]
            r["generation"] = {"prompts": g.prompts, "n": g.n, "prompt_len": g.prompt_len, "max_new": g.max_new,
                               "greedy": g.greedy, "rows_per_call": cfg.sampler.max_rows_per_call}  # fmt: skip
        if chip is not None and m["cost"] is not None:
            if name in gens:  # the decode loop, counted from shapes (XLA counts a loop's body once)
                g = gens[name]

                def bound_at(b, g=g, m=m):
                    return roofline.generation_bound(
                        g, cfg.model, n_params, replicas, mesh["tensor"], m["collective_bytes"], chip,
                        m["slow_bytes"], b,
                    )  # fmt: skip
            else:
                # XLA's cost analysis counts a loop's body once (the layer scan, the micro-batches): the compute
                # term takes the model's own flops per device when they are larger
                flops = max(m["cost"]["flops"], r["model_flops"] / target.count)

                def bound_at(b, flops=flops, m=m):
                    hbm = m["cost"]["bytes_accessed"]
                    return roofline.program_bound(flops, hbm, m["collective_bytes"], chip, m["slow_bytes"], b)

            r["roofline"] = bound_at(dcn)
            # plan/links.py: the bound without the slow link, to put it at any bandwidth
            r["links"] = {"other_s": bound_at(float("inf"))["bound_s"], "slow_bytes": m["slow_bytes"],
                          "sum": name in gens}  # fmt: skip
            bound["generation" if name in gens else "train"] += u.runs * r["roofline"]["bound_s"]
        flops_step += u.runs * r["model_flops"]
        coll_step += u.runs * (m["collective_bytes"] or 0.0)
        slow_step += u.runs * (m["slow_bytes"] or 0.0)
        rows[name] = r
    worst = max(rows, key=lambda n: rows[n]["peak"])
    if rows[worst]["oom"]:  # name what to shrink: the allocation that broke the limit
        rows[worst]["largest"] = pm.oom_allocation(measured[worst]["lowered"])
    peak = {"bytes": rows[worst]["peak"], "program": worst, "hbm_bytes": chip.hbm_bytes if chip else None}
    refused = any(r["oom"] for r in rows.values())  # the compiler's own verdict: past the chip's HBM
    peak["fits"] = None if chip is None else bool(peak["bytes"] <= chip.hbm_bytes and not refused)
    step = {
        "ticks": cfg.ticks_per_step * cfg.train.ppo_epochs,
        "params": n_params,
        "tokens_per_row": T,
        "model_flops": flops_step,
        "collective_bytes": coll_step,
        "slow_bytes": slow_step,
        "fast_bytes": coll_step - slow_step,
        "dcn_gbps": dcn_gbps[0] if dcn_gbps else None,
    }
    if chip is not None and not refused:
        step_s = bound["train"] + bound["generation"]
        step["tick_bound_s"] = rows["train_step"]["roofline"]["bound_s"]
        step["train_bound_s"] = bound["train"]
        step["generation_bound_s"] = bound["generation"]
        step["step_bound_s"] = step_s
        step["mfu_bound"] = roofline.mfu(flops_step, target.count, chip, step_s)
    return {
        "target": target.name,
        "platform": target.platform,
        "devices": target.count,
        "chip": chip._asdict() if chip else None,
        "mesh": mesh,
        "islands": n_islands,
        "programs": rows,
        "resident": resident,
        "peak": peak,
        "host": host,
        "step": step,
    }
