"""The trainer's checkpoints: what a GRPO run saves each `train.checkpoint_every` steps and at its best evaluation,
and how it loads them back (a resume, a guard rollback).

A checkpoint is the train state and the circuit state as one orbax tree {"train", "circuit"} (train/checkpoint.py
writes it atomically), a meta.json of host state (step, history, anchor and codec counters, health, the environment
RNG, the guard, the step's metrics line) and blobs: the anchor's replay buffers and, with `train.async_rollouts`,
the next step's finished rollouts, each a data-only .npz (train/safe_blob.py: nothing in a checkpoint runs code
when it is loaded). `TrainerCheckpoints` is a mixin of `GRPOTrainer` (train/loop.py): it reads and writes the
trainer's own fields, and the host objects' state only through their `state_dict()` / `load_state_dict(d)`. Where
that state lands on disk (which meta key, which blob) is decided here, in `_host_parts` and `_anchor_state`, so
the files keep the keys older checkpoints have.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from twocircuit_jax.anchor.merger import from_legacy, legacy_like
from twocircuit_jax.config.base import ConfigError, to_dict
from twocircuit_jax.model.hf_io import CheckpointError
from twocircuit_jax.step.circuit_state import CircuitState, Clock, place
from twocircuit_jax.train import safe_blob

ANCHOR_BLOB = "anchor_buffers.npz"
AHEAD_BLOB = "rollouts_ahead.npz"  # train.async_rollouts: the next step's finished rollouts, for an exact resume
# The checkpoint tree {"train", "circuit"}; layout 1 (no "state_layout" in meta) held {"train", "ctx", "anchor"}.
STATE_LAYOUT = 2
# meta["merger_state"]: the merger state's type (anchor/merger.py STATES). Checkpoints without it hold the one
# LegacyMergerState of every merger, restored as that and mapped to the merger's own state.


class TrainerCheckpoints:
    """Save and load of `GRPOTrainer`'s state (a mixin). It writes the trainer's own `state`, `cs` and `history` (on
    a load) and reads the built run's parts the trainer exposes (`ckpt`, `cs_sh`, `anchor`, `codec`, `ahead`,
    `health`, `collector`, `guard`, `model_cfg`, `user_cfg`: train/built_run.py)."""

    def _ckpt_state(self):
        return {"train": self.state, "circuit": self.cs}

    def _host_parts(self, gs, metrics=None) -> tuple[dict, dict | None]:
        """(meta, blobs) of a checkpoint at step `gs`: each host object's state_dict() read once (the anchor's
        holds params-sized snapshots)."""
        meta = {
            "step": gs,
            "state_layout": STATE_LAYOUT,
            "circuit_fields": [k for k, v in zip(self.cs._fields, self.cs) if v is not None],
            "merger_state": type(self.cs.merger).__name__ if self.cs.merger is not None else None,
            "history": self.history,
            "model_config": to_dict(self.model_cfg),
            "config": to_dict(self.user_cfg),  # a resume compares its config with this one (train/resume_config.py)
        }
        blobs = {}
        if self.anchor:  # counters in the meta; buffers, window and generator tick in their blob
            a = self.anchor.state_dict()
            meta["anchor"] = a["counters"]
            w = a["window"]
            buffers = {
                **a["buffer"],
                "gen_tick": a["gen_tick"],
                "window": None if w is None else (w["ticks"], w["snaps"]),
            }
            blobs[ANCHOR_BLOB] = safe_blob.dumps(buffers)
        if self.codec:
            c = self.codec.state_dict()  # host counters of codec forwards and end_step calls
            meta["codec_applications"], meta["codec_steps"] = c["applications"], c["steps"]
        meta["health"] = self.health.state_dict()
        collector = self.collector.state_dict()
        if collector:  # the environment RNG: a resume plays the same games
            meta["collector"] = collector
        if self.guard:
            meta["guard"] = self.guard.state_dict()
        if metrics is not None:  # the step's metrics line, restored on resume if the process died before logging it
            meta["metrics"] = json.loads(json.dumps(metrics, default=float))  # numpy scalars as JSON numbers
        ahead = self.ahead.state_dict() if self.ahead is not None else {}
        if ahead:
            blobs[AHEAD_BLOB] = safe_blob.dumps(ahead)
        return meta, blobs or None

    def _restore(self) -> tuple[int, dict | None, dict | None]:
        """The newest readable checkpoint into the trainer. Returns (its step, its metrics line, the step-ahead
        rollouts it holds: None without)."""
        # Newest first: a checkpoint whose files are torn or missing (a disk fault, a copy cut short) falls back to
        # the previous one, and only once an older one has loaded are the unreadable ones renamed aside
        # (`step_N.unreadable`, never deleted; a mismatch every checkpoint shares renames nothing). A refused
        # checkpoint (a pickled part, a newer layout: CheckpointError, ConfigError) is not skipped: that is a
        # decision for the user, not a fault.
        steps = self.ckpt.steps()
        if not steps:
            raise ConfigError("--resume", f"no complete checkpoint under {self.ckpt.root}")
        bad = []
        for step in reversed(steps):
            try:
                meta = self._load(step)
                break
            except (CheckpointError, ConfigError):
                raise
            except Exception as e:  # noqa: BLE001 -- orbax and the file system raise many kinds; all mean unreadable
                bad.append((step, e))
        else:
            step, e = bad[0]
            raise CheckpointError(
                f"no checkpoint under {self.ckpt.root} can be read; the newest, step_{step:08d}: "
                f"{type(e).__name__}: {e}"
            ) from e
        for s, e in bad:
            aside = self.ckpt.set_aside(s)
            print(
                f"warning: checkpoint {self.ckpt.root}/step_{s:08d} is unreadable ({type(e).__name__}: {e}); "
                f"set aside as {aside.name}; resuming from step_{step:08d}",
                file=sys.stderr,
            )
        self.health.load_state_dict(meta.get("health"))
        self.collector.load_state_dict(meta.get("collector") or {})
        if self.guard:
            self.guard.load_state_dict(meta.get("guard"))
        # the finished rollouts of step `step` + 1 (train.async_rollouts)
        return int(meta["step"]), meta.get("metrics"), self.ckpt.read_part(step, AHEAD_BLOB)

    def _load(self, step) -> dict:
        """Checkpoint `step` (or "best") into the trainer: train state, circuit state, host counters, history.
        Returns its meta."""
        meta = self.ckpt.read_meta(step)
        layout = meta.get("state_layout", 1)
        legacy_codec_steps = None
        # The restore targets carry the shardings the arrays come back with. A fresh circuit state's clock is host
        # scalars on one local device: restored like that, it would be a per-process array that cannot then be
        # placed on the global mesh of a multi-process run. Placed first, every leaf returns on its run sharding.
        self.cs = place(self.cs, self.cs_sh)
        if layout == STATE_LAYOUT:
            # Restore into the fields the checkpoint holds; a field it lacks (one a guard mitigation added since,
            # the swap's moments) keeps its fresh value.
            have = meta.get("circuit_fields", self.cs._fields)
            like = CircuitState(*(v if k in have else None for k, v in zip(self.cs._fields, self.cs)))
            legacy_merger = like.merger is not None and "merger_state" not in meta
            if legacy_merger:
                like = like._replace(merger=legacy_like(like.merger))
            state, meta = self.ckpt.restore(step, {"train": self.state, "circuit": like})
            self.state, restored = state["train"], CircuitState(*state["circuit"])
            if legacy_merger:
                restored = restored._replace(merger=from_legacy(restored.merger, type(self.cs.merger)))
            self.cs = CircuitState(*(r if r is not None else f for f, r in zip(self.cs, restored)))
        elif layout == 1:
            state, meta = self.ckpt.restore(step, self._legacy_tree())
            self.state, self.cs = state["train"], self._from_legacy(state)
            if self.codec:  # layout 1 kept the codec's step count in the tree
                legacy_codec_steps = int(state["ctx"]["codec"]["steps"])
        else:
            raise ConfigError(
                "--resume",
                f"the checkpoint {self.ckpt.root}/{'best' if step == 'best' else f'step_{step:08d}'} has state layout {layout}, written by a newer "
                f"twocircuit_jax; this one reads layouts 1 and {STATE_LAYOUT}",
            )
        if self.anchor:
            self.anchor.load_state_dict(_anchor_state(meta.get("anchor"), self.ckpt.read_part(step, ANCHOR_BLOB)))
        self.history = meta["history"]
        if self.codec:  # a counter the meta lacks keeps its value (layout 1: the steps from the tree)
            now = self.codec.state_dict()
            steps = meta.get("codec_steps", legacy_codec_steps if legacy_codec_steps is not None else now["steps"])
            apps = {**now["applications"], **meta.get("codec_applications", {})}
            self.codec.load_state_dict({"applications": apps, "steps": steps})
        return meta

    def _legacy_tree(self):
        """Restore target of a layout-1 checkpoint (written before the circuit state was one pytree): the train
        state, a `ctx` dict and the anchor's moments."""
        cs = self.cs
        ctx = {"step": cs.clock.step, "first_minibatch": cs.clock.first_minibatch}
        if self.codec:
            ctx["codec"] = {"steps": jnp.zeros((), jnp.int32)}
            if cs.codec is not None:
                ctx["codec"]["lowrank"] = cs.codec
            if cs.grad is not None:
                ctx["codec"]["powersgd"] = cs.grad
        if cs.merger is not None:
            ctx.update(
                merger=legacy_like(cs.merger), anchor_fire=cs.clock.anchor_fire, anchor_merge=cs.clock.anchor_merge
            )
        tree = {"train": self.state, "ctx": ctx}
        if self.anchor:
            tree["anchor"] = {"moments": cs.moments} if cs.moments is not None else {"none": jnp.zeros((), jnp.int32)}
        return tree

    def _from_legacy(self, tree) -> CircuitState:
        ctx, codec = tree["ctx"], tree["ctx"].get("codec", {})
        clock = Clock(
            ctx["step"],
            ctx["first_minibatch"],
            ctx.get("anchor_fire", self.cs.clock.anchor_fire),
            ctx.get("anchor_merge", self.cs.clock.anchor_merge),
        )
        moments = tree.get("anchor", {}).get("moments")
        merger = ctx.get("merger")
        if merger is not None:
            merger = from_legacy(merger, type(self.cs.merger))
        return CircuitState(clock, codec.get("lowrank"), codec.get("powersgd"), merger, moments)

    def _maybe_save_best(self, gs, metrics):
        if "eval/accuracy" in metrics:
            best = self.history.get("best")
            if best is None or metrics["eval/accuracy"] > best:
                self.history["best"] = metrics["eval/accuracy"]
                meta, blobs = self._host_parts(gs)
                self.ckpt.save_best(gs, self._ckpt_state(), meta, metrics["eval/accuracy"], blobs)

    def _maybe_checkpoint(self, gs, metrics=None, force: bool = False):
        """Periodic checkpoint, and the final one when `train.final_checkpoint`; `force` after a guard action, so a
        resume starts from what the guard left."""
        t = self.cfg.train
        final = gs == t.steps and t.final_checkpoint
        if force or (t.checkpoint_every and gs % t.checkpoint_every == 0) or final:
            self.ckpt.save(gs, self._ckpt_state(), *self._host_parts(gs, metrics))

    def _stop_requested(self, signals) -> bool:
        """Whether a stop signal arrived (faults.StopSignals). Several processes agree first (one tiny all-gather a
        step, multi-process runs only): a checkpoint is written by all of them or by none."""
        asked = signals.requested is not None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if bool(np.any(multihost_utils.process_allgather(np.int32(asked)))) and not asked:
                signals.requested, asked = "a signal to another process", True
        return asked

    def _preempt(self, signame: str) -> None:
        """A stop signal at step `self.gs`'s boundary: checkpoint that step (unless it has just been written), say
        where and how to go on. The step's metrics line is already written; the run then returns as a finished one
        would (exit 0)."""
        gs = self.gs
        if self.ckpt.latest() != gs:
            self.ckpt.save(gs, self._ckpt_state(), *self._host_parts(gs))
        self.summary["preempted_at"] = gs
        if jax.process_index() == 0:
            print(
                f"twocircuit: stopped by {signame} after step {gs}: checkpoint {self.ckpt.root}/step_{gs:08d}; "
                f"continue with: twocircuit train --config CONFIG --out {self.run_dir} --resume",
                flush=True,
            )


def _anchor_state(counters: dict | None, buffers: dict | None) -> dict:
    """AnchorCircuit.state_dict() from a checkpoint: the counters from the meta, the buffers blob as
    `_host_parts` writes it (None: a checkpoint without one; the anchor keeps its fresh buffers)."""
    d = {"counters": counters or {}, "gen_tick": None, "buffer": None, "window": None}
    if buffers is not None:
        buffers = dict(buffers)
        window = buffers.pop("window")
        d.update(gen_tick=buffers.pop("gen_tick"), buffer=buffers)
        if window is not None:
            d["window"] = {"ticks": window[0], "snaps": window[1]}
    return d
