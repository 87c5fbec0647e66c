"""`scripts/bench_step.py --interleave`: every arm's trainer in one process, stepped in turn (step i of each arm
right after step i of the others, the order reversed every second step), so a machine whose speed drifts over
seconds or minutes slows every arm alike. The table then shows each arm's steps over dense's steps taken next to them
(median and quartiles over steps 3..N), and its seconds over dense's summed over the steps 3..N where neither
compiled. Separate processes, on this 2-core machine, gave ratios to dense that moved by 0.2-0.4 from round to round;
the arms here share compiled programs and memory, so first step, construction and peak RSS are not per arm ("-").
Peers still run in their own processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench_arm import ROOT, SCRIPT, build_trainer, compiled, figures


def worker_interleaved(setting: str, arms: list[str], steps: int, out_dir: str, cache: str = "", sets=()) -> list[dict]:
    """Every arm's trainer in this one process, stepped in turn: step i of each arm runs right after step i of the
    others, in reverse order every second step, so the machine's drift reaches every arm alike. Each arm's figures
    also carry `step_ratios`: its step i over dense's step i, for i >= 3 (with dense among the arms). First steps,
    construction and peak RSS are not per arm here (the arms share compiled programs and memory): NaN."""
    trainers = {a: build_trainer(setting, a, steps, out_dir, cache, sets) for a in arms}
    walls, rows = {a: [] for a in arms}, {a: [] for a in arms}
    for i in range(steps):
        for a in arms[::-1] if i % 2 else arms:
            t = time.perf_counter()
            rows[a].append(trainers[a].step())
            walls[a].append(time.perf_counter() - t)
    for t in trainers.values():
        t.close()
    out = []
    for a in arms:
        r = figures(a, walls[a], rows[a], float("nan"))
        r.update(first_step_s=float("nan"), peak_rss_mb=float("nan"))
        if "dense" in walls:
            r["step_ratios"] = [x / d for x, d in zip(walls[a][2:], walls["dense"][2:])]
            # every step but those that compiled in either arm: periodic work (an anchor fire) counts in full
            keep = [i for i in range(2, steps) if not compiled(rows[a][i]) and not compiled(rows["dense"][i])]
            r["sum_ratio"] = [sum(walls[a][i] for i in keep), sum(walls["dense"][i] for i in keep), len(keep)]
        out.append(r)
    return out


def run_interleaved(setting, arms, steps, out_dir, sets=()) -> list[dict]:
    """worker_interleaved in a fresh process, on a fresh compilation cache folder."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-xla-cache-") as cache:
        cmd = [sys.executable, SCRIPT, "--worker-interleaved", ",".join(arms), "--setting", setting]
        cmd += ["--steps", str(steps), "--out", out_dir, "--cache", cache] + [f"--set={x}" for x in sets]
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not lines:
            raise RuntimeError(f"arms {arms} (interleaved) failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])
