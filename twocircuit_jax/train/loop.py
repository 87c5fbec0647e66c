"""The GRPO loop: rollout -> reward -> advantages -> old/ref log-probs -> ticks -> publish -> evaluate.

One GRPO step `gs` is one rollout batch; one tick is one optimizer update on one mini-batch (design §2). Every
random choice is a function of (train.seed, gs), so a resumed run repeats an uninterrupted one step for step.
`GRPOTrainer` orchestrates a built run (train/built_run.py: config, mesh, circuits, programs, collector, sampler,
checkpoints, as one frozen object from one assembly) and owns what changes as it trains: the train state, the
circuit state `cs` (step/circuit_state.py), the step counter, the history, the metrics files. The fast circuit
plugs in as `codec` (fast/circuit.py), the anchor as `anchor` (anchor/circuit.py); both absent means the dense
trainer. A step's phases are functions of the built run and the state they change (train/step_phases.py).
"""

from __future__ import annotations

import os
import sys
import time

from twocircuit_jax import provenance
from twocircuit_jax.config.run import save_config
from twocircuit_jax.metrics.gauges import length_slope, length_stats, to_floats
from twocircuit_jax.metrics.logger import MetricsLogger
from twocircuit_jax.parallel.distributed import is_primary
from twocircuit_jax.step.circuit_state import place, set_clock
from twocircuit_jax.train import built_run, faults, run_checkpoints, step_phases as ph
from twocircuit_jax.train.built_run import step_seed
from twocircuit_jax.train.guard import mitigate
from twocircuit_jax.train.timing import PhaseTimer
from twocircuit_jax.train.trainer_inputs import as_config, python_task


class GRPOTrainer:
    """GRPO on a task from the config, or on one's own reward functions and rows:

        trainer = GRPOTrainer(cfg, "runs/x", reward_fns=[f, g], train_dataset=rows, eval_dataset=held_out)
        trainer.run()            # or: metrics = trainer.step(), one GRPO step at a time

    `cfg` is a RunConfig, a dict of sections or a YAML path; `run_dir` defaults to runs/<cfg.name>. Reward
    functions are callables `(prompts, completions, **fields) -> list[float]` (tasks/python_task.py), weighted by
    `reward_weights`; datasets are iterables of dicts (a `datasets.Dataset` too) with the prompt field
    (`task.prompt_key`, default "prompt") and the fields the functions read. What the run is built of (config,
    mesh, circuits, programs, sampler, checkpoints) is `trainer.built` (train/built_run.py); the trainer owns what
    changes as it trains: `state`, `cs`, `gs`, `history`."""

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
        self.built, self.state, self.cs = built_run.assemble(
            cfg, task, run_dir, resume=resume, allow_config_change=allow_config_change
        )
        self.history = {"length/mean": [], "best": None}
        self.start_step, resume_row, ahead_blob = 0, None, None
        if resume:
            got, resume_row, ahead_blob = run_checkpoints.restore_latest(self.built, self.state, self.cs)
            self.start_step, self.state, self.cs, self.history = got.step, got.state, got.cs, got.history
        # Everything a step reads is set here, so `step()` works without `run()`: the last step done, the weight
        # version the sampler holds, whether the start-of-run evaluation has run, the guard's stop.
        self.gs = self.state_version = self.start_step
        self.began, self.stopped, self.closed = self.start_step > 0, None, False
        self.timer = PhaseTimer()
        self.summary = {"base_accuracy": None, "final_accuracy": None}
        self.built = b = built_run.start_sampler(self.built, self.state.params, self.start_step)
        if b.ahead is not None and ahead_blob is not None:
            b.ahead.load_state_dict(ahead_blob)
        # Run-level files come from process 0 alone; the others run the same steps and write only their shards of
        # each checkpoint (train/checkpoint.py).
        self.logger = None
        if is_primary():
            save_config(b.user_cfg, os.path.join(run_dir, "config.yaml"))
            if not resume:  # the base as it is now, by content (a resume keeps the start's record)
                base = b.user_cfg.base_model
                provenance.write(run_dir, os.path.expanduser(base) if base else None)
            first = self.start_step if resume else None
            self.logger = MetricsLogger(run_dir, b.cfg.train.steps, show_progress=show_progress, resume_from_step=first)
            if resume_row is not None and self.logger.last_step < self.start_step:
                # The checkpoint was committed and the process died before its step's line was written.
                self.logger.log(self.start_step, resume_row)

    # --- one GRPO step ----------------------------------------------------------------------------------------
    def grpo_step(self, gs: int) -> dict:
        b, timer = self.built, self.timer
        t_start = time.perf_counter()
        col, metrics = ph.rollouts(b, gs, timer)
        staleness = ph.check_staleness(b, col, self.state_version)
        sb = ph.device_batch(b, col)
        self.cs = place(set_clock(self.cs, step=gs), b.cs_sh)  # one input signature for every jitted pass
        self.cs, bm = ph.bootstrap(b, self.state.params, self.cs, gs, sb)
        metrics.update(bm)
        sb, om = ph.old_logprobs(b, self.state.params, self.cs, gs, sb, col.row_turn, timer)
        metrics.update(om)
        accum: dict = {}  # the ticks' metrics; the trainer's state is current after each tick
        for first, mb in ph.minibatches(b, sb):
            self.state, self.cs = ph.tick(b, self.state, self.cs, gs, mb, first, accum, timer)
        tm = ph.ticks_metrics(b, accum, self.state)
        metrics.update(tm)
        self.cs, cm = ph.end_step(b, self.cs, gs, tm)
        metrics.update(cm)
        self.state_version = gs
        if b.ahead is not None:
            with timer("rollout_wait"):  # step gs+1's rollouts stay those of the weights before this step's
                b.ahead.join(share=ph.ahead_share(b))  # many processes: process 0's batch, broadcast here
        with timer("export"):
            b.sampler.update_weights(self.state.params, gs)  # publish: the next rollout uses these weights
        metrics.update(length_stats(col.lengths, col.truncated, b.max_new))
        self.history["length/mean"].append(metrics["length/mean"])
        metrics["length/slope"] = length_slope(self.history["length/mean"])
        metrics["time/step_s"] = time.perf_counter() - t_start
        metrics.update(ph.sampler_gauges(b, col, staleness))
        return metrics

    # --- the run ----------------------------------------------------------------------------------------------
    def evaluate(self, gs) -> dict:
        """Held-out evaluation with the sampler's current weights (no logging)."""
        b = self.built
        return b.evaluator.run(b.sampler, seed=step_seed(b.cfg.train.seed, gs, salt=99))

    def _evaluate_timed(self, gs) -> dict:
        with self.timer("eval"):
            return self.evaluate(gs)

    def begin(self) -> dict:
        """The start of a fresh run (step 0): the base model's evaluation when `eval.at_start`, logged as step 0.
        `step()` calls it before the first step; calling it again does nothing. Returns step 0's metrics."""
        if self.began:
            return {}
        self.began = True
        if not self.built.cfg.eval.at_start:
            return {}
        ev = self._evaluate_timed(0)
        metrics = {"step": 0, "tick": 0, **ev, **self.timer.take()}
        self.summary["base_accuracy"] = ev.get("eval/accuracy")
        if self.built.guard and ev:  # a rollback always has somewhere to go
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
        t = self.built.cfg.train
        if self.closed:
            raise RuntimeError("this GRPOTrainer is closed (run() closes it at the end); make a new one")
        if self.stopped is not None:
            raise RuntimeError(f"the collapse guard stopped this run at step {self.stopped} (see guard.jsonl)")
        if self.gs >= t.steps:
            raise RuntimeError(f"all train.steps={t.steps} steps are done; raise train.steps to train further")
        self.begin()
        gs = self.gs + 1
        metrics = {"step": gs, **self.grpo_step(gs)}
        self.gs, b = gs, self.built
        if b.anchor:
            metrics.update(b.anchor.step_metrics(self.cs))
        if b.eval_due(gs):
            metrics.update(self._evaluate_timed(gs))
        err = metrics.pop("reward/first_score_error", None)
        if err:
            print(f"warning: step {gs}: a scorer raised ({err}); that sample got reward 0", file=sys.stderr)
        metrics = to_floats(metrics)  # empty splits (NaN) are left out: keys present when they apply
        metrics["step"], metrics["tick"] = gs, int(metrics["tick"])
        metrics.update(b.health.update(gs, metrics))
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
        signals = faults.StopSignals(self.built.cfg.train.preempt_grace_s, lambda: self.built.ckpt.latest())
        try:
            self.begin()
            while self.gs < self.built.cfg.train.steps and self.stopped is None:
                self.step()
                if signals.agreed():
                    self._preempt(signals.requested)
                    signals.disarm()
                    break
        finally:
            signals.restore()
            self.close()
        return {**self.summary, "steps": self.built.cfg.train.steps}

    def close(self) -> None:
        """Stop the sampler and close the metrics files, then release the run folder. Safe to call twice, and on a
        trainer whose construction failed part way (what it got to build is closed)."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        b = getattr(self, "built", None)
        try:
            if b is not None and b.ahead is not None:  # a generation in flight ends before its sampler does
                b.ahead.close()
            if getattr(self, "logger", None):
                self.logger.close()
        finally:
            try:
                if b is not None and b.sampler is not None:
                    b.sampler.close()
            finally:
                if self._lock is not None:
                    faults.unlock_run_folder(self._lock)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- checkpoints (train/run_checkpoints.py) ---------------------------------------------------------------
    def _maybe_save_best(self, gs, metrics):
        score = metrics.get("eval/accuracy")
        if score is not None and (self.history.get("best") is None or score > self.history["best"]):
            self.history["best"] = score
            run_checkpoints.save_best(self.built, gs, self.state, self.cs, self.history, score)

    def _maybe_checkpoint(self, gs, metrics=None, force: bool = False):
        """Periodic checkpoint, and the final one when `train.final_checkpoint`; `force` after a guard action, so a
        resume starts from what the guard left."""
        t = self.built.cfg.train
        final = gs == t.steps and t.final_checkpoint
        if force or (t.checkpoint_every and gs % t.checkpoint_every == 0) or final:
            run_checkpoints.save(self.built, gs, self.state, self.cs, self.history, metrics)

    def _preempt(self, signame: str) -> None:
        """A stop signal at step `self.gs`'s boundary: checkpoint that step (unless it has just been written), say
        where and how to go on. The step's metrics line is already written; the run then returns as a finished one
        would (exit 0)."""
        b, gs = self.built, self.gs
        if b.ckpt.latest() != gs:
            run_checkpoints.save(b, gs, self.state, self.cs, self.history)
        self.summary["preempted_at"] = gs
        if is_primary():
            print(
                f"twocircuit: stopped by {signame} after step {gs}: checkpoint {b.ckpt.root}/step_{gs:08d}; "
                f"continue with: twocircuit train --config CONFIG --out {b.run_dir} --resume",
                flush=True,
            )

    # --- the collapse guard -----------------------------------------------------------------------------------
    def _guard_step(self, gs, metrics):
        """Ask the guard (when on) and carry out its action; adds `guard/*` to `metrics`. Returns the action."""
        b = self.built
        if not b.guard:
            return None
        alarming = b.health.alarming(metrics)
        act = b.guard.decide(gs, metrics, alarming)
        if act is None:
            return None
        if act in ("warn", "stop"):
            metrics.update(b.guard.record(gs, act, alarming))
            return act
        if b.ckpt.best_score() is None:  # e.g. the guard was switched on at a resume: nowhere to roll back to
            metrics.update(b.guard.record(gs, "stop", alarming, reason="no best checkpoint to roll back to"))
            return "stop"
        best = b.ckpt.read_meta("best")["step"]
        name = b.guard.next_mitigation() if act == "rollback" else None
        change = self._rollback(gs, name)
        metrics.update(b.guard.record(gs, act, alarming, rollback_to=best, mitigation=name, change=change))
        return act

    def _rollback(self, gs, mitigation):
        """Restore the best checkpoint and go on from step gs + 1, under the mitigated config when one is given
        (circuits and programs rebuilt first, so the checkpoint loads into the new structures)."""
        change, old_cap = None, self.built.max_new
        if self.built.ahead is not None:  # generated from weights the rollback discards
            self.built.ahead.drop()
        if mitigation is not None:
            cfg, change = mitigate(self.built.cfg, mitigation)
            cfg.check()
            self.built, self.cs = built_run.rebuilt(self.built, cfg, self.state.params)
        got = run_checkpoints.load(self.built, "best", self.state, self.cs)
        self.state, self.cs, self.history = got.state, got.cs, got.history
        if self.built.max_new != old_cap:  # the sampler and the evaluator generate to the new cap
            self.built.sampler.close()
            self.built = built_run.start_sampler(self.built, self.state.params, self.start_step)
        b = self.built
        self.cs = place(self.cs, b.cs_sh)
        b.sampler.update_weights(self.state.params, gs)
        self.state_version = gs
        b.health.reset_trends()
        return change
