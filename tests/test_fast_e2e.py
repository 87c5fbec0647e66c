"""`twocircuit train` with the PRF mask on (design §8 inv. 3, seed 003's blindness): one GRPO step, one tick.
The trainer's own first-update ratio is exactly 1 and nothing clips, while the sampler (dense JAX sampler) and the
trainer (codec view) disagree far more than in the dense run; comm/* and codec/* metrics are logged."""

import json
import os

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main

pytestmark = pytest.mark.slow  # end-to-end runs: `make test-fast` skips them, `make test` (CI) runs them

CFG = tiny_config(
    name="fast_e2e",
    model={"num_layers": 4},
    task={"train_size": 32},
    fast={"pp_size": 4, "codec": {"type": "prf_mask", "p": 0.95}},
    # no held-out evaluation and no checkpoint: nothing here reads them (test_grpo_e2e.py checks both), and each
    # would add its own programs and work to both runs
    eval={"at_start": False, "at_end": False},
    train={"steps": 1, "prompts_per_step": 2, "checkpoint_every": 0, "final_checkpoint": False},
)


def run(tmp, codec):
    cfg = dict(CFG, fast=dict(CFG["fast"], codec=codec))
    path = tmp / f"{codec}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = str(tmp / codec)
    assert main(["train", "--config", str(path), "--out", out, "--no-progress"]) == 0
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))][-1]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fast_e2e")
    return run(tmp, "prf_mask"), run(tmp, "none")


def test_ratio_blind_to_a_large_sampler_gap(rows):
    mask, dense = rows
    assert mask["step"] == 1 and mask["tick"] == 1
    assert mask["ppo/ratio_mean"] == 1.0 and mask["ppo/clip_frac"] == 0.0
    assert dense["mismatch/prob_gap_mean"] < 1e-5
    assert mask["mismatch/prob_gap_mean"] > 100 * max(dense["mismatch/prob_gap_mean"], 1e-6)


def test_codec_and_comm_metrics_logged(rows):
    mask, dense = rows
    assert mask["codec/mask_ratio"] == pytest.approx(1 - 2 / 32)  # exact-k: k = round(0.05 * 32) = 2 kept
    for b in (0, 1, 2):
        assert f"codec/recon_rel_err/{b}" in mask
    assert 0 < mask["comm/bytes_ratio"] < 1 and mask["comm/bytes_compressed"] < mask["comm/bytes_dense"]
    assert not any(k.startswith(("codec/", "comm/")) for k in dense)  # codec off: the circuit is absent
