"""`twocircuit sweep`: the arms of a one-knob sweep, run one after another, one run folder per arm.

Sweep file (YAML):

    base: ../two_circuit.yaml        # the one base config, relative to this file
    set: {grpo.clip_high: 0.2}       # optional: dotted overrides applied to every arm (before the arm's own)
    arms:                            # arm name -> dotted overrides; {} is the base itself
      compressed: {}
      anchor_2x: {anchor.cadence: 2}

Every arm's config is resolved and validated before the first arm runs, so a typo fails in seconds, not after
hours. The table printed at the end (and written to OUT/summary.json) has each arm's final reward, held-out
accuracy, reference KL and sampler-trainer gap, read from the arm's metrics.jsonl.
"""

from __future__ import annotations

import json
import os

import yaml

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.run import load_config

COLUMNS = (
    ("reward", "reward/mean"),
    ("heldout_acc", "eval/accuracy"),
    ("ref_kl", "kl/ref"),
    ("gap", "mismatch/prob_gap_mean"),
)


def _sets(d, where) -> list[str]:
    if d is None:
        return []
    if not isinstance(d, dict):
        raise ConfigError(where, f"must be a mapping of dotted keys to values, got {type(d).__name__}")
    return [f"{k}={json.dumps(v)}" for k, v in d.items()]  # JSON is YAML: the value parses back unchanged


def load_sweep(path: str, overrides=None) -> tuple[str, list[tuple[str, object]]]:
    """(sweep name, [(arm name, resolved RunConfig)]). Raises ConfigError naming the file and the arm."""
    if not os.path.isfile(path):
        raise ConfigError("", "sweep file not found", source=path)
    with open(path) as fh:
        spec = yaml.safe_load(fh) or {}
    if not isinstance(spec, dict) or "base" not in spec or not isinstance(spec.get("arms"), dict) or not spec["arms"]:
        raise ConfigError("arms", "a sweep file needs `base: CONFIG.yaml` and a non-empty `arms:` mapping", source=path)
    base = os.path.join(os.path.dirname(os.path.abspath(path)), spec["base"])
    common = _sets(spec.get("set"), "set")
    name = spec.get("name") or os.path.splitext(os.path.basename(path))[0]
    arms = []
    for arm, over in spec["arms"].items():
        try:
            sets = common + _sets(over, f"arms.{arm}") + list(overrides or []) + [f"name={json.dumps(f'{name}/{arm}')}"]
            arms.append((str(arm), load_config(base, sets)))
        except ConfigError as e:
            raise ConfigError(f"arms.{arm}: {e.path}" if e.path else f"arms.{arm}", e.message, source=path) from None
    return name, arms


def _final(metrics_path: str) -> dict:
    """The last value of each column over the arm's metrics.jsonl (None if never logged)."""
    out = {c: None for c, _ in COLUMNS}
    with open(metrics_path) as fh:
        for line in fh:
            row = json.loads(line)
            for col, key in COLUMNS:
                if key in row and (row.get("step", 0) > 0 or key == "eval/accuracy"):
                    out[col] = row[key]
    return out


def format_table(rows: list[dict]) -> str:
    head = ["arm"] + [c for c, _ in COLUMNS]
    cells = [[r["arm"]] + ["-" if r[c] is None else f"{r[c]:.4f}" for c, _ in COLUMNS] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *cells)]
    fmt = lambda xs: "  ".join(x.ljust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in cells])


def run_sweep(sweep_yaml: str, out_dir: str, overrides=None, *, show_progress: bool = False) -> list[dict]:
    from twocircuit_jax.train.loop import GRPOTrainer

    _, arms = load_sweep(sweep_yaml, overrides)
    for arm, _ in arms:
        d = os.path.join(out_dir, arm)
        if os.path.isdir(d) and os.listdir(d):
            raise ConfigError("--out", f"{d} exists and is not empty; use a new folder")
    rows = []
    for arm, cfg in arms:
        run_dir = os.path.join(out_dir, arm)
        print(f"sweep: arm {arm} -> {run_dir}", flush=True)
        GRPOTrainer(cfg, run_dir, show_progress=show_progress).run()
        rows.append({"arm": arm, "run_dir": run_dir, **_final(os.path.join(run_dir, "metrics.jsonl"))})
    table = format_table(rows)
    print(table, flush=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return rows
