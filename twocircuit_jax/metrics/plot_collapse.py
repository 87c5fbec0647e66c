"""The `twocircuit plot` figures for studying a training collapse, and the marks several figures share.

A collapse is a chain of events: reward falls, the policy drifts from the reference, gradients spike, responses run
into the generation cap, the health monitor raises its state and the guard acts. These figures put those series on
one step axis, with the guard's actions as vertical lines, so that cause and reaction line up by eye.

Kept apart from plot.py so that module stays readable; plot.py imports from here and this module needs nothing from
plot.py (a figure function gets plot.py's Canvas, which does the skipping, layout and saving, and its `Run`s;
they are duck-typed here so the import graph stays one-way).
"""

from __future__ import annotations

GUARD = "guard/action"
# guard/action codes: the line style tells the kind, the colour tells the run; an unknown code still gets a line
GUARD_KINDS = {1: ("warn", ":"), 2: ("stop", "--"), 3: ("rollback", "-.")}
STYLE_NAMES = {":": "dotted", "--": "dashed", "-.": "dash-dot", "-": "solid"}
LIMIT_SHARE, TRUNCATED = "length/limit_share", "length/truncated_frac"
HEALTH_STATE, HEALTH_LEVELS = "health/state", ("ok", "warn", "alarm")
HEALTH_GAUGES = (
    ("health/reward_drop", "-"),
    ("health/length_share", "--"),
    ("health/truncated_frac", ":"),
    ("health/gap_ratio", "-."),
)


def moving_avg(v: list[float], w: int = 10) -> list[float]:
    """Trailing mean over up to w points (shorter at the start)."""
    return [sum(v[max(0, i - w + 1) : i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(v))]


def guard_kind(code: int) -> tuple[str, str]:
    """(name, line style) of a guard/action code."""
    return GUARD_KINDS.get(code, (f"action {code}", "-"))


def guard_actions(run) -> list[tuple[int, int]]:
    """(step, action code) of each step where the guard acted; 0 (no action) is what most steps log."""
    acts = [(s, int(round(v))) for s, v in zip(*run.series(GUARD))]
    return [(s, c) for s, c in acts if c > 0]


def swap_steps(run) -> list[int]:
    """Steps with an optimizer-state swap: the cumulative `swap/count` rose since the previous logged step. The count
    starts from 0, so a swap in the first logged step counts; after a rollback it may fall and rise again, and each
    rise is a new swap."""
    out, prev = [], 0.0
    for s, v in zip(*run.series("swap/count")):
        if v > prev:
            out.append(s)
        prev = v
    return out


def mark_guards(ax, runs: list, color: dict) -> list[tuple[str, int, int]]:
    """Draw each guard action as a vertical line (the run's colour, the kind's style). Returns (run name, step, code)
    of every line drawn, for the title's note (and for tests: an absent mark is otherwise invisible)."""
    marked = []
    for r in runs:
        for s, code in guard_actions(r):
            ax.axvline(s, color=color[r.name], linestyle=guard_kind(code)[1], linewidth=1.1, alpha=0.75)
            marked.append((r.name, s, code))
    return marked


def guard_note(marked: list[tuple[str, int, int]]) -> str:
    """Title text naming the guard line styles drawn, e.g. "lines: guard warn (dotted), rollback (dash-dot)";
    "" when nothing was drawn, so a run without a guard gets no legend for marks it hasn't got."""
    kinds = [guard_kind(c) for c in sorted({c for _, _, c in marked})]
    return "lines: guard " + ", ".join(f"{name} ({STYLE_NAMES[style]})" for name, style in kinds) if kinds else ""


def not_logged(ax, key: str) -> None:
    """Say so on a panel no run has data for (the figure is drawn for its other panels)."""
    if not ax.lines:
        ax.text(0.5, 0.5, f"no run logged {key}", transform=ax.transAxes, ha="center", va="center", color="grey")


def reward_panel(ax, runs: list, color: dict) -> None:
    """`reward/mean` per run: raw (light, it is noisy at small batch sizes) and its 10-step trailing mean."""
    for r in runs:
        s, v = r.series("reward/mean")
        if s:
            ax.plot(s, v, color=color[r.name], alpha=0.3, linewidth=0.8)
            ax.plot(s, moving_avg(v), color=color[r.name], label=r.name)


def collapse_anatomy(cv) -> None:
    """Reward, reference KL, gradient norm and length/cap on one step axis, the guard's actions on each panel."""
    title = "Collapse anatomy"
    # reward alone would repeat the accuracy/reward figure: drawn when a run logged one of the collapse signals
    if not cv.want(title, "kl/ref", "grad/norm", LIMIT_SHARE):
        return
    fig, axes = cv.panels(4, cols=2)
    reward_panel(axes[0], cv.runs, cv.color)
    cv.line(axes[1], "kl/ref", legend=False)
    cv.line(axes[2], "grad/norm", log=True, legend=False)  # spikes span decades
    cv.line(axes[3], LIMIT_SHARE, legend=False)
    if axes[3].lines:  # the cap: a mean at 1.0 means every response was cut off
        axes[3].axhline(1.0, color="grey", linewidth=1.0)
    panels = (
        ("reward/mean", "reward/mean (light: raw, solid: 10-step mean)"),
        ("kl/ref", "kl/ref: KL to the reference policy"),
        ("grad/norm", "grad/norm: gradient norm (log)"),
        (LIMIT_SHARE, "length/limit_share: mean response length / generation cap"),
    )
    marked = []
    for ax, (key, text) in zip(axes, panels):
        not_logged(ax, key)
        marked += mark_guards(ax, cv.runs, cv.color)
        ax.set(title=text, xlabel="step")
    note = guard_note(marked)
    if note:
        fig.suptitle(note)
    cv.save(fig, "collapse_anatomy.png", title)


def truncation(cv) -> None:
    """The share of responses cut off at the generation cap, per run, on a fixed 0..1 axis so runs compare."""
    title = "Truncated fraction"
    if not cv.want(title, TRUNCATED):
        return
    fig, (ax,) = cv.panels(1, 7.0)
    cv.line(ax, TRUNCATED, "length/truncated_frac: share of responses cut off at the generation cap")
    ax.set_ylim(-0.02, 1.02)
    cv.save(fig, "truncation.png", title)


def health(cv) -> None:
    """The health monitor's state (ok/warn/alarm) per run, and the gauges it is computed from."""
    title = "Health gauges"
    if not cv.want(title, HEALTH_STATE):
        return
    fig, (a1, a2) = cv.panels(2)
    n = len(cv.runs)
    for i, r in enumerate(cv.runs):
        s, v = r.series(HEALTH_STATE)
        if s:
            # runs in the same state would hide each other: each is nudged a little off the level, within ±0.15
            off = (i - (n - 1) / 2) * min(0.04, 0.3 / n)
            a1.step(s, [x + off for x in v], where="post", color=cv.color[r.name], label=r.name)
    a1.set_yticks(range(len(HEALTH_LEVELS)), HEALTH_LEVELS)
    a1.set_ylim(-0.4, len(HEALTH_LEVELS) - 0.6)
    a1.set(title="health/state (runs nudged apart so none hides another)", xlabel="step")
    top = 0.0
    for key, style in HEALTH_GAUGES:
        cv.line(a2, key, style=style, legend=False)
        vals = [x for r in cv.runs for x in r.series(key)[1]]
        if vals:
            top = max(top, max(vals))
            # one legend entry per gauge (its style, neutral colour); the runs' colours are in the first panel
            a2.plot([], [], style, color="dimgrey", label=key.removeprefix("health/"))
    text = "health gauges (colour: run, style: gauge)"
    if top > 2.0:
        # a gap ratio can reach tens while the shares stay under 1: log above 1 keeps both readable
        a2.set_yscale("symlog", linthresh=1.0)
        text += ", linear to 1, log above"
    a2.set(title=text, xlabel="step")
    not_logged(a2, "a health/* gauge")
    cv.save(fig, "health.png", title)
