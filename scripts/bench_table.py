"""The table scripts/bench_step.py prints under its runs, from every run's figures (bench_arm.figures, a peer's
from bench_peers.run_peer): one row per arm with the median over rounds, then the ratios to dense and to the fastest
peer, the same per round, the interleaved mode's step-by-step ratios and the async arms over their synchronous ones.
"""

from __future__ import annotations

import math
import statistics


def _per_round(results: list[dict]) -> list[str]:
    """With several rounds, each ratio per round (every arm of a round ran within minutes of the others): on a
    machine whose speed drifts between rounds these move less than the ratio of medians over all rounds. Lines:
    `ARM/dense per round: ...`, `ARM/fastest_peer per round: ...`, `ARM first/tunix first per round: ...`."""
    rounds = sorted({r["round"] for r in results if "round" in r})
    if len(rounds) < 2:
        return []
    at = {(r["arm"], r["round"]): r for r in results if "round" in r}
    arms = list(dict.fromkeys(r["arm"] for r in results if not r["arm"].startswith("peer:")))
    peers = list(dict.fromkeys(r["arm"] for r in results if r["arm"].startswith("peer:")))

    def line(label, num, den):
        got = [(num(rd), den(rd)) for rd in rounds]
        vals = [a / b for a, b in got if a is not None and b and math.isfinite(a / b)]
        if not vals:
            return f"{label} per round: -"
        return f"{label} per round: {' '.join(f'{v:.2f}' for v in vals)} (median {statistics.median(vals):.2f})"

    out = []
    step = lambda arm: lambda rd: at[(arm, rd)]["median_step_s"] if (arm, rd) in at else None  # noqa: E731
    fastest = lambda rd: min((at[(p, rd)]["median_step_s"] for p in peers if (p, rd) in at), default=None)  # noqa: E731
    for arm in arms:
        if arm != "dense" and "dense" in arms:
            out.append(line(f"{arm}/dense", step(arm), step("dense")))
        if peers:
            out.append(line(f"{arm}/fastest_peer", step(arm), fastest))
    if "dense" in arms and "peer:tunix" in peers:
        first = lambda arm: lambda rd: at[(arm, rd)]["first_step_s"] if (arm, rd) in at else None  # noqa: E731
        out.append(line("dense first/tunix first", first("dense"), first("peer:tunix")))
    return out


def _num(x: float, digits: int) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def table(results: list[dict]) -> str:
    by = {}
    for r in results:
        by.setdefault(r["arm"], []).append(r)
    phases = sorted({p for r in results for p in r["phases"]})
    head = ["arm", "median step s", "mean", "min", "max", "first step s", "setup s", "peak RSS MB"]
    head += [p[len("time/") : -2] for p in phases]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, rs in by.items():  # several rounds: the median of the rounds' medians, the range of all
        med = statistics.median(r["median_step_s"] for r in rs)
        mean = statistics.median(r.get("mean_step_s", float("nan")) for r in rs)
        row = [arm, f"{med:.3f}", _num(mean, 3)]
        row += [f"{min(r['min_step_s'] for r in rs):.3f}", f"{max(r['max_step_s'] for r in rs):.3f}"]
        row += [
            _num(statistics.median(r["first_step_s"] for r in rs), 2),
            _num(statistics.median(r["setup_s"] for r in rs), 2),
        ]
        row += [_num(max(r["peak_rss_mb"] for r in rs), 0)]
        # a peer reports no phases: "-", not a zero
        row += [
            f"{statistics.median(r['phases'].get(p, 0.0) for r in rs):.3f}" if rs[0]["phases"] else "-" for p in phases
        ]
        lines.append("| " + " | ".join(row) + " |")
    dense = by.get("dense")
    peers = [statistics.median(r["median_step_s"] for r in rs) for a, rs in by.items() if a.startswith("peer:")]
    if dense:
        d = statistics.median(r["median_step_s"] for r in dense)
        lines.append("")
        for arm, rs in by.items():
            if arm.startswith("peer:"):
                continue
            m = statistics.median(r["median_step_s"] for r in rs)
            ratio = f"{arm}/dense={m / d:.2f}"
            if peers:
                ratio += f" {arm}/fastest_peer={m / min(peers):.2f}"
            lines.append(ratio)
    lines += _per_round(results)
    for arm, rs in by.items():  # interleaved arms: each step over dense's step run next to it
        ratios = [x for r in rs for x in r.get("step_ratios", ())]
        if ratios and arm != "dense":
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            lines.append(
                f"{arm}/dense step by step (interleaved): median {statistics.median(ratios):.2f} "
                f"(quartiles {q[0]:.2f}-{q[2]:.2f}, {len(ratios)} steps)"
            )
        sums = [r["sum_ratio"] for r in rs if "sum_ratio" in r and r["sum_ratio"][1] > 0]
        if sums and arm != "dense":
            lines.append(
                f"{arm}/dense over all steps (interleaved): {sum(a for a, _, _ in sums) / sum(d for _, d, _ in sums):.2f} "
                f"(its seconds over dense's, {sum(n for _, _, n in sums)} steps that compiled nothing)"
            )
    for sync_arm, async_arm in (("dense", "dense_async"), ("vllm", "vllm_async")):
        if sync_arm in by and async_arm in by:
            sync, ahead = (statistics.median(r["median_step_s"] for r in by[a]) for a in (sync_arm, async_arm))
            lines.append(f"{async_arm}/{sync_arm}={ahead / sync:.2f}")
    return "\n".join(lines)
