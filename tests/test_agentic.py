"""Multi-turn GRPO end to end with the embedded JAX sampler: trajectories become rows and train; the environment
RNG is saved, so a run resumed mid-way repeats the uninterrupted one exactly; the fast and anchor circuits run on
multi-turn rows, with the mismatch per turn."""

import json

import pytest
from agentic_run import agentic_config, build_base

from twocircuit_jax.config import load_config
from twocircuit_jax.train.checkpoint import CheckpointManager
from twocircuit_jax.train.loop import GRPOTrainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_base(str(tmp_path_factory.mktemp("agentic") / "base"))


def _rows(d):
    return [json.loads(line) for line in open(f"{d}/metrics.jsonl")]


def _strip(row):
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def test_multi_turn_run_plays_games_and_resumes_exactly(base, tmp_path):
    # 2 steps, evaluated and checkpointed after each: the resume starts mid-way, from step 1, and each run still
    # evaluates after a step it does not end on
    train = {"steps": 2, "eval_every": 1, "checkpoint_every": 1}
    cfg = load_config(data=agentic_config(base, train=train))
    full = tmp_path / "full"
    GRPOTrainer(cfg, str(full), show_progress=False).run()
    rows = _rows(full)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["env/turns_mean"] > 1.0 and r["env/format_penalty_frac"] < 0.5  # the SFT base plays legal moves
        assert r["env/rows"] == pytest.approx(r["env/turns_mean"] * 16)  # one row per interaction
        assert "mismatch/turn1/prob_gap_mean" in r and r["mismatch/prob_gap_mean"] < 1e-5  # dense JAX sampler
        assert 0.0 <= r["env/success"] <= 1.0 and r["reward/mean"] == r["env/return"]
    assert "eval/return" in rows[1] and "eval/turns_mean" in rows[2]
    meta = CheckpointManager(str(full / "checkpoints")).read_meta(1)
    assert "env_rng" in meta["collector"]
    # the same run, stopped after step 1 and resumed: identical metrics, the noisy verdicts included
    part = tmp_path / "part"
    GRPOTrainer(
        load_config(data=agentic_config(base, train={**train, "steps": 1})),
        str(part),
        show_progress=False,
    ).run()
    GRPOTrainer(cfg, str(part), resume=True, show_progress=False).run()
    assert [_strip(r) for r in _rows(part)] == [_strip(r) for r in rows]


def test_fast_and_anchor_circuits_on_multi_turn_rows(base, tmp_path):
    d = agentic_config(
        base,
        fast={"codec": {"type": "lowrank", "rank": 4}, "pp_size": 2},
        anchor={"enabled": True, "cadence": 2, "delay": 2, "projection": {"window": 2}},
        # 2 steps: at two ticks a step, cadence 2 makes a fire due on each; no held-out evaluation and no checkpoint
        # (the test above checks both), nothing here reads them
        train={"steps": 2, "eval_every": 0, "final_checkpoint": False},
        eval={"at_start": False, "at_end": False},
    )
    run = tmp_path / "tc"
    GRPOTrainer(load_config(data=d), str(run), show_progress=False).run()
    rows = _rows(run)
    last = rows[-1]
    assert sum(r.get("anchor/fire", 0) for r in rows) >= 1
    assert last["mismatch/prob_gap_mean"] > 1e-4  # the codec's trainer view differs from the dense sampler
    assert "mismatch/turn1/prob_gap_mean" in last and last["env/turns_mean"] > 1.0
