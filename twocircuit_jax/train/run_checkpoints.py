"""A GRPO run's checkpoints: what it saves (each `train.checkpoint_every` steps, at its best evaluation, at a stop)
and what it reads back (a resume, a guard rollback). Functions of the built run (train/built_run.py) and of the
state passed in; a load returns what it read (`Loaded`) and the trainer takes it.

A checkpoint is the train state and the circuit state as one orbax tree {"train", "circuit"} (train/checkpoint.py
writes it atomically), a meta.json of host state (step, history, anchor and codec counters, health, the environment
RNG, the guard, the step's metrics line) and blobs: the anchor's replay buffers and, with `train.async_rollouts`,
the next step's finished rollouts, each a data-only .npz (train/safe_blob.py: nothing in a checkpoint runs code
when it is loaded). The host objects' state goes through their `state_dict()` / `load_state_dict(d)`; which meta
key or blob holds it is decided here, in `host_parts` and `_anchor_state`.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NamedTuple

from twocircuit_jax.config.base import ConfigError, to_dict
from twocircuit_jax.model.hf_io import CheckpointError
from twocircuit_jax.step.circuit_state import CircuitState, place
from twocircuit_jax.train import safe_blob

ANCHOR_BLOB = "anchor_buffers.npz"
AHEAD_BLOB = "rollouts_ahead.npz"  # train.async_rollouts: the next step's finished rollouts, for an exact resume
STATE_LAYOUT = 2  # the checkpoint tree {"train", "circuit"} with meta circuit_fields and merger_state


class Loaded(NamedTuple):
    step: int  # the step the checkpoint was written after
    state: Any  # TrainState, on its run shardings
    cs: Any  # CircuitState, on its run shardings; a field the checkpoint lacks keeps the value passed in
    history: dict  # the trainer's history ({"length/mean": [...], "best": ...})
    meta: dict  # meta.json as written


def _tree(state, cs) -> dict:
    return {"train": state, "circuit": cs}


def host_parts(b, gs: int, cs, history: dict, metrics=None) -> tuple[dict, dict | None]:
    """(meta, blobs) of a checkpoint at step `gs` of built run `b`: each host object's state_dict() read once (the
    anchor's holds params-sized snapshots)."""
    meta = {
        "step": gs,
        "state_layout": STATE_LAYOUT,
        "circuit_fields": [k for k, v in zip(cs._fields, cs) if v is not None],
        "merger_state": type(cs.merger).__name__ if cs.merger is not None else None,
        "history": history,
        "model_config": to_dict(b.model_cfg),
        "config": to_dict(b.user_cfg),  # a resume compares its config with this one (train/resume_config.py)
    }
    blobs = {}
    if b.anchor:  # counters in the meta; buffers, window and generator tick in their blob
        a = b.anchor.state_dict()
        meta["anchor"] = a["counters"]
        w = a["window"]
        buffers = {**a["buffer"], "gen_tick": a["gen_tick"], "window": None if w is None else (w["ticks"], w["snaps"])}
        blobs[ANCHOR_BLOB] = safe_blob.dumps(buffers)
    if b.fast:
        c = b.fast.state_dict()  # host counters of codec forwards and end_step calls
        meta["codec_applications"], meta["codec_steps"] = c["applications"], c["steps"]
    meta["health"] = b.health.state_dict()
    collector = b.collector.state_dict()
    if collector:  # the environment RNG: a resume plays the same games
        meta["collector"] = collector
    if b.guard:
        meta["guard"] = b.guard.state_dict()
    if metrics is not None:  # the step's metrics line, restored on resume if the process died before logging it
        meta["metrics"] = json.loads(json.dumps(metrics, default=float))  # numpy scalars as JSON numbers
    ahead = b.ahead.state_dict() if b.ahead is not None else {}
    if ahead:
        blobs[AHEAD_BLOB] = safe_blob.dumps(ahead)
    return meta, blobs or None


def save(b, gs: int, state, cs, history: dict, metrics=None) -> None:
    """Checkpoint step `gs` (train/checkpoint.py: atomic, the last two kept)."""
    b.ckpt.save(gs, _tree(state, cs), *host_parts(b, gs, cs, history, metrics))


def save_best(b, gs: int, state, cs, history: dict, score: float) -> None:
    """The best held-out checkpoint so far (a guard rollback's target)."""
    meta, blobs = host_parts(b, gs, cs, history)
    b.ckpt.save_best(gs, _tree(state, cs), meta, score, blobs)


def load(b, step, state, cs) -> Loaded:
    """Checkpoint `step` (or "best") of built run `b`, restored into the structure and shardings of `state` and `cs`
    (the run's current ones). The anchor's and the codec's host counters are loaded into those objects."""
    meta = b.ckpt.read_meta(step)
    layout = meta.get("state_layout", 1)
    if layout != STATE_LAYOUT:
        where = f"{b.ckpt.root}/{'best' if step == 'best' else f'step_{step:08d}'}"
        raise ConfigError(
            "--resume",
            f"the checkpoint {where} has state layout {layout}; this twocircuit_jax reads layout {STATE_LAYOUT} "
            "only: start a new run, or resume it with the release that wrote it",
        )
    want = type(cs.merger).__name__ if cs.merger is not None else None
    held = meta.get("merger_state", "none recorded (a checkpoint from before the per-merger states)")
    if want is not None and held not in (None, want):
        raise ConfigError(
            "--resume",
            f"the checkpoint's merger state is {held}; this run's merger keeps {want}: start a new run, or resume "
            "with the anchor.merger the run was started with",
        )
    # The restore targets carry the shardings the arrays come back with. A fresh circuit state's clock is host
    # scalars on one local device: restored like that, it would be a per-process array that cannot then be placed
    # on the global mesh of a multi-process run. Placed first, every leaf returns on its run sharding.
    cs = place(cs, b.cs_sh)
    # Restore into the fields the checkpoint holds; a field it lacks (one a guard mitigation added since, the
    # swap's moments) keeps its fresh value.
    have = meta.get("circuit_fields", cs._fields)
    like = CircuitState(*(v if k in have else None for k, v in zip(cs._fields, cs)))
    tree, meta = b.ckpt.restore(step, _tree(state, like))
    restored = CircuitState(*tree["circuit"])
    cs = CircuitState(*(r if r is not None else f for f, r in zip(cs, restored)))
    if b.anchor:
        b.anchor.load_state_dict(_anchor_state(meta.get("anchor"), b.ckpt.read_part(step, ANCHOR_BLOB)))
    if b.fast:  # a counter the meta lacks keeps its value
        now = b.fast.state_dict()
        apps = {**now["applications"], **meta.get("codec_applications", {})}
        b.fast.load_state_dict({"applications": apps, "steps": meta.get("codec_steps", now["steps"])})
    return Loaded(int(meta["step"]), tree["train"], cs, meta["history"], meta)


def restore_latest(b, state, cs) -> tuple[Loaded, dict | None, dict | None]:
    """The newest readable checkpoint of built run `b` (a resume), with the health gauges', the collector's and the
    guard's host state loaded into them. Returns (what it loaded, its step's metrics line, the step-ahead rollouts
    it holds: None without)."""
    # Newest first: a checkpoint whose files are torn or missing (a disk fault, a copy cut short) falls back to the
    # previous one, and only once an older one has loaded are the unreadable ones renamed aside (`step_N.unreadable`,
    # never deleted; a mismatch every checkpoint shares renames nothing). A refused checkpoint (a pickled part, an
    # other layout: CheckpointError, ConfigError) is not skipped: that is a decision for the user, not a fault.
    steps = b.ckpt.steps()
    if not steps:
        raise ConfigError("--resume", f"no complete checkpoint under {b.ckpt.root}")
    bad = []
    for step in reversed(steps):
        try:
            got = load(b, step, state, cs)
            break
        except (CheckpointError, ConfigError):
            raise
        except Exception as e:  # noqa: BLE001 -- orbax and the file system raise many kinds; all mean unreadable
            bad.append((step, e))
    else:
        step, e = bad[0]
        raise CheckpointError(
            f"no checkpoint under {b.ckpt.root} can be read; the newest, step_{step:08d}: {type(e).__name__}: {e}"
        ) from e
    for s, e in bad:
        aside = b.ckpt.set_aside(s)
        print(
            f"warning: checkpoint {b.ckpt.root}/step_{s:08d} is unreadable ({type(e).__name__}: {e}); set aside as "
            f"{aside.name}; resuming from step_{step:08d}",
            file=sys.stderr,
        )
    b.health.load_state_dict(got.meta.get("health"))
    b.collector.load_state_dict(got.meta.get("collector") or {})
    if b.guard:
        b.guard.load_state_dict(got.meta.get("guard"))
    return got, got.meta.get("metrics"), b.ckpt.read_part(step, AHEAD_BLOB)


def _anchor_state(counters: dict | None, buffers: dict | None) -> dict:
    """AnchorCircuit.state_dict() from a checkpoint: the counters from the meta, the buffers blob as `host_parts`
    writes it (None: a checkpoint without one; the anchor keeps its fresh buffers)."""
    d = {"counters": counters or {}, "gen_tick": None, "buffer": None, "window": None}
    if buffers is not None:
        buffers = dict(buffers)
        window = buffers.pop("window")
        d.update(gen_tick=buffers.pop("gen_tick"), buffer=buffers)
        if window is not None:
            d["window"] = {"ticks": window[0], "snaps": window[1]}
    return d
