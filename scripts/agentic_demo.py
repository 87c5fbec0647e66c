"""`make agentic-demo`: the calculator tool-use demo. Builds the agentic base by SFT on first use, runs multi-turn
GRPO on it (configs/agentic_demo.yaml) and prints the environment's return and success, first vs last 10 steps.

    python scripts/agentic_demo.py [--backend jax|vllm] [--out runs/NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "artifacts", "agentic_base")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("jax", "vllm"), default="jax", help="rollout engine (default: jax)")
    ap.add_argument("--out", default="", help="run folder (default: runs/agentic-BACKEND-TIME)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    from twocircuit_jax.config import load_config
    from twocircuit_jax.train.loop import GRPOTrainer
    from twocircuit_jax.train.sft import base_once

    t0 = time.time()
    base_once("configs/agentic_base.yaml", BASE, "the agentic base", log=lambda m: print(f"[agentic] {m}"))
    run_dir = args.out or os.path.join("runs", time.strftime(f"agentic-{args.backend}-%Y%m%d-%H%M%S"))
    cfg = load_config("configs/agentic_demo.yaml", [f"sampler.backend={args.backend}"])
    print(
        f"[agentic] multi-turn GRPO ({args.backend} sampler): {cfg.train.steps} steps x {cfg.train.prompts_per_step} "
        f"problems x {cfg.sampler.n} trajectories, up to {cfg.env.max_turns} turns -> {run_dir}"
    )
    summary = GRPOTrainer(cfg, run_dir).run()
    if "preempted_at" in summary:  # SIGTERM/SIGINT: checkpointed at a step boundary, no final evaluation to show
        print(f"\n[agentic] stopped at step {summary['preempted_at']}; checkpoint and metrics in {run_dir}")
        return 0
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "env/return" in r]
    k = max(1, min(10, len(steps) // 2))

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    print()
    print(f"{'':36}{'first ' + str(k):>10}{'last ' + str(k):>10}")
    for key in ("env/return", "env/success", "env/turns_mean", "env/format_penalty_frac"):
        print(f"{key + ' (steps)':36}{mean(key, steps[:k]):>10.3f}{mean(key, steps[-k:]):>10.3f}")
    print(
        f"{'held-out success (greedy), base/final':36}{summary['base_accuracy']:>10.3f}{summary['final_accuracy']:>10.3f}"
    )
    print(f"\nrun folder: {run_dir}; total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
