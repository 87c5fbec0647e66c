"""The chunked LM head (model/head.py): log-probs, entropies and token accuracy without the [B, T, V] logits equal
today's whole-logits path (grpo/loss.py token_logprobs / token_entropy of qwen2.lm_head), values and gradients, and
its compiled temporaries do not grow with the sequence."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import NARROW_MODEL, circuit_state, narrow_batch

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.sections import ModelConfig
from twocircuit_jax.grpo.loss import token_entropy, token_logprobs
from twocircuit_jax.model import head, qwen2
from twocircuit_jax.parallel import mesh as pmesh, pipeline as pipe
from twocircuit_jax.parallel.micro_batch import plain_value_and_grad
from twocircuit_jax.step.grpo_step import make_grpo_loss
from twocircuit_jax.step.programs import make_pipeline
from twocircuit_jax.step.sft_loss import next_token_loss

B, T, H, V = 3, 11, 16, 50  # 10 predicting positions: chunk 3 leaves a padded last chunk, chunk 5 divides them


def _head_case(tied: bool, dtype: str):
    cfg = ModelConfig(vocab_size=V, hidden_size=H, tie_embeddings=tied, param_dtype="float32", compute_dtype=dtype)
    k = jax.random.split(jax.random.key(0), 6)
    params = {"embed": jax.random.normal(k[0], (V, H)), "final_norm": 1.0 + 0.1 * jax.random.normal(k[1], (H,))}
    if not tied:
        params["lm_head"] = jax.random.normal(k[2], (H, V))
    h = jax.random.normal(k[3], (B, T, H)).astype(qwen2.dtype_of(dtype))
    tokens = jax.random.randint(k[4], (B, T), 0, V)
    a, b = jax.random.normal(k[5], (2, B, T))  # a weight on every position's log-prob and entropy
    return cfg, params, h, tokens, a, b


def _whole(cfg, params, h, tokens, entropy_grad):
    """Today's path: whole logits, the entropy a constant to autodiff unless entropy_grad."""
    logits = qwen2.lm_head(cfg, params, h)
    return token_logprobs(logits, tokens), token_entropy(logits if entropy_grad else jax.lax.stop_gradient(logits))


def _rel(x, y):
    return float(jnp.linalg.norm((x - y).astype(jnp.float32)) / (jnp.linalg.norm(y.astype(jnp.float32)) + 1e-30))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_equals_whole_logits(tied, dtype, entropy_grad):
    """Values and gradients w.r.t. the hidden state, the final norm and the head weights (embedding or lm_head).
    Chunk 3 of the 10 predicting positions leaves a padded last chunk (tied); chunk 5 divides them (untied)."""
    cfg, params, h, tokens, a, b = _head_case(tied, dtype)
    chunk = 3 if tied else 5

    def loss(stats_fn, params, h):
        logp, ent = stats_fn(params, h)
        return jnp.sum(a * logp + b * ent), (logp, ent)

    ref = jax.jit(
        jax.value_and_grad(
            lambda p, x: loss(lambda p, x: _whole(cfg, p, x, tokens, entropy_grad), p, x), argnums=(0, 1), has_aux=True
        )
    )
    new = jax.jit(
        jax.value_and_grad(
            lambda p, x: loss(lambda p, x: head.head_stats(cfg, p, x, tokens, entropy_grad, chunk), p, x),
            argnums=(0, 1),
            has_aux=True,
        )
    )
    (v0, (lp0, en0)), g0 = ref(params, h)
    (v1, (lp1, en1)), g1 = new(params, h)
    # Per position the same ops on the same logits; only the weight gradient's sum over chunks changes order.
    np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp0), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(en1), np.asarray(en0), rtol=1e-6, atol=1e-5)
    assert float(jnp.max(jnp.abs(lp1[:, 0]))) == 0.0 and float(jnp.max(jnp.abs(en1[:, 0]))) == 0.0
    # The value sums 30 positions each held to atol 1e-5 above: its bound is theirs, weighted (a fixed rtol on the
    # sum, 1e-6, is one float32 rounding on some CPUs and not on others; a dropped or doubled chunk moves it by ~1).
    assert abs(float(v1) - float(v0)) <= 1e-5 * float(jnp.sum(jnp.abs(a) + jnp.abs(b))), (float(v1), float(v0))
    # bf16: the gradient's sums over positions (the final norm's scale, the weight) are rounded to bf16 per chunk
    # instead of once; over these 30 positions the whole path's own bf16 sum is ~1% off its exact value.
    tol = 1e-5 if dtype == "float32" else 3e-2
    assert set(g1[0]) == set(params)
    for name in params:
        assert _rel(g1[0][name], g0[0][name]) < tol, name
    assert _rel(g1[1], g0[1]) < tol
    if not entropy_grad:  # the entropy is a constant: the gradient is the log-probs' alone
        g_lp = jax.grad(lambda x: jnp.sum(a * _whole(cfg, params, x, tokens, False)[0]))(h)
        assert _rel(g1[1], g_lp) < tol


def _flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def test_entropy_without_gradient_adds_nothing_to_the_backward():
    """entropy_grad=False: the gradient program of log-probs plus entropy costs what the log-probs' alone does;
    with the entropy's gradient it costs more (so the count sees the entropy's backward)."""
    cfg, params, h, tokens, a, b = _head_case(True, "float32")

    def grad_of(entropy_grad, with_entropy):
        def f(p, x):
            st = head.head_stats(cfg, p, x, tokens, entropy_grad, 3)
            return jnp.sum(a * st.logp + (b * st.entropy if with_entropy else 0.0))

        return _flops(jax.grad(f, argnums=(0, 1)), params, h)

    logp_only = grad_of(False, False)
    assert grad_of(False, True) == pytest.approx(logp_only, rel=1e-3)
    assert grad_of(True, True) > 1.05 * logp_only  # +11% here: the entropy's elementwise backward over [B, c, V]


def test_next_token_nll_and_sft_loss_equal_whole_logits():
    """The SFT reads (log-prob, argmax hit) chunked equal the whole logits', and the SFT loss and its gradient equal
    today's (log_softmax of whole logits)."""
    cfg, params, h, tokens, _, _ = _head_case(False, "float32")
    logits = qwen2.lm_head(cfg, params, h)
    logp, hit = head.next_token_nll(cfg, params, h, tokens, chunk=3)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(token_logprobs(logits, tokens)), rtol=1e-6, atol=1e-5)
    want_hit = jnp.pad((jnp.argmax(logits[:, :-1], -1) == tokens[:, 1:]).astype(jnp.float32), ((0, 0), (1, 0)))
    np.testing.assert_array_equal(np.asarray(hit), np.asarray(want_hit))

    model = ModelConfig(**{**NARROW_MODEL, "num_layers": 1})  # the head is what differs: depth adds compile time only
    p = qwen2.init_params(model, jax.random.key(1), std=0.3)
    k = jax.random.split(jax.random.key(2), 2)
    batch = {
        "tokens": jax.random.randint(k[0], (4, 12), 0, 100),
        "attention_mask": jnp.ones((4, 12), jnp.int32).at[0, :3].set(0),
        "loss_mask": (jax.random.uniform(k[1], (4, 12)) > 0.3).astype(jnp.int32),
    }
    whole = jax.jit(plain_value_and_grad(lambda p: next_token_loss(model, p, batch)))
    chunked_cfg = dataclasses.replace(model, logits_chunk=4)
    chunked = jax.jit(plain_value_and_grad(lambda p: next_token_loss(chunked_cfg, p, batch)))
    (l0, m0, _), g0 = whole(p)
    (l1, m1, _), g1 = chunked(p)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    assert float(m1["sft/token_acc"]) == float(m0["sft/token_acc"])
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert _rel(x, y) < 1e-5


def _grpo_cfg(mesh: dict, chunk: int):
    return load_config(
        data={
            "model": {**NARROW_MODEL, "logits_chunk": chunk},
            "mesh": mesh,
            "grpo": {"kl_coef": 0.0, "entropy_coeff": 0.01},
            "sampler": {"n": 4},
            "fast": {"pp_size": 4},
            "anchor": {"enabled": False},
            "train": {"prompts_per_step": 4, "prompts_per_update": 4, "max_prompt_len": 6},
        }
    )


def test_grpo_loss_gradient_through_pipe_forward_chunked_equals_whole():
    """The GRPO loss (with an entropy bonus) and its gradient through parallel/pipeline.forward: chunked (4
    positions of 11: a padded last chunk) equal the whole logits', unstaged and staged (data 2 x stage 4)."""
    batch, _ = narrow_batch()
    cfg = _grpo_cfg({"data": 8}, 0)
    params = qwen2.init_params(cfg.model, jax.random.key(0), std=0.3)
    batch = dict(batch, old_logp=jnp.zeros_like(batch["response_mask"]))
    cs = circuit_state()

    def value_grad(run_cfg, pipeline=None):
        loss = make_grpo_loss(run_cfg.model, run_cfg.grpo, 6, pipeline=pipeline)
        (v, m, _), g = jax.jit(plain_value_and_grad(lambda p: loss(p, batch, cs)))(params)
        return v, m, g

    v0, m0, g0 = value_grad(cfg)
    chunked = _grpo_cfg({"data": 8}, 4)
    staged = _grpo_cfg({"data": 2, "stage": 4}, 4)
    runs = {
        "unstaged": value_grad(chunked),
        "staged": value_grad(staged, make_pipeline(staged, staged.model, pmesh.make_mesh(staged.mesh))),
    }
    for name, (v, m, g) in runs.items():
        np.testing.assert_allclose(float(v), float(v0), rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(float(m["policy/entropy"]), float(m0["policy/entropy"]), rtol=1e-5, err_msg=name)
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            assert _rel(x, y) < 1e-5, name


def test_staged_chunked_head_keeps_no_weight_per_tick():
    """The staged forward's residuals for the backward (data 2 x stage 4, 4 microbatches: 7 ticks) hold no copy of
    the head weight per tick: a checkpointed chunk inside the last stage's `cond` inside the tick scan made autodiff
    stack it ([7, V, H]), 11 x 0.93 GB at Qwen2.5-1.5B's stage 8."""
    cfg = _grpo_cfg({"data": 2, "stage": 4}, 4)
    model = dataclasses.replace(cfg.model, vocab_size=997)  # a size no other array has
    params = qwen2.init_params(model, jax.random.key(0))
    pl = pipe.Pipeline(model, pmesh.make_mesh(cfg.mesh), 4)
    batch, _ = narrow_batch()

    def logp_sum(p):
        st, _ = pipe.forward(model, p, batch["tokens"], batch["attention_mask"], pipeline=pl)
        return jnp.sum(st.logp)

    text = str(jax.make_jaxpr(lambda p: jax.vjp(logp_sum, p))(params))
    stacked = re.findall(r"\w+\[\d+,(?:997,16|16,997)\]", text)
    assert not stacked, sorted(set(stacked))
    assert re.search(r"\w+\[997,16\]", text)  # the weight itself is there (the pattern can match)


def test_anchor_loss_chunked_equals_whole():
    """The anchor's dense pass (anchor/loss.py, through parallel/pipeline.forward) with an entropy bonus: loss and
    gradient chunked equal the whole logits'."""
    from twocircuit_jax.anchor.loss import anchor_loss

    batch, _ = narrow_batch()
    cfg = _grpo_cfg({"data": 8}, 0)
    one = dataclasses.replace(cfg.model, num_layers=1)  # the head is what differs: depth adds compile time only
    params = qwen2.init_params(one, jax.random.key(0), std=0.3)

    def value_grad(chunk):
        model = dataclasses.replace(one, logits_chunk=chunk)
        f = plain_value_and_grad(lambda p: anchor_loss(model, cfg.grpo, 6, p, batch))
        (v, m, _), g = jax.jit(f)(params)
        return v, m, g

    v0, m0, g0 = value_grad(0)
    v1, m1, g1 = value_grad(4)
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    np.testing.assert_allclose(float(m1["anchor/entropy"]), float(m0["anchor/entropy"]), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert _rel(x, y) < 1e-5


def test_logits_chunk_config(tmp_path):
    """Whole logits at 0 and when one chunk covers the predicting positions (the default 512 at every tiny config);
    a negative chunk is refused naming the field; beside a base_model the run's chunk applies."""
    from twocircuit_jax.model.hf_io import save_hf
    from twocircuit_jax.train.setup import load_model

    model = load_config(data={}).model
    assert model.logits_chunk == 512 and not head.chunks_logits(model, 513) and head.chunks_logits(model, 514)
    assert not head.chunks_logits(dataclasses.replace(model, logits_chunk=0), 4096)
    assert head.chunks_logits(dataclasses.replace(model, logits_chunk=4), 12)
    assert not head.chunks_logits(dataclasses.replace(model, logits_chunk=11), 12)
    with pytest.raises(ConfigError, match="model.logits_chunk: got -1"):
        _grpo_cfg({"data": 8}, -1)
    mcfg = ModelConfig(hidden_size=32, num_layers=2, head_dim=16, intermediate_size=64)
    path = save_hf(mcfg, jax.device_get(qwen2.init_params(mcfg, jax.random.key(0))), str(tmp_path / "base"))
    loaded, _ = load_model(load_config(data={"base_model": path, "model": {"logits_chunk": 7}}), 0)
    assert loaded.logits_chunk == 7


# Qwen2.5-1.5B's head at one 4,096-token sequence (prompt 1,024 + response 3,072), bf16 compute, fp32 weights.
BIG_T, BIG_H, BIG_V = 4096, 1536, 151936
WHOLE_F32 = BIG_T * BIG_V * 4  # one [T, V] fp32 array: 2.49 GB


def _head_temp(T, chunk, entropy_grad=False, shardings=None):
    """Temporaries (bytes) of the compiled forward+backward of the head at the big shapes, from shapes only."""
    cfg = ModelConfig(vocab_size=BIG_V, hidden_size=BIG_H, compute_dtype="bfloat16")
    args = (
        jax.ShapeDtypeStruct((BIG_V, BIG_H), jnp.float32),
        jax.ShapeDtypeStruct((BIG_H,), jnp.float32),
        jax.ShapeDtypeStruct((1, T, BIG_H), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, T), jnp.int32),
    )

    def f(embed, norm, h, tok):
        st = head.head_stats(cfg, {"embed": embed, "final_norm": norm}, h, tok, entropy_grad, chunk)
        return jnp.sum(st.logp) + 0.01 * jnp.sum(st.entropy)

    g = jax.grad(f, argnums=(0, 1, 2))
    jitted = jax.jit(g) if shardings is None else jax.jit(g, in_shardings=shardings, out_shardings=shardings[:3])
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_temporaries_do_not_grow_with_the_sequence(entropy_grad):
    """XLA:CPU, Qwen2.5-1.5B's head: the whole path's temporaries grow by more than one [T/2, V] fp32 array from
    T/2 to T (the logits autodiff keeps); the chunked path's (chunk 512) by less than 2% of one, and they are at least
    one whole [T, V] fp32 array below the whole path's. (XLA:CPU also holds fp32 copies of the bf16-cast weight for
    its dots, ~3 x 0.93 GB, in the chunked loop: the absolute bound is the TPU test's.)"""
    half = WHOLE_F32 // 2
    whole = _head_temp(BIG_T, 0, entropy_grad)
    assert whole - _head_temp(BIG_T // 2, 0, entropy_grad) > half
    chunked = _head_temp(BIG_T, 512, entropy_grad)
    assert chunked - _head_temp(BIG_T // 2, 512, entropy_grad) < 0.02 * half
    assert chunked < whole - WHOLE_F32


@pytest.mark.tpu_compile
def test_chunked_head_temporaries_on_tpu(monkeypatch):
    """The TPU compiler (a compile-only v5p chip, libtpu), Qwen2.5-1.5B's head at T = 4,096: the whole path holds
    more than one [T, V] fp32 array of temporaries, the chunked one (512) less than the bf16 copy of the weight and
    4 chunks of fp32 logits."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on this box may hold libtpu's lock
    devices = topologies.get_topology_desc(
        platform="tpu", topology_name="v5p:2x2x1", chips_per_host_bounds=(2, 2, 1), num_slices=1
    ).devices
    one = NamedSharding(Mesh(devices[:1], ("x",)), P())
    whole = _head_temp(BIG_T, 0, shardings=(one,) * 4)
    assert whole > WHOLE_F32
    weight_bf16, chunk_f32 = BIG_V * BIG_H * 2, 512 * BIG_V * 4
    for entropy_grad in (False, True):
        assert _head_temp(BIG_T, 512, entropy_grad, shardings=(one,) * 4) < weight_bf16 + 4 * chunk_f32
