"""`scripts/bench_step.py --against DIR`: two versions of the project compared. Each arm also runs on the checkout
at DIR (`git worktree add DIR <commit>` makes one), in its own process right after or before this checkout's, the
order swapped every round. Both sides run this checkout's harness over each checkout's own package, configs and
artifacts. Printed: each round's ratio of this checkout's median step to the other's, their median and range, and
the same of the steps' CPU seconds (all the process's threads), which other work on a busy machine moves far less
than wall time. `--set-here` puts an override on this checkout's runs only (a knob the other lacks, such as
`train.micro_batch_per_device`).
"""

from __future__ import annotations

import os
import statistics
import sys

from bench_arm import ROOT, run_arm
from bench_table import table


def against(args, arms) -> int:
    """Each arm from this checkout and from `args.against`, in fresh processes, alternately (this, that; then that,
    this), `args.rounds` rounds: a machine drifting over minutes slows both alike. Per round the ratio of this
    checkout's median step to the other's; printed: each round's, their median and range, and the medians' table."""
    other = os.path.abspath(args.against)
    if not os.path.isfile(os.path.join(other, "scripts", "bench_step.py")):
        print(f"error: --against: {other} has no scripts/bench_step.py (a checkout of this project)", file=sys.stderr)
        return 2
    here_sets = list(args.set) + list(args.set_here)
    results, ratios = [], {a: [] for a in arms}
    for rnd in range(args.rounds):
        for arm in arms:
            sides = [("here", ROOT, here_sets), ("that", other, list(args.set))]
            got = {}
            for side, root, sets in sides if rnd % 2 == 0 else sides[::-1]:
                r = run_arm(args.setting, arm, args.steps, args.out, False, sets, root)
                got[side] = r
                label = arm if side == "here" else f"{arm}@{os.path.basename(other)}"
                results.append(dict(r, arm=label, round=rnd + 1))
                print(
                    f"round {rnd + 1} {label}: median {r['median_step_s']:.3f} s, CPU {r['median_cpu_s']:.3f} s",
                    flush=True,
                )
            ratios[arm].append([got["here"][k] / got["that"][k] for k in ("median_step_s", "median_cpu_s")])
    print(table(results))
    for arm, rs in ratios.items():
        for i, what in enumerate(("median step", "median CPU seconds of a step")):
            xs = [r[i] for r in rs]
            print(
                f"{arm} here/{os.path.basename(other)} ({what}, per round): "
                + " ".join(f"{x:.3f}" for x in xs)
                + f"; median {statistics.median(xs):.3f}, range {min(xs):.3f}-{max(xs):.3f}"
            )
    return 0
