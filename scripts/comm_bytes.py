"""Bytes per GRPO step of a config, from shapes alone: no weights, no accelerator (design §3.6, §8 inv. 9).

    python scripts/comm_bytes.py --config FILE [--set key=value ...] [--devices 8]

Compiles the train step ahead of time for the config's mesh on `--devices` fake CPU devices (ShapeDtypeStructs
only), sums the operand bytes of every collective in the compiled program (the dp gradient reduction, plus, for a
fast-owned low-rank basis, the sketch sums, plus the loss's scalar reductions), and does the same for the dense
twin of the config (fast.codec=none, fast.grad_codec=none). The boundary activations are not a collective here:
the pipeline is emulated inside one program, so their bytes are the logical §3.6 wire bytes of fast/bytes.py.
With the anchor on, its fires' collectives (the dense gradient mean and, for an anchor-owned basis, the sketch sum)
are compiled too and count on the config's side at one fire every `anchor.cadence` ticks; the dense twin has no
anchor. Both sides are per replica (a replica's share of the tokens) and per step (ticks_per_step x ppo_epochs
train forwards). Last line:
    dense_bytes=D compressed_bytes=C ratio=R
Note: XLA:CPU widens bf16 collectives to f32, so bf16 parameters are counted at 4 bytes on both sides.

With `mesh.stage > 1` the boundaries are real (parallel/pipeline.py) and nothing comes from a formula: the compiled
step's collectives are split into boundary_fwd, boundary_bwd (the stage messages and their transposes),
stage_exit (the last stage's per-token log-probs and entropies summed over `stage`) and grad_reduce (the rest: the data-parallel
gradient mean and scalar reductions), each counted per data replica times how often its loop runs
(fast/hlo_bytes.py), against the same mesh with fast.codec=none and no gradient codec. `--memory` is the memory
report of `twocircuit plan` (twocircuit_jax/plan/) on these fake CPU devices, for the config and for its unstaged twin
(the stage devices used as data replicas): every program of a step compiled, its per-device argument, output,
temporary and aliased bytes (XLA's memory analysis), and the peak over the resident state. Whether it fits a chip is
`twocircuit plan --topology tpu:v5e-8` (the real TPU compiler, against the chip's HBM).

PowerSGD is counted in its steady state, both staged and not: the train step past the warm-up is a program of its
own (step/programs.py PhasedTrainStep) holding the compressed reduction only. The first `start_after` reductions
run the warm-up program, whose plain mean is the dense twin's gradient reduction; the output says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def _setup_devices(n: int):
    if "jax" not in sys.modules:  # the flag only works before jax initialises its backends
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={n}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


_MEASURED: dict = {}  # (config, devices) -> result: the dense twin compiles once per process


def measure(cfg, devices) -> dict:
    """Compile one tick's train step for `cfg`; return HLO collective bytes and logical activation bytes."""
    key = (repr(cfg), tuple(str(d) for d in devices))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(cfg, devices)
    return _MEASURED[key]


def _measure(cfg, devices) -> dict:
    from twocircuit_jax.fast import bytes as fbytes
    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.step.abstract_step import abstract_programs

    model_cfg = cfg.model
    # the trainer's own programs (step/programs.py), from shapes: the train step, and with the anchor its fire
    progs = abstract_programs(cfg, devices)
    mesh = pmesh.make_mesh(cfg.mesh, devices)
    from twocircuit_jax.fast.hlo_bytes import run_bytes

    text = progs["train_step"].lower().compile().as_text()
    coll, run = fbytes.collective_bytes_from_hlo(text), run_bytes(text)
    anchor = anchor_run = 0.0
    if "anchor_fire" in progs:  # the dense gradient mean and, for an anchor-owned basis, the sketch sum
        text = progs["anchor_fire"].lower().compile().as_text()
        anchor = float(fbytes.collective_bytes_from_hlo(text)["total"])
        anchor_run = float(run_bytes(text)["total"])
    ticks = cfg.ticks_per_step * cfg.train.ppo_epochs
    from twocircuit_jax.boundaries import boundary_layers

    b = boundary_layers(model_cfg.num_layers, cfg.fast.pp_size)
    rows = cfg.train.prompts_per_update * cfg.sampler.n // pmesh.dp_size(mesh)  # per replica, like the HLO bytes
    tokens = rows * (cfg.train.max_prompt_len + cfg.sampler.sampling.max_new_tokens)
    act = (
        fbytes.activation_bytes(cfg.fast.codec, tokens=tokens, hidden=model_cfg.hidden_size, boundaries=b)
        if b
        else {"comm/bytes_compressed": 0.0, "comm/bytes_dense": 0.0}
    )
    return {
        "collective_bytes": coll["total"] * ticks,
        "anchor_bytes": anchor * ticks / cfg.anchor.cadence,  # one fire every `cadence` ticks
        "collective_counts": coll["counts"],
        "run_bytes": run["total"] * ticks,  # each collective times how often its loop runs (fast/hlo_bytes.py)
        "run_by_kind": {k: run[k] * ticks for k in run["counts"] if run[k]},
        "anchor_run_bytes": anchor_run * ticks / cfg.anchor.cadence,
        "act_compressed": act["comm/bytes_compressed"] * ticks,
        "act_dense": act["comm/bytes_dense"] * ticks,
        "ticks": ticks,
        "dp": pmesh.dp_size(mesh),
    }


def steady_state(cfg):
    """(cfg, note): the note says when PowerSGD has a warm-up, whose program the count leaves out."""
    gc = cfg.fast.grad_codec
    after = getattr(gc, "start_after", 0)
    if cfg.fast.grad_codec_type != "powersgd" or after <= 0:
        return cfg, ""
    note = (
        f"PowerSGD counted in its steady state (the train step's steady program); its first {after} reductions run "
        "the warm-up program, whose plain mean is the dense twin's gradient reduction"
    )
    return cfg, note


def dense_twin(cfg):
    """The same run with both circuits' compression off (plan/links.py dense_twin)."""
    from twocircuit_jax.plan.links import dense_twin as twin

    return twin(cfg)


def _compiled(cfg, devices):
    from twocircuit_jax.step.abstract_step import abstract_train_step

    step = abstract_train_step(cfg, devices)
    return step.jitted.lower(*step.args).compile(), step.mesh


def staged_report(cfg, devices, memory: bool) -> int:
    """Boundary bytes from the compiled staged step against its codec-none twin on the same mesh (per data replica,
    per GRPO step), and with --memory the per-device memory of the step against the unstaged twin."""
    from twocircuit_jax.fast.hlo_bytes import PARTS, staged_bytes
    from twocircuit_jax.parallel import mesh as pmesh

    ticks = cfg.ticks_per_step * cfg.train.ppo_epochs
    rows = {}
    if cfg.mesh.stage > 1:
        steady, note = steady_state(cfg)
        if note:
            print(note)
        for name, c in (("dense", dense_twin(cfg)), ("config", steady)):
            compiled, mesh = _compiled(c, devices)
            parts = staged_bytes(compiled.as_text(), pmesh.dp_size(mesh))
            rows[name] = {p: parts[p] * ticks for p in PARTS}
            print(f"{name}: " + " ".join(f"{p}={rows[name][p]:.0f}" for p in PARTS) + f" counts={parts['counts']}")
        d = rows["dense"]["boundary_fwd"] + rows["dense"]["boundary_bwd"]
        c = rows["config"]["boundary_fwd"] + rows["config"]["boundary_bwd"]
        print(f"per data replica per step ({ticks} ticks), counted from the compiled programs")
        print(f"boundary_dense_bytes={d:.0f} boundary_compressed_bytes={c:.0f} boundary_ratio={d / c:.2f}x")
        g, gc = rows["dense"]["grad_reduce"], rows["config"]["grad_reduce"]
        print(f"grad_reduce_dense_bytes={g:.0f} grad_reduce_bytes={gc:.0f} grad_reduce_ratio={g / gc:.2f}x")
    if memory:
        from twocircuit_jax.plan.report import make_plan
        from twocircuit_jax.plan.table import render
        from twocircuit_jax.plan.targets import Target

        target = Target(f"cpu:{len(devices)}", "cpu", len(devices), None, None)
        flat = dataclasses.replace(
            cfg, mesh=dataclasses.replace(cfg.mesh, data=cfg.mesh.data * cfg.mesh.stage, stage=1)
        )
        for name, c in (("unstaged", flat), ("staged", cfg)):
            if c.mesh.stage == 1 and name == "staged":
                continue
            plan = make_plan(c, target, devices)
            m = plan["programs"]["train_step"]["memory"]
            print(
                f"memory {name} (mesh {c.mesh.data}x{c.mesh.stage}x{c.mesh.fsdp}x{c.mesh.tensor}), per device: "
                + " ".join(f"{k}={v / 2**20:.1f}MiB" for k, v in m.items())
            )
            print(render(plan))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices (only before jax is imported)")
    ap.add_argument("--memory", action="store_true", help="per-device memory of the compiled step, staged vs not")
    args = ap.parse_args(argv)
    _setup_devices(args.devices)
    import jax

    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.config.run import load_config

    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(jax.devices()) < args.devices:
        print(
            f"error: --devices {args.devices}, but jax has {len(jax.devices())} (set it before importing jax)",
            file=sys.stderr,
        )
        return 2
    devices = jax.devices()[: args.devices]
    if cfg.mesh.stage > 1 or args.memory:
        return staged_report(cfg, devices, args.memory)
    steady, note = steady_state(cfg)
    if note:
        print(note)
    comp = measure(steady, devices)
    dense = measure(dense_twin(cfg), devices)
    for name, r in (("dense", dense), ("config", comp)):
        print(
            f"{name}: dp={r['dp']} ticks/step={r['ticks']} hlo_collective_bytes={r['collective_bytes']:.0f} "
            f"counts={ {k: v for k, v in r['collective_counts'].items() if v} } "
            f"boundary_bytes={r['act_compressed']:.0f} (dense-equivalent {r['act_dense']:.0f}) "
            f"anchor_bytes={r['anchor_bytes']:.0f} run_collective_bytes={r['run_bytes']:.0f} "
            f"run_by_kind={ {k: round(v) for k, v in r['run_by_kind'].items()} } "
            f"anchor_run_bytes={r['anchor_run_bytes']:.0f}"
        )
    # as the programs run: a loop body's collectives times its trip count (the count above reads each body once)
    Dr, Cr = dense["run_bytes"], comp["run_bytes"] + comp["anchor_run_bytes"]
    print(f"run_dense_collective_bytes={Dr:.0f} run_compressed_collective_bytes={Cr:.0f} run_ratio={Cr / Dr:.6f}")
    D = dense["collective_bytes"] + dense["act_dense"]
    C = comp["collective_bytes"] + comp["act_compressed"] + comp["anchor_bytes"]  # the anchor's fires count too
    print(f"dense_bytes={D:.0f} compressed_bytes={C:.0f} ratio={C / D:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
