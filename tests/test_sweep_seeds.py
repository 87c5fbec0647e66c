"""Seeds as a sweep dimension (`twocircuit sweep --seeds`, a sweep file's `seeds:`), the held-out set's size checks
and each run folder's summary.json (final, last-k mean and AUC accuracy; the binomial standard error)."""

import json
import math
import os

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.config.base import ConfigError, from_dict
from twocircuit_jax.config.sections import TaskConfig
from twocircuit_jax.metrics.stats import accuracy_summary
from twocircuit_jax.tasks import make_task
from twocircuit_jax.train.evaluate import binomial_se, heldout_problems
from twocircuit_jax.train.sweep import load_seeded, parse_seeds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_seeds_forms_and_errors():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0,2,5") == [0, 2, 5]
    assert parse_seeds(" 0-2, 7 ") == [0, 1, 2, 7]
    assert parse_seeds([3, 1]) == [3, 1] and parse_seeds(4) == [4]
    for bad, why in (
        ("4-0", "backwards"),
        ("a", "'a' is not"),
        ("", "'' is not"),
        ("1,0-2", "seed 1 given twice"),
        ("-1", "'-1' is not"),
        ([True], "integer"),
        ("0-5000", "at most"),
        (None, "expected"),
    ):
        with pytest.raises(ConfigError, match=why) as e:
            parse_seeds(bad)
        assert e.value.path == "--seeds"


def test_seed_sets_train_seed_and_the_codecs_own(tmp_path):
    """Seed K sets train.seed; the compressed arm's low-rank codec gets fast.codec.seed = K too, the dense arm (no
    codec) has none to set; every other key is the arm's own, and the run's name is SWEEP/ARM/seed_K."""
    path = os.path.join(ROOT, "configs", "sweeps", "seed000_one_knob.yaml")
    runs = load_seeded(path, [3, 7], arms=["compressed", "uncompressed"])
    assert [(a, k) for a, k, _ in runs] == [
        ("compressed", 3),
        ("compressed", 7),
        ("uncompressed", 3),
        ("uncompressed", 7),
    ]
    for arm, k, cfg in runs:
        assert cfg.train.seed == k and cfg.name == f"seed000_one_knob/{arm}/seed_{k}"
        assert (getattr(cfg.fast.codec, "seed", None) == k) == (arm == "compressed")
    (c3, c7) = [c for a, _, c in runs if a == "compressed"]
    assert c3.fast.codec.rank == c7.fast.codec.rank == 3 and c3.anchor == c7.anchor


def test_bad_seeds_exit_2_naming_them(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_config(name="tiny")))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": "base.yaml", "arms": {"a": {}}}))
    out = tmp_path / "runs" / "x"
    assert main(["sweep", "--config", str(sweep), "--out", str(out), "--seeds", "4-0"]) == 2
    err = capsys.readouterr().err
    assert "--seeds" in err and "backwards" in err and not out.exists()
    assert main(["sweep", "--config", str(sweep), "--out", str(out), "--last-k", "0"]) == 2
    assert "--last-k" in capsys.readouterr().err and not out.exists()
    sweep.write_text(yaml.safe_dump({"base": "base.yaml", "seeds": "0-x", "arms": {"a": {}}}))
    assert main(["sweep", "--config", str(sweep), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "seeds" in err and str(sweep) in err and not out.exists()


def _task(**kw):
    opts = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    return make_task(from_dict(TaskConfig, {"type": "reasoning_gym", "dataset": "chain_sum", "options": opts, **kw}))


def test_heldout_size_beyond_the_task_is_an_error():
    """2-term one-digit chain sums: a space of a few hundred. Asking more held-out problems than the task generates,
    or than exist outside train, is refused with the numbers and the fix; within them, the first N."""
    task = _task(train_size=64, eval_size=50)
    assert [p.question for p in heldout_problems(task, 20)] == [p.question for p in task.eval_problems()[:20]]
    with pytest.raises(ConfigError, match=r"task.eval_size = 50 generates only 50") as e:
        heldout_problems(task, 100)
    assert e.value.path == "train.eval_size"
    big = _task(train_size=64, eval_size=5000)
    n = len(big.eval_problems())
    assert n < 5000
    with pytest.raises(ConfigError, match=rf"yielded only {n} distinct held-out problems"):
        heldout_problems(big, 5000)


def test_binomial_se():
    assert binomial_se(0.5, 2000) == pytest.approx(math.sqrt(0.25 / 2000))
    assert binomial_se(1.0, 10) == 0.0 and math.isnan(binomial_se(0.5, 0))


@pytest.mark.slow
def test_sweep_arms_by_seeds_resumed_in_parallel(tmp_path, capsys):
    """`--seeds 0,1` runs OUT/a/seed_0 and seed_1 (train.seed 0 and 1, different rollouts); `--seeds 0-2 --jobs 2
    --resume` then reads those two and runs seed_2 in a worker (its log OUT/a/seed_2.log). Every run folder holds a
    summary.json whose accuracies are those of its metrics.jsonl, each evaluation logs its standard error, and the
    sweep's summary.json has one row per (arm, seed)."""
    base = tiny_config(name="tiny", train={"steps": 2, "eval_every": 1})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "arms": {"a": {}}}))
    out = tmp_path / "s"
    common = ["sweep", "--config", str(tmp_path / "sweep.yaml"), "--out", str(out)]
    assert main(common + ["--seeds", "0,1"]) == 0
    first = (out / "a" / "seed_0" / "metrics.jsonl").read_text()
    assert main(common + ["--seeds", "0-2", "--jobs", "2", "--resume", "--last-k", "2"]) == 0
    text = capsys.readouterr().out
    assert "arm a/seed_0 -> " in text and "finished: read" in text
    assert (out / "a" / "seed_0" / "metrics.jsonl").read_text() == first
    assert (out / "a" / "seed_2.log").is_file() and not (out / "a" / "seed_0.log").exists()
    step1 = {}
    for k in range(3):
        run = out / "a" / f"seed_{k}"
        assert yaml.safe_load(open(run / "config.yaml"))["train"]["seed"] == k
        rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
        evals = [r for r in rows if "eval/accuracy" in r]
        assert [r["step"] for r in evals] == [0, 1, 2]
        for r in evals:
            assert r["eval/n"] == 8 and r["eval/accuracy_se"] == pytest.approx(binomial_se(r["eval/accuracy"], 8))
        summary = json.load(open(run / "summary.json"))
        want = accuracy_summary([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], 2)
        assert {key: summary[key] for key in want} == pytest.approx(want)
        assert summary["eval_n"] == 8 and summary["steps"] == 2
        step1[k] = next(r for r in rows if r["step"] == 1)["policy/entropy"]
    assert len(set(step1.values())) == 3, step1  # the seed moved the init and the rollouts
    table = json.load(open(out / "summary.json"))
    assert [(r["arm"], r["seed"]) for r in table] == [("a", 0), ("a", 1), ("a", 2)]
