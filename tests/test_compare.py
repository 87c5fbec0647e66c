"""Verdict statistics (metrics/stats.py) against hand-computed values, and `twocircuit compare` on synthetic run
folders with planted effects (written by the trainer's own MetricsLogger): no training, seconds."""

import json
import os

import numpy as np
import pytest
import yaml
from scripts_module import load_script

from twocircuit_jax.cli import main
from twocircuit_jax.metrics import stats
from twocircuit_jax.metrics.compare import compare, parse_group, profiles, run_scalars
from twocircuit_jax.metrics.logger import MetricsLogger
from twocircuit_jax.metrics.runs import expand_runs, load_run

# --- stats: known values ---------------------------------------------------------------------------------------


def test_iqm_known_values_and_scipy():
    # 8 values: cut 2 from each end of the sorted [1..7, 100] -> mean(3, 4, 5, 6) = 4.5; the outlier does not count
    assert stats.iqm([1, 2, 3, 4, 100, 5, 6, 7]) == pytest.approx(4.5)
    assert stats.iqm([4.0, 1.0, 2.0]) == pytest.approx(7.0 / 3.0)  # n < 4: nothing cut
    from scipy.stats import trim_mean

    x = np.random.default_rng(3).normal(size=(7, 13))
    np.testing.assert_allclose(stats.iqm(x, axis=-1), trim_mean(x, 0.25, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(stats.iqm(x, axis=0), trim_mean(x, 0.25, axis=0), rtol=1e-12)


def test_prob_improvement_counts_pairs_with_ties_half():
    # pairs (b, a): (2,1) 1, (2,2) 1/2, (3,1) 1, (3,2) 1 -> 3.5 / 4
    assert stats.prob_improvement([1.0, 2.0], [2.0, 3.0]) == pytest.approx(0.875)
    assert stats.prob_improvement([1.0, 2.0], [1.0, 2.0]) == pytest.approx(0.5)
    assert stats.prob_improvement([0.0], [1.0]) == 1.0 and stats.prob_improvement([1.0], [0.0]) == 0.0


def test_bootstrap_ci_degenerate_and_percentiles():
    ci = stats.bootstrap_ci(stats.mean, [0.3] * 6)
    assert ci.point == pytest.approx(0.3) and ci.lo == pytest.approx(0.3) and ci.hi == pytest.approx(0.3)
    # a two-point sample {0, 1}: the resampled mean of n=2 is 0, 1/2 or 1 with probabilities 1/4, 1/2, 1/4, so the
    # 95% interval is [0, 1] and about a quarter of the resamples are 0
    ci = stats.bootstrap_ci(stats.mean, [0.0, 1.0])
    assert (ci.point, ci.lo, ci.hi) == (0.5, 0.0, 1.0)
    # fixed RNG seed: the same interval twice; a different seed, a (slightly) different one
    x = np.random.default_rng(0).normal(size=8)
    assert stats.bootstrap_ci(stats.mean, x) == stats.bootstrap_ci(stats.mean, x)
    assert stats.bootstrap_ci(stats.mean, x, seed=1) != stats.bootstrap_ci(stats.mean, x)


def test_paired_difference_aligns_by_seed():
    p = stats.paired_difference({0: 0.5, 1: 0.6, 2: 0.7}, {2: 0.75, 0: 0.55, 1: 0.65, 9: 0.0})
    assert p.paired and p.seeds == (0, 1, 2) and "left out" in p.note
    np.testing.assert_allclose(p.b - p.a, [0.05, 0.05, 0.05])
    ci = stats.difference_ci(p)  # every pair differs by exactly 0.05: a degenerate interval at 0.05
    assert ci.point == pytest.approx(0.05) and ci.lo == pytest.approx(0.05) and ci.hi == pytest.approx(0.05)
    u = stats.paired_difference({0: 0.5}, {1: 0.7, 2: 0.9})
    assert not u.paired and u.note == "unpaired, 1 vs 2"
    assert stats.difference_ci(u).point == pytest.approx(0.3)


def test_auc_and_accuracy_summary():
    # trapezoids over steps 0, 10, 30: (0.2+0.4)/2*10 + (0.4+0.6)/2*20 = 3 + 10 = 13, over the span 30
    assert stats.auc([0, 10, 30], [0.2, 0.4, 0.6]) == pytest.approx(13 / 30)
    s = stats.accuracy_summary([0, 10, 30], [0.2, 0.4, 0.6], last_k=2)
    assert s["final_accuracy"] == 0.6 and s["last_k_accuracy"] == pytest.approx(0.5)
    assert stats.accuracy_summary([5], [0.3])["auc_accuracy"] == 0.3
    # a run that peaks then falls: its best and the drop from it (a collapse's size); a rising run drops 0
    c = stats.accuracy_summary([0, 10, 20, 30], [0.2, 0.5, 0.3, 0.1])
    assert c["best_accuracy"] == 0.5 and c["drop_from_best"] == pytest.approx(0.4)
    assert s["best_accuracy"] == 0.6 and s["drop_from_best"] == 0.0
    assert stats.accuracy_summary([], [])["drop_from_best"] is None
    # the gain of the final evaluation over step 0's (the base model's); None without a step-0 evaluation
    assert s["gain_over_base"] == pytest.approx(0.4) and c["gain_over_base"] == pytest.approx(-0.1)
    assert stats.accuracy_summary([5], [0.3])["gain_over_base"] is None


def test_score_profile_counts_runs_above_each_threshold_with_a_band():
    v = [0.1, 0.2, 0.2, 0.5]
    taus = [0.0, 0.1, 0.15, 0.2, 0.3, 0.5]
    np.testing.assert_allclose(stats.score_profile(v, taus), [1.0, 0.75, 0.75, 0.25, 0.25, 0.0])
    # leading (resample) axes broadcast: two groups of runs at once
    both = stats.score_profile([[0.1, 0.2], [0.4, 0.6]], [0.15, 0.5])
    np.testing.assert_allclose(both, [[0.5, 0.0], [1.0, 0.5]])
    point, lo, hi = stats.profile_band(v, taus, n_resamples=4000)
    np.testing.assert_allclose(point, stats.score_profile(v, taus))
    assert np.all(lo <= point) and np.all(point <= hi)
    assert lo[2] < 0.75 < hi[2]  # spread runs: a real band
    assert lo[0] == hi[0] == 1.0 and lo[-1] == hi[-1] == 0.0  # below every run / at the top one: certain
    # one value repeated: no spread, no band
    p1, lo1, hi1 = stats.profile_band([0.3, 0.3, 0.3], [0.2, 0.4])
    np.testing.assert_allclose(lo1, p1) and np.testing.assert_allclose(hi1, p1)
    assert list(p1) == [1.0, 0.0]


def test_curve_band_brackets_mean():
    v = np.array([[0.1, 0.2], [0.3, 0.2], [0.2, 0.2]])
    mean, lo, hi = stats.curve_band(v)
    np.testing.assert_allclose(mean, [0.2, 0.2])
    assert lo[0] < 0.2 < hi[0] and lo[1] == pytest.approx(0.2) and hi[1] == pytest.approx(0.2)


# --- synthetic run folders -------------------------------------------------------------------------------------

STEPS = (0, 10, 20, 30)


def _write_run(
    path, seed: int, final: float, gap: float = 1e-3, grad_cos: float | None = None, upto: int | None = None, **last
):
    """A run folder as the trainer leaves it: config.yaml with train.seed, metrics.jsonl through MetricsLogger.
    Accuracy climbs linearly from final - 0.1 at step 0 to `final` at the last evaluation. `upto`: the run stopped
    at that step (its config still says STEPS[-1]); `last`: extra metrics of its last row."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.yaml"), "w") as fh:
        train = {"seed": seed} if upto is None and not last else {"seed": seed, "steps": STEPS[-1]}
        yaml.safe_dump({"name": os.path.basename(path), "train": train, "fast": {"codec": {"type": "none"}}}, fh)
    end = STEPS[-1] if upto is None else upto
    with MetricsLogger(path, STEPS[-1], show_progress=False) as log:
        for s in range(end + 1):
            m = {}
            if s > 0:
                m["mismatch/prob_gap_mean"] = gap
                if grad_cos is not None:
                    m["fidelity/grad_cos"] = grad_cos
            if s in STEPS:
                acc = final - 0.1 * (1 - s / STEPS[-1])
                m["eval/accuracy"] = acc
            if s == end:
                m.update(last)
            log.log(s, m)


def _arm(root, arm: str, finals, seeds=None, **kw):
    for i, f in zip(seeds or range(len(finals)), finals):
        _write_run(os.path.join(root, arm, f"seed_{i}"), i, float(f), **kw)
    return os.path.join(root, arm)


def _planted(n: int, effect: float, rng_seed: int = 0):
    """Per-seed finals of A and B: a shared seed effect (sd 0.01, what pairing removes) plus noise (sd 0.01)."""
    rng = np.random.default_rng(rng_seed)
    shared = rng.normal(0, 0.01, n)
    a = 0.5 + shared + rng.normal(0, 0.01, n)
    b = 0.5 + effect + shared + rng.normal(0, 0.01, n)
    return a, b


def _diff(rows, key):
    return next(r for r in rows if r["key"] == key)


def test_run_scalars_from_metrics(tmp_path):
    _write_run(tmp_path / "r", 3, 0.6, gap=2e-3, grad_cos=0.9)
    s = run_scalars(load_run(str(tmp_path / "r")), last_k=2)
    assert s["final_accuracy"] == pytest.approx(0.6)
    assert s["last_k_accuracy"] == pytest.approx((0.6 + (0.6 - 0.1 / 3)) / 2)
    assert s["auc_accuracy"] == pytest.approx(0.55)  # a straight line from 0.5 to 0.6: its mean height
    assert s["gap_mean"] == pytest.approx(2e-3) and s["grad_cos_mean"] == pytest.approx(0.9)


def test_planted_effect_detected_and_identical_groups_not(tmp_path):
    a, b = _planted(5, 0.05)
    ga = parse_group(_arm(tmp_path, "dense", a))
    gb = parse_group(_arm(tmp_path, "compressed", b))
    rows = compare([ga, gb], n_resamples=10_000)
    d = _diff(rows, "final_accuracy")
    assert d["pairing"] == "paired, 5 seeds"
    assert d["diff"].point == pytest.approx(np.mean(b - a))
    assert 0.0 < d["diff"].lo < 0.05 < d["diff"].hi  # excludes 0, contains the planted effect
    assert d["p_improve"].point == pytest.approx(1.0)
    assert d["iqm_a"].point == pytest.approx(stats.iqm(a)) and d["iqm_b"].point == pytest.approx(stats.iqm(b))
    # the same group twice: difference exactly 0, P(B > A) exactly 1/2
    same = _diff(compare([ga, parse_group(str(tmp_path / "dense"))]), "final_accuracy")
    assert same["diff"].lo <= 0.0 <= same["diff"].hi and same["p_improve"].point == pytest.approx(0.5)
    # two groups from one distribution (no planted effect): the interval holds 0, P(B > A)'s interval holds 1/2
    a0, b0 = _planted(5, 0.0, rng_seed=1)
    null = compare([parse_group(_arm(tmp_path / "n", "a", a0)), parse_group(_arm(tmp_path / "n", "b", b0))])
    n = _diff(null, "final_accuracy")
    assert n["diff"].lo < 0.0 < n["diff"].hi and n["p_improve"].lo < 0.5 < n["p_improve"].hi
    # rising curves: the best is the final, nothing dropped
    assert _diff(rows, "best_accuracy")["diff"].point == pytest.approx(np.mean(b - a))
    assert _diff(rows, "drop_from_best")["diff"].point == pytest.approx(0.0)
    # the performance profile of final accuracy: at a threshold between the groups every A run is below it, every
    # B run above (the planted 0.05 exceeds the noise here)
    taus, bands = profiles([ga, gb], n_resamples=2000)
    mid = int(np.argmin(np.abs(taus - (a.max() + b.min()) / 2)))
    assert a.max() < taus[mid] < b.min()
    assert bands["dense"][0][mid] == 0.0 and bands["compressed"][0][mid] == 1.0
    assert taus[0] < min(a.min(), b.min()) and taus[-1] > max(a.max(), b.max())
    # the gap (logged constant 1e-3 in both) and grad_cos (never logged) rows
    assert _diff(rows, "gap_mean")["diff"].point == pytest.approx(0.0)
    assert _diff(rows, "grad_cos_mean")["diff"] is None


def test_interval_narrows_as_seeds_are_added(tmp_path):
    """3 -> 10 seeds: the interval of B - A narrows (about as 1/sqrt(n)). One draw of 3 seeds can happen to agree
    closely, so the widths are averaged over 20 independent sweeps; the first goes through run folders."""
    widths = {3: [], 10: []}
    for rep in range(20):
        a, b = _planted(10, 0.05, rng_seed=100 + rep)
        for n in (3, 10):
            if rep == 0:
                ga = parse_group(_arm(tmp_path / str(n), "a", a[:n]))
                gb = parse_group(_arm(tmp_path / str(n), "b", b[:n]))
                d = _diff(compare([ga, gb], n_resamples=2000), "final_accuracy")["diff"]
            else:
                p = stats.paired_difference(dict(enumerate(a[:n])), dict(enumerate(b[:n])))
                d = stats.difference_ci(p, n_resamples=2000)
            widths[n].append(d.hi - d.lo)
    w3, w10 = np.mean(widths[3]), np.mean(widths[10])
    assert w10 < 0.75 * w3, (w3, w10)


def test_cli_compare_writes_table_and_figure_and_names_a_bad_group(tmp_path, capsys):
    a, b = _planted(4, 0.05)
    sweep = tmp_path / "sweep"
    _arm(sweep, "dense", a)
    _arm(sweep, "compressed", b, gap=5e-3)
    md, png = tmp_path / "v.md", tmp_path / "v.png"
    args = ["compare", f"{sweep}:dense", f"{sweep}:compressed", "--out", str(md), "--figure", str(png)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert md.read_text() == out
    assert "### compressed vs dense" in out and "| final accuracy |" in out and "| last-3 accuracy |" in out
    assert "paired, 4 seeds" in out and png.stat().st_size > 10_000
    # a list of run folders with a label is a group too
    runs = ",".join(str(sweep / "compressed" / f"seed_{i}") for i in range(4))
    assert main(["compare", f"{sweep}/dense", f"B={runs}"]) == 0
    assert "### B vs dense" in capsys.readouterr().out
    assert main(["compare", f"{sweep}:dense", f"{sweep}:nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "compressed, dense" in err
    assert main(["compare", f"{sweep}:dense", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_plot_expands_seeded_sweep_and_draws_bands(tmp_path):
    a, b = _planted(3, 0.05)
    sweep = tmp_path / "sw"
    _arm(sweep, "dense", a)
    _arm(sweep, "compressed", b)
    names = [r.name for r in expand_runs([str(sweep)])]
    assert names == [f"sw/compressed/seed_{i}" for i in range(3)] + [f"sw/dense/seed_{i}" for i in range(3)]
    assert main(["plot", str(sweep), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "accuracy_bands.png").stat().st_size > 10_000


def test_ladder_one_paired_verdict_per_rung_with_levels_and_figure(tmp_path, capsys):
    """Three rungs with planted effects -0.10, -0.05, 0.00 (B - A) and B's grad_cos 0.5, 0.7, 0.9: each rung's
    difference is its own pairs' mean, its interval excludes the other rungs' effects, the levels are the logged
    constants; the CLI writes the table and the figure, and a ladder that does not match the groups is refused."""
    sweep, specs, effects, coss, means = tmp_path / "ladder", [], (-0.10, -0.05, 0.0), (0.5, 0.7, 0.9), []
    for k, (w, eff, cos) in enumerate(zip((64, 128, 192), effects, coss)):
        a, b = _planted(5, eff, rng_seed=10 + k)
        means.append(float(np.mean(b - a)))
        _arm(sweep, f"w{w}_dense", a, gap=1e-7)
        _arm(sweep, f"w{w}_lowrank", b, gap=0.05 / (k + 1), grad_cos=cos)
        specs += [f"{sweep}:w{w}_dense", f"{sweep}:w{w}_lowrank"]
    from twocircuit_jax.metrics.ladder import ladder

    rows = ladder([64, 128, 192], [parse_group(s) for s in specs], n_resamples=4000)
    for r, eff, cos, k in zip(rows, effects, coss, range(3)):
        d = r["final_accuracy"]
        assert d.point == pytest.approx(means[k]) and d.lo <= d.point <= d.hi
        assert not (d.lo < eff - 0.05 < d.hi) and not (d.lo < eff + 0.05 < d.hi), (eff, d)
        assert r["grad_cos_mean_b"].point == pytest.approx(cos) and r["grad_cos_mean_a"] is None
        assert r["gap_mean_b"].point == pytest.approx(0.05 / (k + 1)) and r["gap_mean_a"].point == pytest.approx(1e-7)
        assert r["pairing"] == "paired, 5 seeds" and r["b"] == f"w{r['x']:g}_lowrank"
        # every synthetic run climbs 0.1 from its step-0 evaluation: each arm's gain over its base
        assert r["gain_over_base_a"].point == pytest.approx(0.1) and r["gain_over_base_b"].point == pytest.approx(0.1)
    png, md = tmp_path / "ladder.png", tmp_path / "ladder.md"
    args = ["compare", "--ladder", "64,128,192", "--ladder-name", "hidden", "--figure", str(png), "--out", str(md)]
    assert main(args + specs) == 0
    out = capsys.readouterr().out
    assert out == md.read_text() and "### hidden" in out
    assert [ln.split(" | ")[0] for ln in out.splitlines() if "lowrank vs" in ln] == [
        "| 64",
        "| 128",
        "| 192",
    ]
    assert "w192_lowrank vs w192_dense" in out and png.stat().st_size > 10_000
    assert main(["compare", "--ladder", "64,128", *specs]) == 2
    assert "--ladder" in capsys.readouterr().err
    assert main(["compare", "--ladder", "64,wide", *specs[:4]]) == 2
    assert "64,wide" in capsys.readouterr().err


def test_unfinished_runs_are_left_out_and_named_unless_asked_for(tmp_path, capsys):
    """A run short of its train.steps (a sweep still running, a killed run) is not compared as if it had finished:
    it is left out and named under the table; a group with no finished run is refused (exit 2) naming it;
    --include-unfinished counts them; a run the guard ended early is finished."""
    sweep = tmp_path / "sweep"
    _arm(sweep, "dense", [0.5, 0.5, 0.5])
    for k in range(3):
        _write_run(str(sweep / "comp" / f"seed_{k}"), k, 0.55)
    _write_run(str(sweep / "comp" / "seed_3"), 3, 0.9, upto=15)  # halfway: its last evaluation is step 10's
    _write_run(str(sweep / "guarded" / "seed_0"), 0, 0.45, upto=20, **{"guard/action": 2.0})  # the guard stopped it
    _write_run(str(sweep / "guarded" / "seed_1"), 1, 0.45, upto=20, **{"guard/action": 3.0})  # its final rollback
    _write_run(str(sweep / "running" / "seed_0"), 0, 0.5, upto=20)
    g = parse_group(f"{sweep}:comp")
    assert [r.name for r in g.runs] == ["seed_0", "seed_1", "seed_2"] and g.left_out == ["seed_3 (step 15 of 30)"]
    assert len(parse_group(f"{sweep}:comp", include_unfinished=True).runs) == 4
    assert not parse_group(f"{sweep}:guarded").left_out
    assert main(["compare", f"{sweep}:dense", f"{sweep}:comp"]) == 0
    out = capsys.readouterr().out
    assert "paired, 3 seeds |" in out and "| final accuracy | 0.5000 [0.5000, 0.5000] | 0.5500" in out
    assert "Left out of comp, unfinished: seed_3 (step 15 of 30)." in out and "--include-unfinished" in out
    assert main(["compare", f"{sweep}:dense", f"{sweep}:comp", "--include-unfinished"]) == 0
    assert "Left out" not in capsys.readouterr().out
    assert main(["compare", f"{sweep}:dense", f"{sweep}:running"]) == 2
    err = capsys.readouterr().err
    assert "no finished run" in err and "seed_0 (step 20 of 30)" in err and "--include-unfinished" in err
    ladder = ["compare", "--ladder", "1,2", f"{sweep}:dense", f"{sweep}:comp", f"{sweep}:dense", f"{sweep}:guarded"]
    assert main(ladder) == 0
    assert "Left out of comp, unfinished: seed_3 (step 15 of 30)." in capsys.readouterr().out


def test_select_marks_the_candidate_with_the_highest_mean_auc(tmp_path, capsys):
    """Three candidates over 2 seeds: the best by mean AUC is marked even where another ends higher on one seed;
    a run still going is left out and named; the seeds one candidate has beyond the others (the chosen arm's
    later seeds) are named and not counted; candidates with no seed in common, and --select with --ladder, are
    refused."""
    sweep = tmp_path / "grid"
    _arm(sweep, "lr1", [0.40, 0.42])  # AUC of each run: final - 0.05
    _arm(sweep, "lr2", [0.50, 0.46])
    _arm(sweep, "lr4", [0.30, 0.55])
    _write_run(sweep / "lr4" / "seed_2", 2, 0.9, upto=2)
    specs = [f"{sweep}:lr1", f"{sweep}:lr2", f"{sweep}:lr4"]
    from twocircuit_jax.metrics.compare import select

    rows = select([parse_group(s) for s in specs])
    assert [r["best"] for r in rows] == [False, True, False]
    assert rows[1]["auc_accuracy"] == pytest.approx(0.43) and rows[2]["auc_accuracy"] == pytest.approx(0.375)
    assert rows[2]["seeds"] == [0, 1]
    assert main(["compare", "--select", *specs]) == 0
    out = capsys.readouterr().out
    assert "Best by mean AUC accuracy: lr2." in out and "| lr2 | 0,1 | 0.4300 |" in out and "seed_2 (step 2" in out
    _arm(sweep, "lr1", [0.99, 0.99], seeds=[2, 3])  # later seeds of lr1, far above: the grid's choice stands
    assert main(["compare", "--select", *specs]) == 0
    out = capsys.readouterr().out
    assert "| lr1 | 0,1 | 0.3600 |" in out and "Best by mean AUC accuracy: lr2." in out
    assert "Not counted, as not every candidate has them: lr1 (seeds 2,3)." in out
    _arm(tmp_path / "other", "lr8", [0.5], seeds=[7])
    assert main(["compare", "--select", specs[0], f"{tmp_path / 'other'}:lr8"]) == 2
    err = capsys.readouterr().err
    assert "share no seed" in err and "lr8: 7" in err and "lr1: 0,1,2,3" in err
    assert main(["compare", "--select", "--ladder", "1,2", *specs[:2]]) == 2
    assert "--select" in capsys.readouterr().err


def _provenance(run, sha: str) -> None:
    with open(os.path.join(run, "provenance.json"), "w") as fh:
        json.dump({"base_model": "artifacts/base", "base_model_sha256": sha}, fh)


def test_compare_names_a_paired_seed_whose_runs_started_from_different_bases(tmp_path, capsys):
    """provenance.json's fingerprints: one base for every pair says nothing; a seed whose two runs started from
    different bases (one rebuilt on another machine) is named, in `compare` and in `compare --ladder`."""
    a, b = _planted(3, 0.0)
    dense, comp = _arm(tmp_path, "dense", a), _arm(tmp_path, "comp", b)
    for arm in (dense, comp):
        for i in range(3):
            _provenance(os.path.join(arm, f"seed_{i}"), "a" * 64)
    specs = [f"dense={dense}", f"comp={comp}"]
    assert main(["compare", *specs]) == 0
    assert "different bases" not in capsys.readouterr().out
    _provenance(os.path.join(comp, "seed_1"), "b" * 64)
    os.remove(os.path.join(dense, "seed_2", "provenance.json"))  # a run from before the record: nothing said
    _provenance(os.path.join(comp, "seed_2"), "c" * 64)
    want = f"comp vs dense: the pair's runs started from different bases at seed 1 ({'a' * 12} vs {'b' * 12})."
    assert main(["compare", *specs]) == 0
    assert want in capsys.readouterr().out
    assert main(["compare", "--ladder", "64,128", *specs, f"dense128={dense}", f"comp128={comp}"]) == 0, (
        capsys.readouterr().err
    )
    assert want in capsys.readouterr().out


def _archiver():
    return load_script("archive_runs")


def test_an_archived_sweep_reads_as_its_runs_and_is_never_overwritten(tmp_path, capsys):
    """scripts/archive_runs.py keeps a finished run's config, summaries and gzipped metrics: `compare` prints the
    same verdict from the archive as from the runs, the sweep's finished-arm path (`--resume`) reads the same
    summary from it, an unfinished run is left out, and a second archive of changed metrics is refused whole."""
    from twocircuit_jax.train.sweep import DONE, _final, run_summary

    a, b = _planted(3, 0.05)
    sweep = tmp_path / "runs" / "sw"
    for arm, finals in (("dense", a), ("compressed", b)):
        for i in range(3):
            _arm(sweep, arm, [finals[i]], seeds=[i])
            run = sweep / arm / f"seed_{i}"
            (run / DONE).write_text("{}")
            (run / "summary.json").write_text("{}")
            _provenance(run, "a" * 64)
    verdict = ["compare", "--last-k", "2"]
    assert main(verdict + [f"{sweep}:dense", f"{sweep}:compressed"]) == 0
    from_runs = capsys.readouterr().out
    _write_run(str(sweep / "dense" / "seed_3"), 3, 0.4, upto=10)  # unfinished: no sweep_done.json
    dest = tmp_path / "docs" / "sw"
    arch = _archiver()
    assert arch.main([str(sweep), str(dest)]) == 0
    assert "archived 6 runs" in capsys.readouterr().out
    assert not (dest / "dense" / "seed_3").exists() and not (dest / "dense" / "seed_0" / "metrics.jsonl").exists()
    assert sorted(os.listdir(dest / "dense" / "seed_0")) == sorted(
        [DONE, "config.yaml", "metrics.jsonl.gz", "provenance.json", "summary.json"]
    )
    assert main(verdict + [f"{dest}:dense", f"{dest}:compressed"]) == 0
    assert capsys.readouterr().out == from_runs.replace(str(sweep), str(dest)) and "paired, 3 seeds" in from_runs
    for i in range(3):
        run, kept = sweep / "compressed" / f"seed_{i}", dest / "compressed" / f"seed_{i}"
        assert run_summary(str(kept)) == run_summary(str(run)) and _final(str(kept)) == _final(str(run))
    assert arch.main([str(sweep), str(dest)]) == 0 and "archived 0 runs" in capsys.readouterr().out
    # the metrics of one run change (a rerun that did not reproduce): refused, naming it, nothing written
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    _write_run(str(sweep / "compressed" / "seed_2"), 2, 0.9)
    (sweep / "dense" / "seed_3" / DONE).write_text("{}")  # and a newly finished run, which must not land either
    (sweep / "dense" / "seed_3" / "summary.json").write_text("{}")
    assert arch.main([str(sweep), str(dest)]) == 2
    assert "compressed/seed_2" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before
