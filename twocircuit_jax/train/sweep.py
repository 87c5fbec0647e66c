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
cost of memory N times one arm's. SIGTERM or SIGINT to such a sweep stops it whole: no new arm starts, each running
arm saves at its step's end, and the sweep exits 0 (`_run_parallel`).

`--resume` continues an interrupted sweep: a finished arm (its folder holds `sweep_done.json`) is read, not rerun;
an arm with checkpoints resumes from its latest; the rest start fresh (an arm killed before its first checkpoint has
its partial files removed first).

Seeds. `--seeds 0-4` (or `0,2,5`, or `seeds: 0-4` / `seeds: [0, 1, 2]` in the sweep file; the flag wins) runs every
arm once per seed, each into OUT/ARM/seed_K (its log, with --jobs, OUT/ARM/seed_K.log). Seed K sets `train.seed`
(model init when there is no base model, problem order, rollout sampling, the environment's RNG) and, when the arm's
codecs have one, `fast.codec.seed` and `fast.grad_codec.seed` (PRF masks, the low-rank frame): the same K in two arms
is the same data order and sampling, so `twocircuit compare` pairs runs by seed. The problem sets (task.train_seed,
task.eval_seed) are not touched: every seed is scored on the same held-out problems. Without seeds the layout is
OUT/ARM and the configs' own seeds are used. Every run folder gets `summary.json`: the trainer's summary, its
final, last-k-mean and AUC held-out accuracy (metrics/stats.py), and the held-out set's size.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import sys
from typing import NamedTuple

import yaml

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.run import load_config

DONE = "sweep_done.json"  # written into an arm's folder when its run returns: `--resume` skips that arm
SUMMARY = "summary.json"  # each run folder's verdict numbers (and the sweep folder's table of all runs)
LAST_K = 3  # evaluations averaged into a run's last_k_accuracy
MAX_SEEDS = 1000  # a typo guard: "0-99999" is not a sweep anyone means

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


def parse_seeds(spec, where: str = "--seeds") -> list[int]:
    """Seeds from "0-4", "0,2,5", "0-2,7", an int, or a list of ints: distinct, >= 0, in the order given."""
    if isinstance(spec, bool):
        raise ConfigError(where, f"got {spec!r}; expected a seed range like 0-4 or a list like 0,2,5")
    if isinstance(spec, int):
        spec = [spec]
    if isinstance(spec, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
            raise ConfigError(where, f"got {spec!r}; every seed must be an integer")
        seeds = list(spec)
    elif isinstance(spec, str):
        seeds = []
        for part in (p.strip() for p in spec.split(",")):
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if not m:
                raise ConfigError(where, f"got {spec!r}; expected seeds like 0-4, 0,2,5 or 0-2,7 ({part!r} is not)")
            lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
            if hi < lo:
                raise ConfigError(where, f"got {spec!r}; the range {part} runs backwards")
            if hi - lo >= MAX_SEEDS:
                raise ConfigError(where, f"got {spec!r}; at most {MAX_SEEDS} seeds")
            seeds += range(lo, hi + 1)
    else:
        raise ConfigError(where, f"got {spec!r}; expected a seed range like 0-4 or a list like 0,2,5")
    if not seeds:
        raise ConfigError(where, "no seeds given")
    if any(x < 0 for x in seeds):
        raise ConfigError(where, f"got {spec!r}; seeds must be >= 0")
    dup = sorted({x for x in seeds if seeds.count(x) > 1})
    if dup:
        raise ConfigError(where, f"got {spec!r}; seed {dup[0]} given twice")
    if len(seeds) > MAX_SEEDS:
        raise ConfigError(where, f"got {len(seeds)} seeds; at most {MAX_SEEDS}")
    return seeds


def seed_sets(cfg, seed: int) -> list[str]:
    """The overrides that make `cfg` seed `seed`: train.seed, and the codecs' own seeds where they have one."""
    sets = [f"train.seed={seed}"]
    for sec in ("codec", "grad_codec"):
        if hasattr(getattr(cfg.fast, sec, None), "seed"):
            sets.append(f"fast.{sec}.seed={seed}")
    return sets


def sweep_seeds(path: str) -> list[int] | None:
    """The sweep file's `seeds:` (None when it has none)."""
    with open(path) as fh:
        spec = yaml.safe_load(fh) or {}
    if not isinstance(spec, dict) or spec.get("seeds") is None:
        return None
    try:
        return parse_seeds(spec["seeds"], "seeds")
    except ConfigError as e:
        raise e.with_source(path) from None


def _spec(path: str) -> tuple[str, str, list[str], dict]:
    """(base config path, sweep name, common sets, {arm: its sets}) of a sweep file."""
    if not os.path.isfile(path):
        raise ConfigError("", "sweep file not found", source=path)
    with open(path) as fh:
        spec = yaml.safe_load(fh) or {}
    if not isinstance(spec, dict) or "base" not in spec or not isinstance(spec.get("arms"), dict) or not spec["arms"]:
        raise ConfigError("arms", "a sweep file needs `base: CONFIG.yaml` and a non-empty `arms:` mapping", source=path)
    base = os.path.join(os.path.dirname(os.path.abspath(path)), spec["base"])
    name = spec.get("name") or os.path.splitext(os.path.basename(path))[0]
    try:
        arms = {str(arm): _sets(over, f"arms.{arm}") for arm, over in spec["arms"].items()}
        return base, name, _sets(spec.get("set"), "set"), arms
    except ConfigError as e:
        raise e.with_source(path) from None


def _load_arm(path, base, arm, sets) -> object:
    try:
        return load_config(base, sets)
    except ConfigError as e:
        raise ConfigError(f"arms.{arm}: {e.path}" if e.path else f"arms.{arm}", e.message, source=path) from None


def load_sweep(path: str, overrides=None) -> tuple[str, list[tuple[str, object]]]:
    """(sweep name, [(arm name, resolved RunConfig)]). Raises ConfigError naming the file and the arm."""
    base, name, common, arms = _spec(path)
    sets = {a: common + over + list(overrides or []) for a, over in arms.items()}
    return name, [(a, _load_arm(path, base, a, sets[a] + [f"name={json.dumps(f'{name}/{a}')}"])) for a in arms]


def load_seeded(path: str, seeds: list[int], overrides=None, arms: list[str] | None = None) -> list[tuple]:
    """[(arm, seed, RunConfig)] for every selected arm x seed, arm-major: the arm's config with `seed_sets`."""
    name, all_arms = load_sweep(path, overrides)
    base, _, common, arm_sets = _spec(path)
    out = []
    for arm, cfg in select_arms(all_arms, arms, path):
        for k in seeds:
            sets = common + arm_sets[arm] + list(overrides or []) + seed_sets(cfg, k)
            out.append((arm, k, _load_arm(path, base, arm, sets + [f"name={json.dumps(f'{name}/{arm}/seed_{k}')}"])))
    return out


def _final(run_dir: str) -> dict:
    """The last value of each column over the arm's metrics.jsonl (None if never logged)."""
    from twocircuit_jax.metrics.runs import metrics_file, open_metrics

    out = {c: None for c, _ in COLUMNS}
    with open_metrics(metrics_file(run_dir)) as fh:
        for line in fh:
            row = json.loads(line)
            for col, key in COLUMNS:
                if key in row and (row.get("step", 0) > 0 or key == "eval/accuracy"):
                    out[col] = row[key]
    return out


def run_summary(run_dir: str, trainer: dict | None = None, last_k: int = LAST_K) -> dict:
    """A run folder's summary.json: the trainer's summary (when this process ran it), the held-out accuracy's
    final / last-k mean / AUC (metrics/stats.py) and the last evaluation's size and binomial standard error."""
    from twocircuit_jax.metrics.runs import metrics_file, open_metrics
    from twocircuit_jax.metrics.stats import accuracy_summary

    steps, acc, last = [], [], {}
    with open_metrics(metrics_file(run_dir)) as fh:  # an archived run (docs/results/) holds metrics.jsonl.gz
        for line in fh:
            row = json.loads(line)
            if "eval/accuracy" in row:
                steps.append(row["step"])
                acc.append(float(row["eval/accuracy"]))
                last = row
    out = {**(trainer or {}), **accuracy_summary(steps, acc, last_k), "eval_steps": steps}
    out["eval_n"], out["eval_accuracy_se"] = last.get("eval/n"), last.get("eval/accuracy_se")
    return out


def format_table(rows: list[dict]) -> str:
    seeded = any(r.get("seed") is not None for r in rows)
    head = ["arm"] + (["seed"] if seeded else []) + [c for c, _ in COLUMNS]
    cells = [
        [r["arm"]]
        + ([str(r.get("seed", "-"))] if seeded else [])
        + ["-" if r[c] is None else f"{r[c]:.4f}" for c, _ in COLUMNS]
        for r in rows
    ]
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


class Unit(NamedTuple):
    """One run of the sweep: an arm, or an arm at one seed."""

    key: str  # ARM, or ARM/seed_K: its folder under OUT, and its name in messages
    arm: str
    seed: int | None  # None: no --seeds (the config's own seeds)
    cfg: object  # the resolved RunConfig


def _run_unit(
    u: Unit,
    run_dir: str,
    plan: str,
    show_progress: bool,
    log_path: str | None = None,
    last_k: int = LAST_K,
    allow_config_change: bool = False,
) -> dict:
    """Runs one unit (in this process, or in a worker with its output sent to `log_path`) and returns its row."""
    with contextlib.ExitStack() as stack:
        if log_path:  # a worker process: its prints and warnings go to the arm's log, not interleaved on the console
            fh = stack.enter_context(open(log_path, "a", buffering=1))
            stack.enter_context(contextlib.redirect_stdout(fh))
            stack.enter_context(contextlib.redirect_stderr(fh))
        trainer = None
        if plan != "done":
            from twocircuit_jax.train.loop import GRPOTrainer

            trainer = GRPOTrainer(
                u.cfg,
                run_dir,
                resume=plan == "resume",
                show_progress=show_progress,
                allow_config_change=allow_config_change,
            ).run()
            if "preempted_at" in trainer:  # stopped by SIGTERM/SIGINT with a checkpoint: not done, resumable
                return {"arm": u.arm, "seed": u.seed, "run_dir": run_dir, "preempted_at": trainer["preempted_at"]}
            with open(os.path.join(run_dir, DONE), "w") as out:
                json.dump(trainer, out)
        elif os.path.isfile(os.path.join(run_dir, DONE)):
            with open(os.path.join(run_dir, DONE)) as fh:
                trainer = json.load(fh)
        _write_json(os.path.join(run_dir, SUMMARY), run_summary(run_dir, trainer, last_k))
    return {"arm": u.arm, "seed": u.seed, "run_dir": run_dir, **_final(run_dir)}


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
    seeds=None,
    last_k: int = LAST_K,
    allow_config_change: bool = False,
) -> list[dict]:
    """Runs the arms into `out_dir`/ARM (with `seeds`, a spec for parse_seeds or the sweep file's `seeds:`, into
    `out_dir`/ARM/seed_K). Someone else's non-empty `out_dir` is refused unless `overwrite` or `resume` (the sweep's
    own folder, marked by outdir.py, takes more arms; a run's folder still needs --resume). An arm resumed from its
    checkpoint has its config checked against the checkpoint's (train/resume_config.py) and stops the sweep with a
    ConfigError on a change to its training, unless `allow_config_change`."""
    from twocircuit_jax import outdir

    if jobs < 1:
        raise ConfigError("--jobs", f"must be >= 1, got {jobs}")
    if last_k < 1:
        raise ConfigError("--last-k", f"must be >= 1, got {last_k}")
    seed_list = parse_seeds(seeds) if seeds is not None else None  # the flag is checked before the file is read
    if not resume:
        outdir.check_out(out_dir, overwrite)
    _, all_arms = load_sweep(sweep_yaml, overrides)
    if seed_list is None:
        seed_list = sweep_seeds(sweep_yaml)
    if seed_list is None:
        todo = [Unit(a, a, None, c) for a, c in select_arms(all_arms, arms, sweep_yaml)]
    else:
        todo = [Unit(f"{a}/seed_{k}", a, k, c) for a, k, c in load_seeded(sweep_yaml, seed_list, overrides, arms)]
    plans = {u.key: _arm_plan(os.path.join(out_dir, u.key), resume) for u in todo}  # every folder checked first
    for key, plan in plans.items():
        if plan == "restart":
            _restart(os.path.join(out_dir, key))
            plans[key] = "fresh"
    os.makedirs(out_dir, exist_ok=True)
    if outdir.marker(out_dir) is None:
        outdir.write_marker(out_dir, "sweep")
    rows = {}
    for u in todo:
        run_dir = os.path.join(out_dir, u.key)
        if plans[u.key] == "done" or jobs == 1:
            print(
                f"sweep: arm {u.key} -> {run_dir}" + (" (finished: read)" if plans[u.key] == "done" else ""), flush=True
            )
            rows[u.key] = _run_unit(u, run_dir, plans[u.key], show_progress, None, last_k, allow_config_change)
            if "preempted_at" in rows[u.key]:
                print(f"sweep: stopped by a signal in arm {u.key}; continue with --resume", flush=True)
                return []
    if jobs > 1:
        rest = [u for u in todo if u.key not in rows]
        ran = _run_parallel(rest, plans, out_dir, jobs, last_k, allow_config_change)
        if ran is None:  # stopped by a signal: the arms saved where they were; no table for a partial sweep
            return []
        rows.update(ran)
    ordered = [rows[u.key] for u in todo]
    print(format_table(ordered), flush=True)
    _merge_summary(os.path.join(out_dir, SUMMARY), ordered, [a for a, _ in all_arms])
    return ordered


def _child(conn, args: tuple) -> None:
    """A `--jobs N` run's process: one unit, its row (or its exception) sent back on `conn`.

    Its own process group, so a signal meant for the sweep (Ctrl-C at a terminal, `kill -- -PGID`, a preemptor's
    SIGTERM) reaches the parent alone, which forwards it exactly once (`_run_parallel`): a child that got the group's
    SIGINT and the parent's copy too would take the second as "stop now" (train/faults.py). A daemon thread watches
    the parent: if it dies without forwarding (SIGKILL), the child sends itself SIGTERM, so it saves at the step's
    end and exits instead of training on, or idling, as an orphan."""
    import signal
    import threading
    import time

    os.setpgrp()
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="sweep-parent-watch").start()
    try:
        msg = ("row", _run_unit(*args))
    except BaseException as e:  # noqa: BLE001 -- sent to the parent, which raises it naming the run's log
        msg = ("error", e)
    try:
        try:
            conn.send(msg)
        except Exception:  # an exception that does not pickle still reaches the parent, as its text
            conn.send(("error", RuntimeError(f"{type(msg[1]).__name__}: {msg[1]}")))
    except OSError:
        pass  # the parent is gone: the run's folder holds what it saved
    finally:
        conn.close()


def _run_parallel(
    todo: list[Unit], plans, out_dir, jobs, last_k: int = LAST_K, allow_config_change: bool = False
) -> dict | None:
    """Up to `jobs` runs at once, each in a fresh spawned process (JAX state is not shared across a fork, and a fresh
    process per run gives each its memory back). The first run to fail stops new runs from starting; those running
    finish, then the failure is raised naming its log.

    SIGTERM and SIGINT to this process (or to its process group) start no new run and are forwarded once to each
    running one, whose trainer saves at its step's end (train/faults.py StopSignals); an arm stopped by a signal of
    its own starts no new run either. This process waits for the running ones, says where each stopped, and returns
    None: the sweep is stopped, `--resume` goes on. A second SIGINT is forwarded too (the runs stop at once)."""
    import signal
    import threading
    from multiprocessing.connection import wait as wait_any

    ctx = multiprocessing.get_context("spawn")
    received: list[int] = []  # signals to forward, appended by the handler; the loop forwards them
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    rows, failed, stopped = {}, None, []
    running = {}  # key -> (process, our end of its pipe, its log)
    forwarded = 0
    queue = list(todo)
    try:
        while queue or running:
            while queue and len(running) < jobs and failed is None and not received and not stopped:
                u = queue.pop(0)
                run_dir, log = os.path.join(out_dir, u.key), os.path.join(out_dir, f"{u.key}.log")
                os.makedirs(os.path.dirname(log), exist_ok=True)  # OUT/ARM for OUT/ARM/seed_K.log
                print(f"sweep: arm {u.key} -> {run_dir} (log: {log})", flush=True)
                ours, theirs = ctx.Pipe(duplex=False)
                args = (u, run_dir, plans[u.key], False, log, last_k, allow_config_change)
                proc = ctx.Process(target=_child, args=(theirs, args), name=f"sweep {u.key}")
                proc.start()
                theirs.close()
                running[u.key] = (proc, ours, log)
            if not running:
                break
            while forwarded < len(received):  # each signal reaches each running run once
                if forwarded == 0:
                    name, names = signal.Signals(received[0]).name, ", ".join(running)
                    print(f"sweep: {name}: no new arms; waiting for {names} to save", file=sys.stderr, flush=True)
                for proc, _, _ in running.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, received[forwarded])
                forwarded += 1
            ready = wait_any([c for _, c, _ in running.values()], timeout=0.5)
            for key in [k for k, (_, c, _) in running.items() if c in ready]:
                proc, conn, log = running.pop(key)
                try:
                    kind, value = conn.recv()
                except EOFError:  # ended without a word: killed, or stopped before its trainer could save
                    kind, value = "lost", None
                conn.close()
                proc.join()
                if kind == "row" and "preempted_at" in value:  # stopped by a signal with a checkpoint: resumable
                    rows[key] = value
                    stopped.append(f"{key} at step {value['preempted_at']}")
                    print(f"sweep: arm {key} stopped at step {value['preempted_at']}", flush=True)
                elif kind == "row":
                    rows[key] = value
                    print(f"sweep: arm {key} finished", flush=True)
                elif received and (kind == "lost" or isinstance(value, KeyboardInterrupt)):
                    # the stop reached it before its trainer held the signals (or a second Ctrl-C): nothing saved
                    stopped.append(f"{key} before its first checkpoint")
                    print(f"sweep: arm {key} stopped (exit {proc.exitcode}) before saving", flush=True)
                else:
                    e = value if kind == "error" else RuntimeError(f"its process ended with exit {proc.exitcode}")
                    print(f"sweep: arm {key} failed: {e} (see {log})", file=sys.stderr, flush=True)
                    failed = failed or (key, log, e)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if failed:
        key, log, e = failed
        if isinstance(e, ConfigError):  # bad input found by the arm (its resume's config check): exit 2, as --jobs 1
            raise ConfigError(e.path, f"{e.message} (sweep arm {key}; its output: {log})", e.source) from None
        raise RuntimeError(f"sweep arm {key} failed: {e} (its output: {log})") from e
    if received or stopped:
        print(
            f"sweep: stopped by a signal ({'; '.join(stopped) or 'no arm was running'}); continue with --resume",
            flush=True,
        )
        return None
    return rows


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)  # never a half-written file


def _merge_summary(path: str, rows: list[dict], order: list[str]):
    """summary.json keeps every run so far (a sweep run in parts adds up), in the sweep file's arm order, then by
    seed. A row is keyed by (arm, seed); seed is None for a sweep run without seeds."""
    old = {}
    if os.path.isfile(path):
        with open(path) as fh:
            old = {(r["arm"], r.get("seed")): r for r in json.load(fh)}
    old.update({(r["arm"], r.get("seed")): r for r in rows})
    rank = lambda k: (order.index(k[0]) if k[0] in order else len(order), k[0], -1 if k[1] is None else k[1])  # noqa: E731
    _write_json(path, [old[k] for k in sorted(old, key=rank)])
