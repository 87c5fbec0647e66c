"""`twocircuit sweep`: the arms of a one-knob sweep, one run folder per arm, one after another or `--jobs N` at once.

Sweep file (YAML):

    base: ../two_circuit.yaml        # the one base config, relative to this file
    set: {grpo.clip_high: 0.2}       # optional: dotted overrides applied to every arm (before the arm's own)
    arms:                            # arm name -> dotted overrides; {} is the base itself
      compressed: {}
      anchor_2x: {anchor.cadence: 2}

Every arm's config is resolved and validated before the first arm runs, so a typo fails in seconds, not after
hours. The table printed at the end (and merged into OUT/summary.json, so sweeps run in parts add up) has each
arm's final reward, held-out accuracy, reference KL and sampler-trainer gap, read from the arm's metrics.jsonl.

`--arms a,b` runs a subset. `--jobs N` runs up to N arms at once, each in its own process with its output in
OUT/ARM.log: on a machine whose cores one arm cannot fill (a CPU, a small model) the sweep finishes sooner, at the
cost of memory N times one arm's. `--resume` continues an interrupted sweep: a finished arm (its folder holds
`sweep_done.json`) is read, not rerun; an arm with checkpoints resumes from its latest; the rest start fresh (an arm
killed before its first checkpoint has its partial files removed first).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

import yaml

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.run import load_config

DONE = "sweep_done.json"  # written into an arm's folder when its run returns: `--resume` skips that arm

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


def select_arms(arms: list, names: list[str] | None, source: str) -> list:
    """The arms named in `names` (all if None), in the sweep file's order."""
    if not names:
        return arms
    known = [a for a, _ in arms]
    bad = [n for n in names if n not in known]
    if bad:
        raise ConfigError("--arms", f"unknown arm {bad[0]!r}; this sweep's arms are {', '.join(known)}", source=source)
    return [(a, c) for a, c in arms if a in names]


def _arm_plan(run_dir: str, resume: bool) -> str:
    """'done' (read it), 'resume' (latest checkpoint), or 'fresh'; a non-empty folder without --resume is an error."""
    if not (os.path.isdir(run_dir) and os.listdir(run_dir)):
        return "fresh"
    if not resume:
        raise ConfigError("--out", f"{run_dir} exists and is not empty; use --resume or a new folder")
    if os.path.isfile(os.path.join(run_dir, DONE)):
        return "done"
    from twocircuit_jax.train.checkpoint import committed_steps

    if committed_steps(os.path.join(run_dir, "checkpoints")):
        return "resume"
    return "restart"  # killed before its first checkpoint: nothing to resume from, so it starts again


def _restart(run_dir: str) -> None:
    """An arm killed before its first checkpoint: its own files (a partial metrics.jsonl, events, config.yaml) are
    removed so the fresh run does not append to them; anything else in its folder is kept. Refused while another
    process's trainer holds the folder (train/faults.py lock)."""
    from twocircuit_jax import outdir
    from twocircuit_jax.train import faults

    key = faults.lock_run_folder(run_dir)
    try:
        outdir.remove_run_files(run_dir)
    finally:
        faults.unlock_run_folder(key)


def _run_arm(arm: str, cfg, run_dir: str, plan: str, show_progress: bool, log_path: str | None = None) -> dict:
    """Runs one arm (in this process, or in a worker with its output sent to `log_path`) and returns its row."""
    with contextlib.ExitStack() as stack:
        if log_path:  # a worker process: its prints and warnings go to the arm's log, not interleaved on the console
            fh = stack.enter_context(open(log_path, "a", buffering=1))
            stack.enter_context(contextlib.redirect_stdout(fh))
            stack.enter_context(contextlib.redirect_stderr(fh))
        if plan != "done":
            from twocircuit_jax.train.loop import GRPOTrainer

            summary = GRPOTrainer(cfg, run_dir, resume=plan == "resume", show_progress=show_progress).run()
            if "preempted_at" in summary:  # stopped by SIGTERM/SIGINT with a checkpoint: not done, resumable
                return {"arm": arm, "run_dir": run_dir, "preempted_at": summary["preempted_at"]}
            with open(os.path.join(run_dir, DONE), "w") as out:
                json.dump(summary, out)
    return {"arm": arm, "run_dir": run_dir, **_final(os.path.join(run_dir, "metrics.jsonl"))}


def run_sweep(
    sweep_yaml: str,
    out_dir: str,
    overrides=None,
    *,
    arms: list[str] | None = None,
    jobs: int = 1,
    resume: bool = False,
    show_progress: bool = False,
    overwrite: bool = False,
) -> list[dict]:
    """Runs the arms into `out_dir`/ARM. Someone else's non-empty `out_dir` is refused unless `overwrite` or `resume`
    (the sweep's own folder, marked by outdir.py, takes more arms; an arm's folder still needs --resume)."""
    from twocircuit_jax import outdir

    if jobs < 1:
        raise ConfigError("--jobs", f"must be >= 1, got {jobs}")
    if not resume:
        outdir.check_out(out_dir, overwrite)
    _, all_arms = load_sweep(sweep_yaml, overrides)
    todo = select_arms(all_arms, arms, sweep_yaml)
    plans = {arm: _arm_plan(os.path.join(out_dir, arm), resume) for arm, _ in todo}  # every folder checked first
    for arm, plan in plans.items():
        if plan == "restart":
            _restart(os.path.join(out_dir, arm))
            plans[arm] = "fresh"
    os.makedirs(out_dir, exist_ok=True)
    if outdir.marker(out_dir) is None:
        outdir.write_marker(out_dir, "sweep")
    rows = {}
    for arm, cfg in todo:
        run_dir = os.path.join(out_dir, arm)
        if plans[arm] == "done" or jobs == 1:
            print(f"sweep: arm {arm} -> {run_dir}" + (" (finished: read)" if plans[arm] == "done" else ""), flush=True)
            rows[arm] = _run_arm(arm, cfg, run_dir, plans[arm], show_progress)
            if "preempted_at" in rows[arm]:
                print(f"sweep: stopped by a signal in arm {arm}; continue with --resume", flush=True)
                return []
    if jobs > 1:
        rows.update(_run_parallel([(a, c) for a, c in todo if a not in rows], plans, out_dir, jobs))
    ordered = [rows[a] for a, _ in todo]
    print(format_table(ordered), flush=True)
    _merge_summary(os.path.join(out_dir, "summary.json"), ordered, [a for a, _ in all_arms])
    return ordered


def _run_parallel(todo, plans, out_dir, jobs) -> dict:
    """Up to `jobs` arms at once, each in a fresh (spawned) process: JAX state is not shared across a fork. The first
    arm to fail stops new arms from starting; those running finish, then the failure is raised naming its log."""
    rows, failed = {}, None
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        pending = {}
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < jobs and failed is None:
                arm, cfg = queue.pop(0)
                run_dir, log = os.path.join(out_dir, arm), os.path.join(out_dir, f"{arm}.log")
                print(f"sweep: arm {arm} -> {run_dir} (log: {log})", flush=True)
                pending[pool.submit(_run_arm, arm, cfg, run_dir, plans[arm], False, log)] = (arm, log)
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                arm, log = pending.pop(fut)
                try:
                    rows[arm] = fut.result()
                    if "preempted_at" in rows[arm]:  # stopped by a signal: no new arms; --resume goes on
                        failed = failed or (
                            arm,
                            log,
                            RuntimeError(f"stopped by a signal at step {rows[arm]['preempted_at']}"),
                        )
                    print(f"sweep: arm {arm} finished", flush=True)
                except Exception as e:  # noqa: BLE001 -- reported with the arm's log, re-raised below
                    print(f"sweep: arm {arm} failed: {e} (see {log})", file=sys.stderr, flush=True)
                    failed = failed or (arm, log, e)
    if failed:
        raise RuntimeError(f"sweep arm {failed[0]} failed: {failed[2]} (its output: {failed[1]})") from failed[2]
    return rows


def _merge_summary(path: str, rows: list[dict], order: list[str]):
    """summary.json keeps every arm run so far (a sweep run in parts adds up), in the sweep file's order."""
    old = {}
    if os.path.isfile(path):
        with open(path) as fh:
            old = {r["arm"]: r for r in json.load(fh)}
    old.update({r["arm"]: r for r in rows})
    merged = [old[a] for a in order if a in old] + [r for a, r in old.items() if a not in order]
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(merged, fh, indent=1)
    os.replace(tmp, path)  # never a half-written summary
