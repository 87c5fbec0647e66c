"""Every program the GRPO trainer jits, assembled in one place from (config, mesh, circuits).

The loop (train/built_run.py `assemble`, `rebuilt`) and the shapes-only tools (step/abstract_step.py:
scripts/comm_bytes.py, the accelerator export tests, the plan) call the same two functions, so what a tool compiles
from shapes is the program a run executes, not a look-alike:

  build_circuits(cfg, model_cfg, mesh, params)   the staged forward, the fast circuit, the anchor, and the circuit
                                                 state with its shardings (arrays; ShapeDtypeStructs with
                                                 `abstract=True`, nothing allocated)
  build_programs(cfg, model_cfg, mesh, optimizer, state_sh, circuits)
                                                 the loss and every jitted program: the train step (two programs,
                                                 `PhasedTrainStep`, when the gradient codec has a warm-up; with the fused
                                                 ℓ_old diagnostics when the step's one forward is the old pass, the
                                                 replica gather under a gradient codec, the anchor's merger), the
                                                 ℓ_old, ℓ_ref, dense and anchor ℓ_ref^dense passes, the diagnostics,
                                                 the fidelity probe, and the anchor's fire (jitted by the anchor)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.metrics.probe import dense_probe_sums, make_fidelity_fn
from twocircuit_jax.names import DENSE, OLD, REF
from twocircuit_jax.parallel import dispatch, mesh as pmesh, micro_batch as accumulate
from twocircuit_jax.parallel.mesh_context import under
from twocircuit_jax.step.circuit_state import CircuitState, init_clock
from twocircuit_jax.step.grpo_step import make_diagnostics_fn, make_grpo_loss
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.step.train_step import build_train_step, default_grad_fn


class Circuits(NamedTuple):
    pipeline: Any  # parallel.pipeline.Pipeline (mesh.stage > 1) or None
    fast: Any  # fast.circuit.FastCircuit, or None when both codecs are off
    anchor: Any  # anchor.circuit.AnchorCircuit, or None when the anchor is off
    cs: CircuitState  # the circuit state of tick 1: arrays, or ShapeDtypeStructs when built from shapes
    cs_sh: CircuitState  # its shardings (one fixed tree: the step compiles once)


def build_circuits(cfg, model_cfg, mesh, params, *, abstract: bool = False, lowering_platform=None) -> Circuits:
    """The circuits the config turns on (None = absent, not merely idle) and the circuit state with its shardings:
    every field exists from tick 1. `params` are the placed parameters, or with `abstract` ShapeDtypeStructs that
    carry their shardings (the anchor reads them); the state is then shapes only (jax.eval_shape)."""
    make = jax.eval_shape if abstract else (lambda f, *a: f(*a))
    codec_state = grad_state = merger = moments = None
    pipeline = make_pipeline(cfg, model_cfg, mesh) if mesh.shape["stage"] > 1 else None
    codec = anchor = None
    if cfg.fast.codec_type != "none" or cfg.fast.grad_codec_type != "none":
        from twocircuit_jax.fast.circuit import FastCircuit

        codec = FastCircuit(cfg, model_cfg, mesh, lowering_platform=lowering_platform)
        codec_state, grad_state = make(codec.init_codec_state), make(codec.init_grad_state, params)
    if cfg.anchor.enabled:
        from twocircuit_jax.anchor.circuit import AnchorCircuit

        sketcher = codec.basis_sketcher if (codec and cfg.anchor_owns_q) else None
        anchor = AnchorCircuit(cfg, model_cfg, params, sketcher=sketcher, pipeline=pipeline)
        merger, moments = make(anchor.init_merger_state), make(anchor.init_moments)
    clock = make(init_clock)
    cs = CircuitState(clock, codec_state, grad_state, merger, moments)
    rep = pmesh.replicated(mesh)
    replicate = lambda tree: jax.tree.map(lambda _: rep, tree)  # noqa: E731
    cs_sh = CircuitState(
        replicate(clock),
        replicate(codec_state),
        codec.grad_state_shardings(grad_state) if codec else None,
        anchor.merger_sh if anchor else None,  # M, δ sharded like their params (anchor/merger.py)
        anchor.mom_sh if anchor else None,
    )
    return Circuits(pipeline, codec, anchor, cs, cs_sh)


def fuses_old_pass(cfg, codec, pipeline) -> bool:
    """Whether the train forward is the old-log-prob pass (the loss computes ℓ_old, the TIS weights and the step's
    diagnostics itself; no separate ℓ_old program runs). One tick per step (one mini-batch, one epoch: a second
    epoch's ℓ_old is not its own forward's), single-turn, not pipelined, no probe. Under an activation codec too when
    ℓ_old takes the codec's view: the train view is the same (the codec keys on the step and the rows, not on the
    path). Under a gradient codec the loss runs per data replica: the diagnostics gather their inputs over the batch
    axes (grpo_step.make_grpo_loss, rows_over). With the anchor too: a fire reads neither ℓ_old nor the live weights
    and writes no weight, so the tick's forward sees what a pass would. Off with `train.fused_old_pass: false`."""
    one_view = codec is None or not codec.has_activation_codec or codec.applies(OLD)
    return (
        cfg.train.fused_old_pass
        and cfg.ticks_per_step == 1
        and cfg.train.ppo_epochs == 1
        and one_view
        and pipeline is None
        and not cfg.train.probe_every
        and not cfg.env.enabled
        and not cfg.train.micro_batch_per_device  # the fused diagnostics are whole-batch: not over micro-batches
    )


def anchor_ref_own_pass(cfg, codec) -> bool:
    """Whether the anchor's ℓ_ref^dense (its KL, in the dense view) is a reference forward of its own
    (`Programs.logp_anchor_ref`): with a KL term, when the activation codec acts on the reference pass; otherwise
    ℓ_ref is dense already and the anchor reads it."""
    return cfg.grpo.kl_coef > 0 and codec is not None and codec.applies(REF)


class StagedComm:
    """A staged run's train-step collectives by part (fast/hlo_bytes.py `step_comm`: boundary messages, stage exit,
    gradient reduction), read once a run from the compiled program before its first call and logged every step as
    `comm/hlo/*`. Lives with the programs: a rebuilt run (a guard mitigation) has new programs and reads it again."""

    def __init__(self, replicas: int, ticks: int):
        self.replicas, self.ticks = replicas, ticks  # data replicas; ticks a step (mini-batches x epochs)
        self.parts: dict | None = None

    def measure(self, train_step, args) -> None:
        """Read the collectives from the compiled train step for `args` (state, circuit state, mini-batch), once."""
        if self.parts is None:
            from twocircuit_jax.fast.hlo_bytes import step_comm

            self.parts = step_comm(train_step, args, self.replicas, self.ticks)


class PhasedTrainStep:
    """The train step of a gradient codec with a warm-up (PowerSGD's `start_after`): two programs, the warm-up's
    plain mean and the steady compressed reduction, called like one. A single program would hold both reductions
    in a `lax.cond`, and XLA keeps both branches' buffers: at Qwen2.5-1.5B on a v5e-8 that is 8.72 GiB of
    temporaries against 7.66, the difference between fitting and not (docs/scale.md). Each program compiles on its
    first call, so a run that resumes past the warm-up never compiles the plain one. The choice reads the codec's
    reduce count from the device (a host sync before the call) during the warm-up only: the count only grows, so
    once the steady program has run it runs for good."""

    def __init__(self, warmup, steady, warmup_reduces: int):
        self.warmup, self.steady, self.warmup_reduces = warmup, steady, int(warmup_reduces)
        self._steady = False

    def program_for(self, cs):
        """The program a call with circuit state `cs` runs."""
        if not self._steady:
            self._steady = int(cs.grad.step) >= self.warmup_reduces
        return self.steady if self._steady else self.warmup

    def __call__(self, state, cs, batch):
        return self.program_for(cs)(state, cs, batch)

    def lower(self, state, cs, batch):
        return self.program_for(cs).lower(state, cs, batch)


class Programs(NamedTuple):
    fused_old_pass: bool  # the train step's forward is the old-log-prob pass (fuses_old_pass)
    loss_fn: Any  # the GRPO loss the train step differentiates
    train_step: Any  # (state, cs, mini-batch) -> (state, cs, metrics), state and cs donated; a PhasedTrainStep
    # when the gradient codec has a warm-up
    diagnostics: Any  # (ℓ_old, ℓ_sampler, response mask, full mask, truncated, entropy) -> (TIS weights, metrics)
    logp_old: Any  # (params, rows, cs) -> (ℓ_old, entropy, codec aux): the codec's view when it acts on ℓ_old
    logp_ref: Any  # (ref params, rows, cs) -> ...: ℓ_ref in the codec's view when it acts on the reference
    logp_dense: Any  # the probe's passes, codecs off everywhere
    logp_anchor_ref: Any  # the anchor's ℓ_ref^dense on the mini-batches it keeps: same forward, its own program
    probe_sums: Any  # the dense probe's token means (metrics/probe.py), one program
    fidelity: Any  # (params, ref params, mini-batch, cs) -> fidelity/* scalars, or None without the probe
    anchor_fire: Any  # the anchor's fire (anchor/circuit.py jits it), or None without the anchor
    staged_comm: Any  # StagedComm of a staged run (mesh.stage > 1), else None


def build_programs(cfg, model_cfg, mesh, optimizer, state_sh, circuits: Circuits):
    """Every program of a run; nothing is compiled until first called (or lowered)."""
    pl, fc, anchor = circuits.pipeline, circuits.fast, circuits.anchor
    act = fc if (fc and fc.has_activation_codec) else None
    max_new = cfg.sampler.sampling.max_new_tokens
    fused_old_pass = fuses_old_pass(cfg, fc, pl)
    rows_over = fc.grad_axes if (fc and fc.grad_codec is not None) else None  # the gradient codec's manual axes
    mb = accumulate.check(cfg, pmesh.dp_size(mesh))  # train.micro_batch_per_device (ConfigError), 0 = one pass
    loss_fn = make_grpo_loss(model_cfg, cfg.grpo, max_new, act, pl, diagnose=fused_old_pass, rows_over=rows_over)
    grad_fn = fc.grad_fn(state_sh.params, micro_batch=mb) if fc else None
    grad_transform = anchor.grad_transform if anchor else None
    fidelity = None
    if cfg.train.probe_every:  # the fidelity gauge: the applied gradient against the dense step's, same batch
        fid = make_fidelity_fn(
            model_cfg,
            cfg.grpo,
            max_new,
            act,
            grad_fn(loss_fn) if grad_fn else default_grad_fn(loss_fn, micro_batch=mb, mesh=mesh),
            grad_transform,
            lambda: make_grpo_loss(model_cfg, cfg.grpo, max_new, None, pl),
            pipeline=pl,
            micro_batch=mb,
            mesh=mesh,
        )
        fidelity = dispatch.jit(under(mesh, fid))
    step_of = lambda grad_fn: build_train_step(  # noqa: E731
        loss_fn,
        optimizer,
        state_sh,
        mesh,
        circuit_sharding=circuits.cs_sh,
        grad_fn=grad_fn,
        absorb_aux=fc.absorb_aux if fc else None,
        grad_transform=grad_transform,
        skip_nonfinite=cfg.train.skip_nonfinite,
        micro_batch=mb,
    )
    warmup = fc.grad_codec.warmup_reduces if (fc and fc.grad_codec is not None) else 0
    if warmup > 0:  # the warm-up's plain mean and the compressed reduction as two programs (PhasedTrainStep)
        train_step = PhasedTrainStep(
            step_of(fc.grad_fn(state_sh.params, micro_batch=mb, phase="plain")),
            step_of(fc.grad_fn(state_sh.params, micro_batch=mb, phase="compressed")),
            warmup,
        )
    else:
        train_step = step_of(grad_fn)
    rows = dict(micro_batch=mb, mesh=mesh)  # the forward-only passes hold one micro-batch's activations too
    return Programs(
        fused_old_pass=fused_old_pass,
        loss_fn=loss_fn,
        train_step=train_step,
        diagnostics=dispatch.jit(make_diagnostics_fn(cfg.grpo)),
        logp_old=dispatch.jit(under(mesh, make_logp_fn(model_cfg, act, OLD, pl, **rows))),
        logp_ref=dispatch.jit(under(mesh, make_logp_fn(model_cfg, act, REF, pl, **rows))),
        logp_dense=dispatch.jit(under(mesh, make_logp_fn(model_cfg, None, DENSE, pl, **rows))),
        logp_anchor_ref=dispatch.jit(under(mesh, make_logp_fn(model_cfg, None, DENSE, pl, **rows))),
        probe_sums=dispatch.jit(dense_probe_sums, static_argnames="estimator"),
        fidelity=fidelity,
        anchor_fire=anchor.fire_program if anchor else None,
        staged_comm=StagedComm(pmesh.dp_size(mesh), cfg.ticks_per_step * cfg.train.ppo_epochs) if pl else None,
    )


def build_sft_step(model_cfg, optimizer, state_sh, mesh, batch_sharding):
    """(circuits, train step) of supervised fine-tuning (train/sft.py): the next-token loss, neither circuit (a
    clock the loss ignores), the batch split over the batch axes."""
    import functools

    from twocircuit_jax.step.circuit_state import dense_state
    from twocircuit_jax.step.sft_loss import next_token_loss

    cs = dense_state()
    cs_sh = jax.tree.map(lambda _: pmesh.replicated(mesh), cs)
    loss = functools.partial(next_token_loss, model_cfg)
    step = build_train_step(loss, optimizer, state_sh, mesh, circuit_sharding=cs_sh, batch_sharding=batch_sharding)
    return Circuits(None, None, None, cs, cs_sh), step


def make_pipeline(run_cfg, model_cfg, mesh):
    """The staged forward for mesh.stage > 1 (parallel/pipeline.py), with the run's shapes checked: equal stages of
    the (possibly loaded) model, and every forward's rows split into `train.pipeline_microbatches` parts that divide over the
    data-parallel replicas."""
    from twocircuit_jax.boundaries import codec_stage_mismatch
    from twocircuit_jax.parallel.mesh import dp_size
    from twocircuit_jax.parallel.pipeline import Pipeline

    S, L = mesh.shape["stage"], model_cfg.num_layers
    if L % S:
        raise ConfigError("mesh.stage", f"got {S}; must divide the model's {L} layers (equal stages)")
    f = run_cfg.fast
    problem = codec_stage_mismatch(L, f.pp_size, S) if f.codec_type != "none" else None
    if problem is not None:
        raise ConfigError("fast.pp_size", problem)
    pipeline = Pipeline(model_cfg, mesh, run_cfg.train.pipeline_microbatches)
    rows, M, dp = run_cfg.train.prompts_per_update * run_cfg.sampler.n, pipeline.microbatches, dp_size(mesh)
    if rows % (M * dp):
        raise ConfigError(
            "train.pipeline_microbatches",
            f"{M} microbatches (0 = mesh.stage) of a mini-batch's {rows} rows (train.prompts_per_update*sampler.n) must each "
            f"split over the {dp} data-parallel replicas: {rows} must divide by {M}*{dp}",
        )
    return pipeline
