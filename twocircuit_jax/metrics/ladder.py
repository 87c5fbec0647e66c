"""`twocircuit compare --ladder X1,X2,... A1 B1 A2 B2 ...`: one comparison per rung of a ladder (a width, a rank).

A verdict at one setting says whether B learns next to A there; a ladder asks how that answer moves with a knob.
The groups come in (A, B) pairs, one pair per ladder value, each paired by seed as `compare` does. Per rung the
table has B - A of the accuracy scalars with its 95% interval, and each arm's IQM of its gain over its base (final
minus step-0 accuracy), of the mismatch gap and of `fidelity/grad_cos`, with theirs; the figure draws the four
against the knob, intervals as error bars.
"""

from __future__ import annotations

import os

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.metrics import stats
from twocircuit_jax.metrics.compare import (
    Group,
    base_note,
    by_seed,
    check_options,
    compare,
    left_out_note,
    parse_groups,
    save_table,
)

DIFFS = (("final accuracy", "final_accuracy"), ("AUC accuracy", "auc_accuracy"))
# per arm: did it learn at all (a rung where dense does not cannot say "within 0.02 of dense")? and its fidelity
LEVELS = (
    ("final − base", "gain_over_base"),
    ("mismatch gap (mean)", "gap_mean"),
    ("grad_cos (mean)", "grad_cos_mean"),
)


def parse_ladder(spec: str, n_groups: int) -> list[float]:
    """The ladder's values from "64,128,192": numbers, one per (A, B) pair of groups."""
    try:
        xs = [float(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise ConfigError("--ladder", f"got {spec!r}; expected numbers like 64,128,192") from None
    if len(xs) < 2:
        raise ConfigError("--ladder", f"got {spec!r}; a ladder needs at least two values")
    if n_groups != 2 * len(xs):
        raise ConfigError(
            "--ladder", f"{len(xs)} values need {2 * len(xs)} groups (A B per value, in order), got {n_groups}"
        )
    return xs


def ladder(xs: list[float], groups: list[Group], last_k: int = 3, n_resamples: int = stats.N_RESAMPLES) -> list[dict]:
    """One row per rung: x, the pair's labels, B - A per DIFFS key (an Interval, None where not logged) and each
    arm's IQM per LEVELS key."""
    kw = dict(n_resamples=n_resamples, seed=0)
    rows = []
    for i, x in enumerate(xs):
        a, b = groups[2 * i], groups[2 * i + 1]
        by_key = {r["key"]: r for r in compare([a, b], last_k, n_resamples)}
        row = {"x": x, "a": a.label, "b": b.label, "pairing": by_key[DIFFS[0][1]]["pairing"]}
        for _, key in DIFFS:
            row[key] = by_key[key]["diff"]
        for _, key in LEVELS:
            for side, g in (("a", a), ("b", b)):
                vals = list(by_seed(g, key, last_k).values())
                row[f"{key}_{side}"] = stats.bootstrap_ci(stats.iqm, vals, **kw) if vals else None
        rows.append(row)
    return rows


def _ci(x, fmt: str = "{:+.3f}") -> str:
    return "-" if x is None else f"{fmt.format(x.point)} [{fmt.format(x.lo)}, {fmt.format(x.hi)}]"


def markdown(rows: list[dict]) -> str:
    head = ["x", "B vs A", *(f"B − A {n} [95% CI]" for n, _ in DIFFS)]
    head += [f"{n} IQM, {s}" for n, _ in LEVELS for s in ("A", "B")] + ["pairing"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['x']:g}", f"{r['b']} vs {r['a']}", *(_ci(r[k]) for _, k in DIFFS)]
        cells += [_ci(r[f"{k}_{s}"], "{:.3g}") for _, k in LEVELS for s in ("a", "b")] + [r["pairing"]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _errorbar(ax, xs, cis, label, color, dodge: float = 0.0):
    """Points with their intervals; `dodge` shifts them by that fraction of the x span, so two series at the same
    x stay apart."""
    pts = [(x, c) for x, c in zip(xs, cis) if c is not None]
    if not pts:
        return
    shift = dodge * ((max(xs) - min(xs)) or 1.0)
    x = [p[0] + shift for p in pts]
    y = [p[1].point for p in pts]
    err = [[p[1].point - p[1].lo for p in pts], [p[1].hi - p[1].point for p in pts]]
    ax.errorbar(x, y, yerr=err, fmt="o-", color=color, capsize=4, label=label)


def write_figure(rows: list[dict], path: str, xlabel: str = "ladder value") -> str:
    """Four panels against x: B - A (final and AUC accuracy), then per arm its gain over its base, the mismatch
    gap, and grad_cos."""
    from matplotlib.figure import Figure

    xs = [r["x"] for r in rows]
    fig = Figure(figsize=(21, 4.5), layout="constrained")
    ax = fig.add_subplot(1, 1 + len(LEVELS), 1)
    for j, (name, key) in enumerate(DIFFS):
        _errorbar(ax, xs, [r[key] for r in rows], f"B − A, {name}", f"C{j}", dodge=0.012 * (2 * j - 1))
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.axhline(-0.02, color="gray", lw=0.8, ls="--", label="−0.02")
    ax.set(xlabel=xlabel, ylabel="held-out accuracy difference", title="B − A, paired by seed, 95% CI")
    for k, (name, key) in enumerate(LEVELS):
        ax = fig.add_subplot(1, 1 + len(LEVELS), 2 + k)
        for j, side in enumerate(("a", "b")):
            label = "A (" + rows[0]["a"] + ", ...)" if side == "a" else "B (" + rows[0]["b"] + ", ...)"
            _errorbar(ax, xs, [r[f"{key}_{side}"] for r in rows], label, f"C{j + 2}", dodge=0.012 * (2 * j - 1))
        if key == "gain_over_base":
            ax.axhline(0.0, color="gray", lw=0.8)
        ax.set(xlabel=xlabel, ylabel=name, title=f"{name}: IQM over seeds, 95% CI")
        if key == "gap_mean":
            ax.set_yscale("log")
    for ax in fig.axes:
        ax.set_xticks(xs)
        ax.legend(fontsize="small")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def run_ladder(
    specs: list[str],
    values: str,
    out: str = "",
    figure: str = "",
    last_k: int = 3,
    resamples: int = 10_000,
    name: str = "ladder value",
    include_unfinished: bool = False,
) -> str:
    """`twocircuit compare --ladder`'s body: the values and groups checked first, then the table (returned, and
    written to `out`) and the figure."""
    check_options(last_k, resamples)
    xs = parse_ladder(values, len(specs))
    groups = parse_groups(specs, include_unfinished)
    rows = ladder(xs, groups, last_k, resamples)
    pairs = list(zip(groups[0::2], groups[1::2]))
    text = save_table(
        f"### {name}: B − A per rung\n\n" + markdown(rows) + left_out_note(groups) + base_note(pairs), out
    )
    if figure:
        write_figure(rows, figure, name)
    return text
