"""Checkpoints for the GRPO loop: orbax for the array state, JSON for host state, an atomic commit protocol.

Layout under `root`:

    step_00000040/   state/ (orbax PyTree)   meta.json   COMMITTED   blobs/*.npz (train/safe_blob.py)
    step_00000050/   ...                                   periodic, the last `keep_last` are kept
    best/            state/   meta.json   COMMITTED        best held-out score so far (higher is better)
    .tmp-*           a save in progress, or the debris of a crashed one

A save writes everything into a fresh `.tmp-*` directory, writes the `COMMITTED` marker last, fsyncs every file and
folder in it, then renames the directory into place (one atomic rename on a POSIX filesystem) and fsyncs `root`, so
the rename is durable too (train/faults.py; one fsync per file and folder, milliseconds against the write itself).
A directory without the marker is never returned by `latest()` and is deleted on the next `CheckpointManager(...)`
or `save`; retention renames a folder to `.tmp-*` before deleting it, so a half-deleted one never looks committed. `state` is any pytree of arrays (params,
optimizer state, codec/anchor state; PRNG keys as raw uint32 arrays); `meta` is JSON-able host state (seeds and
counters, tick, data cursor, metric history, best score). Saving is synchronous: it blocks until the files are on
disk (orbax's device-to-host copy plus the write), so call it between steps, not inside a jitted region.

Multi-process: orbax writes the arrays cooperatively; the directory renames and deletions are done by process 0 and
followed by a barrier.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from twocircuit_jax.model.hf_io import CheckpointError
from twocircuit_jax.train import faults, safe_blob

_MARKER = "COMMITTED"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_BEST = "best"
# Parts older releases pickled (anchor_buffers.pkl, rollouts_ahead.pkl): unpickling runs code the file names, so a
# checkpoint holding one is refused, never read.
_PICKLED = (".pkl", ".pickle")


def _step_dir(step: int) -> str:
    return f"step_{step:08d}"


def committed_steps(root) -> list[int]:
    """The committed periodic checkpoint steps under `root`, ascending (read only: nothing created or cleaned)."""
    root, out = Path(root), []
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP_RE.match(d.name)
            if m and (d / _MARKER).is_file():
                out.append(int(m.group(1)))
    return sorted(out)


def _remove(d: Path) -> None:
    """Delete a committed folder: renamed to `.tmp-*` debris first (one atomic step), so a crash while deleting never
    leaves a folder that still looks committed with half its files gone; `_clean` finishes the job."""
    trash = d.parent / f".tmp-drop-{d.name}-{uuid.uuid4().hex[:8]}"
    os.rename(d, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _abstract(x):
    """Restore target for one leaf: jax arrays keep their sharding, host arrays come back as numpy arrays."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    return x


class CheckpointManager:
    """Periodic checkpoints with retention, plus the best-scoring one kept in `root/best`."""

    def __init__(self, root, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self._primary = jax.process_index() == 0
        if self._primary:
            self.root.mkdir(parents=True, exist_ok=True)
        self._sync("ckpt_init_mkdir")
        self._ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        self._clean()

    # ----- queries -----
    def steps(self) -> list[int]:
        """Committed periodic checkpoint steps, ascending."""
        return committed_steps(self.root)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best_score(self) -> float | None:
        d = self.root / _BEST
        if not (d / _MARKER).is_file():
            return None
        return json.loads((d / _MARKER).read_text())["score"]

    # ----- saving -----
    def save(self, step: int, state, meta: dict, blobs: dict | None = None) -> Path:
        """Write periodic checkpoint `step` (replacing an existing one of the same step), then apply retention.
        `blobs` ({file name: bytes}) are host-side extras written beside meta.json, inside the same commit."""
        self._clean()
        final = self._write(state, dict(meta), {"step": int(step)}, _step_dir(int(step)), blobs)
        if self._primary:
            faults.point("ckpt/after_commit")
            for old in self.steps()[: -self.keep_last]:
                _remove(self.root / _step_dir(old))
                faults.point("ckpt/retention")
        self._sync("ckpt_retention")
        return final

    def save_best(self, step: int, state, meta: dict, score: float, blobs: dict | None = None) -> bool:
        """Keep this state in `root/best` if `score` is strictly better (higher) than the kept one. NaN never wins.
        Returns whether it was written."""
        score = float(score)
        cur = self.best_score()
        if math.isnan(score) or (cur is not None and not score > cur):
            return False
        self._clean()
        self._write(state, dict(meta), {"step": int(step), "score": score}, _BEST, blobs)
        return True

    # ----- restoring -----
    def restore(self, step, target_like):
        """Restore periodic checkpoint `step` (or "best") into the structure, dtypes and shardings of `target_like`
        (real arrays or jax.ShapeDtypeStruct with `sharding`). Returns (state, meta)."""
        d = self.root / (_BEST if step == _BEST else _step_dir(int(step)))
        if not (d / _MARKER).is_file():
            raise FileNotFoundError(f"no committed checkpoint {step!r} under {self.root} (have {self.steps()})")
        self._refuse_pickles(d)
        abstract = jax.tree_util.tree_map(_abstract, target_like)
        state = self._ckptr.restore(d / "state", args=ocp.args.StandardRestore(abstract))
        meta = json.loads((d / "meta.json").read_text())
        return state, meta

    def read_meta(self, step) -> dict:
        """The JSON host state of checkpoint `step` (or "best") alone, without touching the arrays."""
        d = self.root / (_BEST if step == _BEST else _step_dir(int(step)))
        if not (d / _MARKER).is_file():
            raise FileNotFoundError(f"no committed checkpoint {step!r} under {self.root} (have {self.steps()})")
        return json.loads((d / "meta.json").read_text())

    def read_blob(self, step, name: str) -> bytes | None:
        """A host-side extra saved with checkpoint `step` (or "best"); None if that checkpoint has none."""
        f = self.root / (_BEST if step == _BEST else _step_dir(int(step))) / "blobs" / name
        if f.suffix in _PICKLED:
            self._refuse_pickles(f.parent.parent)
        return f.read_bytes() if f.is_file() else None

    def read_part(self, step, name: str):
        """A blob written with `safe_blob.dumps`, decoded (data only: never unpickled); None if absent. BlobError
        (a CheckpointError) naming the file when it is anything else."""
        data = self.read_blob(step, name)
        where = self.root / (_BEST if step == _BEST else _step_dir(int(step))) / "blobs" / name
        return None if data is None else safe_blob.loads(data, str(where))

    @staticmethod
    def _refuse_pickles(d: Path) -> None:
        blobs = d / "blobs"
        for f in sorted(blobs.iterdir()) if blobs.is_dir() else ():
            if f.suffix in _PICKLED:
                raise CheckpointError(
                    f"{f}: a pickled checkpoint part (an older twocircuit_jax wrote it); reading a pickle runs the "
                    "code it names, so this checkpoint is not loaded. Resume it with the release that wrote it, or "
                    "start a new run"
                )

    def set_aside(self, step) -> Path:
        """Rename an unreadable periodic checkpoint `step` to `step_N.unreadable` (`-2`, `-3`, ... if taken): out of
        `steps()`, out of retention and `_clean`, kept for the user to inspect. Never deleted. Returns the new path."""
        d = self.root / _step_dir(int(step))
        aside, k = d.with_name(d.name + ".unreadable"), 1
        while aside.exists():
            k += 1
            aside = d.with_name(f"{d.name}.unreadable-{k}")
        if self._primary:
            os.rename(d, aside)
            faults.fsync_path(self.root)
        self._sync("ckpt_set_aside")
        return aside

    # ----- internals -----
    def _write(self, state, meta, marker: dict, name: str, blobs: dict | None = None) -> Path:
        # Deterministic name so every process agrees on it; `_clean()` ran just before, so it does not exist.
        tmp = self.root / f".tmp-{name}"
        if self._primary:
            tmp.mkdir()
        self._sync("ckpt_tmp_mkdir")
        self._ckptr.save(tmp / "state", args=ocp.args.StandardSave(state))
        final = self.root / name
        if self._primary:
            (tmp / "meta.json").write_text(json.dumps(meta))
            if blobs:
                (tmp / "blobs").mkdir()
                for fname, data in blobs.items():
                    if "/" in fname or fname.startswith("."):
                        raise ValueError(f"checkpoint blob name {fname!r}: a plain file name is required")
                    (tmp / "blobs" / fname).write_bytes(data)
            (tmp / _MARKER).write_text(json.dumps(marker))  # written last: its presence means complete
            faults.fsync_tree(tmp)  # the contents on disk before the rename that makes them the checkpoint
            faults.point("best/before_commit" if name == _BEST else "ckpt/before_commit")
            if final.exists():  # same step again (resume), or the old best
                trash = self.root / f".tmp-old-{name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, trash)
                if name == _BEST:
                    faults.point("best/swapped_out")
                os.rename(tmp, final)
                faults.fsync_path(self.root)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
                faults.fsync_path(self.root)
        self._sync("ckpt_commit")
        return final

    def _clean(self):
        """Delete debris of crashed saves: `.tmp-*` dirs and step dirs without the marker. If a crash fell between
        the two renames that replace `best`, the displaced old best (committed) is put back first."""
        if self._primary and self.root.is_dir():
            best = self.root / _BEST
            for d in sorted(self.root.iterdir()):
                if not d.is_dir():
                    continue
                if d.name.startswith(f".tmp-old-{_BEST}-") and not best.exists() and (d / _MARKER).is_file():
                    os.rename(d, best)
                elif d.name.startswith(".tmp-") or (_STEP_RE.match(d.name) and not (d / _MARKER).is_file()):
                    shutil.rmtree(d, ignore_errors=True)
            if best.is_dir() and not (best / _MARKER).is_file():
                shutil.rmtree(best, ignore_errors=True)
        self._sync("ckpt_clean")

    @staticmethod
    def _sync(tag: str):
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(tag)
