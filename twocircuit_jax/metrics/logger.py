"""Run metrics: `metrics.jsonl` (the public record, design §9), TensorBoard scalars, and the progress (a tqdm bar
on a terminal, plain lines in a log file: progress.py).

`metrics.jsonl` holds one JSON object per GRPO step, written and flushed as the step ends, so a crash loses at most
the step in flight. Values are converted to plain JSON: jax/numpy scalars become int/float/bool, arrays become
lists. Non-finite floats are written as the *strings* "nan", "inf", "-inf" (strict JSON has no NaN, and null would
hide whether a value blew up or was infinite by definition, e.g. `codec/basis_cond`); `float(x)` reads them back.

Resume: `MetricsLogger(run_dir, total, resume_from_step=k)` drops lines with step > k (and a torn last line) so the
resumed run rewrites them without duplicates; TensorBoard gets `purge_step=k+1`, which makes it discard the old
run's events from step k+1 on.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import jax
import numpy as np

from twocircuit_jax.metrics.progress import progress

_JSONL = "metrics.jsonl"


def _plain(v):
    """A value from a metrics dict as plain JSON (see module doc for non-finite floats)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.ndarray, np.generic)):
        return _plain(v.tolist())
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    raise TypeError(f"metric value of type {type(v).__name__} is not loggable: {v!r}")


def _scalar(v):
    """A float for TensorBoard, or None for non-numeric / non-scalar values."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return None


def _truncate_jsonl(path: Path, last_step: int) -> list[dict]:
    """Keep the records with step <= last_step; rewrite the file atomically. Returns the kept records."""
    kept, lines = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a crash
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= last_step:
                kept.append(rec)
                lines.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as fh:  # on disk before the rename makes it the record (a power loss: old or new, not empty)
        fh.write("".join(x + "\n" for x in lines))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)  # and the rename itself
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return kept


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch when torch is not loaded yet. tensorboardX imports
    torch at module level only to recognise torch tensors among the values it is given; this logger hands it floats.
    Importing torch costs ~1.5 s of CPU per process (measured: tensorboardX with torch 1.5 s, without 0.1 s), paid by
    every `twocircuit train` start, every sweep arm and every resume. `sys.modules["torch"] = None` makes that one
    import fail as if torch were absent, which tensorboardX handles; the entry is removed at once, so a later
    `import torch` anywhere in the process works as usual."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsLogger:
    """`log(step, metrics)` after each GRPO step; `close()` at the end (or use as a context manager)."""

    def __init__(self, run_dir, total_steps: int, show_progress: bool = True, resume_from_step: int | None = None):
        SummaryWriter = _summary_writer_class()

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / _JSONL
        self._last = {"reward": None, "eval": None}
        start, self.last_step = 0, -1  # the last step with a line in metrics.jsonl
        if resume_from_step is not None:
            for rec in _truncate_jsonl(self.path, int(resume_from_step)):
                self._remember(rec)
                self.last_step = max(self.last_step, rec["step"])
            start = int(resume_from_step)
        self._file = open(self.path, "a", encoding="utf-8")
        purge = None if resume_from_step is None else int(resume_from_step) + 1
        self._tb = SummaryWriter(logdir=str(self.run_dir), purge_step=purge)
        self._bar = progress(
            total=total_steps,
            initial=min(start, total_steps),
            disable=not show_progress,
            unit="step",
            dynamic_ncols=True,
        )
        self._bar.set_description("grpo")
        self._refresh_postfix()

    def log(self, step: int, metrics: dict):
        """Append one record {"step": step, **metrics}. One device-to-host transfer for all jax values in `metrics`
        (this is a host sync: call it after the step's results are needed anyway)."""
        host = jax.device_get(dict(metrics))
        rec = {"step": int(step)}
        rec.update(_plain({k: v for k, v in host.items() if k != "step"}))
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        # One TensorBoard event a step holding every scalar: one `add_scalar` per metric costs ~0.2 ms each (a proto,
        # an event and a queue hand-off apiece), about 20 ms a step at 90 metrics.
        from tensorboardX.proto.summary_pb2 import Summary

        scalars = {k: _scalar(v) for k, v in rec.items() if k != "step"}
        values = [Summary.Value(tag=k, simple_value=x) for k, x in scalars.items() if x is not None]
        if values:
            self._tb._get_file_writer().add_summary(Summary(value=values), global_step=int(step))
        self._remember(rec)
        self.last_step = max(self.last_step, int(step))
        self._refresh_postfix()
        if step > self._bar.n:
            self._bar.update(min(step, self._bar.total or step) - self._bar.n)

    def close(self):
        self._bar.close()
        self._tb.flush()
        self._tb.close()
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _remember(self, rec: dict):
        if "reward/mean" in rec:
            self._last["reward"] = rec["reward/mean"]
        if "eval/accuracy" in rec:
            self._last["eval"] = rec["eval/accuracy"]

    def _refresh_postfix(self):
        fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
        self._bar.set_postfix(reward=fmt(self._last["reward"]), eval=fmt(self._last["eval"]), refresh=False)
