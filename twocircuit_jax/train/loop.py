"""The GRPO loop: rollout -> reward -> advantages -> old/ref log-probs -> ticks -> publish -> evaluate.

One GRPO step `gs` is one rollout batch; one tick is one optimizer update on one mini-batch (design §2). Every
random choice is a function of (train.seed, gs), so a resumed run repeats an uninterrupted one step for step.
The fast circuit plugs in as `codec` (fast/circuit.py), the anchor as `anchor` (anchor/circuit.py); both absent
means the dense trainer. Their array state is one pytree, the circuit state `cs` (train/circuit_state.py), which the
loop threads through the pure pieces: the jitted step `(state, cs, batch) -> (state, cs, metrics)`, the anchor's
fire and swap, the basis refresh at the end of a step.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.run import save_config
from twocircuit_jax.config.sections import SamplingConfig
from twocircuit_jax.fast.hlo_bytes import step_comm
from twocircuit_jax.metrics.gauges import length_slope, length_stats, to_floats
from twocircuit_jax.metrics.health import HealthMonitor
from twocircuit_jax.metrics.logger import MetricsLogger
from twocircuit_jax.metrics.mismatch import mismatch_by_turn
from twocircuit_jax.metrics.probe import dense_probe_metrics
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.parallel.distributed import is_primary
from twocircuit_jax.parallel.host import to_global, to_host
from twocircuit_jax.tasks import bounded
from twocircuit_jax.train import faults, rollout as ro
from twocircuit_jax.train.checkpoint import CheckpointManager
from twocircuit_jax.train.circuit_state import place, set_clock
from twocircuit_jax.train.collect import make_collector
from twocircuit_jax.train.evaluate import heldout_problems
from twocircuit_jax.train.grpo_step import OLD, REF
from twocircuit_jax.train.guard import Guard, apply_mitigations, mitigate
from twocircuit_jax.train.programs import build_circuits, build_programs
from twocircuit_jax.train.resume_config import check_resume_config
from twocircuit_jax.train.rollout_ahead import RolloutAhead
from twocircuit_jax.train.setup import (
    check_vocab,
    enable_compile_cache,
    load_model,
    load_run_tokenizer,
    make_sampler,
)
from twocircuit_jax.train.step import (
    init_state,
    learning_rate,
    make_optimizer,
    reference_copy,
    state_shardings,
)
from twocircuit_jax.train.timing import PhaseTimer
from twocircuit_jax.train.trainer_checkpoints import TrainerCheckpoints
from twocircuit_jax.train.trainer_inputs import as_config, python_task


def step_seed(seed: int, gs: int, salt: int = 0) -> int:
    return (seed * 1_000_003 + gs * 7_919 + salt) & 0x7FFFFFFF


def _logp_rows(batch: dict) -> dict:
    """What a log-prob pass reads: one input signature whatever else the step batch has gathered by then (one
    compilation per pass)."""
    return {k: batch[k] for k in ("tokens", "attention_mask", "sample_id") if k in batch}


class GRPOTrainer(TrainerCheckpoints):
    """GRPO on a task from the config, or on one's own reward functions and rows:

        trainer = GRPOTrainer(cfg, "runs/x", reward_fns=[f, g], train_dataset=rows, eval_dataset=held_out)
        trainer.run()            # or: metrics = trainer.step(), one GRPO step at a time

    `cfg` is a RunConfig, a dict of sections or a YAML path; `run_dir` defaults to runs/<cfg.name>. Reward
    functions are callables `(prompts, completions, **fields) -> list[float]` (tasks/python_task.py), weighted by
    `reward_weights`; datasets are iterables of dicts (a `datasets.Dataset` too) with the prompt field
    (`task.prompt_key`, default "prompt") and the fields the functions read."""

    FUSE_OLD_PASS = True  # one tick per step: ℓ_old from the train forward, no separate pass (False: always separate)

    def __init__(
        self,
        cfg,
        run_dir: str | None = None,
        *,
        reward_fns=None,
        reward_weights=None,
        train_dataset=None,
        eval_dataset=None,
        resume: bool = False,
        show_progress: bool = True,
        allow_config_change: bool = False,
    ):
        cfg = as_config(cfg)
        task = None
        if any(x is not None for x in (reward_fns, reward_weights, train_dataset, eval_dataset)):
            cfg, task = python_task(cfg, reward_fns, reward_weights, train_dataset, eval_dataset)
        run_dir = os.path.abspath(run_dir or os.path.join("runs", cfg.name))  # orbax wants absolute paths
        os.makedirs(run_dir, exist_ok=True)
        self._lock = faults.lock_run_folder(run_dir) if is_primary() else None  # before anything writes there
        try:
            self._construct(cfg, task, run_dir, resume, show_progress, allow_config_change)
        except BaseException:  # a run that never started must not keep the folder locked (a sweep retries in-process)
            self.close()
            raise

    def _construct(self, cfg, task, run_dir, resume, show_progress, allow_config_change):
        self.ckpt = CheckpointManager(os.path.join(run_dir, "checkpoints"), keep_last=2)
        self.user_cfg = cfg  # as given; the guard's mitigations in force are applied on top (and saved in the meta)
        if resume:  # before any work: a config that changes the training is refused (exit 2) unless allowed
            check_resume_config(cfg, self.ckpt, run_dir, allow_config_change)
        self.guard = Guard(cfg.guard, run_dir, write=is_primary()) if cfg.guard.enabled else None
        if resume and self.guard and self._resume_step() is not None:  # the mitigations shape what gets compiled
            self.guard.load_state_dict(self.ckpt.read_meta(self._resume_step()).get("guard"))
            cfg = apply_mitigations(cfg, self.guard.applied)
        self.cfg, self.run_dir, self.resume = cfg, run_dir, resume
        enable_compile_cache(cfg.train.compile_cache)  # before the first compile of this process
        if cfg.train.async_rollouts and jax.process_count() > 1:
            # The background generation would dispatch programs in a different order on each process.
            raise ConfigError(
                "train.async_rollouts",
                f"1 runs with one trainer process; this run has {jax.process_count()}",
            )
        self.health = HealthMonitor(cfg.health)
        t, s = cfg.train, cfg.sampler
        self.tokenizer = load_run_tokenizer(cfg)
        self._set_cap()
        # the task or the environment
        self.collector, self.task = make_collector(cfg, self.tokenizer, self.rollout_sampling, task)
        self.train_problems = list(self.task.train_problems())
        if len(self.train_problems) < t.train_batch:
            raise ConfigError(
                "train.train_batch",
                f"got {t.train_batch}; the task has only {len(self.train_problems)} training problems",
            )
        self.eval_problems = heldout_problems(self.task, t.eval_size)  # a short generated split: an error
        self.collector.check_prompts(self.train_problems, self.eval_problems)  # exit 2 naming a too-long row
        model_cfg, params = load_model(cfg, t.seed)
        self.model_cfg = check_vocab(model_cfg, self.tokenizer)
        self.mesh = pmesh.make_mesh(cfg.mesh)
        dp = pmesh.dp_size(self.mesh)
        if (t.mini_batch * s.n) % dp:
            raise ConfigError(
                "train.mini_batch",
                f"mini_batch*sampler.n = {t.mini_batch * s.n} rows must divide by "
                f"the data-parallel size {dp} (mesh.data*mesh.fsdp)",
            )
        self.optimizer = make_optimizer(cfg.optim)
        state = init_state(params, self.optimizer)
        self.state_sh = state_shardings(state, self.mesh)
        self.state = to_global(state, self.state_sh)
        self.param_sh = self.state_sh.params
        # Frozen reference policy: a copy (the train state's buffers are donated every tick), in the compute dtype.
        self.ref_params = reference_copy(to_global(params, self.param_sh), self.model_cfg.compute_dtype)
        self.codec = self.anchor = None
        self._build_circuits()
        self._compile()
        self.start_step, self.history = 0, {"length/mean": [], "best": None}
        self._resume_row = self._ahead_blob = None
        if resume:
            self._restore()
        # Everything a step reads is set here, so `step()` works without `run()`: the last step done, the weight
        # version the sampler holds, whether the start-of-run evaluation has run, the guard's stop.
        self.gs = self.state_version = self.start_step
        self.began, self.stopped, self.closed = self.start_step > 0, None, False
        self.timer = PhaseTimer()
        self.summary = {"base_accuracy": None, "final_accuracy": None}
        self._start_sampler()
        self.ahead = None  # train.async_rollouts: step gs+1's rollouts, generated during step gs
        if t.async_rollouts:
            # The embedded sampler's programs may not run beside the trainer's on a multi-device XLA:CPU mesh.
            inline = s.backend == "jax" and dispatch.serial_dispatch() and self.mesh.size > 1
            self.ahead = RolloutAhead(threaded=not inline)
            if self._ahead_blob is not None:
                self.ahead.load_state_dict(self._ahead_blob)
        # Run-level files come from process 0 alone; the others run the same steps and write only their shards of
        # each checkpoint (train/checkpoint.py).
        self.logger = None
        if is_primary():
            save_config(self.user_cfg, os.path.join(run_dir, "config.yaml"))
            self.logger = MetricsLogger(
                run_dir, t.steps, show_progress=show_progress, resume_from_step=self.start_step if resume else None
            )
            row = self._resume_row
            if row is not None and self.logger.last_step < self.start_step:
                # The checkpoint was committed and the process died before its step's line was written.
                self.logger.log(self.start_step, row)

    # --- construction -----------------------------------------------------------------------------------------
    def _set_cap(self):
        self.max_new = self.cfg.sampler.sampling.max_new_tokens
        # Rollouts sample the unmodified policy (design §1): temperature 1, no truncation (SamplerConfig.check
        # refuses any other sampler.sampling).
        self.rollout_sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=self.max_new)
        if getattr(self, "collector", None) is not None:  # a guard mitigation changed the config or the cap
            self.collector.set_config(self.cfg, self.rollout_sampling)

    def _start_sampler(self):
        t = self.cfg.train
        self.sampler = make_sampler(self.cfg, self.model_cfg, self.state.params, self.tokenizer, self.run_dir)
        self.sampler.update_weights(self.state.params, self.start_step)
        self.evaluator = self.collector.evaluator(self.eval_problems, greedy=t.eval_greedy)

    def _build_circuits(self):
        """Fast circuit and anchor when the config turns them on (None = absent, not merely idle), and the circuit
        state with its shardings: every field exists from tick 1, so the step compiles once (train/programs.py,
        the builder the shapes-only tools share)."""
        self.comm_hlo = None  # staged runs: the train step's collectives by part, from its compiled program
        c = build_circuits(self.cfg, self.model_cfg, self.mesh, self.state.params)
        self.pipeline, self.codec, self.anchor, self.cs, self.cs_sh = c
        self.circuits = c

    def _compile(self):
        """Every program of the run, from the one builder the shapes-only tools use (train/programs.py)."""
        c = self.circuits._replace(cs=self.cs, cs_sh=self.cs_sh)
        p = build_programs(
            self.cfg, self.model_cfg, self.mesh, self.optimizer, self.state_sh, c, fuse_old=self.FUSE_OLD_PASS
        )
        self.programs, self.old_from_train, self.fidelity = p, p.old_from_train, p.fidelity
        self.train_step, self.diagnostics, self.probe_sums = p.train_step, p.diagnostics, p.probe_sums
        self.logp_old, self.logp_ref, self.logp_dense = p.logp_old, p.logp_ref, p.logp_dense
        self.logp_anchor_ref = p.logp_anchor_ref

    def _shard_batch(self, batch):
        """Host rows (the same on every process) or device rows, split over the batch axes of the mesh."""
        return to_global(batch, pmesh.batch_shardings(batch, self.mesh))

    # --- one GRPO step ----------------------------------------------------------------------------------------
    def _problems_for(self, gs):
        """Deterministic data order: a fresh permutation per pass over the train set."""
        t = self.cfg.train
        per_epoch = max(1, len(self.train_problems) // t.train_batch)
        epoch, k = divmod(gs - 1, per_epoch)
        perm = np.random.default_rng(step_seed(t.seed, epoch, salt=17)).permutation(len(self.train_problems))
        return [self.train_problems[i] for i in perm[k * t.train_batch : (k + 1) * t.train_batch]]

    def grpo_step(self, gs: int) -> dict:
        cfg, t = self.cfg, self.cfg.train
        t_start = time.perf_counter()
        col, metrics = self._rollouts(gs)
        staleness = self.state_version - col.weight_version
        if staleness > cfg.sampler.max_staleness + t.async_rollouts:
            raise RuntimeError(
                f"sampler answered with weight version {col.weight_version}; the trainer is at "
                f"{self.state_version}, sampler.max_staleness is {cfg.sampler.max_staleness} and "
                f"train.async_rollouts is {t.async_rollouts}"
            )
        batch = dict(col.batch)
        loss_mask = batch.pop("loss_mask")
        full_mask = self._shard_batch(batch["response_mask"])  # every sampled token: the diagnostics see them all
        batch["response_mask"] = batch["response_mask"] * loss_mask[:, None]  # the loss may exclude some rows
        truncated = batch.pop("truncated")
        self.cs = place(set_clock(self.cs, step=gs), self.cs_sh)  # one input signature for every jitted pass
        dev = self._shard_batch(batch)
        if self.codec and gs == 1:  # a fresh run only: a resumed one restores its basis with the circuit state
            codec_state, bm = self.codec.bootstrap(self.cs.codec, self.state.params, dev)
            self.cs = place(self.cs._replace(codec=codec_state), self.cs_sh)  # placed like every later step's
            metrics.update(bm)
        trunc_dev = self._shard_batch(truncated)  # a global array: one program on every process
        if self.old_from_train:  # the tick's forward gives ℓ_old, the TIS weights and the diagnostics
            dev["full_mask"], dev["truncated"] = full_mask, trunc_dev
            if cfg.grpo.kl_coef > 0:
                with self.timer("logprob"):
                    self._ref_pass(dev)
                    jax.block_until_ready(dev["ref_logp"])
        else:
            metrics.update(self._old_pass(gs, dev, full_mask, trunc_dev, col))
        tm = self._ticks(gs, dev)
        metrics.update(tm)
        if self.old_from_train and self.codec:  # the tick's forward was the old-log-prob pass: its codec view too
            self.codec.count_forward(OLD)
            views = ("codec/mask_ratio", "codec/recon_rel_err")  # what summarize_aux reports of an old pass
            metrics.update({f"codec/{OLD}/{k[len('codec/') :]}": tm[k] for k in views if k in tm})
        if self.codec:
            codec_state, cm = self.codec.end_step(self.cs.codec, gs, self.cs.grad)
            self.cs = self.cs._replace(codec=codec_state)
            metrics.update(cm)
        self.state_version = gs
        if self.ahead is not None:
            with self.timer("rollout_wait"):  # step gs+1's rollouts stay those of the weights before this step's
                self.ahead.join()
        with self.timer("export"):
            self.sampler.update_weights(self.state.params, gs)  # publish: the next rollout uses these weights
        metrics.update(length_stats(col.lengths, col.truncated, self.max_new))
        self.history["length/mean"].append(metrics["length/mean"])
        metrics["length/slope"] = length_slope(self.history["length/mean"])
        metrics["time/step_s"] = time.perf_counter() - t_start
        if self.pipeline is not None:
            metrics["pipeline/bubble_fraction"] = self.pipeline.bubble
            metrics.update(self.comm_hlo or {})
        metrics["time/tokens_per_s"] = sum(col.lengths) / max(col.gen_s, 1e-9)
        metrics["sampler/restarts"] = 0
        if hasattr(self.sampler, "metrics"):  # vLLM: restarts, refused deltas, bytes of the newest weight sync
            metrics.update(self.sampler.metrics())
        metrics["sampler/weight_version"] = col.weight_version  # the rollouts' version, not the newest export
        metrics["sampler/staleness"] = staleness
        return metrics

    def _old_pass(self, gs, dev, full_mask, truncated, col) -> dict:
        """ℓ_old (and ℓ_ref) into `dev` from their own forwards, the TIS weights, the step's diagnostics (and the
        dense probe when due). Returns their metrics."""
        cfg, t = self.cfg, self.cfg.train
        with self.timer("logprob"):
            old_logp, ent, old_aux = self.logp_old(self.state.params, _logp_rows(dev), self.cs)
            dev["old_logp"] = old_logp
            if cfg.grpo.kl_coef > 0:
                self._ref_pass(dev)
            jax.block_until_ready((old_logp, dev.get("ref_logp")))
        w, metrics = self.diagnostics(old_logp, dev["sampler_logp"], dev["response_mask"], full_mask, truncated, ent)
        if w is not None:
            dev["is_weight"] = w
        if col.row_turn is not None:  # multi-turn: the gap per interaction index
            metrics.update(mismatch_by_turn(old_logp, dev["sampler_logp"], full_mask, col.row_turn))
        if self.codec:
            metrics.update(self.codec.summarize_aux(old_aux, tag=OLD))
        if t.probe_every and gs % t.probe_every == 0:
            with self.timer("logprob"):
                metrics.update(to_host(self._dense_probe(dev, full_mask, old_logp)))
        return metrics

    def _ref_pass(self, dev) -> None:
        """ℓ_ref into `dev` (kl_coef > 0). The anchor's dense view of it is `_anchor_rows`'s."""
        dev["ref_logp"] = self.logp_ref(self.ref_params, _logp_rows(dev), self.cs)[0]

    def _anchor_rows(self, tau, mb):
        """The mini-batch as the anchor reads it at tick τ: with ℓ_ref^dense (kl_coef > 0) when the anchor keeps
        these rows (retained for a later fire, or this fire's batch), else as it is. The anchor's KL is in the dense
        view: when the codec acts on the reference pass, that is one more reference forward with codecs off, over
        the mini-batches the anchor keeps only (1/cadence of the rows; its program compiles at the first one)."""
        if self.cfg.grpo.kl_coef <= 0 or not self.anchor.keeps(tau):
            return mb
        if self.codec is None or not self.codec.applies(REF):
            return {**mb, "ref_logp_dense": mb["ref_logp"]}
        return {**mb, "ref_logp_dense": self.logp_anchor_ref(self.ref_params, _logp_rows(mb), self.cs)[0]}

    def _collect(self, gs: int):
        """Step gs's rollouts, scored and packed (train/collect.py)."""
        begin = getattr(self.task, "begin_step", None)  # optional: a task whose scoring depends on the step
        if begin is not None:
            begin(gs)
            bounded.refresh(self.task)  # its scoring workers fork again from the task as begin_step left it
        return self.collector.collect(gs, self._problems_for(gs), self.sampler, step_seed(self.cfg.train.seed, gs))

    def _rollouts(self, gs: int):
        """(Collected, metrics) of step gs: the rollouts generated during step gs-1 when `train.async_rollouts`
        (their engine and scoring seconds overlapped that step: `sampler/*_ahead_s`, not phases of this one), else
        collected now. With async_rollouts, step gs+1's then start from the weights the sampler holds."""
        col = self.ahead.take(gs) if self.ahead is not None else None
        if col is None:
            col = self._collect(gs)
            self.timer.add("generate", col.gen_s)
            self.timer.add("score", col.score_s)
            metrics = dict(col.metrics)
        else:
            metrics = {**col.metrics, "sampler/generate_ahead_s": col.gen_s, "sampler/score_ahead_s": col.score_s}
        if self.ahead is not None and gs < self.cfg.train.steps:
            with self.timer("rollout_wait"):  # ~0 s in a thread; all of step gs+1's generation when inline
                self.ahead.start(gs + 1, lambda: self._collect(gs + 1))
        return col, metrics

    def _dense_probe(self, dev, mask, old_logp) -> dict:
        """design §6 probe: reference KL with codecs off everywhere (`kl/ref_dense`) against the codec view at the
        same point (`kl/ref_codec`), their ratio `kl/gain`, and the dense trainer's own gap to the sampler.
        Cost: two or three extra forwards, no backward."""
        lp = self.logp_dense(self.state.params, _logp_rows(dev), self.cs)[0]
        lr_dense = self.logp_dense(self.ref_params, _logp_rows(dev), self.cs)[0]
        ref_codec = (
            dev["ref_logp"] if "ref_logp" in dev else self.logp_ref(self.ref_params, _logp_rows(dev), self.cs)[0]
        )
        return dense_probe_metrics(
            lp, lr_dense, old_logp, ref_codec, dev["sampler_logp"], mask, self.cfg.grpo.kl_estimator, self.probe_sums
        )

    def _ticks(self, gs, dev) -> dict:
        cfg, t = self.cfg, self.cfg.train
        probe = self.fidelity is not None and gs % t.probe_every == 0
        n_mini = cfg.ticks_per_step
        accum: dict = {}
        for epoch in range(t.ppo_epochs):
            for j, mb in enumerate(ro.split_minibatches(dev, n_mini)):
                mb = self._shard_batch(mb)
                tau = int(self.state.tick) + 1
                first = j == 0 and epoch == 0
                # ℓ_old from the train forward; placed, so the anchor's ℓ_ref^dense pass sees the circuit state as
                # every other pass does (one program, the one train/abstract_step.py builds from shapes)
                self.cs = place(set_clock(self.cs, first_minibatch=first), self.cs_sh)
                if self.anchor:
                    with self.timer("anchor"):
                        basis = self.cs.codec if self.anchor.owns_q else None
                        amb = self._anchor_rows(tau, mb)
                        self.cs, am, sketch = self.anchor.before_tick(tau, gs, first, amb, self.state, self.cs, basis)
                        if sketch is not None:  # the anchor's dense sketch refreshes the basis (staged)
                            self.cs = self.cs._replace(codec=self.codec.absorb_sketch(self.cs.codec, sketch))
                        jax.block_until_ready(self.cs)
                    _merge(accum, to_host(am))
                with self.timer("update"):
                    # Both states are donated: `place` commits every leaf to its sharding, no buffer twice.
                    self.cs = place(self.cs, self.cs_sh)
                    if probe and first:  # before the tick: the weights and M it will use
                        _merge(accum, to_host(self.fidelity(self.state.params, self.ref_params, mb, self.cs)))
                    if self.pipeline is not None and self.comm_hlo is None:  # once a run, before the first call
                        args, n = (self.state, self.cs, mb), n_mini * t.ppo_epochs
                        self.comm_hlo = step_comm(self.train_step, args, pmesh.dp_size(self.mesh), n)
                    self.state, self.cs, m = self.train_step(self.state, self.cs, mb)
                    m = to_host(dict(m))  # host sync, once per tick
                if self.codec:
                    self.codec.tick_done()
                if self.anchor:
                    with self.timer("anchor"):
                        self.state, sm = self.anchor.after_tick(tau, self.state, self.cs)
                        jax.block_until_ready(self.state)
                    m.update(to_host(sm))
                _merge(accum, m)
        out = {k: float(np.mean(v)) for k, v in accum.items()}
        for k in ("grad/skipped", "anchor/fire"):
            if k in accum:
                out[k] = float(np.sum(accum[k]))
        out["tick"] = int(self.state.tick)
        out["lr"] = learning_rate(cfg.optim, int(self.state.tick))
        return out

    # --- the run ----------------------------------------------------------------------------------------------
    def evaluate(self, gs) -> dict:
        """Held-out evaluation with the sampler's current weights (no logging)."""
        return self.evaluator.run(self.sampler, seed=step_seed(self.cfg.train.seed, gs, salt=99))

    def _evaluate_timed(self, gs) -> dict:
        with self.timer("eval"):
            return self.evaluate(gs)

    def begin(self) -> dict:
        """The start of a fresh run (step 0): the base model's evaluation when `eval.at_start`, logged as step 0.
        `step()` calls it before the first step; calling it again does nothing. Returns step 0's metrics."""
        if self.began:
            return {}
        self.began = True
        if not self.cfg.eval.at_start:
            return {}
        ev = self._evaluate_timed(0)
        metrics = {"step": 0, "tick": 0, **ev, **self.timer.take()}
        self.summary["base_accuracy"] = ev.get("eval/accuracy")
        if self.guard and ev:  # a rollback always has somewhere to go
            with self.timer("checkpoint"):
                self._maybe_save_best(0, ev)
            metrics.update(self.timer.take())
        if self.logger:
            self.logger.log(0, metrics)
        return metrics

    def step(self) -> dict:
        """Run the next GRPO step (`self.gs + 1`) with what the run does around it: the evaluation when due, the
        health gauges, the collapse guard, the metrics line, checkpoints. Returns the step's metrics (as logged).
        `run()` is a loop over it; calling it directly needs nothing else first."""
        t = self.cfg.train
        if self.closed:
            raise RuntimeError("this GRPOTrainer is closed (run() closes it at the end); make a new one")
        if self.stopped is not None:
            raise RuntimeError(f"the collapse guard stopped this run at step {self.stopped} (see guard.jsonl)")
        if self.gs >= t.steps:
            raise RuntimeError(f"all train.steps={t.steps} steps are done; raise train.steps to train further")
        self.begin()
        gs = self.gs + 1
        metrics = {"step": gs, **self.grpo_step(gs)}
        self.gs = gs
        if self.anchor:
            metrics.update(self.anchor.step_metrics(self.cs))
        last = gs == t.steps
        if (t.eval_every and gs % t.eval_every == 0) or (last and self.cfg.eval.at_end):
            metrics.update(self._evaluate_timed(gs))
        err = metrics.pop("reward/first_score_error", None)
        if err:
            print(f"warning: step {gs}: a scorer raised ({err}); that sample got reward 0", file=sys.stderr)
        metrics = to_floats(metrics)  # empty splits (NaN) are left out: keys present when they apply
        metrics["step"], metrics["tick"] = gs, int(metrics["tick"])
        metrics.update(self.health.update(gs, metrics))
        with self.timer("checkpoint"):
            self._maybe_save_best(gs, metrics)  # before the guard: a rollback must not become the best
        act = self._guard_step(gs, metrics)
        if act == "final":
            metrics.update(self._evaluate_timed(gs))
        if "eval/accuracy" in metrics:
            self.summary["final_accuracy"] = metrics["eval/accuracy"]
        if act in ("stop", "final"):
            self.stopped = self.summary["stopped_by_guard"] = gs
        # The checkpoint is written before the metrics line, so the line holds its time; its meta holds the line
        # (without that time), which a resume writes if the process died in between.
        metrics.update(self.timer.take())
        with self.timer("checkpoint"):
            self._maybe_checkpoint(gs, metrics, force=act in ("rollback", "stop", "final"))
        metrics.update(self.timer.take())
        faults.point("metrics/before_line")
        if self.logger:
            self.logger.log(gs, metrics)
        faults.point("metrics/after_line")
        return metrics

    def run(self) -> dict:
        """Every remaining step (`step()` in a loop), then `close()`. Returns the summary: base and final held-out
        accuracy, the steps, `stopped_by_guard` when the guard ended the run."""
        # SIGTERM / SIGINT: a checkpoint at the next step boundary, then return; or, past train.preempt_grace_s, exit
        # 143 without one (faults.StopSignals)
        signals = faults.StopSignals(self.cfg.train.preempt_grace_s, lambda: self.ckpt.latest())
        try:
            self.begin()
            while self.gs < self.cfg.train.steps and self.stopped is None:
                self.step()
                if self._stop_requested(signals):
                    self._preempt(signals.requested)
                    signals.disarm()
                    break
        finally:
            signals.restore()
            self.close()
        return {**self.summary, "steps": self.cfg.train.steps}

    def close(self) -> None:
        """Stop the sampler and close the metrics files, then release the run folder. Safe to call twice, and on a
        trainer whose construction failed part way (what it got to build is closed)."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        try:
            if getattr(self, "ahead", None) is not None:  # a generation in flight ends before its sampler does
                self.ahead.close()
            if getattr(self, "logger", None):
                self.logger.close()
        finally:
            try:
                if getattr(self, "sampler", None) is not None:
                    self.sampler.close()
            finally:
                if self._lock is not None:
                    faults.unlock_run_folder(self._lock)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the collapse guard -----------------------------------------------------------------------------------
    def _guard_step(self, gs, metrics):
        """Ask the guard (when on) and carry out its action; adds `guard/*` to `metrics`. Returns the action."""
        if not self.guard:
            return None
        alarming = self.health.alarming(metrics)
        act = self.guard.decide(gs, metrics, alarming)
        if act is None:
            return None
        if act in ("warn", "stop"):
            metrics.update(self.guard.record(gs, act, alarming))
            return act
        if self.ckpt.best_score() is None:  # e.g. the guard was switched on at a resume: nowhere to roll back to
            metrics.update(self.guard.record(gs, "stop", alarming, reason="no best checkpoint to roll back to"))
            return "stop"
        best = self.ckpt.read_meta("best")["step"]
        name = self.guard.next_mitigation() if act == "rollback" else None
        change = self._rollback(gs, name)
        metrics.update(self.guard.record(gs, act, alarming, rollback_to=best, mitigation=name, change=change))
        return act

    def _rollback(self, gs, mitigation):
        """Restore the best checkpoint and go on from step gs + 1, under the mitigated config when one is given
        (circuits rebuilt and recompiled first, so the checkpoint loads into the new structures)."""
        change = None
        if self.ahead is not None:  # generated from weights the rollback discards
            self.ahead.drop()
        if mitigation is not None:
            cfg, change = mitigate(self.cfg, mitigation)
            cfg.check()
            old_cap, self.cfg = self.max_new, cfg
            self._set_cap()
            self._build_circuits()
        self._load("best")
        if mitigation is not None:
            self._compile()
            if self.max_new != old_cap:  # the sampler and the evaluator generate to the new cap
                self.sampler.close()
                self._start_sampler()
        self.cs = place(self.cs, self.cs_sh)
        self.sampler.update_weights(self.state.params, gs)
        self.state_version = gs
        self.health.reset_trends()
        return change


def _merge(acc: dict, m: dict):
    for k, v in m.items():
        if np.ndim(v) == 0:
            acc.setdefault(k, []).append(float(v))
