"""Output folders the commands write (`--out`): never delete what a user put there.

A folder the project writes holds a marker, `.twocircuit.json` {"kind": ..., "files": [top-level names it wrote]}.
A command refuses a non-empty folder without the marker (someone else's) unless `--overwrite`; even then, and in
its own folders, it replaces only the names it writes itself, one entry at a time (`install`), and removes only
names its marker lists. The cost of never deleting a folder whole: a replaced entry is renamed aside and deleted
after the new one is in place, so for a moment both are on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

MARKER = ".twocircuit.json"


def marker(path: str) -> dict | None:
    """The marker of folder `path`, or None when the project did not write it (no or unreadable marker)."""
    try:
        with open(os.path.join(path, MARKER)) as fh:
            m = json.load(fh)
        return m if isinstance(m, dict) and isinstance(m.get("files", []), list) else None
    except (OSError, ValueError):
        return None


def foreign(path: str) -> bool:
    """`path` is a non-empty folder (or a file) the project did not create."""
    if not os.path.exists(path):
        return False
    if not os.path.isdir(path):
        return True
    return bool(os.listdir(path)) and marker(path) is None


def check_out(path: str, overwrite: bool, flag: str = "--out") -> None:
    """ConfigError naming `path` when it is someone else's non-empty folder (or a file) and not `overwrite`."""
    from twocircuit_jax.config.base import ConfigError

    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(flag, f"{path} is a file, not a folder")
    if foreign(path) and not overwrite:
        raise ConfigError(
            flag,
            f"{path} is not empty and twocircuit did not create it; choose a new folder, or pass --overwrite to "
            "write into it (only the files twocircuit writes are replaced)",
        )


def write_marker(path: str, kind: str, files=()) -> None:
    """Mark `path` as the project's, listing `files` (top-level names) as written by it; atomic."""
    names = sorted(set(files) - {MARKER})
    fd, tmp = tempfile.mkstemp(prefix=".tmp-marker-", dir=path)
    with os.fdopen(fd, "w") as fh:
        json.dump({"kind": kind, "files": names}, fh)
    os.replace(tmp, os.path.join(path, MARKER))


def install(tmp: str, path: str, kind: str, overwrite: bool = False) -> str:
    """Move the entries of the finished folder `tmp` into `path` and remove `tmp`. A new `path` is `tmp` renamed
    (one atomic step). Into an existing one, each entry replaces its namesake (a file by one os.replace); entries
    an earlier marker listed that this write lacks (an earlier export's extra shards) are removed; everything else
    stays. ConfigError when `path` is someone else's non-empty folder and not `overwrite`."""
    from twocircuit_jax.config.base import ConfigError

    names = sorted(os.listdir(tmp))
    if not os.path.exists(path):
        write_marker(tmp, kind, names)
        os.rename(tmp, path)
        return path
    if foreign(path) and not overwrite:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            "--out", f"{path}: not empty and not written by twocircuit; pass --overwrite to write into it"
        )
    stale = set((marker(path) or {}).get("files", [])) - set(names) - {MARKER}
    for name in names:
        src, dst = os.path.join(tmp, name), os.path.join(path, name)
        if os.path.isdir(dst) and not os.path.islink(dst):
            aside = tempfile.mkdtemp(prefix=f".tmp-old-{name}-", dir=path)
            os.rename(dst, os.path.join(aside, name))
            os.rename(src, dst)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(src, dst)
    for name in stale:
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.remove(p)
    write_marker(path, kind, names)
    shutil.rmtree(tmp, ignore_errors=True)
    return path


# What a training run writes at the top of its folder (train/loop.py, metrics/logger.py, train/guard.py, setup.py);
# TensorBoard's event files start with RUN_EVENTS.
RUN_FILES = ("config.yaml", "metrics.jsonl", "guard.jsonl", "checkpoints", "sampler", "provenance.json")
RUN_EVENTS = "events.out.tfevents."


def run_files(path: str) -> list[str]:
    """The names in folder `path` a training run writes."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if n in RUN_FILES or n.startswith(RUN_EVENTS))


def remove_run_files(path: str) -> None:
    """Delete a previous run's own files from its folder (the caller checked the marker); nothing else."""
    for name in run_files(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
