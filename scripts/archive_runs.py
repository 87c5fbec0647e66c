"""Archive a sweep's finished runs next to the figures they back (docs/results/), small enough to commit.

    python scripts/archive_runs.py runs/ladder_lr docs/results/ladder_lr

Each finished run under SWEEP (its folder holds sweep_done.json) is copied to DEST at the same relative path:
config.yaml, summary.json, sweep_done.json, provenance.json (when the run has one) and metrics.jsonl gzipped (metrics.jsonl.gz, about a sixth of its size;
written with no timestamp, so the same run gives the same bytes). Checkpoints, TensorBoard events and logs are left
out. `twocircuit compare` and `plot` read an archived run as they read the run (metrics/runs.py), and a `sweep
--resume` into a copy of the archive reads its finished arms instead of rerunning them, so a sweep longer than one
machine's life goes on from the archive:

    cp -r docs/results/ladder_lr runs/ && twocircuit sweep --config configs/sweeps/ladder_lr.yaml \
        --out runs/ladder_lr --resume --seeds 0-4 --jobs 2

A run already in DEST is skipped when its archived metrics are the same and refused (exit 2, nothing written) when
they differ: the figures already cited must not change under them. Unfinished runs are not archived.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import shutil
import sys

DONE = "sweep_done.json"
COPIED = ("config.yaml", "summary.json", DONE)
OPTIONAL = ("provenance.json",)  # a run from before the trainer wrote it has none


def finished_runs(sweep: str) -> list[str]:
    """The finished run folders under `sweep` (ARM or ARM/seed_K, relative), sorted."""
    out = []
    for here, dirs, files in os.walk(sweep):
        dirs[:] = sorted(d for d in dirs if d != "checkpoints")
        if DONE in files and "metrics.jsonl" in files:
            out.append(os.path.relpath(here, sweep))
    return sorted(out)


def _gzipped(path: str) -> bytes:
    buf = io.BytesIO()
    with open(path, "rb") as src, gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as gz:
        shutil.copyfileobj(src, gz)
    return buf.getvalue()


def archive(sweep: str, dest: str) -> tuple[list[str], list[str]]:
    """(archived, already there) relative run paths. Raises ValueError naming the first run whose archived metrics
    differ from its run's, before anything is written."""
    plan = []
    for rel in finished_runs(sweep):
        missing = [f for f in COPIED if not os.path.isfile(os.path.join(sweep, rel, f))]
        if missing:
            raise ValueError(f"{os.path.join(sweep, rel)}: finished run without {missing[0]}")
        blob = _gzipped(os.path.join(sweep, rel, "metrics.jsonl"))
        have = os.path.join(dest, rel, "metrics.jsonl.gz")
        if os.path.isfile(have):
            with gzip.open(have, "rb") as fh, open(os.path.join(sweep, rel, "metrics.jsonl"), "rb") as now:
                if fh.read() != now.read():
                    raise ValueError(f"{have} holds other metrics than {os.path.join(sweep, rel)}; not overwritten")
        plan.append((rel, blob, os.path.isfile(have)))
    new, kept = [], []
    for rel, blob, there in plan:
        if there:
            kept.append(rel)
            continue
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        for f in COPIED + tuple(f for f in OPTIONAL if os.path.isfile(os.path.join(sweep, rel, f))):
            shutil.copyfile(os.path.join(sweep, rel, f), os.path.join(dest, rel, f))
        tmp = os.path.join(dest, rel, "metrics.jsonl.gz.tmp")
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, os.path.join(dest, rel, "metrics.jsonl.gz"))  # last: a run is archived once this exists
        new.append(rel)
    return new, kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", help="a sweep's output folder (runs/NAME)")
    ap.add_argument("dest", help="the archive folder (docs/results/NAME)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.sweep):
        print(f"archive_runs: {args.sweep}: not a folder", file=sys.stderr)
        return 2
    try:
        new, kept = archive(args.sweep, args.dest)
    except ValueError as e:
        print(f"archive_runs: {e}", file=sys.stderr)
        return 2
    print(f"archived {len(new)} runs into {args.dest} ({len(kept)} already there)")
    for rel in new:
        print(f"  {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
