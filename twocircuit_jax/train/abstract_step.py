"""One tick's GRPO train step built from shapes alone: no weights are allocated and nothing runs.

What ahead-of-time tools need (scripts/comm_bytes.py compiles it to count collective bytes; the accelerator export
tests lower it for CUDA and TPU): the loop's own builder (`build_train_step`: the same loss, gradient codec,
shardings and donation as a training run) fed with ShapeDtypeStructs. `lowering_platform` builds the fast
circuit's kernels for that accelerator from a host with another backend (FastCircuit's argument): the result may
then be lowered or exported for it, never run here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class AbstractStep(NamedTuple):
    jitted: Any  # the jitted train step (dispatch.Jitted); `.wrapped` is the plain jax.jit object for jax.export
    args: tuple  # (state, circuit state, batch) as ShapeDtypeStructs
    circuit: Any  # the FastCircuit, or None when both codecs are off
    params: Any  # parameter shapes
    param_shardings: Any
    mesh: Any


def batch_shapes(cfg) -> dict:
    """The mini-batch the train step consumes: [B, T] rows of B = mini_batch * n samples."""
    t, s = cfg.train, cfg.sampler
    B, T = t.mini_batch * s.n, t.max_prompt_len + s.sampling.max_new_tokens
    f = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    b = {
        "tokens": f((B, T), jnp.int32),
        "attention_mask": f((B, T), jnp.int32),
        "response_mask": f((B, T), jnp.float32),
        "sampler_logp": f((B, T), jnp.float32),
        "advantages": f((B,), jnp.float32),
        "sample_id": f((B,), jnp.int32),
        "old_logp": f((B, T), jnp.float32),
    }
    if cfg.grpo.kl_coef > 0:
        b["ref_logp"] = f((B, T), jnp.float32)
    return b


def abstract_train_step(cfg, devices, *, lowering_platform: str | None = None) -> AbstractStep:
    from twocircuit_jax.fast.circuit import FastCircuit
    from twocircuit_jax.model.qwen2 import init_params
    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.train.circuit_state import CircuitState, init_clock
    from twocircuit_jax.train.grpo_step import make_grpo_loss
    from twocircuit_jax.train.setup import make_pipeline
    from twocircuit_jax.train.step import build_train_step, init_state, make_optimizer, state_shardings

    model_cfg = cfg.model
    mesh = pmesh.make_mesh(cfg.mesh, devices)
    opt = make_optimizer(cfg.optim)
    params = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    state = jax.eval_shape(lambda p: init_state(p, opt), params)
    state_sh = state_shardings(state, mesh)
    on = cfg.fast.codec_type != "none" or cfg.fast.grad_codec_type != "none"
    circuit = FastCircuit(cfg, model_cfg, mesh, lowering_platform=lowering_platform) if on else None
    # The circuit state from shapes alone (the fast circuit's fields; the merger adds no collective: M is
    # replicated and rewrites an already-reduced gradient elementwise).
    cs = CircuitState(jax.eval_shape(init_clock), None, None, None, None)
    if circuit:
        cs = cs._replace(
            codec=jax.eval_shape(circuit.init_codec_state), grad=jax.eval_shape(circuit.init_grad_state, params)
        )
    act_codec = circuit if (circuit and circuit.has_activation_codec) else None
    pipeline = make_pipeline(cfg, model_cfg, mesh) if mesh.shape["stage"] > 1 else None
    loss_fn = make_grpo_loss(model_cfg, cfg.grpo, cfg.sampler.sampling.max_new_tokens, act_codec, pipeline)
    grad_fn = circuit.grad_fn(state_sh.params) if circuit else None
    batch = batch_shapes(cfg)
    rep = pmesh.replicated(mesh)
    # from shapes alone every input needs an explicit sharding; PowerSGD's error memory lives split over dp
    cs_sh = jax.tree.map(lambda _: rep, cs)
    if circuit:
        cs_sh = cs_sh._replace(grad=circuit.grad_state_shardings(cs.grad))
    jitted = build_train_step(
        loss_fn,
        opt,
        state_sh,
        mesh,
        circuit_sharding=cs_sh,
        grad_fn=grad_fn,
        absorb_aux=circuit.absorb_aux if circuit else None,
        skip_nonfinite=cfg.train.skip_nonfinite,
        batch_sharding=pmesh.batch_shardings(batch, mesh),
    )
    return AbstractStep(jitted, (state, cs, batch), circuit, params, state_sh.params, mesh)
