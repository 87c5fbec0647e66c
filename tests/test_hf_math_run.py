"""A run pointed at a local Hugging Face checkpoint (its own tokenizer) and local MATH JSONL files."""

import json

import jax
import pytest
import yaml

from twocircuit_jax.cli import main
from twocircuit_jax.config import ModelConfig
from twocircuit_jax.model import init_params, save_hf
from twocircuit_jax.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # end-to-end runs: `make test-fast` skips them, `make test` (CI) runs them


def test_train_from_hf_dir_on_math_files(tmp_path):
    tok = load_tokenizer("char")
    mcfg = ModelConfig(
        vocab_size=100,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        tie_embeddings=False,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    hf = save_hf(mcfg, init_params(mcfg, jax.random.key(0)), str(tmp_path / "hf"), tokenizer=tok)
    rows = [
        {"problem": f"What is {a}+{b}?", "solution": f"It is \\boxed{{{a + b}}}.", "answer": str(a + b)}
        for a in range(4)
        for b in range(4)
    ]
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows[:12]))
    test.write_text("\n".join(json.dumps(r) for r in rows[12:]))
    cfg = {
        "base_model": hf,
        "tokenizer": "auto",
        "task": {
            "type": "math_files",
            "train_files": [str(train)],
            "eval_files": [str(test)],
            "prompt_template": "{question} \\boxed{",
        },
        "sampler": {"n": 2, "sampling": {"max_new_tokens": 4}},
        "train": {
            "steps": 1,
            "prompts_per_step": 4,
            "prompts_per_update": 4,
            "eval_every": 1,
            "eval_size": 4,
            "max_prompt_len": 32,
        },
    }
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert main(["train", "--config", str(p), "--out", str(run), "--no-progress"]) == 0
    recs = [json.loads(l) for l in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [0, 1]
    assert recs[1]["eval/n"] == 4 and "reward/mean" in recs[1]
    resolved = yaml.safe_load(open(run / "config.yaml"))
    assert resolved["base_model"] == hf and resolved["task"]["type"] == "math_files"
