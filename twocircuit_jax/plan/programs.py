"""The programs one GRPO step runs, built from shapes alone, and how often each runs per step.

`programs(cfg, devices, platform)` is the one place the plan learns what to compile: {name: (jitted, args)} with
ShapeDtypeStruct args. Today it is assembled from the pieces the loop and scripts/comm_bytes.py use:
  train_step     train/abstract_step.py (loss, gradient codec, shardings, donation of a real run); args
                 (state, circuit state, mini-batch): the plan reads the resident state from its first two
  logp_old       ℓ_old over the step's rows, its own forward unless the loop takes it from the train forward
                 (one tick per step, one epoch, not pipelined: train/loop.py `old_from_train`)
  logp_ref       ℓ_ref of the frozen reference weights (kl_coef > 0)
  anchor_fire    the anchor's dense forward/backward on a mini-batch (anchor/loss.py make_anchor_grad)
  anchor_ref     the anchor's dense ℓ_ref on the mini-batches it keeps, when the codec acts on the reference pass
What it does not hold yet: the anchor's gradient transform inside the train step (abstract_train_step builds the
step without it) and the diagnostics fused into the train forward; the programs differ from the loop's there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Usage(NamedTuple):
    runs: float  # calls per GRPO step
    rows: int  # sequences per call (global)
    backward: bool  # a gradient is taken (model flops 6N per token, else 2N)


def step_rows(cfg) -> dict:
    """What a log-prob pass reads over the whole step batch: [train_batch * n, T]."""
    t, s = cfg.train, cfg.sampler
    B, T = t.train_batch * s.n, t.max_prompt_len + s.sampling.max_new_tokens
    return {
        "tokens": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "attention_mask": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "sample_id": jax.ShapeDtypeStruct((B,), jnp.int32),
    }


def _old_from_train(cfg, circuit) -> bool:
    from twocircuit_jax.train.grpo_step import OLD

    one_view = circuit is None or not circuit.has_activation_codec or circuit.applies(OLD)
    return (
        cfg.ticks_per_step == 1
        and cfg.train.ppo_epochs == 1
        and one_view
        and cfg.mesh.stage == 1
        and not cfg.train.probe_every
        and not cfg.env.enabled
    )


def usage(cfg, names) -> dict:
    """{name: Usage} for the programs `programs` returned."""
    t, s = cfg.train, cfg.sampler
    ticks = cfg.ticks_per_step * t.ppo_epochs
    mini, step = t.mini_batch * s.n, t.train_batch * s.n
    fires = ticks / cfg.anchor.cadence if cfg.anchor.enabled else 0.0
    table = {
        "train_step": Usage(ticks, mini, True),
        "logp_old": Usage(1, step, False),
        "logp_ref": Usage(1, step, False),
        "anchor_fire": Usage(fires, mini, True),
        # the kept mini-batches: one per fire, and the retained one when the delay is not a multiple of the cadence
        "anchor_ref": Usage(fires * (1 if cfg.anchor.delay % cfg.anchor.cadence == 0 else 2), mini, False),
    }
    return {n: table[n] for n in names}


def programs(cfg, devices, platform: str) -> dict:
    """{name: (jitted, args)}: every program one GRPO step of `cfg` runs on `devices`, from shapes alone.
    `platform` ("tpu" or "cpu") is what the Pallas kernels are built for."""
    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.train.abstract_step import abstract_train_step, batch_shapes
    from twocircuit_jax.train.grpo_step import REF, make_logp_fn
    from twocircuit_jax.train.setup import make_pipeline

    step = abstract_train_step(cfg, devices, lowering_platform=platform if platform != "cpu" else None)
    state, cs, _ = step.args
    mesh, circuit = step.mesh, step.circuit
    out = {"train_step": (step.jitted, step.args)}
    rep = pmesh.replicated(mesh)
    cs_sh = jax.tree.map(lambda _: rep, cs)
    if circuit:
        cs_sh = cs_sh._replace(grad=circuit.grad_state_shardings(cs.grad))
    codec = circuit if (circuit and circuit.has_activation_codec) else None
    pl = make_pipeline(cfg, cfg.model, mesh) if mesh.shape["stage"] > 1 else None
    rows = step_rows(cfg)

    def logp(codec, tag, rows):
        fn = make_logp_fn(cfg.model, codec, tag, pl)
        sh = (step.param_shardings, pmesh.batch_shardings(rows, mesh), cs_sh)
        return jax.jit(fn, in_shardings=sh), (step.params, rows, cs)

    if not _old_from_train(cfg, circuit):
        from twocircuit_jax.train.grpo_step import OLD

        out["logp_old"] = logp(codec, OLD, rows)
    if cfg.grpo.kl_coef > 0:
        out["logp_ref"] = logp(codec, REF, rows)
    if cfg.anchor.enabled:
        from twocircuit_jax.anchor.loss import anchor_batch_keys, make_anchor_grad
        from twocircuit_jax.train.grpo_step import DENSE

        mb = batch_shapes(cfg)
        mb["ref_logp_dense"] = mb.get("ref_logp")
        batch = {k: mb[k] for k in anchor_batch_keys(cfg.grpo)}
        owns = circuit is not None and cfg.anchor_owns_q
        grad = make_anchor_grad(
            cfg.model, cfg.grpo, cfg.sampler.sampling.max_new_tokens, circuit.basis_sketcher if owns else None, pl
        )
        basis = cs.codec if owns else None
        basis_sh = jax.tree.map(lambda _: rep, basis) if owns else None
        fire = jax.jit(grad, in_shardings=(step.param_shardings, pmesh.batch_shardings(batch, mesh), basis_sh))
        out["anchor_fire"] = (fire, (step.params, batch, basis))
        if cfg.grpo.kl_coef > 0 and codec is not None and codec.applies(REF):
            out["anchor_ref"] = logp(None, DENSE, {k: mb[k] for k in ("tokens", "attention_mask", "sample_id")})
    del state
    return out
