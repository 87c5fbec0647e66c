"""A GRPO run, built: everything `GRPOTrainer` reads and never replaces while it trains, as one frozen object.

`assemble(cfg, ...)` builds it in the order the pieces depend on each other: the run folder's checkpoints and the
guard (whose mitigations in force, on a resume, shape everything compiled after), the tokenizer and the collector
with its problems, the model and its mesh, the optimizer and the state shardings, the frozen reference policy, the
circuits and every program (step/programs.py, the builder the shapes-only tools share). It returns the built run
with the train state and circuit state of tick 1, which the trainer owns from then on (both are donated every tick).
`start_sampler` adds the rollout engine and the evaluator once the trainer knows the weights it starts from (a
resume restores them first); `rebuilt` gives the run under a guard mitigation's config (new circuits and programs).

The objects held here are handles: the host objects among them (codec, anchor, collector, guard, health, the
step-ahead rollouts, the sampler) change through their own methods, and the dataclass's fields are never
reassigned: a different run is a new BuiltRun (`dataclasses.replace`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.sections import SamplingConfig
from twocircuit_jax.metrics.health import HealthMonitor
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.parallel.distributed import is_primary
from twocircuit_jax.parallel.host import to_global
from twocircuit_jax.step.programs import Programs, build_circuits, build_programs
from twocircuit_jax.step.train_step import init_state, make_optimizer, reference_copy, state_shardings
from twocircuit_jax.train.checkpoint import CheckpointManager
from twocircuit_jax.train.collect import make_collector
from twocircuit_jax.train.evaluate import heldout_problems
from twocircuit_jax.train.guard import Guard, apply_mitigations
from twocircuit_jax.train.resume_config import check_resume_config
from twocircuit_jax.train.rollout_ahead import RolloutAhead
from twocircuit_jax.train.setup import check_vocab, enable_compile_cache, load_model, load_run_tokenizer, make_sampler


def step_seed(seed: int, gs: int, salt: int = 0) -> int:
    """Every random choice of step gs is a function of (train.seed, gs): a resumed run repeats an uninterrupted one."""
    return (seed * 1_000_003 + gs * 7_919 + salt) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class BuiltRun:
    cfg: Any  # RunConfig in force: the user's with the guard's mitigations applied
    user_cfg: Any  # RunConfig as given (config.yaml and the checkpoints' meta hold this one)
    run_dir: str  # absolute (orbax wants absolute paths)
    ckpt: CheckpointManager  # run_dir/checkpoints
    guard: Guard | None  # guard.enabled
    health: HealthMonitor
    tokenizer: Any
    task: Any  # the task or the environment family: where the problems come from
    collector: Any  # train/collect.py SingleTurn or envs/collector.py MultiTurn
    train_problems: list
    eval_problems: list
    rollout_sampling: SamplingConfig  # the unmodified policy: temperature 1, no truncation, the run's cap
    model_cfg: Any
    mesh: Any
    optimizer: Any
    state_sh: Any  # TrainState of shardings
    ref_params: Any  # the frozen reference policy, in the compute dtype
    ahead: RolloutAhead | None  # train.async_rollouts: step gs+1's rollouts, generated during step gs
    pipeline: Any  # parallel.pipeline.Pipeline (mesh.stage > 1) or None
    fast: Any  # fast.circuit.FastCircuit, or None when both codecs are off
    anchor: Any  # anchor.circuit.AnchorCircuit, or None
    cs_sh: Any  # CircuitState of shardings (one fixed tree: the step compiles once)
    programs: Programs  # every jitted program; `programs.fused_old_pass` says where ℓ_old comes from
    sampler: Any = None  # the rollout engine (start_sampler)
    evaluator: Any = None  # held-out evaluation with the sampler (start_sampler)

    @property
    def max_new(self) -> int:
        return self.rollout_sampling.max_new_tokens

    def shard(self, batch):
        """Host rows (the same on every process) or device rows, split over the batch axes of the mesh."""
        return to_global(batch, pmesh.batch_shardings(batch, self.mesh))

    def problems_for(self, gs: int) -> list:
        """Step gs's problems in a deterministic order: a fresh permutation per pass over the train set."""
        t = self.cfg.train
        per_epoch = max(1, len(self.train_problems) // t.prompts_per_step)
        epoch, k = divmod(gs - 1, per_epoch)
        perm = np.random.default_rng(step_seed(t.seed, epoch, salt=17)).permutation(len(self.train_problems))
        return [self.train_problems[i] for i in perm[k * t.prompts_per_step : (k + 1) * t.prompts_per_step]]

    def probe_due(self, gs: int) -> bool:
        """The dense probe and the fidelity gauge run at this step (train.probe_every)."""
        every = self.cfg.train.probe_every
        return bool(every) and gs % every == 0

    def eval_due(self, gs: int) -> bool:
        """A held-out evaluation after step gs: every train.eval_every steps, and after the last with eval.at_end."""
        t = self.cfg.train
        return bool(t.eval_every and gs % t.eval_every == 0) or (gs == t.steps and self.cfg.eval.at_end)


def rollout_sampling(cfg) -> SamplingConfig:
    """Rollouts sample the unmodified policy (design §1): temperature 1, no truncation (SamplerConfig.check refuses
    any other sampler.sampling), to the run's generation cap."""
    return SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=cfg.sampler.sampling.max_new_tokens)


def _resume_step(ckpt) -> int | None:
    """The newest committed checkpoint whose meta.json reads (None: there is none)."""
    for step in reversed(ckpt.steps()):
        try:
            ckpt.read_meta(step)
            return step
        except (OSError, ValueError):  # a torn or corrupted meta.json (json's errors are ValueErrors)
            continue
    return None


def assemble(cfg, task, run_dir: str, *, resume: bool, allow_config_change: bool):
    """(BuiltRun without its sampler, train state, circuit state of tick 1) of config `cfg` (a RunConfig) in
    `run_dir`. `task`: one built from Python objects (train/trainer_inputs.py), else None."""
    ckpt = CheckpointManager(os.path.join(run_dir, "checkpoints"), keep_last=2)
    user_cfg = cfg  # as given; the guard's mitigations in force are applied on top (and saved in the meta)
    if resume:  # before any work: a config that changes the training is refused (exit 2) unless allowed
        check_resume_config(cfg, ckpt, run_dir, allow_config_change)
    guard = Guard(cfg.guard, run_dir, write=is_primary()) if cfg.guard.enabled else None
    if resume and guard and _resume_step(ckpt) is not None:  # the mitigations shape what gets compiled
        guard.load_state_dict(ckpt.read_meta(_resume_step(ckpt)).get("guard"))
        cfg = apply_mitigations(cfg, guard.applied)
    enable_compile_cache(cfg.train.compile_cache)  # before the first compile of this process
    if cfg.train.async_rollouts and jax.process_count() > 1:
        _check_async_many_processes(cfg)
    health = HealthMonitor(cfg.health)
    t, s = cfg.train, cfg.sampler
    tokenizer = load_run_tokenizer(cfg)
    sampling = rollout_sampling(cfg)
    collector, task = make_collector(cfg, tokenizer, sampling, task)  # the task or the environment
    train_problems = list(task.train_problems())
    if len(train_problems) < t.prompts_per_step:
        raise ConfigError(
            "train.prompts_per_step",
            f"got {t.prompts_per_step}; the task has only {len(train_problems)} training problems",
        )
    eval_problems = heldout_problems(task, t.eval_size)  # a short generated split: an error
    collector.check_prompts(train_problems, eval_problems)  # exit 2 naming a too-long row
    model_cfg, params = load_model(cfg, t.seed)
    model_cfg = check_vocab(model_cfg, tokenizer)
    mesh = pmesh.make_mesh(cfg.mesh)
    dp = pmesh.dp_size(mesh)
    if (t.prompts_per_update * s.n) % dp:
        raise ConfigError(
            "train.prompts_per_update",
            f"prompts_per_update*sampler.n = {t.prompts_per_update * s.n} rows must divide by "
            f"the data-parallel size {dp} (mesh.data*mesh.fsdp)",
        )
    optimizer = make_optimizer(cfg.optim)
    state = init_state(params, optimizer)
    state_sh = state_shardings(state, mesh)
    state = to_global(state, state_sh)
    # Frozen reference policy: a copy (the train state's buffers are donated every tick), in the compute dtype.
    ref_params = reference_copy(to_global(params, state_sh.params), model_cfg.compute_dtype)
    parts, cs = _circuits(cfg, model_cfg, mesh, optimizer, state_sh, state.params)
    ahead = None
    if t.async_rollouts:
        # The embedded sampler's programs may not run beside the trainer's on a multi-device XLA:CPU mesh.
        inline = s.backend == "jax" and dispatch.serial_dispatch() and mesh.size > 1
        ahead = RolloutAhead(threaded=not inline)
    built = BuiltRun(
        cfg=cfg, user_cfg=user_cfg, run_dir=run_dir, ckpt=ckpt, guard=guard, health=health, tokenizer=tokenizer,
        task=task, collector=collector, train_problems=train_problems, eval_problems=eval_problems,
        rollout_sampling=sampling, model_cfg=model_cfg, mesh=mesh, optimizer=optimizer, state_sh=state_sh,
        ref_params=ref_params, ahead=ahead, **parts,
    )  # fmt: skip
    return built, state, cs


def _check_async_many_processes(cfg) -> None:
    """`train.async_rollouts` with several trainer processes runs with an engine process on process 0
    (sampler/process_zero.py: its thread collects, every main thread receives the batch at the same point). What
    it cannot make correct is refused, with the reason."""
    n = jax.process_count()
    if cfg.sampler.backend == "jax":
        # The embedded sampler's generation is a JAX program over every process's devices: dispatched from a
        # background thread, it would interleave with the main thread's programs in a different order on each
        # process.
        raise ConfigError(
            "train.async_rollouts",
            f"1 with sampler.backend: jax runs with one trainer process; this run has {n} (use sampler.backend: "
            "vllm, whose engine process 0 drives, or train.async_rollouts: 0)",
        )
    if cfg.env.enabled:
        # Process 0's thread plays the episodes alone: the other processes' environments would not advance, and a
        # step collected in the main thread after a rollback would start them from other states.
        raise ConfigError(
            "train.async_rollouts",
            f"1 with an environment (the env section) runs with one trainer process; this run has {n} "
            "(set train.async_rollouts: 0)",
        )


def _circuits(cfg, model_cfg, mesh, optimizer, state_sh, params):
    """({pipeline, codec, anchor, cs_sh, programs} of `cfg`, fresh circuit state): the fast circuit and the anchor
    when the config turns them on (None = absent, not merely idle), every circuit-state field existing from tick 1
    so the step compiles once, and every program built on them (step/programs.py)."""
    c = build_circuits(cfg, model_cfg, mesh, params)
    programs = build_programs(cfg, model_cfg, mesh, optimizer, state_sh, c)
    return dict(pipeline=c.pipeline, fast=c.fast, anchor=c.anchor, cs_sh=c.cs_sh, programs=programs), c.cs


def rebuilt(built: BuiltRun, cfg, params):
    """(built run, fresh circuit state) under a guard mitigation's config: new circuits (fresh host state, which the
    rollback's checkpoint then restores) and programs; the collector samples to the new cap. The sampler stays: a
    new cap needs `start_sampler` too."""
    sampling = rollout_sampling(cfg)
    built.collector.set_config(cfg, sampling)
    parts, cs = _circuits(cfg, built.model_cfg, built.mesh, built.optimizer, built.state_sh, params)
    return dataclasses.replace(built, cfg=cfg, rollout_sampling=sampling, **parts), cs


def start_sampler(built: BuiltRun, params, version: int) -> BuiltRun:
    """The built run with its rollout engine holding `params` as weight `version`, and the evaluator on it."""
    cfg = built.cfg
    sampler = make_sampler(cfg, built.model_cfg, params, built.tokenizer, built.run_dir)
    try:
        sampler.update_weights(params, version)
        evaluator = built.collector.evaluator(built.eval_problems, greedy=cfg.train.eval_greedy)
    except BaseException:
        sampler.close()
        raise
    return dataclasses.replace(built, sampler=sampler, evaluator=evaluator)
