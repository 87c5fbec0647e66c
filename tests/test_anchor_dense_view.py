"""The anchor is a dense participant (design §4.3): with the mask codec on, its KL term is the dense probe's
`kl/ref_dense` on the same batch (not KL(dense ‖ codec-view reference)), and its TIS weights compare its own dense
log-probs with the sampler's, so they are 1 when trainer and sampler are the same dense model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny_config

from twocircuit_jax.anchor.circuit import AnchorCircuit
from twocircuit_jax.config import load_config
from twocircuit_jax.fast.circuit import FastCircuit
from twocircuit_jax.grpo.tis import tis_weights
from twocircuit_jax.metrics.probe import dense_probe_metrics
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.names import DENSE, OLD, REF
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.step.circuit_state import CircuitState, init_clock
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.step.train_step import init_state, make_optimizer, state_shardings

MODEL = tiny_config()["model"]
B, T, NEW = 8, 12, 4


@pytest.fixture(scope="module")
def fired():
    cfg = load_config(
        data={
            "name": "dense_view",
            "tokenizer": "char",
            "model": MODEL,
            "mesh": {"data": -1},
            "task": {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 64, "eval_size": 8},
            "sampler": {"n": 4, "sampling": {"max_new_tokens": NEW}},
            "grpo": {"kl_coef": 0.01, "tis": "token", "tis_cap": 2.0},
            "fast": {"codec": {"type": "prf_mask", "p": 0.9}, "pp_size": 2},
            "anchor": {"enabled": True, "cadence": 2, "delay": 2, "projection": {"enabled": False, "window": 2}},
            "train": {
                "steps": 2,
                "prompts_per_step": 4,
                "prompts_per_update": 2,
                "eval_every": 0,
                "max_prompt_len": T - NEW,
            },
        }
    )
    mesh = pmesh.make_mesh(cfg.mesh)
    ref = init_params(cfg.model, jax.random.PRNGKey(0), std=0.3)
    theta = jax.tree.map(lambda x: x + 0.05 * jnp.cos(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape)), ref)
    state = init_state(theta, make_optimizer(cfg.optim))
    state = jax.device_put(state, state_shardings(state, mesh))
    ref = jax.device_put(ref, state_shardings(state, mesh).params)
    codec = FastCircuit(cfg, cfg.model, mesh)
    anchor = AnchorCircuit(cfg, cfg.model, state.params)  # a mask codec: the anchor owns no basis
    cs = CircuitState(init_clock(1), codec.init_codec_state(), None, anchor.init_merger_state(), anchor.init_moments())
    r = np.random.default_rng(0)
    b = {
        "tokens": r.integers(3, 100, (B, T)).astype(np.int32),
        "attention_mask": np.ones((B, T), np.int32),
        "response_mask": np.concatenate([np.zeros((B, T - NEW)), np.ones((B, NEW))], 1).astype(np.float32),
        "advantages": r.normal(size=B).astype(np.float32),
        "sample_id": np.arange(B, dtype=np.int32),
    }
    b = jax.device_put(b, pmesh.batch_shardings(b, mesh))
    # What the loop puts in the batch: codec-view ℓ_old and ℓ_ref, the sampler's dense ℓ_s (here: the same dense
    # model as the trainer), and the fast circuit's TIS weights exp(ℓ_old(codec) − ℓ_s).
    dense = dispatch.jit(make_logp_fn(cfg.model, None, DENSE))
    b["old_logp"] = dispatch.jit(make_logp_fn(cfg.model, codec, OLD))(state.params, b, cs)[0]
    b["ref_logp"] = dispatch.jit(make_logp_fn(cfg.model, codec, REF))(ref, b, cs)[0]
    b["ref_logp_dense"] = dense(ref, b, cs)[0]  # what the loop adds when the anchor is on
    b["sampler_logp"] = dense(state.params, b, cs)[0]
    b["is_weight"] = tis_weights(b["old_logp"], b["sampler_logp"], b["response_mask"], "token", 2.0)[0]
    for tau in (1, 2):  # the same weights and batch on every tick: whichever pair the fire replays is (θ, b)
        cs, m, _ = anchor.before_tick(tau, 1, tau == 1, b, state, cs)
    probe = dense_probe_metrics(
        dense(state.params, b, cs)[0],
        dense(ref, b, cs)[0],
        b["old_logp"],
        b["ref_logp"],
        b["sampler_logp"],
        b["response_mask"],
        cfg.grpo.kl_estimator,
    )
    return m, probe


def test_anchor_kl_is_the_dense_probe_kl(fired):
    m, probe = fired
    assert anchor_fired(m)
    assert abs(probe["kl/ref_codec"] - probe["kl/ref_dense"]) > 0.5  # the two views really differ on this batch
    np.testing.assert_allclose(float(m["anchor/kl_loss"]), probe["kl/ref_dense"], rtol=1e-5, atol=1e-7)


def test_anchor_tis_weights_are_one_for_the_same_dense_model(fired):
    m, _ = fired
    assert anchor_fired(m)
    for k in ("anchor/tis/weight_mean", "anchor/tis/weight_max", "anchor/tis/weight_min"):
        assert abs(float(m[k]) - 1.0) <= 1e-5, (k, float(m[k]))


def anchor_fired(m):
    return "anchor/pg_loss" in m
