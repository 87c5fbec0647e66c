"""The suite's outputs: a markdown table and a JSON file (one column per checkpoint, in-domain rows above the
divider, each side's mean), and a grouped bar plot with the in-domain benchmarks left of a dashed divider."""

from __future__ import annotations

import json
import os

import numpy as np


def _means(res: dict) -> dict:
    out = {}
    for dom in ("in", "out"):
        rows = [r for r in res["benchmarks"] if r["domain"] == dom]
        if rows:
            out[dom] = {c: float(np.mean([r["accuracy"][c] for r in rows])) for c in res["checkpoints"]}
    return out


def markdown(res: dict) -> str:
    cks = res["checkpoints"]
    lines = [
        f"# {res['suite']}: held-out accuracy (greedy)",
        "",
        "| domain | benchmark | n | " + " | ".join(cks) + " |",
        "|---|---|---|" + "---|" * len(cks),
    ]
    means = _means(res)
    for dom, title in (("in", "in-domain"), ("out", "out-of-domain")):
        rows = [r for r in res["benchmarks"] if r["domain"] == dom]
        for r in rows:
            lines.append(
                f"| {title} | {r['name']} | {r['n']} | " + " | ".join(f"{r['accuracy'][c]:.3f}" for c in cks) + " |"
            )
        if rows:
            lines.append(f"| **{title} mean** | | | " + " | ".join(f"**{means[dom][c]:.3f}**" for c in cks) + " |")
        if dom == "in":
            lines.append("| ‖ | ‖ | ‖ | " + " | ".join("‖" for _ in cks) + " |")  # the divider
    return "\n".join(lines) + "\n"


def bar_plot(res: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cks = res["benchmarks"], res["checkpoints"]
    n_in = sum(r["domain"] == "in" for r in rows)
    x = np.arange(len(rows), dtype=float)
    x[n_in:] += 0.6  # room for the divider
    w = 0.8 / max(1, len(cks))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(rows) + 2), 4.2))
    for j, c in enumerate(cks):
        ax.bar(x + (j - (len(cks) - 1) / 2) * w, [r["accuracy"][c] for r in rows], w, label=c)
    if 0 < n_in < len(rows):
        xd = (x[n_in - 1] + x[n_in]) / 2
        ax.axvline(xd, color="k", ls="--", lw=1)
        top = 1.02
        ax.text(xd - 0.15, top, "in-domain", ha="right", va="bottom", fontsize=9)
        ax.text(xd + 0.15, top, "out-of-domain", ha="left", va="bottom", fontsize=9)
    ax.set_xticks(x, [r["name"] for r in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(res["suite"])
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(res: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, res["suite"])
    with open(base + ".json.tmp", "w") as fh:
        json.dump({**res, "means": _means(res)}, fh, indent=1)
    os.replace(base + ".json.tmp", base + ".json")
    with open(base + ".md", "w") as fh:
        fh.write(markdown(res))
    return [base + ".json", base + ".md", bar_plot(res, base + ".png")]
