"""Run folders as `twocircuit plot` and `twocircuit compare` read them: each run's `metrics.jsonl` and `config.yaml`
(and `provenance.json`'s base fingerprint where the run has one), so finished runs, runs still in progress and copies from another machine read alike. An archived run
(scripts/archive_runs.py: docs/results/) holds `metrics.jsonl.gz` instead and reads the same. A sweep folder
(subfolders that are runs, ARM or ARM/seed_K) is expanded into its arms. No plotting here."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from dataclasses import dataclass, field

import yaml

from twocircuit_jax import provenance
from twocircuit_jax.config.base import ConfigError, registered
from twocircuit_jax.config.sections import ActivationCodecConfig

METRICS = "metrics.jsonl"  # what the trainer writes (metrics/logger.py)
ARCHIVED = METRICS + ".gz"  # an archived run's copy of it (scripts/archive_runs.py)


def metrics_file(run_dir: str) -> str | None:
    """The run folder's metrics file (metrics.jsonl, else an archive's metrics.jsonl.gz), or None: not a run."""
    for name in (METRICS, ARCHIVED):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            return path
    return None


def open_metrics(path: str):
    """A text handle on a metrics file, gzipped or not."""
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def codec_order() -> tuple:
    """The registered activation codecs (`type: none` aside) in registration order: the fidelity map's rows. Each
    codec's section declares its strength field (`strength`); a codec registered by a user module counts as well."""
    return tuple(n for n in registered(ActivationCodecConfig) if n != "none")


def strength_key(codec: str) -> tuple:
    """(field, short label) of a codec's compression strength, as its section declares it; (None, None) if none."""
    section = registered(ActivationCodecConfig).get(codec)
    return (section.strength if section is not None else None) or (None, None)


GAP, GRAD_COS, ACC = "mismatch/prob_gap_mean", "fidelity/grad_cos", "eval/accuracy"
KL_K3 = "mismatch/kl_k3"


def _num(v) -> float | None:
    """A finite float from a logged value (bools and the logger's "nan"/"inf" strings included), else None."""
    try:
        x = float(v) if isinstance(v, (bool, int, float, str)) else None
    except ValueError:
        return None
    return x if x is not None and math.isfinite(x) else None


@dataclass
class Run:
    """One run folder: its name, resolved config (plain dict), metrics rows sorted by step, and the config keys the
    comparison is about (codec, its strength, anchor on/off, hidden size)."""

    name: str
    path: str
    config: dict
    rows: list[dict] = field(default_factory=list)
    base_sha: str | None = None  # sha256 of the base folder it started from (provenance.json), None: not recorded

    def __post_init__(self) -> None:
        sec = lambda k: self.config.get(k) if isinstance(self.config.get(k), dict) else {}  # noqa: E731
        fast = sec("fast")
        section = lambda v: {"type": v} if isinstance(v, str) else dict(v or {})  # noqa: E731
        codec = {"type": "none", **section(fast.get("codec"))}
        self.codec: str = str(codec["type"])
        self.anchor: bool = bool(sec("anchor").get("enabled", False))
        self.hidden: int | None = sec("model").get("hidden_size")
        key, short = strength_key(self.codec)
        self.strength: float | None = codec.get(key) if key else None
        grad = section(fast.get("grad_codec")).get("type", "none")
        # e.g. "lowrank r=8"; a gradient codec is appended ("+powersgd"): a different compression, a different row
        self.codec_label = (
            self.codec
            + (f" {short}={self.strength:g}" if self.strength is not None else "")
            + (f" +{grad}" if grad != "none" else "")
        )
        self.is_dense = self.codec == "none" and not self.anchor and grad == "none"

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the steps that logged `key`."""
        pts = [(r["step"], _num(r[key])) for r in self.rows if key in r]
        pts = [(s, v) for s, v in pts if v is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    def last(self, key: str, n: int = 1) -> float | None:
        """The last logged value of `key`, or with n > 1 the mean of the last n; None if never logged."""
        vals = self.series(key)[1][-n:]
        return sum(vals) / len(vals) if vals else None

    def summary(self) -> dict:
        """The run's headline numbers (None where not logged)."""
        steps, acc = self.series(ACC)
        return {
            "name": self.name,
            "codec": self.codec_label,
            "anchor": self.anchor,
            "base_accuracy": acc[steps.index(0)] if 0 in steps else None,
            "final_accuracy": acc[-1] if acc else None,
            "max_accuracy": max(acc) if acc else None,
            "gap_last10": self.last(GAP, 10),
            "grad_cos": self.last(GRAD_COS),
            # the guard's counter is cumulative: its last value is the run's total
            "guard_rollbacks": int(n) if (n := self.last("guard/rollbacks")) is not None else None,
        }


def load_run(path: str, name: str | None = None) -> Run:
    """Read one run folder. A torn line (a run still writing) is skipped, as the trainer's own logger does."""
    mpath, cpath = metrics_file(path), os.path.join(path, "config.yaml")
    if mpath is None:
        raise ConfigError(path, "not a run folder: no metrics.jsonl")
    if not os.path.isfile(cpath):
        raise ConfigError(path, "run folder without config.yaml")
    try:
        with open(cpath) as fh:
            cfg = yaml.safe_load(fh) or {}
    except yaml.YAMLError as e:
        raise ConfigError(cpath, f"unreadable YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(cpath, "expected a YAML mapping")
    rows = []
    with open_metrics(mpath) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                rows.append(rec)
    rows.sort(key=lambda r: r["step"])
    base_sha = provenance.read(path).get("base_model_sha256")
    return Run(name or os.path.basename(os.path.normpath(path)), path, cfg, rows, base_sha)


def _arms(folder: str) -> list[str]:
    """A sweep folder's run subfolders, relative to it: ARM, or ARM/seed_K for a sweep run with seeds (an arm's own
    folder gives its seed_K). summary.json's arm order first (the sweep file's order), then by name; seeds in order."""

    def runs_in(d: str) -> list[str]:
        return [x for x in os.listdir(d) if metrics_file(os.path.join(d, x))]

    def by_seed(x: str):
        m = re.fullmatch(r"seed_(\d+)", x)
        return (0, int(m.group(1)), x) if m else (1, 0, x)

    top = sorted(runs_in(folder), key=by_seed)
    nested = sorted(
        d
        for d in os.listdir(folder)
        if d not in top and os.path.isdir(os.path.join(folder, d)) and runs_in(os.path.join(folder, d))
    )
    try:
        with open(os.path.join(folder, "summary.json")) as fh:
            order = list(dict.fromkeys(r["arm"] for r in json.load(fh) if isinstance(r, dict) and "arm" in r))
    except (OSError, ValueError, TypeError):
        order = []
    arms = [a for a in order if a in top or a in nested] + [a for a in top + nested if a not in order]
    return [
        x
        for a in arms
        for x in ([a] if a in top else [f"{a}/{r}" for r in sorted(runs_in(os.path.join(folder, a)), key=by_seed)])
    ]


def group_name(run: "Run") -> str:
    """The group a run belongs to: its name without a trailing /seed_K (sweep ARM/seed_K runs share ARM)."""
    return re.sub(r"/seed_\d+$", "", run.name)


def expand_runs(paths: list[str]) -> list[Run]:
    """Runs for the given paths, sweep folders expanded to `SWEEP/ARM`. Raises ConfigError on the first bad path."""
    runs = []
    for p in paths:
        if metrics_file(p):
            runs.append(load_run(p))
        elif os.path.isdir(p) and (arms := _arms(p)):
            sweep = os.path.basename(os.path.normpath(p))
            runs += [load_run(os.path.join(p, a), f"{sweep}/{a}") for a in arms]
        else:
            what = "not found" if not os.path.exists(p) else "no metrics.jsonl in it or in any subfolder"
            raise ConfigError(p, f"not a run or sweep folder: {what}")
    names = [r.name for r in runs]
    for r in runs:  # the same basename twice: tell them apart by their parent folder
        if names.count(r.name) > 1:
            r.name = os.path.relpath(os.path.abspath(r.path), os.path.dirname(os.path.dirname(os.path.abspath(r.path))))
    return runs
