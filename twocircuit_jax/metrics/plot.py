"""`twocircuit plot`: figures and one HTML page comparing run folders (compressed vs dense).

Reads run folders through metrics/runs.py (each run's `metrics.jsonl` and `config.yaml`; a sweep folder expanded
into its arms). matplotlib is
imported lazily, and only its object API (no pyplot, no global backend), so importing this module is cheap. The
figures for studying a training collapse (guard actions, health gauges, lengths) are in plot_collapse.py.
"""

from __future__ import annotations

import base64
import html
import json
import os

from twocircuit_jax.metrics import stats
from twocircuit_jax.metrics.plot_collapse import (
    collapse_anatomy,
    guard_note,
    health,
    mark_guards,
    not_logged,
    reward_panel,
    swap_steps,
    truncation,
)
from twocircuit_jax.metrics.runs import ACC, GAP, GRAD_COS, KL_K3, Run, codec_order, group_name


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def map_cells(runs: list[Run]) -> list[dict]:
    """Fidelity-map cells: one per (codec, strength, anchor, hidden) among the codec runs, with the final held-out
    accuracy minus that of the dense run(s) of the same hidden size. Runs sharing a cell (seeds) are averaged."""
    dense: dict = {}
    for r in runs:
        if r.is_dense:
            dense.setdefault(r.hidden, []).append(r.last(ACC))
    groups: dict = {}
    order = codec_order()
    for r in runs:
        if r.codec in order:
            groups.setdefault((r.codec_label, r.codec, r.strength, r.anchor, r.hidden), []).append(r)
    cells = []
    for (label, codec, strength, anchor, hidden), rs in groups.items():
        acc, dacc = _mean([r.last(ACC) for r in rs]), _mean(dense.get(hidden, []))
        cells.append(
            {
                "codec": codec,
                "strength": strength,
                "label": label,
                "anchor": anchor,
                "hidden": hidden,
                "accuracy": acc,
                "dense_accuracy": dacc,
                "gap": acc - dacc if acc is not None and dacc is not None else None,
                "prob_gap_last10": _mean([r.last(GAP, 10) for r in rs]),
                "grad_cos": _mean([r.last(GRAD_COS) for r in rs]),
                "runs": [r.name for r in rs],
            }
        )
    cells.sort(
        key=lambda c: (
            order.index(c["codec"]),
            c["strength"] is None,
            c["strength"] or 0,
            c["label"],
            c["hidden"] or 0,
            c["anchor"],
        )
    )
    return cells


def _fmt(x) -> str:
    """A table cell: "-" for not logged, yes/no, 4 significant digits."""
    if x is None or isinstance(x, bool):
        return {None: "-", True: "yes", False: "no"}[x]
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _map_md(cells: list[dict]) -> str:
    head = ["codec", "anchor", "hidden", "accuracy", "dense", "gap", "prob_gap (last 10)", "grad_cos"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        vals = [
            c["label"],
            "on" if c["anchor"] else "off",
            c["hidden"],
            c["accuracy"],
            c["dense_accuracy"],
            c["gap"],
            c["prob_gap_last10"],
            c["grad_cos"],
        ]
        lines.append("| " + " | ".join(_fmt(v) for v in vals) + " |")
    return "\n".join(lines) + "\n"


def _draw_map(fig, cells: list[dict]) -> None:
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    rows = list(dict.fromkeys(c["label"] for c in cells))
    hiddens = sorted({c["hidden"] for c in cells}, key=lambda h: (h is None, h or 0))
    cols = [(h, a) for h in hiddens for a in (False, True)]
    grid = np.full((len(rows), len(cols)), np.nan)
    for c in cells:
        if c["gap"] is not None:
            grid[rows.index(c["label"]), cols.index((c["hidden"], c["anchor"]))] = c["gap"]
    m = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 0.0
    cmap = colormaps["RdBu"].with_extremes(bad="white")
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=Normalize(-(m or 1e-3), m or 1e-3), aspect="auto")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xticks(
        range(len(cols)), [(f"H{h} " if len(hiddens) > 1 else "") + f"anchor {'on' if a else 'off'}" for h, a in cols]
    )
    for (i, j), g in np.ndenumerate(grid):
        if np.isfinite(g):
            ax.text(j, i, f"{g:+.3f}", ha="center", va="center", color="white" if abs(g) > 0.6 * m else "black")
    fig.colorbar(im, ax=ax, label="final accuracy − dense")
    ax.set_title("fidelity map: held-out accuracy gap to dense")


class Canvas:
    """What every figure of one `plot_runs` call shares: the runs and their colours, the output folder, the paths
    written and the page's sections (title, png path or None, note why skipped). The figure functions in
    plot_collapse.py draw through it too, so every figure is skipped, laid out and saved the same way."""

    def __init__(self, runs: list[Run], out_dir: str):
        from matplotlib import colormaps

        self.runs, self.out_dir = runs, out_dir
        cmap = colormaps["tab10" if len(runs) <= 10 else "tab20"]
        self.color = {r.name: cmap(i % cmap.N) for i, r in enumerate(runs)}
        self.written: list[str] = []
        self.sections: list[tuple] = []

    def want(self, title: str, *keys: str) -> bool:
        """Whether any run logged one of `keys`; if none did, the page says so instead of showing an empty figure."""
        if any(r.series(k)[0] for r in self.runs for k in keys):
            return True
        self.sections.append((title, None, f"no run logged {' or '.join(keys)}"))
        return False

    def panels(self, n: int, w: float = 6.0, cols: int | None = None):
        """A figure of n panels, one row unless `cols` wraps them into a grid."""
        from matplotlib.figure import Figure

        cols = cols or n
        rows = -(-n // cols)
        fig = Figure(figsize=(w * cols, 4.2 * rows), layout="constrained")
        return fig, [fig.add_subplot(rows, cols, i + 1) for i in range(n)]

    def line(self, ax, key, title=None, log=False, style="-", legend=True, **kw):
        for r in self.runs:
            s, v = r.series(key)
            if log:
                s, v = [a for a, b in zip(s, v) if b > 0], [b for b in v if b > 0]
            if s:
                ax.plot(s, v, style, color=self.color[r.name], label=r.name if legend else None, **kw)
        if title is not None:
            ax.set(title=title, xlabel="step")
        if log and ax.lines:
            ax.set_yscale("log")

    def save(self, fig, fname, title):
        for ax in fig.axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
        path = os.path.join(self.out_dir, fname)
        fig.savefig(path, dpi=110)
        self.written.append(path)
        self.sections.append((title, path, ""))


def plot_runs(runs: list[Run], out_dir: str) -> list[str]:
    """Write the figures, map.json/map.md (when there is a dense and a codec run) and index.html into out_dir.
    Returns the paths written."""
    from matplotlib.figure import Figure
    from matplotlib.transforms import blended_transform_factory

    os.makedirs(out_dir, exist_ok=True)
    cv = Canvas(runs, out_dir)
    color = cv.color

    if cv.want("Held-out accuracy and reward", ACC, "reward/mean"):
        fig, (a1, a2) = cv.panels(2)
        cv.line(a1, ACC, style="o-", markersize=4)
        reward_panel(a2, runs, color)
        # anchor fires along the bottom, optimizer-state swaps along the top: one row per run, so they don't overlap
        ticks = blended_transform_factory(a2.transData, a2.transAxes)
        for i, r in enumerate(runs):
            fires = [s for s, v in zip(*r.series("anchor/fire")) if v > 0.5]
            if fires:
                a2.plot(fires, [0.02 + 0.03 * i] * len(fires), "|", color=color[r.name], markersize=7, transform=ticks)
            swaps = swap_steps(r)
            if swaps:
                a2.plot(swaps, [0.98 - 0.03 * i] * len(swaps), "v", color=color[r.name], markersize=4, transform=ticks)
        note = guard_note(mark_guards(a1, runs, color) + mark_guards(a2, runs, color))
        a1.set(title="held-out accuracy" + (f"\n{note}" if note else ""), xlabel="step")
        a2.set(
            title="reward/mean (light: raw, solid: 10-step mean)\n"
            "ticks: | anchor fires (bottom), v optimizer-state swaps (top)" + (f"\n{note}" if note else ""),
            xlabel="step",
        )
        cv.save(fig, "accuracy_reward.png", "Held-out accuracy and reward")
    _bands(cv)
    collapse_anatomy(cv)
    if cv.want("Sampler-trainer mismatch", GAP, "mismatch/prob_corr", KL_K3):
        fig, axes = cv.panels(3, 5.0)
        cv.line(axes[0], GAP, "sampler-trainer prob gap (mean, log)", log=True)
        cv.line(axes[1], "mismatch/prob_corr", "sampler-trainer prob correlation", legend=False)
        cv.line(axes[2], KL_K3, "rollout-vs-trainer KL (k3 estimate, log)", log=True, legend=False)
        for ax, key in zip(axes, (GAP, "mismatch/prob_corr", KL_K3)):
            not_logged(ax, key)
        cv.save(fig, "mismatch.png", "Sampler-trainer mismatch")
    truncation(cv)
    if cv.want("Policy entropy", "policy/entropy"):
        fig, (a1,) = cv.panels(1, 7.0)
        cv.line(a1, "policy/entropy", "policy entropy")
        note = guard_note(mark_guards(a1, runs, color))
        if note:
            a1.set_title(f"policy entropy\n{note}")
        cv.save(fig, "entropy.png", "Policy entropy")
    health(cv)
    if cv.want("Gradient fidelity", GRAD_COS, "fidelity/grad_cos_pre_merger"):
        fig, (a1,) = cv.panels(1, 7.0)
        cv.line(a1, GRAD_COS, "gradient cosine to dense (solid; dashed: before the merger)", marker=".")
        cv.line(a1, "fidelity/grad_cos_pre_merger", style="--", legend=False, marker=".")
        cv.save(fig, "fidelity.png", "Gradient fidelity")
    if any(r.is_dense for r in runs) and any(r.codec in codec_order() for r in runs):
        cells = map_cells(runs)
        fig = Figure(
            figsize=(3.0 + 1.6 * 2 * len({c["hidden"] for c in cells}), 1.2 + 0.5 * len(cells)), layout="constrained"
        )
        _draw_map(fig, cells)
        cv.save(fig, "map.png", "Fidelity map (final accuracy minus dense, same hidden size)")
        for fname, text in (("map.json", json.dumps(cells, indent=1)), ("map.md", _map_md(cells))):
            with open(os.path.join(out_dir, fname), "w") as fh:
                fh.write(text)
            cv.written.append(os.path.join(out_dir, fname))
    else:
        cv.sections.append(("Fidelity map", None, "needs a dense run (codec none, anchor off) and a codec run"))
    cv.written.append(_write_html(runs, cv.sections, os.path.join(out_dir, "index.html")))
    return cv.written


def _bands(cv: Canvas) -> None:
    """Held-out accuracy per group of seeds (runs named GROUP/seed_K): the mean over seeds with its 95% bootstrap
    band (draw_bands). Only when some group has two seeds or more."""
    groups: dict = {}
    for r in cv.runs:
        groups.setdefault(group_name(r), []).append(r)
    title = "Held-out accuracy over seeds (mean, 95% bootstrap band)"
    if not any(len(rs) > 1 and any(r.series(ACC)[0] for r in rs) for rs in groups.values()):
        cv.sections.append(
            (title, None, "no group of two or more seeds (runs named GROUP/seed_K) logged eval/accuracy")
        )
        return
    fig, (ax,) = cv.panels(1, 7.0)
    draw_bands(ax, list(groups.items()))
    ax.set_title("held-out accuracy: mean over seeds, 95% bootstrap band")
    cv.save(fig, "accuracy_bands.png", title)


def group_curve(runs: list, key: str = ACC):
    """(steps every run logged `key` at, values [runs, steps]), or None if no common step."""
    import numpy as np

    series = [dict(zip(*r.series(key))) for r in runs]
    common = sorted(set.intersection(*(set(s) for s in series))) if series else []
    if not common:
        return None
    return common, np.array([[s[t] for t in common] for s in series])


def draw_bands(ax, groups: list, key: str = ACC, colors=None, n_resamples: int = stats.N_RESAMPLES) -> None:
    """Each (label, runs) group's mean curve over seeds with its 95% bootstrap band (a group of one: its line, no
    band); `twocircuit plot` and `twocircuit compare` draw with it."""
    for i, (label, runs) in enumerate(groups):
        curve = group_curve(runs, key)
        if curve is None:
            continue
        steps, vals = curve
        mean, lo, hi = stats.curve_band(vals, n_resamples=n_resamples)
        color = colors[i] if colors else f"C{i % 10}"
        ax.plot(steps, mean, "o-", color=color, markersize=3, label=f"{label} ({vals.shape[0]} seeds)")
        if vals.shape[0] > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
    ax.set(xlabel="step", ylabel=key)


def _write_html(runs: list[Run], sections: list[tuple], path: str) -> str:
    """One self-contained page: the per-run table, then each figure as an embedded PNG (or a note why not)."""
    e = html.escape
    head = [
        "run",
        "codec",
        "anchor",
        "base acc (step 0)",
        "final acc",
        "max acc",
        "gap (last 10)",
        "grad_cos",
        "guard rollbacks",
    ]
    trs = "".join("<tr>" + "".join(f"<td>{e(_fmt(v))}</td>" for v in r.summary().values()) + "</tr>\n" for r in runs)
    body = [
        f"<h1>twocircuit runs ({len(runs)})</h1>",
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + f"</tr>\n{trs}</table>",
    ]
    for title, png, note in sections:
        body.append(f"<h2>{e(title)}</h2>")
        if png:
            with open(png, "rb") as fh:
                data = base64.b64encode(fh.read()).decode()
            body.append(f'<img alt="{e(os.path.basename(png))}" src="data:image/png;base64,{data}">')
        else:
            body.append(f"<p><em>skipped: {e(note)}</em></p>")
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:3px 8px;text-align:right}td:first-child{text-align:left}img{max-width:100%}"
    )
    with open(path, "w") as fh:
        fh.write(
            f"<!doctype html><html><head><meta charset='utf-8'><title>twocircuit plot</title><style>{style}"
            f"</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
        )
    return path
