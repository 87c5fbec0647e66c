"""`twocircuit compare GROUP_A GROUP_B [...]`: does arm B differ from arm A, by how much, how sure?

A group is the runs of one arm over seeds, given as
- `SWEEP_DIR:ARM` (the arm's folder in a sweep run with `--seeds`: SWEEP_DIR/ARM/seed_K),
- a folder whose subfolders are runs (an arm's folder, e.g. runs/sweep/compressed), or one run folder,
- a comma-separated list of run folders (`runs/a,runs/b,runs/c`);
optionally prefixed `LABEL=` (the table's name for it; default: the spec).

A run that has not finished (its last logged step short of its config's `train.steps`, and not ended by the guard)
is left out, and the table says which and where it stood: a comparison made while a sweep still runs would
otherwise take a half-trained run's last evaluation as its final one. `--include-unfinished` keeps them.

Each run is reduced to scalars (metrics/stats.py): final held-out accuracy, the mean of its last k evaluations,
the AUC accuracy, the best accuracy and the drop from it to the final one (a collapse's size), the gain of the
final accuracy over the step-0 evaluation (did the arm learn at all?), the mean sampler-trainer gap over its GRPO steps, the mean `fidelity/grad_cos` where logged. The
first group is the baseline A; every other group B gets, per scalar, the difference B - A paired by seed (the seed
is the run's `train.seed`, read from its config.yaml) with a 95% stratified bootstrap interval, each group's IQM
with its interval, and P(B > A) with its interval. `--figure` draws each group's held-out accuracy curve (mean over
seeds) with its bootstrap band, the mismatch gap's likewise when logged, and each group's performance profile of
final accuracy (the fraction of its runs above each threshold, with a bootstrap band: rliable's score
distribution, which shows a collapsed seed that an IQM trims away).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.metrics import stats
from twocircuit_jax.metrics.plot import draw_bands
from twocircuit_jax.metrics.runs import ACC, GAP, GRAD_COS, Run, load_run, metrics_file

SEED_DIR = re.compile(r"seed_(\d+)$")  # a sweep's run folder for one seed: SWEEP/ARM/seed_K
METRICS = (
    ("final accuracy", "final_accuracy"),
    ("last-k accuracy", "last_k_accuracy"),
    ("AUC accuracy", "auc_accuracy"),
    ("best accuracy", "best_accuracy"),
    ("drop from best to final", "drop_from_best"),
    ("gain over the base (final − step 0)", "gain_over_base"),
    ("mismatch gap (mean)", "gap_mean"),
    ("grad_cos (mean)", "grad_cos_mean"),
)


GUARD_ENDED = (2.0, 3.0)  # guard/action codes of a run's last row when the guard ended it (stop; final rollback)


@dataclass
class Group:
    label: str
    runs: list[Run]
    left_out: list[str] = field(default_factory=list)  # "NAME (step S of N)" per unfinished run not counted

    def seeds(self) -> list[int]:
        return [run_seed(r) for r in self.runs]


def run_seed(run: Run) -> int:
    """The run's `train.seed` (its config.yaml; the library default 0 when absent)."""
    train = run.config.get("train") if isinstance(run.config.get("train"), dict) else {}
    return int(train.get("seed", 0))


def unfinished(run: Run) -> str | None:
    """None for a finished run; else where it stands ("step S of N"). Finished: its last logged step reached its
    config's `train.steps` (a config without one counts as finished), or its last row is the guard ending it."""
    train = run.config.get("train") if isinstance(run.config.get("train"), dict) else {}
    planned = train.get("steps")
    last = run.rows[-1] if run.rows else {}
    step = int(last.get("step", -1))
    if planned is None or step >= int(planned) or last.get("guard/action") in GUARD_ENDED:
        return None
    return f"step {max(step, 0)} of {int(planned)}"


def _mean_of(run: Run, key: str, from_step: int = 0) -> float | None:
    vals = [v for s, v in zip(*run.series(key)) if s >= from_step]
    return float(np.mean(vals)) if vals else None


def run_scalars(run: Run, last_k: int = 3) -> dict:
    """The scalars a verdict compares, None where the run never logged them. The gap is averaged over GRPO steps
    (step >= 1: step 0 is the base model's evaluation)."""
    steps, acc = run.series(ACC)
    out = stats.accuracy_summary(steps, acc, last_k)
    out["gap_mean"] = _mean_of(run, GAP, 1)
    out["grad_cos_mean"] = _mean_of(run, GRAD_COS)
    return out


def _run_folders(folder: str) -> list[str]:
    """A folder's runs: itself if it is one, else its subfolders that are, seed_K ones in seed order."""
    if metrics_file(folder):
        return [folder]
    subs = [d for d in os.listdir(folder) if metrics_file(os.path.join(folder, d))]
    key = lambda d: (0, int(m.group(1)), d) if (m := SEED_DIR.match(d)) else (1, 0, d)  # noqa: E731
    return [os.path.join(folder, d) for d in sorted(subs, key=key)]


def parse_group(spec: str, include_unfinished: bool = False) -> Group:
    """A Group from a command-line spec (module doc), its unfinished runs left out unless `include_unfinished`.
    Raises ConfigError naming the spec."""
    label, body = "", spec
    if "=" in spec and not os.path.exists(spec):
        label, body = spec.split("=", 1)
    if "," in body:
        paths = [p for p in body.split(",") if p]
        bad = [p for p in paths if not metrics_file(p)]
        if bad:
            raise ConfigError(f"group {spec!r}", f"{bad[0]} is not a run folder (no metrics.jsonl)")
    else:
        folder = body
        if not os.path.isdir(folder) and ":" in body:
            sweep, arm = body.rsplit(":", 1)
            folder = os.path.join(sweep, arm)
            label = label or arm
            if not os.path.isdir(folder):
                arms = sorted(os.listdir(sweep)) if os.path.isdir(sweep) else []
                arms = [
                    a for a in arms if os.path.isdir(os.path.join(sweep, a)) and _run_folders(os.path.join(sweep, a))
                ]
                raise ConfigError(
                    f"group {spec!r}",
                    f"no arm {arm!r} in {sweep}" + (f"; its arms: {', '.join(arms)}" if arms else ""),
                )
        if not os.path.isdir(folder):
            raise ConfigError(f"group {spec!r}", "not found: give SWEEP_DIR:ARM, a folder of runs or RUN,RUN,...")
        paths = _run_folders(folder)
        if not paths:
            raise ConfigError(f"group {spec!r}", f"no run folder (metrics.jsonl) in {folder} or its subfolders")
    runs = [load_run(p, os.path.basename(os.path.normpath(p))) for p in paths]
    name = lambda p: os.path.basename(os.path.normpath(p))  # noqa: E731
    default = name(body) if len(paths) == 1 or "," not in body else f"{name(paths[0])}+{len(paths) - 1}"
    left = [(r, where) for r in runs if (where := unfinished(r))]
    if left and not include_unfinished:
        if len(left) == len(runs):
            names = ", ".join(f"{r.path} ({w})" for r, w in left)
            raise ConfigError(
                f"group {spec!r}",
                f"no finished run: {names}; wait for them, or pass --include-unfinished to compare them as they are",
            )
        runs = [r for r in runs if not unfinished(r)]
    group = Group(label or default, runs, [] if include_unfinished else [f"{r.name} ({w})" for r, w in left])
    seeds = group.seeds()
    dup = sorted({s for s in seeds if seeds.count(s) > 1})
    if dup:
        raise ConfigError(f"group {spec!r}", f"two runs with train.seed {dup[0]}: a group is one run per seed")
    return group


def by_seed(group: Group, key: str, last_k: int) -> dict:
    vals = {run_seed(r): run_scalars(r, last_k)[key] for r in group.runs}
    return {s: v for s, v in vals.items() if v is not None}


def compare(groups: list[Group], last_k: int = 3, n_resamples: int = stats.N_RESAMPLES, seed: int = 0) -> list[dict]:
    """One row per (group B != A, metric): the IQMs, B - A and P(B > A), each with its 95% interval (None where a
    group never logged the metric). groups[0] is A."""
    if len(groups) < 2:
        raise ConfigError("compare", f"needs at least two groups, got {len(groups)}")
    kw = dict(n_resamples=n_resamples, seed=seed)
    base, rows = groups[0], []
    for other in groups[1:]:
        for name, key in METRICS:
            a, b = by_seed(base, key, last_k), by_seed(other, key, last_k)
            row = {"a": base.label, "b": other.label, "metric": name, "key": key}
            row["iqm_a"] = stats.bootstrap_ci(stats.iqm, list(a.values()), **kw) if a else None
            row["iqm_b"] = stats.bootstrap_ci(stats.iqm, list(b.values()), **kw) if b else None
            if a and b:
                p = stats.paired_difference(a, b)
                row.update(diff=stats.difference_ci(p, **kw), p_improve=stats.improvement_ci(p, **kw), pairing=p.note)
            else:
                missing = " and ".join(g.label for g, v in ((base, a), (other, b)) if not v)
                row.update(diff=None, p_improve=None, pairing=f"not logged by {missing}")
            rows.append(row)
    return rows


def _ci(x, signed: bool = False) -> str:
    if x is None:
        return "-"
    f = "{:+.4f}" if signed else "{:.4f}"
    return f"{f.format(x.point)} [{f.format(x.lo)}, {f.format(x.hi)}]"


def markdown(rows: list[dict], last_k: int, n_resamples: int) -> str:
    """The table: one section per B, one line per metric."""
    out = []
    for b in dict.fromkeys(r["b"] for r in rows):
        sel = [r for r in rows if r["b"] == b]
        a = sel[0]["a"]
        out += [
            f"### {b} vs {a}",
            "",
            f"| metric | IQM {a} [95% CI] | IQM {b} [95% CI] | {b} − {a} [95% CI] | P({b} > {a}) [95% CI] | pairing |",
            "|---|---|---|---|---|---|",
        ]
        for r in sel:
            name = r["metric"].replace("last-k", f"last-{last_k}")
            cells = [name, _ci(r["iqm_a"]), _ci(r["iqm_b"]), _ci(r["diff"], True), _ci(r["p_improve"]), r["pairing"]]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out.append(
        f"Intervals: 95% percentile bootstrap, {n_resamples} resamples of the seeds within each group (paired: the "
        "seeds resampled jointly); IQM: mean of the middle half of the seeds; P(B > A): over pairs of runs, ties 1/2."
    )
    return "\n".join(out) + "\n"


def base_note(pairs: list[tuple[Group, Group]]) -> str:
    """The lines that name each paired seed whose two runs started from different bases (their provenance.json
    sha256s differ: a base rebuilt on another machine), "" when none did; runs without the record say nothing."""
    lines = []
    for a, b in pairs:
        sha_a = {run_seed(r): r.base_sha for r in a.runs if r.base_sha}
        sha_b = {run_seed(r): r.base_sha for r in b.runs if r.base_sha}
        bad = [
            f"seed {s} ({sha_a[s][:12]} vs {sha_b[s][:12]})"
            for s in sorted(sha_a.keys() & sha_b.keys())
            if sha_a[s] != sha_b[s]
        ]
        if bad:
            lines.append(f"{b.label} vs {a.label}: the pair's runs started from different bases at {', '.join(bad)}.")
    if not lines:
        return ""
    return "\n" + "\n".join(lines) + "\nTheir difference mixes the arms' with the bases'; rerun the pair on one base.\n"


def left_out_note(groups: list[Group]) -> str:
    """The lines that name each group's unfinished runs left out ("" when none was)."""
    lines = [f"Left out of {g.label}, unfinished: {', '.join(g.left_out)}." for g in groups if g.left_out]
    if not lines:
        return ""
    return "\n" + "\n".join(lines) + "\nPass --include-unfinished to count them as they are.\n"


def write_figure(groups: list[Group], path: str, n_resamples: int = stats.N_RESAMPLES) -> str:
    """Held-out accuracy (and the mismatch gap when logged) per group: mean over seeds, 95% bootstrap band; then
    the performance profile of final accuracy."""
    from matplotlib.figure import Figure

    keys = [ACC] + ([GAP] if any(r.series(GAP)[0] for g in groups for r in g.runs) else [])
    fig = Figure(figsize=(6.5 * (len(keys) + 1), 4.5), layout="constrained")
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys) + 1, i + 1)
        draw_bands(ax, [(g.label, g.runs) for g in groups], key, n_resamples=n_resamples)
        ax.set_title(f"{key}: mean over seeds, 95% bootstrap band")
        if key == GAP:
            ax.set_yscale("log")
        ax.legend(fontsize="small")
    draw_profiles(fig.add_subplot(1, len(keys) + 1, len(keys) + 1), groups, n_resamples=n_resamples)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def profiles(groups: list[Group], n_points: int = 101, n_resamples: int = stats.N_RESAMPLES) -> tuple:
    """(taus [T], {label: (point, lo, hi)}): each group's performance profile of final accuracy on one grid
    spanning every group's runs, with its 95% bootstrap band; groups that never evaluated are left out."""
    finals = {g.label: [v for v in by_seed(g, "final_accuracy", 1).values()] for g in groups}
    finals = {k: v for k, v in finals.items() if v}
    if not finals:
        return np.zeros(0), {}
    every = np.concatenate([np.asarray(v) for v in finals.values()])
    pad = max(0.02, 0.05 * float(every.max() - every.min()))
    taus = np.linspace(float(every.min()) - pad, float(every.max()) + pad, n_points)
    return taus, {k: stats.profile_band(v, taus, n_resamples=n_resamples) for k, v in finals.items()}


def draw_profiles(ax, groups: list[Group], n_resamples: int = stats.N_RESAMPLES) -> None:
    taus, bands = profiles(groups, n_resamples=n_resamples)
    for i, (label, (point, lo, hi)) in enumerate(bands.items()):
        ax.step(taus, point, where="post", color=f"C{i % 10}", label=f"{label} ({len(_runs_of(groups, label))} runs)")
        ax.fill_between(taus, lo, hi, step="post", color=f"C{i % 10}", alpha=0.2, linewidth=0)
    ax.set(xlabel="final accuracy threshold tau", ylabel="fraction of runs > tau", ylim=(-0.02, 1.02))
    ax.set_title("performance profile: final accuracy, 95% bootstrap band")
    if bands:
        ax.legend(fontsize="small")


def _runs_of(groups: list[Group], label: str) -> list[Run]:
    return next(g.runs for g in groups if g.label == label)


def parse_groups(specs: list[str], include_unfinished: bool = False) -> list[Group]:
    """Every group parsed (and checked) first; two arms of the same name from two sweeps keep their full spec as
    their label, so the table tells them apart."""
    groups = [parse_group(s, include_unfinished) for s in specs]
    labels = [g.label for g in groups]
    for g, spec in zip(groups, specs):
        if labels.count(g.label) > 1:
            g.label = spec
    return groups


def check_options(last_k: int, resamples: int) -> None:
    if last_k < 1:
        raise ConfigError("--last-k", f"got {last_k}; must be >= 1")
    if resamples < 100:
        raise ConfigError("--resamples", f"got {resamples}; must be >= 100")


def run_compare(
    specs: list[str],
    out: str = "",
    figure: str = "",
    last_k: int = 3,
    resamples: int = 10_000,
    include_unfinished: bool = False,
) -> str:
    """The CLI's body: the groups, then the table (returned, and written to `out`)."""
    check_options(last_k, resamples)
    groups = parse_groups(specs, include_unfinished)
    text = markdown(compare(groups, last_k, resamples), last_k, resamples) + left_out_note(groups)
    text = save_table(text + base_note([(groups[0], g) for g in groups[1:]]), out)
    if figure:
        write_figure(groups, figure, resamples)
    return text


SELECT_KEYS = ("auc_accuracy", "final_accuracy", "last_k_accuracy", "gain_over_base")


def select(groups: list[Group], last_k: int = 3) -> list[dict]:
    """The candidates of one choice (an arm at several learning rates, say), one row each: the seeds every
    candidate has and their mean of each of SELECT_KEYS (a candidate's other seeds, run later at the chosen value,
    are listed in `extra_seeds` and not counted, so the choice stays the one the grid made). The best is the highest
    mean AUC accuracy (the curve's average height: a run that learns early and holds counts above one that ends
    level with it after a dip); ties go to the first. Raises ConfigError when the candidates share no seed."""
    shared = set.intersection(*(set(g.seeds()) for g in groups)) if groups else set()
    if not shared:
        have = "; ".join(f"{g.label}: {','.join(map(str, sorted(g.seeds()))) or 'none'}" for g in groups)
        raise ConfigError("--select", f"the candidates share no seed to compare them on ({have})")
    rows = []
    for g in groups:
        row = {"label": g.label, "seeds": sorted(shared), "extra_seeds": sorted(set(g.seeds()) - shared)}
        for key in SELECT_KEYS:
            vals = [v for s, v in by_seed(g, key, last_k).items() if s in shared]
            row[key] = float(np.mean(vals)) if vals else None
        rows.append(row)
    scored = [r for r in rows if r["auc_accuracy"] is not None]
    best = max(scored, key=lambda r: r["auc_accuracy"]) if scored else None
    for r in rows:
        r["best"] = r is best
    return rows


def select_markdown(rows: list[dict], last_k: int) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    lines = [
        f"| candidate | seeds | mean AUC accuracy | mean final accuracy | mean last-{last_k} accuracy | mean gain over "
        "the base | best |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["label"], ",".join(map(str, r["seeds"])), *(fmt(r[k]) for k in SELECT_KEYS), "**best**" * r["best"]]
        lines.append("| " + " | ".join(cells) + " |")
    best = next((r["label"] for r in rows if r["best"]), None)
    extra = [f"{r['label']} (seeds {','.join(map(str, r['extra_seeds']))})" for r in rows if r["extra_seeds"]]
    note = f"\nNot counted, as not every candidate has them: {'; '.join(extra)}.\n" if extra else ""
    return "\n".join(lines) + f"\n\nBest by mean AUC accuracy: {best}.\n" + note


def run_select(specs: list[str], out: str = "", last_k: int = 3, include_unfinished: bool = False) -> str:
    """`compare --select`: the candidates' table, returned and written to `out`."""
    check_options(last_k, 10_000)
    groups = parse_groups(specs, include_unfinished)
    return save_table(select_markdown(select(groups, last_k), last_k) + left_out_note(groups), out)


def save_table(text: str, out: str) -> str:
    """The table, also written to `out` when given."""
    if out:
        with open(out, "w") as fh:
            fh.write(text)
    return text
