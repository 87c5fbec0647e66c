"""Kill a training run over and over and check that it still ends exactly where an uninterrupted run ends.

    python scripts/chaos.py --kills 20 [--seed 0] [--steps 8] [--out /tmp/chaos] [--timing-share 0.25]
    python scripts/chaos.py --sampler vllm --kills 20

A tiny demo-like config (random char-level model on chain_sum, a checkpoint every 2 steps, an evaluation every 3, so
periodic checkpoints, retention and best updates all happen) is trained once without interruption (`twocircuit
train` in a subprocess), then again under chaos: each attempt is a fresh subprocess (`--resume` from the newest
checkpoint, or a fresh start when there is none) that is SIGKILLed at a random instant drawn from the seed:

- at a fault-injection point (train/faults.py: inside a checkpoint commit before or after its rename, between the
  deletions of retention, inside a best update, before or after a step's metrics line; the least used of those the
  attempt will reach), the count-th time it is reached, the count drawn among the times the attempt will reach it
  (known from the uninterrupted run);
- or (a `--timing-share` of the kills) after a random number of seconds from the start, from outside.

After the kills, one last attempt runs to the end. The final metrics.jsonl (time/* fields, which measure the
machine, left out) and every parameter of the final checkpoint must equal the uninterrupted run's bit for bit.
Prints the kills survived and the values compared; exit 1 on any difference, or if a run fails in a way a kill
does not explain. The persistent compile cache (`train.compile_cache`, in --out) keeps each restart to seconds.

`--sampler vllm`: the same with `sampler.backend: vllm` (a vLLM server process beside each trainer; a full export
every 3 versions, deltas between), and the kill points of the weight export added (`export/before_commit`,
`export/after_commit`; a best update is not predictable there: an attempt aimed at one it never makes finishes and
is checked, not counted). vLLM's sampling is not bit-for-bit reproducible, so the check is: the run completes (exit 0,
every step's metrics line, the final checkpoint), and every step s was generated with the weights the trainer
published after step s - 1 (`sampler/weight_version` == s - 1, as in the uninterrupted run), which the engine
really served (`mismatch/prob_gap_mean`, the engine's logprobs against the trainer's, under 1e-4). After each
attempt the processes it left (found by a tag in their environment) get 20 s to exit by themselves (the server
watches its parent every second); any still there then is SIGKILLed and counted as an orphan.

`--sampler vllm --engines 2`: a fleet of engines (sampler/fleet.py) instead, and the kills hit single engines, not
the trainer: one `twocircuit train` run of --steps steps, and --kills times, at instants drawn from the seed once the
first step is logged (0.5-4 s apart), the process group of one running engine (drawn too) is SIGKILLed. The run must
complete every step (exit 0, every metrics line, the final checkpoint), each step from the previous step's weights
served as published (as above), `sampler/restarts` must count the kills that hit a running engine, and no engine
process may outlive the trainer.
    python scripts/chaos.py --sampler vllm --engines 2 --kills 3 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHECKPOINT_EVERY, KEEP_LAST = 2, 2  # KEEP_LAST: GRPOTrainer's CheckpointManager(keep_last=2)
# Not compared: wall-clock measurements, and the compile counters of the steps a (re)started process compiled on.
IGNORED_PREFIXES = ("time/",)


# The vLLM mode's model (the engine needs head_dim >= 32 and a position limit) and sampler (tests/test_vllm_resume.py).
VLLM_MODEL = {"hidden_size": 64, "head_dim": 32, "intermediate_size": 96, "max_position_embeddings": 64}
VLLM_SAMPLER = {"backend": "vllm", "startup_timeout_s": 240, "full_every": 3}
TAG_ENV = "TWOCIRCUIT_CHAOS_TAG"  # set in every attempt's environment; its descendants inherit it (orphan search)
VLLM_GAP = 1e-4  # largest mean |engine logprob - trainer logprob| of a step served the trainer's weights


def tiny_config(steps: int, cache: str, sampler: str = "jax") -> dict:
    cfg = {
        "name": "chaos",
        "tokenizer": "char",
        "mesh": {"data": -1},
        "optim": {"lr": 1e-3},
        "model": {
            "vocab_size": 100,
            "hidden_size": 32,
            "num_layers": 2,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 16,
            "intermediate_size": 64,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "bos_token_id": 1,
        },
        "task": {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 64, "eval_size": 8},
        "sampler": {"n": 4, "sampling": {"max_new_tokens": 4}},
        "grpo": {"format_penalty": -1.0},  # reward variance on a random model: the updates are not all zero
        "fast": {"pp_size": 2},
        "train": {
            "steps": steps,
            "prompts_per_step": 4,
            "prompts_per_update": 2,
            "eval_every": 3,
            "eval_size": 8,
            "max_prompt_len": 16,
            "checkpoint_every": CHECKPOINT_EVERY,
            "compile_cache": cache,
        },
    }
    if sampler == "vllm":
        cfg["model"].update(VLLM_MODEL)
        cfg["sampler"].update(VLLM_SAMPLER)
    return cfg


def _env(point: str | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # with libtpu installed vLLM sees a TPU platform too and refuses
    env[TAG_ENV] = TAG["tag"]
    env.pop("TWOCIRCUIT_CHAOS_POINT", None)
    if point:
        env["TWOCIRCUIT_CHAOS_POINT"] = point
    return env


TAG = {"tag": f"chaos-{os.getpid()}"}
ORPHANS = {"left": 0, "killed": 0, "linger_s": 0.0}  # processes alive after an attempt ended; SIGKILLed by us


def _tagged() -> list[int]:
    """Live processes (not zombies) with this chaos run's tag in their environment: an attempt's descendants."""
    want, pids = f"{TAG_ENV}={TAG['tag']}".encode(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as fh:
                if want not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:  # gone meanwhile, or not ours
            continue
        pids.append(int(d))
    return pids


def _reap(wait_s: float = 20.0) -> None:
    """After an attempt: wait for its leftover processes (a killed trainer's sampler server) to exit by themselves,
    then SIGKILL what is still there (counted in ORPHANS)."""
    t0 = time.time()
    left = _tagged()
    ORPHANS["left"] += len(left)
    while left and time.time() - t0 < wait_s:
        time.sleep(0.25)
        left = _tagged()
    if ORPHANS["left"]:
        ORPHANS["linger_s"] = max(ORPHANS["linger_s"], time.time() - t0)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            ORPHANS["killed"] += 1
        except ProcessLookupError:
            pass
    if left:
        print(f"chaos: {len(left)} process(es) still alive {wait_s:.0f} s after the attempt: SIGKILLed {left}")


WALL = {"full": None}  # seconds of the quickest attempt that ran to its end (after the first, which compiled)


def _train(cfg: str, run: str, resume: bool, point: str | None = None, kill_after_s: float | None = None):
    """One `twocircuit train` attempt. Returns (exit status, stderr tail); -9 is a SIGKILL."""
    t0 = time.time()
    argv = [sys.executable, "-m", "twocircuit_jax.cli", "train", "--config", cfg, "--out", run, "--no-progress"]
    argv += ["--resume"] if resume else (["--overwrite"] if os.path.isdir(run) else [])
    with open(os.path.join(os.path.dirname(run), "attempt.log"), "w") as log:
        p = subprocess.Popen(argv, env=_env(point), stdout=log, stderr=subprocess.STDOUT)
        if kill_after_s is not None:
            try:
                p.wait(timeout=kill_after_s)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
        rc = p.wait()
    _reap()
    if rc == 0:  # a whole run or the rest of one: a bound on how long an attempt lives
        WALL["full"] = min(WALL["full"] or 1e9, time.time() - t0)
    with open(os.path.join(os.path.dirname(run), "attempt.log")) as fh:
        return rc, fh.read()[-3000:]


def _committed(run: str) -> list[int]:
    from twocircuit_jax.train.checkpoint import committed_steps

    return committed_steps(os.path.join(run, "checkpoints"))


def _point_counts(ref_rows: list[dict], steps: int, start: int, have: list[int], exports: bool = False) -> dict:
    """How many times an attempt resuming from step `start` (with committed checkpoints `have`) reaches each fault
    point, from the uninterrupted run's rows (its evaluations decide the best updates). `exports` (the vLLM
    sampler): one weight export at the start (version `start`) and one after each step."""
    counts = dict.fromkeys(
        ("metrics/before_line", "metrics/after_line", "ckpt/before_commit", "ckpt/after_commit", "ckpt/retention"), 0
    )
    counts.update({"best/before_commit": 0, "best/swapped_out": 0})
    if exports:
        counts["export/before_commit"] = counts["export/after_commit"] = 1 + steps - start
    evals = {r["step"]: r["eval/accuracy"] for r in ref_rows if "eval/accuracy" in r and r["step"] > 0}
    best = max((a for s, a in evals.items() if s <= start), default=None)
    kept = list(have)
    for gs in range(start + 1, steps + 1):
        counts["metrics/before_line"] += 1
        counts["metrics/after_line"] += 1
        if gs in evals and (best is None or evals[gs] > best):
            counts["best/before_commit"] += 1
            counts["best/swapped_out"] += best is not None
            best = evals[gs]
        if gs % CHECKPOINT_EVERY == 0 or gs == steps:
            counts["ckpt/before_commit"] += 1
            counts["ckpt/after_commit"] += 1
            kept = sorted(set(kept) | {gs})
            counts["ckpt/retention"] += max(0, len(kept) - KEEP_LAST)
            kept = kept[-KEEP_LAST:]
    return {k: v for k, v in counts.items() if v > 0}


def _rows(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(IGNORED_PREFIXES)}


def _params(run: str, step: int) -> dict:
    import jax

    from twocircuit_jax.train.policy_io import load_policy

    _, params = load_policy(os.path.join(run, "checkpoints", f"step_{step:08d}"))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def compare(ref: str, run: str, steps: int) -> tuple[int, list[str]]:
    """(values compared, differences) between two finished runs: metrics rows and final parameters."""
    diffs, n = [], 0
    a, b = _rows(ref), _rows(run)
    if [r["step"] for r in a] != [r["step"] for r in b]:
        diffs.append(f"metrics.jsonl steps differ: {[r['step'] for r in a]} vs {[r['step'] for r in b]}")
    for ra, rb in zip(a, b):
        sa, sb = _strip(ra), _strip(rb)
        if set(sa) != set(sb):
            diffs.append(f"step {ra['step']}: keys differ: {sorted(set(sa) ^ set(sb))}")
        for k in sorted(set(sa) & set(sb)):
            n += 1
            if sa[k] != sb[k]:
                diffs.append(f"step {ra['step']} {k}: {sa[k]!r} != {sb[k]!r}")
    pa, pb = _params(ref, steps), _params(run, steps)
    for k in sorted(set(pa) | set(pb)):
        if k not in pa or k not in pb:
            diffs.append(f"param {k} only in one run")
            continue
        n += pa[k].size
        if pa[k].dtype != pb[k].dtype or pa[k].shape != pb[k].shape or pa[k].tobytes() != pb[k].tobytes():
            diffs.append(f"param {k}: differs (max abs {np.max(np.abs(pa[k].astype(float) - pb[k])):.3g})")
    return n, diffs


def check_vllm(ref: str, run: str, steps: int) -> tuple[int, list[str]]:
    """(values checked, problems) of a finished vLLM-sampler run (module doc): every step's line, each step's
    rollouts from the trainer's previous version (as in the uninterrupted run `ref`) and served as published, and
    the final checkpoint."""
    problems, n = [], 0
    a, b = {r["step"]: r for r in _rows(ref)}, _rows(run)
    if [r["step"] for r in b] != sorted(a):
        problems.append(f"metrics.jsonl steps {[r['step'] for r in b]}, expected {sorted(a)}")
    for r in b:
        if r["step"] < 1:
            continue
        n += 2
        want = r["step"] - 1
        if r.get("sampler/weight_version") != want or a.get(r["step"], {}).get("sampler/weight_version") != want:
            problems.append(
                f"step {r['step']}: sampler/weight_version {r.get('sampler/weight_version')} (uninterrupted run: "
                f"{a.get(r['step'], {}).get('sampler/weight_version')}), the trainer published {want}"
            )
        if not r.get("mismatch/prob_gap_mean", float("inf")) < VLLM_GAP:
            problems.append(f"step {r['step']}: mismatch/prob_gap_mean {r.get('mismatch/prob_gap_mean')} >= {VLLM_GAP}")
    if steps not in _committed(run):
        problems.append(f"no final checkpoint step_{steps:08d}")
    return n + 1, problems


def _engine_leaders(trainer_pid: int) -> list[int]:
    """The tagged processes that lead their own process group and run the sampler server: the fleet's engines (the
    trainer starts other session leaders too, e.g. its reward worker)."""
    out = []
    for pid in _tagged():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                server = b"twocircuit_jax.sampler.vllm_server" in fh.read()
            if pid != trainer_pid and server and os.getpgid(pid) == pid:
                out.append(pid)
        except (OSError, ProcessLookupError):  # gone meanwhile
            pass
    return sorted(out)


def engine_chaos(args, rng: random.Random, cfg_data: dict) -> int:
    """--engines K: kill single engines of one running trainer (module doc)."""
    t0 = time.time()
    cfg_data["sampler"].update(engines=args.engines, gpu_memory_utilization=0.06)
    cfg_data["train"].update(eval_every=0)
    cfg = os.path.join(args.out, "cfg.yaml")
    with open(cfg, "w") as fh:
        yaml.safe_dump(cfg_data, fh)
    run = os.path.join(args.out, "fleet", "run")
    os.makedirs(os.path.dirname(run))
    argv = [sys.executable, "-m", "twocircuit_jax.cli", "train", "--config", cfg, "--out", run, "--no-progress"]
    kills, hit = [], 0
    with open(os.path.join(args.out, "fleet", "attempt.log"), "w") as log:
        p = subprocess.Popen(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        metrics = os.path.join(run, "metrics.jsonl")
        deadline = time.time() + 600  # engine starts and the run: bounded; a stuck run is killed and fails
        while p.poll() is None and time.time() < deadline and not _logged_a_step(metrics):
            time.sleep(0.2)
        while p.poll() is None and len(kills) < args.kills and time.time() < deadline:
            time.sleep(rng.uniform(0.5, 4.0))
            leaders = _engine_leaders(p.pid)
            if not leaders or p.poll() is not None:
                continue
            victim = rng.choice(leaders)
            try:
                os.killpg(victim, signal.SIGKILL)
                hit += 1
            except ProcessLookupError:
                continue
            kills.append(victim)
            print(f"chaos: kill {len(kills)}: engine process group {victim} ({len(leaders)} running)", flush=True)
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
    _reap()
    with open(os.path.join(args.out, "fleet", "attempt.log")) as fh:
        tail = fh.read()[-3000:]
    if rc != 0:
        print(f"chaos: the fleet run failed (exit {rc}):\n{tail}")
        return 1
    _, problems = check_vllm(run, run, args.steps)
    rows = _rows(run)
    restarts = rows[-1].get("sampler/restarts", 0)
    if restarts < hit:
        problems.append(f"sampler/restarts {restarts} < {hit} engines killed")
    if ORPHANS["killed"]:
        problems.append(f"{ORPHANS['killed']} processes outlived the trainer")
    per = {k: v for k, v in rows[-1].items() if k.startswith("sampler/engine_")}
    print(f"chaos: {hit} engine kills, sampler/restarts {restarts}; {per}")
    for d in problems[:20]:
        print(f"chaos: MISMATCH {d}")
    print(f"chaos: {'FAIL' if problems else 'OK'} in {time.time() - t0:.0f} s")
    return 1 if problems else 0


def _logged_a_step(metrics: str) -> bool:
    """The run's metrics.jsonl holds a step's line (step 0 is the start-of-run evaluation)."""
    try:
        with open(metrics) as fh:
            return any(json.loads(line).get("step", 0) >= 1 for line in fh if line.strip())
    except (OSError, ValueError):  # not written yet, or a line being written
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="/tmp/twocircuit_chaos")
    ap.add_argument("--timing-share", type=float, default=0.25, help="share of the kills sent from outside at a time")
    ap.add_argument(
        "--sampler",
        choices=("jax", "vllm"),
        default="jax",
        help="jax: the embedded sampler (bit-for-bit check); vllm: a vLLM server (completion and weight versions)",
    )
    ap.add_argument(
        "--engines", type=int, default=0, help="with --sampler vllm: a fleet of this many engines; kill single engines"
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    rng = random.Random(args.seed)
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    if args.engines:
        if args.sampler != "vllm" or args.engines < 2:
            ap.error("--engines needs --sampler vllm and at least 2 engines (one must serve while another restarts)")
        return engine_chaos(args, rng, tiny_config(args.steps, os.path.join(args.out, "xla_cache"), "vllm"))
    cfg = os.path.join(args.out, "cfg.yaml")
    with open(cfg, "w") as fh:
        yaml.safe_dump(tiny_config(args.steps, os.path.join(args.out, "xla_cache"), args.sampler), fh)
    vllm = args.sampler == "vllm"
    compare_runs = check_vllm if vllm else compare
    ref, run = os.path.join(args.out, "ref", "run"), os.path.join(args.out, "chaos", "run")
    os.makedirs(os.path.dirname(ref))
    os.makedirs(os.path.dirname(run))
    t_ref = time.time()
    rc, tail = _train(cfg, ref, resume=False)
    t_ref, WALL["full"] = time.time() - t_ref, None  # the first run compiled everything: not a restart's time
    if rc != 0:
        print(f"chaos: the uninterrupted run failed (exit {rc}):\n{tail}")
        return 1
    ref_rows = _rows(ref)
    survived, rounds, compared, diffs = 0, 0, 0, []
    used: dict[str, int] = {}

    def finish_round() -> bool:
        """Run the chaos run to its end (a last --resume, or nothing when it is done) and compare it; then it is
        removed, and the next kill hits a fresh run. False if the last attempt fails."""
        nonlocal rounds, compared
        have = _committed(run)
        rc, tail = _train(cfg, run, resume=bool(have))  # a finished run's --resume only writes what is missing
        if rc != 0:
            print(f"chaos: the final attempt failed (exit {rc}):\n{tail}")
            return False
        n, d = compare_runs(ref, run, args.steps)
        rounds, compared = rounds + 1, compared + n
        diffs.extend(d)
        print(f"chaos: round {rounds} ended after kill {survived}: {n} values compared, {len(d)} differ", flush=True)
        shutil.rmtree(run)
        return True

    while survived < args.kills:
        have = _committed(run) if os.path.isdir(run) else []
        start = have[-1] if have else 0
        resume = bool(have)
        if start >= args.steps:  # the last kill came after the final checkpoint: this run has nothing left to kill
            if not finish_round():
                return 1
            continue
        timed = rng.random() < args.timing_share
        # vLLM: the run's evaluations differ from the uninterrupted run's (its sampling is not reproducible), so
        # whether an attempt updates `best` is not known in advance: a best point it never reaches lets it finish
        unsure = timed
        if timed:
            # within a whole fresh run's time (the uninterrupted run's until one ran with the compile cache warm)
            delay = rng.uniform(0.3, 0.95) * (WALL["full"] or t_ref)
            rc, tail = _train(cfg, run, resume, kill_after_s=delay)
            what = f"SIGKILL at {delay:.1f} s"
        else:
            counts = _point_counts(ref_rows, args.steps, start, have, exports=vllm)
            fewest = min(used.get(k, 0) for k in counts)  # every reachable point gets its turn
            name = rng.choice(sorted(k for k in counts if used.get(k, 0) == fewest))
            unsure = vllm and name.startswith("best/")
            used[name] = used.get(name, 0) + 1
            count = rng.randint(1, counts[name])
            rc, tail = _train(cfg, run, resume, point=f"{name}:{count}")
            what = f"SIGKILL at {name} #{count}"
        from_ = f"resumed from step {start}" if resume else "fresh start"
        if rc == -signal.SIGKILL:
            survived += 1
            print(f"chaos: kill {survived}: {from_}, {what}", flush=True)
        elif rc == 0 and unsure:  # the run ended before the timer (or the point): compared like any finished run
            print(f"chaos: {from_}, {what}: the run finished first (not counted)", flush=True)
            rounds, n, d = rounds + 1, *compare_runs(ref, run, args.steps)
            compared += n
            diffs.extend(d)
            shutil.rmtree(run)
        else:
            print(f"chaos: {from_}, {what}: unexpected exit {rc}:\n{tail}")
            return 1
    if not finish_round():
        return 1
    what = "weight versions and logprob gaps per step, final checkpoint" if vllm else "metrics lines, final parameters"
    print(
        f"chaos: {survived}/{args.kills} kills survived; {rounds} runs compared with the uninterrupted one, "
        f"{compared} values in all ({what})"
    )
    if vllm:
        print(
            f"chaos: processes left after an attempt: {ORPHANS['left']} (gone by themselves within "
            f"{ORPHANS['linger_s']:.1f} s), {ORPHANS['killed']} SIGKILLed by chaos.py"
        )
    for d in diffs[:20]:
        print(f"chaos: MISMATCH {d}")
    print(f"chaos: {'FAIL' if diffs else 'OK'} in {time.time() - t0:.0f} s")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
