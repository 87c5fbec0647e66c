"""The phases of one GRPO step, as functions of the built run (train/built_run.py) and the state they change.

`GRPOTrainer.grpo_step` (train/loop.py) calls them in this order: `rollouts` (collected now, or taken from the
step-ahead generation), `device_batch`, `bootstrap` (step 1's codec basis), `old_logprobs` (ℓ_ref and, unless the
train forward gives it, ℓ_old with the step's diagnostics and the dense probe: `old_pass`), `tick` for each of
`minibatches` (the optimizer updates with the anchor around them), `end_step` (the codec's basis refresh). Each
returns what it changed (train state, circuit state) and its metrics; none keeps anything between calls, and the
trainer holds the new state after each tick. `timer` is the trainer's PhaseTimer (train/timing.py): the phases
time themselves into it.
"""

from __future__ import annotations

import jax
import numpy as np

from twocircuit_jax.metrics.mismatch import mismatch_by_turn
from twocircuit_jax.metrics.probe import dense_probe_metrics
from twocircuit_jax.names import OLD
from twocircuit_jax.parallel.host import to_host
from twocircuit_jax.step.circuit_state import place, set_clock
from twocircuit_jax.step.programs import anchor_ref_own_pass
from twocircuit_jax.step.step_batch import StepBatch
from twocircuit_jax.step.train_step import learning_rate
from twocircuit_jax.tasks import bounded
from twocircuit_jax.train import rollout as ro
from twocircuit_jax.train.built_run import BuiltRun, step_seed
from twocircuit_jax.train.rollout_ahead import share_from_zero


def logp_rows(batch: dict) -> dict:
    """What a log-prob pass reads: one input signature whatever else the step batch has gathered by then (one
    compilation per pass)."""
    return {k: batch[k] for k in ("tokens", "attention_mask", "sample_id") if k in batch}


def begin_step(b: BuiltRun, gs: int) -> None:
    """The task's preparation for step gs, on every process (optional: a task whose scoring depends on the step)."""
    begin = getattr(b.task, "begin_step", None)
    if begin is not None:
        begin(gs)
        bounded.refresh(b.task)  # its scoring workers fork again from the task as begin_step left it


def collect(b: BuiltRun, gs: int, sampler=None):
    """Step gs's rollouts, scored and packed (train/collect.py), from `sampler` (default the run's)."""
    begin_step(b, gs)
    sampler = b.sampler if sampler is None else sampler
    return b.collector.collect(gs, b.problems_for(gs), sampler, step_seed(b.cfg.train.seed, gs))


def ahead_share(b: BuiltRun):
    """How every process receives the step-ahead batch: from process 0 when the sampler lives there alone (its
    `ahead_work`: sampler/process_zero.py), else None (each process has its own)."""
    return share_from_zero if hasattr(b.sampler, "ahead_work") else None


def ahead_work(b: BuiltRun, gs: int):
    """What the step-ahead thread runs for step gs. With a sampler on process 0 of many, no collective may run
    there: process 0 collects with the inner sampler, the others only prepare the task; `ahead_share` then
    broadcasts process 0's batch from every main thread."""
    work = getattr(b.sampler, "ahead_work", None)
    if work is None:
        return lambda: collect(b, gs)
    return work(lambda inner: collect(b, gs, sampler=inner), others=lambda: begin_step(b, gs))


def rollouts(b: BuiltRun, gs: int, timer):
    """(Collected, metrics) of step gs: the rollouts generated during step gs-1 when `train.async_rollouts`
    (their engine and scoring seconds overlapped that step: `sampler/*_ahead_s`, not phases of this one), else
    collected now. With async_rollouts, step gs+1's then start from the weights the sampler holds."""
    col = b.ahead.take(gs, share=ahead_share(b)) if b.ahead is not None else None
    if col is None:
        col = collect(b, gs)
        timer.add("generate", col.gen_s)
        timer.add("score", col.score_s)
        metrics = dict(col.metrics)
    else:
        metrics = {**col.metrics, "sampler/generate_ahead_s": col.gen_s, "sampler/score_ahead_s": col.score_s}
    if b.ahead is not None and gs < b.cfg.train.steps:
        with timer("rollout_wait"):  # ~0 s in a thread; all of step gs+1's generation when inline
            b.ahead.start(gs + 1, ahead_work(b, gs + 1))
    return col, metrics


def check_staleness(b: BuiltRun, col, version: int) -> int:
    """How many weight versions the rollouts lag the trainer at `version`; past sampler.max_staleness beyond
    train.async_rollouts' scheduled lag, an error."""
    staleness, s, t = version - col.weight_version, b.cfg.sampler, b.cfg.train
    if staleness > s.max_staleness + t.async_rollouts:
        raise RuntimeError(
            f"sampler answered with weight version {col.weight_version}; the trainer is at {version}, "
            f"sampler.max_staleness is {s.max_staleness} and train.async_rollouts is {t.async_rollouts}"
        )
    return staleness


def device_batch(b: BuiltRun, col) -> StepBatch:
    """The collected batch on the mesh (step/step_batch.py): the loss reads the response mask with the collector's
    loss mask applied (it may exclude some rows); the diagnostics see every sampled token. The flags are a global
    array: one program on every process."""
    batch = dict(col.batch)
    loss_mask = batch.pop("loss_mask")
    full_mask = b.shard(batch["response_mask"])
    batch["response_mask"] = batch["response_mask"] * loss_mask[:, None]
    truncated = batch.pop("truncated")
    return StepBatch(b.shard(batch), full_mask, b.shard(truncated))


def bootstrap(b: BuiltRun, params, cs, gs, sb: StepBatch) -> tuple:
    """(circuit state, metrics): the codec's state from the first step's rows before its first tick (the low-rank
    basis from one dense sketch), at step 1 of a fresh run only: a resumed one restores it with the circuit state."""
    if not (b.fast and gs == 1):
        return cs, {}
    codec_state, bm = b.fast.bootstrap(cs.codec, params, sb.rows)
    return place(cs._replace(codec=codec_state), b.cs_sh), bm  # placed like every later step's


def old_logprobs(b: BuiltRun, params, cs, gs, sb: StepBatch, row_turn, timer) -> tuple[StepBatch, dict]:
    """(step batch with ℓ_ref and, unless the train forward gives it, ℓ_old and the weights; metrics). Where ℓ_old
    comes from is `programs.fused_old_pass` (decided once, step/programs.py `fuses_old_pass`): the tick's own
    forward, which then also gives the weights and the diagnostics from the batch's full mask and flags; or
    separate passes now (`old_pass`)."""
    if not b.programs.fused_old_pass:
        return old_pass(b, params, cs, gs, sb, row_turn, timer)
    if b.cfg.grpo.kl_coef > 0:
        with timer("logprob"):
            sb = ref_pass(b, sb, cs)
            jax.block_until_ready(sb.ref_logp)
    return sb, {}


def ref_pass(b: BuiltRun, sb: StepBatch, cs) -> StepBatch:
    """The batch with ℓ_ref (kl_coef > 0). The anchor's dense view of it is `anchor_rows`'."""
    return sb._replace(ref_logp=b.programs.logp_ref(b.ref_params, sb.pass_rows(), cs)[0])


def old_pass(b: BuiltRun, params, cs, gs, sb: StepBatch, row_turn, timer) -> tuple[StepBatch, dict]:
    """ℓ_old (and ℓ_ref) from their own forwards, the weights, the step's diagnostics (and the dense probe when
    due): (the batch with them, their metrics)."""
    p, rows = b.programs, sb.rows
    with timer("logprob"):
        old_logp, ent, old_aux = p.logp_old(params, sb.pass_rows(), cs)
        sb = sb._replace(old_logp=old_logp)
        if b.cfg.grpo.kl_coef > 0:
            sb = ref_pass(b, sb, cs)
        jax.block_until_ready((old_logp, sb.ref_logp))
    w, metrics = p.diagnostics(old_logp, rows["sampler_logp"], rows["response_mask"], sb.full_mask, sb.truncated, ent)
    sb = sb._replace(is_weight=w)
    if row_turn is not None:  # multi-turn: the gap per interaction index
        metrics.update(mismatch_by_turn(old_logp, rows["sampler_logp"], sb.full_mask, row_turn))
    if b.fast:
        metrics.update(b.fast.summarize_aux(old_aux, tag=OLD))
    if b.probe_due(gs):
        with timer("logprob"):
            metrics.update(to_host(dense_probe(b, params, cs, sb)))
    return sb, metrics


def dense_probe(b: BuiltRun, params, cs, sb: StepBatch) -> dict:
    """design §6 probe: reference KL with codecs off everywhere (`kl/ref_dense`) against the codec view at the
    same point (`kl/ref_codec`), their ratio `kl/gain`, and the dense trainer's own gap to the sampler.
    Cost: two or three extra forwards, no backward."""
    p, rows = b.programs, sb.pass_rows()
    lp = p.logp_dense(params, rows, cs)[0]
    lr_dense = p.logp_dense(b.ref_params, rows, cs)[0]
    ref_codec = sb.ref_logp if sb.ref_logp is not None else p.logp_ref(b.ref_params, rows, cs)[0]
    return dense_probe_metrics(
        lp,
        lr_dense,
        sb.old_logp,
        ref_codec,
        sb.rows["sampler_logp"],
        sb.full_mask,
        b.cfg.grpo.kl_estimator,
        p.probe_sums,
    )


def anchor_rows(b: BuiltRun, tau, mb, cs):
    """The mini-batch as the anchor reads it at tick τ: with ℓ_ref^dense (kl_coef > 0) when the anchor keeps these
    rows (retained for a later fire, or this fire's batch), else as it is. The anchor's KL is in the dense view: when
    the codec acts on the reference pass, that is one more reference forward with codecs off, over the mini-batches
    the anchor keeps only (1/cadence of the rows; its program compiles at the first one)."""
    if b.cfg.grpo.kl_coef <= 0 or not b.anchor.keeps(tau):
        return mb
    if not anchor_ref_own_pass(b.cfg, b.fast):
        return {**mb, "ref_logp_dense": mb["ref_logp"]}
    return {**mb, "ref_logp_dense": b.programs.logp_anchor_ref(b.ref_params, logp_rows(mb), cs)[0]}


def minibatches(b: BuiltRun, sb: StepBatch):
    """(first, mini-batch on the mesh) for each tick of the step: `train.ppo_epochs` passes over its mini-batches
    (row blocks of the train step's inputs, each put on the mesh's batch sharding); `first`: the step's first tick."""
    inputs = sb.train_inputs(b.programs.fused_old_pass)
    for epoch in range(b.cfg.train.ppo_epochs):
        for j, mb in enumerate(ro.split_minibatches(inputs, b.cfg.ticks_per_step)):
            yield j == 0 and epoch == 0, b.shard(mb)


def tick(b: BuiltRun, state, cs, gs, mb, first, accum: dict, timer):
    """One optimizer tick of step gs on mini-batch `mb`, the anchor before and after it. Returns (train state,
    circuit state), both new (the old ones are donated); its metrics go into `accum`. A staged run reads its train
    step's collectives from the compiled program before the first call (`programs.staged_comm`)."""
    p = b.programs
    tau = int(state.tick) + 1
    # ℓ_old from the train forward; placed, so the anchor's ℓ_ref^dense pass sees the circuit state as every other
    # pass does (one program, the one step/abstract_step.py builds from shapes)
    cs = place(set_clock(cs, first_minibatch=first), b.cs_sh)
    if b.anchor:
        with timer("anchor"):
            basis = cs.codec if b.anchor.owns_q else None
            amb = anchor_rows(b, tau, mb, cs)
            cs, am, sketch = b.anchor.before_tick(tau, gs, first, amb, state, cs, basis)
            if sketch is not None:  # the anchor's dense sketch refreshes the basis (staged)
                cs = cs._replace(codec=b.fast.absorb_sketch(cs.codec, sketch))
            # Both states are donated to the train step: `place` commits every leaf the anchor wrote to its
            # sharding, no buffer twice.
            cs = place(cs, b.cs_sh)
            jax.block_until_ready(cs)
        add_scalars(accum, to_host(am))
    with timer("update"):
        if p.fidelity is not None and b.probe_due(gs) and first:  # before the tick: the weights and M it will use
            add_scalars(accum, to_host(p.fidelity(state.params, b.ref_params, mb, cs)))
        if p.staged_comm is not None:  # once a run, before the first call
            p.staged_comm.measure(p.train_step, (state, cs, mb))
        state, cs, m = p.train_step(state, cs, mb)
        m = to_host(dict(m))  # host sync, once per tick
    if b.fast:
        b.fast.tick_done()
    if b.anchor:
        with timer("anchor"):
            state, sm = b.anchor.after_tick(tau, state, cs)
            jax.block_until_ready(state)
        m.update(to_host(sm))
    add_scalars(accum, m)
    return state, cs


def ticks_metrics(b: BuiltRun, accum: dict, state) -> dict:
    """The step's tick metrics: means over its ticks, counts summed, the tick reached and its learning rate."""
    out = {k: float(np.mean(v)) for k, v in accum.items()}
    for k in ("grad/skipped", "anchor/fire"):
        if k in accum:
            out[k] = float(np.sum(accum[k]))
    out["tick"] = int(state.tick)
    out["lr"] = learning_rate(b.cfg.optim, int(state.tick))
    return out


def end_step(b: BuiltRun, cs, gs, tick_metrics) -> tuple:
    """(circuit state, metrics) after the ticks: the codec's view of the old pass when the tick's forward was it,
    and the codec's end of step (its basis refresh)."""
    if not b.fast:
        return cs, {}
    metrics = {}
    if b.programs.fused_old_pass:
        b.fast.count_forward(OLD)
        views = ("codec/mask_ratio", "codec/recon_rel_err")  # what summarize_aux reports of an old pass
        metrics.update({f"codec/{OLD}/{k[len('codec/') :]}": tick_metrics[k] for k in views if k in tick_metrics})
    codec_state, cm = b.fast.end_step(cs.codec, gs, cs.grad)
    metrics.update(cm)
    return cs._replace(codec=codec_state), metrics


def sampler_gauges(b: BuiltRun, col, staleness: int) -> dict:
    """The step's engine and pipeline gauges: bubble and collectives (staged), tokens/s, the sampler's own."""
    m = {}
    if b.pipeline is not None:
        m["pipeline/bubble_fraction"] = b.pipeline.bubble
        m.update(b.programs.staged_comm.parts or {})
    m["time/tokens_per_s"] = sum(col.lengths) / max(col.gen_s, 1e-9)
    m["sampler/restarts"] = 0
    if hasattr(b.sampler, "metrics"):  # vLLM: restarts, refused deltas, bytes of the newest weight sync
        m.update(b.sampler.metrics())
    m["sampler/weight_version"] = col.weight_version  # the rollouts' version, not the newest export
    m["sampler/staleness"] = staleness
    return m


def add_scalars(acc: dict, m: dict):
    """Append each scalar of `m` to its list in `acc` (a step's tick metrics, averaged by `ticks_metrics`)."""
    for k, v in m.items():
        if np.ndim(v) == 0:
            acc.setdefault(k, []).append(float(v))
