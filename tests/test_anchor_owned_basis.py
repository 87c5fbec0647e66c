"""The anchor-owned low-rank basis (anchor.owns_q auto with fast.codec lowrank): only fires refresh Q."""

import json

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.config import load_config

# end-to-end tests are marked slow: `make test-fast` skips them, `make test` (CI) runs them

CFG = tiny_config(
    optim={"lr": 3e-3},  # tiny's 2 layers, pp_size 2: one low-rank boundary, as 4 layers gave (more only compile)
    fast={"codec": {"type": "lowrank", "rank": 3}},
    anchor={"enabled": True, "cadence": 4, "delay": 4, "projection": {"window": 2}},
    train={"steps": 5},
)


@pytest.mark.slow
def test_only_fires_publish_a_basis(tmp_path, monkeypatch):
    from twocircuit_jax.train import loop

    assert load_config(data=CFG).anchor_owns_q
    seen = {}
    real = loop.GRPOTrainer.run

    def keep(self):
        seen["t"] = self
        return real(self)

    monkeypatch.setattr(loop.GRPOTrainer, "run", keep)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(CFG))
    assert main(["train", "--config", str(p), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert seen["t"].built.fast.owns_basis is False  # the fast path never sketches or refreshes
    rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")][1:]
    fires = [int(r["anchor/fire"]) for r in rows]
    assert fires == [0, 1, 0, 1, 0]  # cadence 4 ticks, 2 ticks per step
    # bootstrap publishes Q1 at step 1; then exactly one new basis per fire, active from the next step on
    assert [int(r["codec/q_updates"]) for r in rows] == [1, 2, 2, 3, 3]
    assert [int(r["codec/q_activations"]) for r in rows] == [1, 2, 2, 3, 3]
    assert all(r["codec/q_stage_overwrites"] == 0 for r in rows)
    assert all(abs(r["codec/basis_cond"] - 1.0) < 1e-4 for r in rows)  # orthonormal


def test_explicit_owner_needs_lowrank():
    import pytest

    from twocircuit_jax.config import ConfigError

    with pytest.raises(ConfigError, match="anchor.owns_q"):
        load_config(data=CFG, overrides=["fast.codec=prf_mask", "anchor.owns_q=true"])
    cfg = load_config(data=CFG, overrides=["anchor.owns_q=false"])
    assert not cfg.anchor_owns_q
