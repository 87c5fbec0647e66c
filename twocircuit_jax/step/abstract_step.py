"""Every program of a GRPO run built from shapes alone: no weights are allocated and nothing runs.

What ahead-of-time tools need (scripts/comm_bytes.py compiles the train step to count collective bytes; the
accelerator export tests lower it for CUDA and TPU; the plan compiles them all): the loop's own builder
(step/programs.py: the same circuits, losses, gradient codec, shardings and donation as a training run) fed with
ShapeDtypeStructs that carry the shardings the loop's arrays have. `abstract_programs` gives each program the run
executes with its abstract arguments; `abstract_train_step` the train step alone. `lowering_platform` builds the
fast circuit's kernels for that accelerator from a host with another backend (FastCircuit's argument): the result
may then be lowered or exported for it, never run here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from twocircuit_jax.step.step_batch import StepBatch


class AbstractStep(NamedTuple):
    jitted: Any  # the jitted train step (dispatch.Jitted); `.wrapped` is the plain jax.jit object for jax.export
    args: tuple  # (state, circuit state, batch) as ShapeDtypeStructs with their shardings
    circuit: Any  # the FastCircuit, or None when both codecs are off
    params: Any  # parameter shapes
    param_shardings: Any
    mesh: Any


class Program(NamedTuple):
    jitted: Any  # dispatch.Jitted as the loop holds it
    args: tuple  # ShapeDtypeStructs with shardings, as the loop passes them
    kwargs: dict = {}  # static keyword arguments (probe_sums' estimator)

    def lower(self):
        return self.jitted.lower(*self.args, **self.kwargs)


class Assembly(NamedTuple):
    mesh: Any
    state: Any  # TrainState of ShapeDtypeStructs (with shardings)
    state_sh: Any
    circuits: Any  # programs.Circuits; its `cs` with shardings attached
    programs: Any  # programs.Programs
    batch: dict  # the train step's mini-batch as the loop feeds it
    step_rows: dict  # what a log-prob pass over the step's rollouts reads


def _with(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _rows(cfg) -> tuple[int, int]:
    """(rows of a GRPO step's batch, rows of a mini-batch): one row per sample (and per turn of an environment)."""
    t = cfg.train
    rows = t.prompts_per_step * cfg.sampler.n * (cfg.env.max_turns if cfg.env.enabled else 1)
    return rows, rows // cfg.ticks_per_step


def _packed(cfg, B: int) -> dict:
    """StepBatch.rows (step/step_batch.py) for B rows: the collector's row fields (train/rollout.py pack_rows) less
    the loss mask and `truncated` that the loop takes out, with the advantages."""
    T = cfg.train.max_prompt_len + cfg.sampler.sampling.max_new_tokens
    f = jax.ShapeDtypeStruct
    return {
        "tokens": f((B, T), jnp.int32),
        "attention_mask": f((B, T), jnp.int32),
        "response_mask": f((B, T), jnp.float32),
        "sampler_logp": f((B, T), jnp.float32),
        "sample_id": f((B,), jnp.int32),
        "advantages": f((B,), jnp.float32),
    }


def _step_batch(cfg, programs, B: int) -> StepBatch:
    """The StepBatch of B rows as the loop has it when the ticks start (train/step_phases.py): ℓ_ref with a KL term,
    and, without the fused ℓ_old path, ℓ_old and the weights of the separate pass."""
    rows = _packed(cfg, B)
    lp = rows["sampler_logp"]
    sb = StepBatch(rows, lp, jax.ShapeDtypeStruct((B,), jnp.bool_))
    if not programs.fused_old_pass:
        w, _ = jax.eval_shape(programs.diagnostics, lp, lp, lp, lp, sb.truncated, lp)
        sb = sb._replace(old_logp=lp, is_weight=w)
    if cfg.grpo.kl_coef > 0:
        sb = sb._replace(ref_logp=lp)
    return sb


def _seq_len(cfg) -> int:
    return cfg.train.max_prompt_len + cfg.sampler.sampling.max_new_tokens


def abstract_assembly(cfg, devices, *, lowering_platform: str | None = None) -> Assembly:
    """The run's circuits and programs on a mesh of `devices`, and the shapes of what the loop feeds them."""
    from twocircuit_jax.model.qwen2 import init_params
    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.step.programs import build_circuits, build_programs
    from twocircuit_jax.step.train_step import init_state, make_optimizer, state_shardings

    model_cfg = cfg.model
    if lowering_platform is not None and model_cfg.attention == "auto":
        # `auto` picks the attention for the backend that runs the program: here the one it is lowered for, not
        # this host's (the TPU flash kernel when planning a TPU run from a CPU machine).
        from twocircuit_jax.model.attention import resolve

        model_cfg = dataclasses.replace(model_cfg, attention=resolve(model_cfg, _seq_len(cfg), lowering_platform))
        cfg = dataclasses.replace(cfg, model=model_cfg)
    mesh = pmesh.make_mesh(cfg.mesh, devices)
    opt = make_optimizer(cfg.optim)
    params = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    state = jax.eval_shape(lambda p: init_state(p, opt), params)
    state_sh = state_shardings(state, mesh)
    state = _with(state, state_sh)
    circuits = build_circuits(cfg, model_cfg, mesh, state.params, abstract=True, lowering_platform=lowering_platform)
    circuits = circuits._replace(cs=_with(circuits.cs, circuits.cs_sh))
    programs = build_programs(cfg, model_cfg, mesh, opt, state_sh, circuits)
    step_rows, mini_rows = _rows(cfg)
    batch = _step_batch(cfg, programs, mini_rows).train_inputs(programs.fused_old_pass)
    passes = StepBatch(_packed(cfg, step_rows), None, None).pass_rows()
    place = lambda b: _with(b, pmesh.batch_shardings(b, mesh))  # noqa: E731
    return Assembly(mesh, state, state_sh, circuits, programs, place(batch), place(passes))


def _steady(train_step):
    """The program a run's ticks execute past a gradient codec's warm-up (step/programs.py PhasedTrainStep)."""
    from twocircuit_jax.step.programs import PhasedTrainStep

    return train_step.steady if isinstance(train_step, PhasedTrainStep) else train_step


def abstract_programs(cfg, devices, *, lowering_platform: str | None = None) -> dict[str, Program]:
    """{name: Program(jitted, args)} for every program a run of `cfg` executes (the loop's own objects):
    train_step always (past a gradient codec's warm-up; train_step_warmup, the warm-up's plain mean, when the
    codec has one); logp_old and diagnostics unless the train forward is the ℓ_old pass; logp_ref with a KL
    term; logp_dense, probe_sums and fidelity with the probe; anchor_fire with the anchor, and logp_anchor_ref
    when its dense ℓ_ref is a pass of its own (the codec acts on the reference pass)."""
    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.step.programs import PhasedTrainStep, anchor_ref_own_pass

    a = abstract_assembly(cfg, devices, lowering_platform=lowering_platform)
    p, c, cs, params = a.programs, a.circuits, a.circuits.cs, a.state.params
    from twocircuit_jax.step.train_step import reference_copy

    ref = reference_copy(params, cfg.model.compute_dtype)  # the loop's frozen copy (step/train_step.py)
    out = {"train_step": Program(_steady(p.train_step), (a.state, cs, a.batch))}
    if isinstance(p.train_step, PhasedTrainStep):  # the gradient codec's warm-up: a program of its own
        out["train_step_warmup"] = Program(p.train_step.warmup, (a.state, cs, a.batch))
    lp = a.step_rows["tokens"]
    full = jax.ShapeDtypeStruct(lp.shape, jnp.float32, sharding=lp.sharding)  # a [B, T] fp32 over the step's rows
    if not p.fused_old_pass:
        out["logp_old"] = Program(p.logp_old, (params, a.step_rows, cs))
        trunc = jax.ShapeDtypeStruct(lp.shape[:1], jnp.bool_, sharding=a.step_rows["sample_id"].sharding)
        out["diagnostics"] = Program(p.diagnostics, (full, full, full, full, trunc, full))
    if cfg.grpo.kl_coef > 0:
        out["logp_ref"] = Program(p.logp_ref, (ref, a.step_rows, cs))
    if p.fidelity is not None:
        out["logp_dense"] = Program(p.logp_dense, (ref, a.step_rows, cs))
        out["probe_sums"] = Program(p.probe_sums, (full,) * 6, {"estimator": cfg.grpo.kl_estimator})
        out["fidelity"] = Program(p.fidelity, (params, ref, a.batch, cs))
    if c.anchor is not None:
        from twocircuit_jax.anchor.circuit import fire_weights
        from twocircuit_jax.anchor.loss import anchor_batch_keys

        mini = {k: a.batch[k] for k in ("tokens", "attention_mask", "sample_id")}
        if anchor_ref_own_pass(cfg, c.fast):
            out["logp_anchor_ref"] = Program(p.logp_anchor_ref, (ref, mini, cs))
        fire = {**a.batch, "ref_logp_dense": a.batch["sampler_logp"]}
        fire = {k: fire[k] for k in anchor_batch_keys(cfg.grpo)}
        fire = _with(fire, pmesh.batch_shardings(fire, a.mesh))
        basis = cs.codec if c.anchor.owns_q else None
        carry = {"merger": cs.merger, "moments": cs.moments}
        out["anchor_fire"] = Program(p.anchor_fire, (fire_weights(params, cfg.model.compute_dtype), fire, carry, basis))
    return out


def abstract_train_step(cfg, devices, *, lowering_platform: str | None = None) -> AbstractStep:
    """The train step alone (Program `train_step` of `abstract_programs`: past a gradient codec's warm-up), with
    the fast circuit and the mesh."""
    a = abstract_assembly(cfg, devices, lowering_platform=lowering_platform)
    args = (a.state, a.circuits.cs, a.batch)
    return AbstractStep(
        _steady(a.programs.train_step), args, a.circuits.fast, a.state.params, a.state_sh.params, a.mesh
    )
