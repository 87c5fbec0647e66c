"""Low-rank bootstrap: one dense sketch pass before the first compressed forward publishes Q1."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from tiny_run import FOUR_BLOCK_MODEL

from twocircuit_jax.cli import main
from twocircuit_jax.config import load_config
from twocircuit_jax.fast.circuit import FastCircuit
from twocircuit_jax.fast.codecs import lowrank as lr
from twocircuit_jax.model import init_params
from twocircuit_jax.model.qwen2 import forward_with_aux
from twocircuit_jax.parallel import make_mesh

# end-to-end tests are marked slow: `make test-fast` skips them, `make test` (CI) runs them

TINY = {
    "tokenizer": "char",
    "model": {**FOUR_BLOCK_MODEL, "num_layers": 2},  # pp_size 2: one boundary, as at 4 layers (more: compile time)
    "task": {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 32, "eval_size": 8},
    "sampler": {"n": 4, "sampling": {"max_new_tokens": 4}},
    "fast": {"codec": {"type": "lowrank", "rank": 3}, "pp_size": 2},
    "train": {
        "steps": 1,
        "prompts_per_step": 4,
        "prompts_per_update": 4,
        "eval_every": 0,
        "eval_size": 8,
        "max_prompt_len": 16,
    },
}


def test_bootstrap_publishes_the_power_iteration_of_a_dense_sketch():
    cfg = load_config(data=TINY)
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    fc = FastCircuit(cfg, cfg.model, mesh)
    st0 = fc.init_codec_state()
    params = init_params(cfg.model, jax.random.key(1), std=0.2)
    rng = np.random.default_rng(0)
    batch = {
        "tokens": jnp.asarray(rng.integers(3, 100, (4, 10)), jnp.int32),
        "attention_mask": jnp.asarray(np.pad(np.ones((4, 8)), ((0, 0), (2, 0))), jnp.int32),
    }
    st1, m = fc.bootstrap(st0, params, batch)
    assert m == {"codec/bootstrapped": 1}
    # the same thing by hand: dense forward, sketch against Q0, one power-iteration step (the forward jitted: run
    # op by op it took seconds of dispatch)
    hook, layers = fc.basis_sketcher(st0, batch["attention_mask"])
    dense = jax.jit(lambda p, tok, mask: forward_with_aux(cfg.model, p, tok, mask, hook=hook, hook_layers=layers))
    _, aux = dense(params, batch["tokens"], batch["attention_mask"])
    ref = lr.activate_staged(lr.refresh_basis(lr.accumulate_sketch(st0, aux), cfg.fast.codec))
    for b in fc.boundaries:
        np.testing.assert_allclose(np.asarray(st1.Q[b]), np.asarray(ref.Q[b]), atol=1e-6)
        assert not np.allclose(np.asarray(st1.Q[b]), np.asarray(st0.Q[b]))
    off = load_config(data=TINY, overrides=["fast.codec.bootstrap=false"])
    assert FastCircuit(off, off.model, mesh).bootstrap(st0, params, batch) == (st0, {})


@pytest.mark.slow
def test_bootstrapped_basis_reconstructs_better_at_the_first_step(tmp_path):
    errs = {}
    for flag in ("true", "false"):
        p = tmp_path / f"{flag}.yaml"
        p.write_text(yaml.safe_dump(TINY))
        run = tmp_path / flag
        assert (
            main(
                [
                    "train",
                    "--config",
                    str(p),
                    "--out",
                    str(run),
                    "--no-progress",
                    "--set",
                    f"fast.codec.bootstrap={flag}",
                ]
            )
            == 0
        )
        r = [json.loads(l) for l in open(run / "metrics.jsonl")][1]
        assert ("codec/bootstrapped" in r) == (flag == "true")
        errs[flag] = r["codec/old_logprob/recon_rel_err"]
    assert errs["true"] < errs["false"], errs
