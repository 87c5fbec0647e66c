"""The dense probe (train.probe_every): reference KL with codecs off against the codec view."""

import json

import pytest
import yaml
from tiny_run import FOUR_BLOCK_MODEL

from twocircuit_jax.cli import main

pytestmark = pytest.mark.slow  # end-to-end runs: `make test-fast` skips them, `make test` (CI) runs them

CFG = {
    "tokenizer": "char",
    "model": {**FOUR_BLOCK_MODEL, "num_layers": 2},  # pp_size 2: one boundary, after layer 0 (depth: compile time)
    "optim": {"lr": 3e-2, "weight_decay": 1.0},  # rewards are all 0 on a random model: decay moves the policy
    "task": {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 32, "eval_size": 8},
    "sampler": {"n": 4, "sampling": {"max_new_tokens": 4}},
    "grpo": {"kl_coef": 0.0},
    "fast": {"codec": {"type": "prf_mask", "p": 0.75}, "pp_size": 2},
    "train": {
        "steps": 3,
        "prompts_per_step": 4,
        "prompts_per_update": 4,
        "eval_every": 0,
        "eval_size": 8,
        "max_prompt_len": 16,
        "probe_every": 1,
    },
}


def test_probe_logs_dense_and_codec_view_kl(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(CFG))
    assert main(["train", "--config", str(p), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")][1:]
    # step 1: the policy is the reference, so the dense KL is 0 (the codec view is not: it masks both sides
    # with the same bits, so it is 0 too) and the dense trainer equals the dense sampler
    assert rows[0]["kl/ref_dense"] == pytest.approx(0.0, abs=1e-7)
    assert "kl/gain" not in rows[0]
    for r in rows:
        assert r["probe/prob_gap_mean"] < 1e-5  # the dense view is the sampler's policy
        assert r["mismatch/prob_gap_mean"] > max(1e-4, 100 * r["probe/prob_gap_mean"])  # the codec view is not
    assert rows[2]["kl/ref_dense"] > 0 and rows[2]["kl/ref_codec"] > 0
    assert rows[2]["kl/gain"] == pytest.approx(rows[2]["kl/ref_codec"] / rows[2]["kl/ref_dense"], rel=1e-5)


def test_loop_logs_the_fidelity_gauge_on_probe_steps(tmp_path):
    """metrics.jsonl carries fidelity/* on every probe step (train.probe_every=2: steps 2 and 4, not 1 and 3)."""
    cfg = dict(CFG, train=dict(CFG["train"], steps=4, probe_every=2), grpo={"kl_coef": 0.001})
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(p), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")][1:]
    assert ["fidelity/grad_cos" in r for r in rows] == [False, True, False, True]
    for r in rows[1::2]:
        assert -1.0 <= r["fidelity/grad_cos"] < 0.999  # p=0.75 at one boundary: clearly not the dense gradient
        assert r["fidelity/grad_cos_pre_merger"] == r["fidelity/grad_cos"]  # no anchor, no merger
        assert r["fidelity/boundary_rel_err/0"] > 0.1 and r["fidelity/grad_norm_ratio"] > 0
        assert {"fidelity/grad_cos/attn", "fidelity/grad_cos/mlp", "fidelity/grad_cos/embed"} <= set(r)
