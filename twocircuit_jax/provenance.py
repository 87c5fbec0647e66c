"""A run's provenance file, `provenance.json`: the base it started from, by content as well as by path.

Paired seeds compare two arms started from one base. A base rebuilt on another machine can differ in its last bits
(SFT on XLA:CPU is deterministic on one machine, not across CPUs), so a path says too little: the file records the
sha256 of the base folder's files, and `twocircuit compare` names any paired seed whose two runs started from
different bases. Hashing reads the whole base once at a fresh start: about a second a GB.
"""

from __future__ import annotations

import hashlib
import json
import os

PROVENANCE = "provenance.json"
_SKIP = (".twocircuit.json",)  # the output-folder marker lists file names only; not the model


def folder_sha256(path: str) -> str:
    """sha256 over every file under `path`: each one's relative path, size and bytes, in sorted order (mtimes and
    the folder's own location do not count)."""
    h = hashlib.sha256()
    files = []
    for here, dirs, names in os.walk(path):
        dirs.sort()
        files += [os.path.join(here, n) for n in names if n not in _SKIP]
    for f in sorted(files, key=lambda f: os.path.relpath(f, path)):
        rel = os.path.relpath(f, path).replace(os.sep, "/")
        h.update(f"{rel}\0{os.path.getsize(f)}\0".encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def write(run_dir: str, base_model: str | None) -> dict:
    """Write the run folder's provenance.json (atomically) and return it; `base_model` None: a random init."""
    info = {"base_model": base_model, "base_model_sha256": folder_sha256(base_model) if base_model else None}
    tmp = os.path.join(run_dir, f".tmp-{PROVENANCE}-{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(info, fh, indent=1)
    os.replace(tmp, os.path.join(run_dir, PROVENANCE))
    return info


def read(run_dir: str) -> dict:
    """The run folder's provenance ({} when it has none: a run from before the file existed, or unreadable)."""
    try:
        with open(os.path.join(run_dir, PROVENANCE)) as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}
