"""The trainer as a library: `step()` one GRPO step at a time with nothing set by `run()`, per-phase timing in the
metrics, and the switches `eval.at_start`, `eval.at_end`, `train.final_checkpoint`."""

import json
import os

import pytest
from tiny_run import tiny_config

from twocircuit_jax.config import load_config
from twocircuit_jax.train.loop import GRPOTrainer

PHASES = ("time/generate_s", "time/score_s", "time/logprob_s", "time/update_s", "time/export_s")


def rows(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


@pytest.mark.slow
def test_step_by_step_without_run_and_switches_off(tmp_path):
    cfg = load_config(
        data=tiny_config(
            eval={"at_start": False, "at_end": False},
            train={"steps": 2, "eval_every": 0, "final_checkpoint": False},
        )
    )
    run = str(tmp_path / "r")
    with GRPOTrainer(cfg, run, show_progress=False) as tr:
        m1 = tr.step()  # no run() first: nothing hidden to set
        assert m1["step"] == 1 and tr.gs == 1
        for k in PHASES:
            assert m1[k] >= 0.0, k
        assert m1["time/compile_s"] > 0  # the first step compiles the sampler and the train step
        assert sum(m1[k] for k in PHASES) <= m1["time/step_s"] + 1e-3
        m2 = tr.step()
        assert m2["step"] == 2 and m2["tick"] == 4
        assert "eval/accuracy" not in m2 and "time/eval_s" not in m2  # eval.at_end: false
        with pytest.raises(RuntimeError, match="train.steps=2"):
            tr.step()
    assert [r["step"] for r in rows(run)] == [1, 2]  # eval.at_start: false, no step 0 line
    assert rows(run)[0]["reward/mean"] == m1["reward/mean"]
    assert not [d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_")]
    with pytest.raises(RuntimeError, match="closed"):
        tr.step()


@pytest.mark.slow
def test_run_defaults_evaluate_at_both_ends_and_checkpoint_last(tmp_path):
    cfg = load_config(data=tiny_config(train={"steps": 1, "eval_every": 0, "checkpoint_every": 0}))
    run = str(tmp_path / "r")
    summary = GRPOTrainer(cfg, run, show_progress=False).run()
    r = rows(run)
    assert [x["step"] for x in r] == [0, 1]
    assert "eval/accuracy" in r[0] and r[0]["time/eval_s"] > 0
    assert "eval/accuracy" in r[1] and r[1]["time/eval_s"] > 0 and r[1]["time/checkpoint_s"] > 0
    assert summary["base_accuracy"] == r[0]["eval/accuracy"] and summary["final_accuracy"] == r[1]["eval/accuracy"]
    assert "step_00000001" in os.listdir(os.path.join(run, "checkpoints"))


@pytest.mark.slow
def test_resume_writes_the_line_of_a_checkpoint_committed_before_its_log(tmp_path, monkeypatch):
    from twocircuit_jax.metrics.logger import MetricsLogger

    data = tiny_config(eval={"at_start": False}, train={"steps": 2, "eval_every": 0, "checkpoint_every": 1})
    run = str(tmp_path / "r")
    real = MetricsLogger.log

    def dying(self, step, metrics):
        if step == 2:
            raise KeyboardInterrupt  # after step 2's checkpoint, before its line
        return real(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", dying)
    with pytest.raises(KeyboardInterrupt):
        GRPOTrainer(load_config(data=data), run, show_progress=False).run()
    monkeypatch.setattr(MetricsLogger, "log", real)
    assert [r["step"] for r in rows(run)] == [1]
    GRPOTrainer(load_config(data=data), run, resume=True, show_progress=False).run()
    r = rows(run)
    assert [x["step"] for x in r] == [1, 2] and "reward/mean" in r[1] and "eval/accuracy" in r[1]


_ONE_STEP = """
import json, sys
from tiny_run import tiny_config
from twocircuit_jax.config import load_config
from twocircuit_jax.train.loop import GRPOTrainer
train = {"steps": 1, "eval_every": 0, "final_checkpoint": False, "compile_cache": sys.argv[2]}
cfg = load_config(data=tiny_config(eval={"at_start": False, "at_end": False}, train=train))
with GRPOTrainer(cfg, sys.argv[1], show_progress=False) as tr:
    m = tr.step()
print(json.dumps({k: v for k, v in m.items() if k.startswith("time/compile")}))
"""


@pytest.mark.slow
def test_second_run_loads_its_programs_from_the_compile_cache(tmp_path):
    """train.compile_cache: a fresh process running the same shapes compiles nothing; every program is a hit."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # make test's shared cache would win over train.compile_cache
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), env.get("PYTHONPATH")]))
    cache = str(tmp_path / "cache")

    def one(name):
        out = subprocess.run(
            [sys.executable, "-c", _ONE_STEP, str(tmp_path / name), cache],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = one("a"), one("b")
    print(f"\nfirst step compile: cold {cold}, warm {warm}")
    assert cold["time/compile_cache_misses"] > 0 and os.listdir(cache)
    assert warm["time/compile_cache_misses"] == 0
    assert warm["time/compile_cache_hits"] >= cold["time/compile_cache_misses"]
