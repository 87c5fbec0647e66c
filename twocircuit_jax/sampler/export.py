"""Versioned weight exports for the vLLM sampler process (design §1, §2 step 6 "Publish").

Layout of one version:

    export_root/v00000007/params/...   orbax PyTree checkpoint of the dense parameter pytree
    export_root/v00000007/meta.json    {"version": 7, "model_config": {...ModelConfig fields...}}

A version is written under `export_root/.tmp-v00000007-<pid>` and renamed into place with one `os.rename`, so a
reader never sees a half-written folder: either `v00000007` exists whole or not at all. Only the newest `keep`
versions stay on disk (a 0.5B fp32 export is ~2 GiB; a long run would otherwise fill the disk).

Restoring (`load_export`) returns numpy arrays in host memory, never device arrays: the sampler process needs no
accelerator and must not grab one from the trainer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import numpy as np

from twocircuit_jax.train import faults

_NAME = re.compile(r"^v(\d{8})$")
META = "meta.json"
PARAMS = "params"


class ExportError(RuntimeError):
    """A weight export that is missing or cannot be read; the message names the folder and what is wrong."""


def version_dir(export_root: str, version: int) -> str:
    return os.path.join(export_root, f"v{int(version):08d}")


def _config_dict(config) -> dict:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"model config must be a dataclass or dict, got {type(config).__name__}")


def list_versions(export_root: str) -> list[int]:
    """Complete versions on disk, ascending (temporary folders are never listed)."""
    if not os.path.isdir(export_root):
        return []
    return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(export_root)) if m)


def export_weights(
    params, config, export_root: str, version: int, keep: int = 3, meta: dict | None = None, *, alone: bool = False
) -> str:
    """Save `params` (jax or numpy pytree) as version `version`; returns the version folder.

    `alone`: this process writes host arrays it holds whole, and the run's other processes (jax.distributed) are not
    saving with it: orbax's barriers then wait for this process only (by default orbax syncs every process of the
    run, which a save on process 0 alone, sampler/process_zero.py, would wait on forever).

    Costs one host copy of the parameters (orbax gathers sharded arrays). Re-exporting an existing version
    replaces it. `keep` >= 1 newest versions are retained; older ones are deleted after the rename (see prune).
    `meta`: extra meta.json fields (sampler/weight_publish.py writes `kind`, `hashes` and a delta's `base_version`).
    """
    import orbax.checkpoint as ocp

    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    os.makedirs(export_root, exist_ok=True)
    final = version_dir(export_root, version)
    tmp = os.path.join(export_root, f".tmp-v{int(version):08d}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed earlier attempt by this pid
    os.makedirs(tmp)
    try:
        # No zstd: weights in bf16/fp32 barely compress (a 126 MB delta payload shrank to 100 MB) and compressing
        # cost 4-7x the write (0.3-0.7 s vs 0.1 s on /dev/shm, 2 cores). Readers need no flag: the codec is in
        # the array metadata.
        saver = {}
        if alone:
            import jax
            from orbax.checkpoint.options import MultiprocessingOptions

            me = jax.process_index()
            saver["multiprocessing_options"] = MultiprocessingOptions(primary_host=me, active_processes={me})
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False), **saver).save(
            os.path.join(tmp, PARAMS), params
        )
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump({**(meta or {}), "version": int(version), "model_config": _config_dict(config)}, fh, indent=1)
        faults.point("export/before_commit")  # a kill here leaves the .tmp-* folder: prune removes it next start
        if os.path.isdir(final):  # rename cannot replace a non-empty folder; move the old one aside first
            old = tmp + ".old"
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(export_root, keep, written=version)
    faults.point("export/after_commit")  # a kill here leaves a version newer than the checkpoint: discard_newer
    return final


def prune(export_root: str, keep: int, written: int | None = None) -> None:
    """Delete all but the newest `keep` versions (and stale temporary folders of dead writers). `written`, the
    version just written, is always kept, even when newer numbers are on disk. A kept delta keeps the versions back
    to its newest full base (the chain `weight_receive.rebuild` walks), so every kept version can be rebuilt from disk."""
    keep = max(1, int(keep))
    versions = list_versions(export_root)
    kept = set(versions[-keep:])
    if written is not None and int(written) in versions:
        kept.add(int(written))
    for v in sorted(kept):
        i = versions.index(v)
        while i > 0 and _kind(version_dir(export_root, versions[i])) == "delta":
            i -= 1
            kept.add(versions[i])
    for v in versions:
        if v not in kept:
            shutil.rmtree(version_dir(export_root, v), ignore_errors=True)
    for name in os.listdir(export_root):
        m = re.match(r"^\.tmp-v\d{8}-(\d+)", name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(export_root, name), ignore_errors=True)


def discard_newer(export_root: str, version: int) -> list[int]:
    """Delete the versions numbered above `version`; returns them. A resumed (or rolled-back) run publishes its
    checkpoint's step again: versions above it were written by the history it discards (a dead run's newest full
    base and its deltas), and would otherwise outrank the new ones in `prune` and in a restarted server's view."""
    gone = [v for v in list_versions(export_root) if v > int(version)]
    for v in gone:
        shutil.rmtree(version_dir(export_root, v), ignore_errors=True)
    return gone


SHM_PREFIX = "twocircuit-exports-"
OWNER = "owner.json"


def make_shm_root(shm: str = "/dev/shm") -> str:
    """A fresh export folder in `shm` (host memory) owned by this process, after removing the folders of dead
    owners (see remove_dead_shm_roots): a run killed with SIGKILL never reaches its close(), and its exports would
    hold host memory until a reboot."""
    remove_dead_shm_roots(shm)
    import socket
    import tempfile

    root = tempfile.mkdtemp(prefix=SHM_PREFIX, dir=shm)
    with open(os.path.join(root, OWNER), "w") as fh:
        json.dump({"pid": os.getpid(), "machine": socket.gethostname()}, fh)
    return root


def remove_dead_shm_roots(shm: str = "/dev/shm") -> list[str]:
    """Delete the export folders under `shm` that this project made (name prefix `twocircuit-exports-`, an
    owner.json) whose owner process, on this host, is gone; returns them. A folder without a readable owner file, of
    another host (a /dev/shm shared between containers) or of a live pid is left alone."""
    import socket

    gone = []
    try:
        names = os.listdir(shm)
    except OSError:
        return gone
    for name in names:
        path = os.path.join(shm, name)
        if not name.startswith(SHM_PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER)) as fh:
                owner = json.load(fh)
            pid, machine = int(owner["pid"]), str(owner["machine"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if machine == socket.gethostname() and pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kind(path: str) -> str:
    try:
        with open(os.path.join(path, META)) as fh:
            return str(json.load(fh).get("kind", "full"))
    except (OSError, ValueError):
        return "full"


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, META)
    if not os.path.isdir(path):
        raise ExportError(f"{path}: export folder not found")
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
        int(meta["version"])
        dict(meta["model_config"])
    except FileNotFoundError:
        raise ExportError(f"{meta_path}: missing (incomplete or corrupt export)") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{meta_path}: malformed ({type(e).__name__}: {e})") from None
    return meta


def load_export(path: str, allow_delta: bool = False):
    """(model_config dict, params as a numpy pytree) from one version folder; ExportError if missing/corrupt.
    A delta version (sampler/weight_words.py) holds changed words only: refused unless `allow_delta`, which
    returns its raw payload {"idx", "val"}; `weight_receive.rebuild` turns a delta chain into parameters."""
    import jax
    import orbax.checkpoint as ocp

    meta = read_meta(path)
    if meta.get("kind") == "delta" and not allow_delta:
        raise ExportError(
            f"{path}: a delta version (changed words against version {meta.get('base_version')}); "
            "rebuild it from its full base with twocircuit_jax.sampler.weight_receive.rebuild"
        )
    ppath = os.path.join(path, PARAMS)
    if not os.path.isdir(ppath):
        raise ExportError(f"{ppath}: missing (incomplete or corrupt export)")
    try:
        ckpt = ocp.PyTreeCheckpointer()
        tree = ckpt.metadata(ppath).item_metadata.tree
        # restore_type=np.ndarray keeps every leaf in host memory: no device placement, no accelerator needed.
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        params = ckpt.restore(ppath, restore_args=args)
    except Exception as e:  # orbax/tensorstore raise many types for truncated or garbled files
        raise ExportError(f"{ppath}: cannot restore orbax checkpoint ({type(e).__name__}: {e})") from None
    return meta["model_config"], params
