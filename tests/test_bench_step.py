"""scripts/bench_step.py: bad flags exit 2 with one line naming the flag, and the table puts ratios to dense and
to the fastest peer under the arms (the timings themselves are a benchmark's, never asserted)."""

import importlib
import os
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def _script(name: str):
    """A module of scripts/: bench_step.py and the modules beside it import one another by name (a script run has
    its folder on the import path), so the folder is on it while they load, and only then."""
    sys.path.insert(0, SCRIPTS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(SCRIPTS)


def _bench():
    return _script("bench_step")


def _table(results):
    return _script("bench_table").table(results)


def _arm():
    return _script("bench_arm")


def test_bad_flags_exit_2(capsys, tmp_path):
    b = _bench()
    assert b.main(["--arms", "dense,warp"]) == 2
    assert "--arms" in capsys.readouterr().err
    assert b.main(["--steps", "2"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert b.main(["--peers", "--peers-dir", str(tmp_path)]) == 2  # no venvs there
    assert "--peers" in capsys.readouterr().err
    assert b.main(["--interleave", "--compile-cache", "warm"]) == 2
    assert "--compile-cache" in capsys.readouterr().err


def test_table_ratios():
    arm = lambda name, m, phases: {  # noqa: E731
        "arm": name,
        "median_step_s": m,
        "min_step_s": m,
        "max_step_s": m,
        "first_step_s": 1.0,
        "setup_s": 1.0,
        "peak_rss_mb": 100.0,
        "phases": phases,
    }
    t = _table(
        [
            arm("dense", 0.5, {"time/update_s": 0.2}),
            arm("prf_mask", 0.6, {"time/update_s": 0.3}),
            arm("peer:trl", 0.4, {}),
            arm("peer:tunix", 0.25, {}),
        ]
    )
    assert "dense/dense=1.00 dense/fastest_peer=2.00" in t
    assert "prf_mask/dense=1.20 prf_mask/fastest_peer=2.40" in t
    assert "| peer:trl | 0.400 | - | 0.400 | 0.400 | 1.00 | 1.00 | 100 | - |" in t  # a peer prints no mean


def test_peer_rows_are_the_peers_draw():
    rows = _arm().peer_rows(16)
    assert len(rows) == 16 and all(len(r["prompt"]) == 15 for r in rows)
    assert rows == _arm().peer_rows(16)  # numpy default_rng(1234): the same prompts every run


def test_ratios_per_round():
    arm = lambda name, rnd, m, first=1.0: {  # noqa: E731
        "arm": name,
        "round": rnd,
        "median_step_s": m,
        "min_step_s": m,
        "max_step_s": m,
        "first_step_s": first,
        "setup_s": 1.0,
        "peak_rss_mb": 100.0,
        "phases": {},
    }
    # round 2 ran on a machine twice as slow: per round the ratios hold still
    t = _table(
        [
            arm("dense", 1, 0.2, 8.0),
            arm("prf_mask", 1, 0.22),
            arm("peer:tunix", 1, 0.25, 10.0),
            arm("peer:trl", 1, 0.3, float("nan")),
            arm("dense", 2, 0.4, 16.0),
            arm("prf_mask", 2, 0.48),
            arm("peer:tunix", 2, 0.5, 16.0),
            arm("peer:trl", 2, 0.45, float("nan")),
        ]
    )
    assert "prf_mask/dense per round: 1.10 1.20 (median 1.15)" in t
    assert "dense/fastest_peer per round: 0.80 0.89 (median 0.84)" in t  # round 2's fastest peer is TRL
    assert "dense first/tunix first per round: 0.80 1.00 (median 0.90)" in t
    assert "per round" not in _table([arm("dense", 1, 0.2), arm("peer:tunix", 1, 0.25)])  # one round: none


def test_rounds_alternate_the_order_of_the_runs():
    order = _bench().round_order
    first = order(["dense", "prf_mask"], ["tunix", "trl"], 0)
    assert first == [("arm", "dense"), ("arm", "prf_mask"), ("peer", "tunix"), ("peer", "trl")]
    assert order(["dense", "prf_mask"], ["tunix", "trl"], 1) == first[::-1]
    assert order(["dense", "prf_mask"], ["tunix", "trl"], 2) == first
    # over two rounds every run's mean position is the same
    runs = order(["a", "b", "c"], ["p"], 0)
    assert len({sum(order(["a", "b", "c"], ["p"], r).index(run) for r in (0, 1)) for run in runs}) == 1


def test_interleaved_arms_print_step_by_step_ratios_and_no_per_arm_first_step():
    nan = float("nan")
    arm = lambda name, m, ratios=None: {  # noqa: E731
        "arm": name,
        "round": 1,
        "median_step_s": m,
        "min_step_s": m,
        "max_step_s": m,
        "first_step_s": nan,
        "setup_s": nan,
        "peak_rss_mb": nan,
        "phases": {"time/update_s": m / 2},
        **({"step_ratios": ratios} if ratios is not None else {}),
    }
    t = _table([arm("dense", 0.2, [1.0] * 5), arm("prf_mask", 0.25, [1.0, 1.1, 1.2, 1.3, 1.4])])
    assert "prf_mask/dense step by step (interleaved): median 1.20 (quartiles 1.05-1.35, 5 steps)" in t
    assert "dense/dense step by step" not in t
    assert "| prf_mask | 0.250 | - | 0.250 | 0.250 | - | - | - |" in t
    assert "| dense | 0.200 | - | 0.200 | 0.200 | - | - | - | 0.100 |" in t
    # summed seconds: a step that fires now and then counts at its share (two rounds add up before dividing)
    two = [
        dict(arm("dense", 0.2), sum_ratio=[1.0, 1.0, 5]),
        dict(arm("two_circuit", 0.2, [1.0] * 5), sum_ratio=[1.5, 1.0, 5]),
        dict(arm("two_circuit", 0.2), round=2, sum_ratio=[2.5, 2.0, 6]),
    ]
    assert "two_circuit/dense over all steps (interleaved): 1.33 (its seconds over dense's, 11 steps" in _table(two)


def test_figures_mean_counts_periodic_steps_and_leaves_out_compiling_ones():
    """Steps 1-2 warm up; of the rest, a step that compiled (time/compile_s) is left out of the mean, a fire step
    (here every fourth) is in it at its share, and the median does not see it."""
    walls = [5.0, 0.3, 0.1, 0.1, 0.1, 0.5, 3.0, 0.1, 0.1, 0.5]
    rows = [{"time/compile_s": 4.0}, {}, {}, {}, {}, {}, {"time/compile_s": 2.9}, {}, {}, {}]
    f = _arm().figures("two_circuit", walls, rows, 1.0)
    assert f["median_step_s"] == 0.1 and f["max_step_s"] == 3.0
    assert abs(f["mean_step_s"] - 1.5 / 7) < 1e-12


def test_set_goes_over_every_arm_and_a_bad_one_exits_2(capsys):
    b = _bench()
    cfg = _arm().arm_config("peers", "two_circuit", 12, "", ["anchor.cadence=20", "anchor.delay=20"])
    assert (cfg.anchor.cadence, cfg.anchor.delay) == (20, 20)  # over the recipe's 4 and 4
    assert cfg.fast.codec_type == "lowrank" and cfg.anchor.enabled  # the rest of the arm stays
    assert _arm().arm_config("peers", "two_circuit", 12).anchor.cadence == 4
    assert b.main(["--arms", "dense", "--set", "anchor.cadense=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set:") and "cadense" in err
