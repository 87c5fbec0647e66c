"""Benchmark (not a test): one GRPO step of this project, arm by arm, and optionally of the peer frameworks.

    python scripts/bench_step.py [--setting peers|demo] [--arms dense,prf_mask,...] [--steps 12] [--rounds 1]
                                 [--compile-cache cold|warm] [--interleave] [--set KEY=VALUE ...]
                                 [--peers] [--peers-dir DIR] [--against DIR [--set-here KEY=VALUE ...]]

Each arm runs in a fresh process (its own compiles and peak RSS): a `GRPOTrainer` built from the setting, then
`--steps` calls of `trainer.step()`, each timed as a whole on the host (scripts/bench_arm.py). Printed per arm
(scripts/bench_table.py): the median, min and max step over steps 3..N, the mean over those of them that compiled
nothing (work that comes every few steps, such as the anchor's fire, counts there at its share; the median hides
it), the first step (it compiles), the trainer's construction, peak RSS, and the median of every per-phase time the
trainer logs (`time/<phase>_s`, `time/compile_s` on steps that compiled).
`--compile-cache cold` (default) gives each arm process an empty persistent compilation cache (train.compile_cache),
so its first step compiles everything; `warm` runs each arm twice on one cache folder and reports the second run,
as a user's second run of the same shapes would see it.

Three other modes, each in a module of its own that says what it does:
  --interleave   every arm in one process, stepped in turn (scripts/bench_interleave.py)
  --against DIR  each arm also on another checkout, alternately (scripts/bench_against.py)
  --peers        the peer frameworks' harnesses beside the arms (scripts/bench_peers.py)

Settings:
  peers  the peer harnesses' tiny setting (../shared/peers/README.md): random Qwen2 with vocab 128, hidden 128,
         intermediate 256, 4 layers, 4 heads / 2 KV heads, fp32; 8 prompts of 16 tokens x 8 samples x 32 new
         tokens, temperature 1; reward the share of even token ids; KL 0; one AdamW update per step, lr 1e-5, no
         clipping or decay. The project's prompts are text of the built-in character tokenizer (15 characters and
         BOS = 16 ids); its sampler stops a row at EOS, which a random model samples now and then, but every
         rollout still runs all 32 positions (static shapes), so the work per step is the peers'.
  demo   configs/demo.yaml (the tiny char model from artifacts/tiny_base, built on first use).

Arms (fast and anchor sections put over the setting): dense, prf_mask, lowrank, sr_quant, powersgd, two_circuit
(configs/two_circuit.yaml's: lowrank r=3 at one boundary with the anchor); dense_async: dense with train.async_rollouts:
1 (the embedded sampler generating in a thread); vllm and vllm_async: dense with the vLLM engine process as the
sampler, synchronous and with train.async_rollouts: 1 (peak RSS is the trainer's alone). With `--peers`, the peer harnesses run
in the same invocation, interleaved with the arms round by round, when their venvs exist under `--peers-dir`
(default $PEERS: DIR/tunix/bin/python, DIR/trl/bin/python); the table then ends with each arm's median step over
the faster peer's. Ratios are only meaningful on a quiet machine. Every second round runs its arms and peers in reverse
order, so a machine drifting within a round favours no run over a pair of rounds.

The modules beside this one are imported by name: run it as a script (`python scripts/bench_step.py`), which puts
scripts/ on the import path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench_against import against
from bench_arm import ARMS, ROOT, arm_config, run_arm, worker
from bench_interleave import run_interleaved, worker_interleaved
from bench_peers import run_peer, venvs
from bench_table import table


def round_order(arms: list[str], peers: list[str], rnd: int) -> list[tuple[str, str]]:
    """The runs of round `rnd` (from 0): the arms then the peers, reversed in every second round, so that a machine
    that slows or speeds up during a round does not always favour the same runs (over rounds 1 and 2 every run's
    mean position is the same)."""
    runs = [("arm", a) for a in arms] + [("peer", p) for p in peers]
    return runs[::-1] if rnd % 2 else runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", choices=("peers", "demo"), default="peers")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the arms (and peers)")
    ap.add_argument("--peers", action="store_true", help="also run the peer harnesses (their venvs must exist)")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS", ""), help="folder of the peers' venvs")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_step"), help="run folders of the arms")
    ap.add_argument(
        "--compile-cache",
        choices=("cold", "warm"),
        default="cold",
        help="cold: each arm compiles from scratch; warm: each arm's second process on the first one's cache",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="all arms in one process, stepped in turn (ratios to dense step by step; no per-arm first step or RSS)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override put over every arm, after the arm's own (as `twocircuit train --set`); repeatable",
    )
    ap.add_argument(
        "--against",
        metavar="DIR",
        help="another checkout (say `git worktree add DIR <commit>`): each arm runs there too, in its own process "
        "right before or after this checkout's (the order swapped every round); prints this/that per round",
    )
    ap.add_argument(
        "--set-here",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --against: an override for this checkout's runs only (a knob the other one lacks); repeatable",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-interleaved", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        r = worker(args.setting, args.worker, args.steps, args.out, args.cache, args.set)
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    if args.worker_interleaved:
        arms = args.worker_interleaved.split(",")
        print(
            "RESULT " + json.dumps(worker_interleaved(args.setting, arms, args.steps, args.out, args.cache, args.set))
        )
        return 0
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        print(f"error: --arms: unknown {bad or 'empty'}; allowed {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if args.steps < 3:
        print(f"error: --steps: got {args.steps}; at least 3 (steps 1-2 compile and warm up)", file=sys.stderr)
        return 2
    if args.set:  # a bad override: one line naming it, before any arm starts
        from twocircuit_jax.config.base import ConfigError

        try:
            for arm in arms:
                arm_config(args.setting, arm, args.steps, "", args.set)
        except ConfigError as e:
            print(f"error: --set: {e}", file=sys.stderr)
            return 2
    if args.interleave and args.compile_cache == "warm":
        print("error: --compile-cache warm: not with --interleave (no per-arm first step there)", file=sys.stderr)
        return 2
    peers = {}
    if args.peers:
        try:
            peers = venvs(args.peers_dir)
        except ValueError as e:
            print(f"error: --peers: {e}", file=sys.stderr)
            return 2
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.against:
        return against(args, arms)
    results = []
    for rnd in range(args.rounds):
        runs = round_order(["*"] if args.interleave else arms, list(peers), rnd)
        for kind, name in runs:
            if name == "*":  # every arm in one process, stepped in turn
                rs = run_interleaved(args.setting, arms, args.steps, args.out, args.set)
                rs = [dict(r, round=rnd + 1) for r in rs]
                for r in rs:
                    print(f"round {rnd + 1} {r['arm']} (interleaved): median {r['median_step_s']:.3f} s", flush=True)
                results += rs
                continue
            if kind == "peer":
                r = dict(run_peer(name, peers[name], env), round=rnd + 1)
                print(f"round {rnd + 1} peer {name}: median {r['median_step_s']:.3f} s", flush=True)
            else:
                warm = args.compile_cache == "warm"
                r = dict(run_arm(args.setting, name, args.steps, args.out, warm, args.set), round=rnd + 1)
                print(
                    f"round {rnd + 1} {name}: median {r['median_step_s']:.3f} s, first {r['first_step_s']:.2f} s",
                    flush=True,
                )
            results.append(r)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
