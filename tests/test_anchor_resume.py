"""A compressed run with the anchor on, killed and resumed, repeats the uninterrupted run step for step."""

import json

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main

pytestmark = pytest.mark.slow  # end-to-end runs: `make test-fast` skips them, `make test` (CI) runs them

CFG = tiny_config(
    optim={"lr": 3e-3},  # tiny's 2 layers, pp_size 2: one low-rank boundary, as 4 layers gave (more only compile)
    fast={"codec": {"type": "lowrank", "rank": 3}},
    grpo={"format_penalty": -1.0},  # reward variance on a random model, so the updates are not all zero
    # delay < cadence: the batch a fire needs was retained before the interruption, so it must be checkpointed
    # signed_gate (the shipped recipe's merger): its state has the most to carry (ω beside M), and both tests then
    # run the same programs, compiled once in this process
    anchor={
        "enabled": True,
        "cadence": 4,
        "delay": 2,
        "merger": {"type": "signed_gate"},
        "projection": {"window": 2},
        "swap": {"cadence": 2},
    },
    train={"steps": 6, "checkpoint_every": 1},
)


def _rows(run):
    return [json.loads(l) for l in open(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run of CFG, trained once: both tests' cut-and-resumed runs must repeat it (read-only)."""
    root = tmp_path_factory.mktemp("anchor_full")
    (root / "cfg.yaml").write_text(yaml.safe_dump(CFG))
    assert main(["train", "--config", str(root / "cfg.yaml"), "--out", str(root / "full"), "--no-progress"]) == 0
    return root / "full"


def test_anchored_compressed_run_resumes_exactly(tmp_path, monkeypatch, full):
    from twocircuit_jax.train import loop

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    cut = tmp_path / "cut"
    real = loop.GRPOTrainer.grpo_step

    def dying(self, gs):
        if gs == 4:  # after step 3's checkpoint; tick 6 retained a batch that the fire at tick 8 replays
            raise KeyboardInterrupt
        return real(self, gs)

    monkeypatch.setattr(loop.GRPOTrainer, "grpo_step", dying)
    assert main(["train", "--config", str(cfg), "--out", str(cut), "--no-progress"]) == 130
    monkeypatch.setattr(loop.GRPOTrainer, "grpo_step", real)
    assert main(["train", "--config", str(cfg), "--out", str(cut), "--no-progress", "--resume"]) == 0
    a, b = _rows(full), _rows(cut)
    assert [r["step"] for r in b] == list(range(7))
    assert sum(r.get("anchor/fire", 0) for r in a[4:]) >= 1 and a[-1]["swap/count"] > 0
    for ra, rb in zip(a[4:], b[4:]):
        # compile time and cache counts are logged on the steps that compiled: a resumed process compiles again
        compiled = {"time/compile_s", "time/compile_cache_hits", "time/compile_cache_misses"}
        assert set(ra) - compiled == set(rb) - compiled
        for k, v in ra.items():
            if k.startswith("time/") or not isinstance(v, (int, float)):
                continue
            assert rb[k] == pytest.approx(v, abs=1e-6, rel=1e-6), (ra["step"], k)
