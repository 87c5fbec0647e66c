"""The anchor circuit in the GRPO loop (design §2 step 4, §4): fire, merger, rank-1 projection, optimizer swap.

The loop calls, per tick τ: `before_tick` (snapshot/retain, and the fire when `fire_due(τ)`) → the jitted train
step, whose `grad_transform` applies the merger → `after_tick` (the optimizer-state swap when `swap_due(τ)`). The
anchor never reads live trainer parameters for its gradient: a fire runs on a host snapshot (the delayed paired
one, or a rank-1 forecast built only from exact delayed snapshots), and the trainer state is never written by a
fire. It has no optimizer, sampler or task handle, so `anchor/{optimizer_steps, rollouts_generated,
rewards_recomputed}` are structurally 0.

Device state lives in the circuit state the loop threads through (step/circuit_state.py): `cs.merger` (replicated,
one fixed sharding so the step compiles once) and `cs.moments` (swap only; sharded like the parameters). This
object keeps configuration, host counters and the host replay buffers, all in `state_dict()`. Resume: the
trainer puts the counters in the checkpoint's meta and the retained batches, host snapshots and projection window
beside it as plain data (train/run_checkpoints.py; stored without pickle, train/safe_blob.py), so a resumed run
fires on the same pairs as an uninterrupted one.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from twocircuit_jax.anchor.loss import anchor_batch_keys, make_anchor_grad
from twocircuit_jax.anchor.merger import init_merger, merge, merger_shardings, path_str, update_ema
from twocircuit_jax.anchor.projection import SnapshotWindow
from twocircuit_jax.anchor.retention import ReplayBuffer
from twocircuit_jax.anchor.swap import (
    all_finite,
    init_anchor_moments,
    swap_optimizer_moments,
    update_anchor_moments,
)
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.model.qwen2 import as_computed
from twocircuit_jax.parallel import dispatch, mesh as pmesh, micro_batch as accumulate
from twocircuit_jax.parallel.host import to_global
from twocircuit_jax.parallel.mesh_context import under


def fire_weights(weights, compute_dtype: str):
    """The fire's weights as they cross to the device: each floating leaf in the compute dtype where that is
    narrower (model/qwen2.py as_computed), as host arrays or as ShapeDtypeStructs for the shapes-only tools.
    `_fire_fn` widens them back; the fire's result is the same."""

    def one(x):
        dt = as_computed(x.dtype, compute_dtype)
        if dt == x.dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)
        return x.astype(dt) if isinstance(x, jax.Array) else np.asarray(x).astype(dt)

    return jax.tree.map(one, weights)


def _new_step() -> dict:
    """Per-step accumulators: fire ticks, swap ρs, (delay, staleness) pairs, skip flags (device int32 scalars)."""
    return {"fire_ticks": [], "rhos": [], "replays": [], "skips": []}


_ZERO_COUNTERS = ("anchor/optimizer_steps", "anchor/rollouts_generated", "anchor/rewards_recomputed")


class AnchorCircuit:
    def __init__(self, run_cfg, model_cfg, params, sketcher=None, pipeline=None):
        a = self.cfg = run_cfg.anchor
        # Anchor-owned low-rank basis: every fire's dense forward also sketches the activations (unchanged) with
        # `sketcher(basis_state, attention_mask) -> (hook, layers)`, handed in by the loop; the fire returns the
        # sketch, and the loop gives it to the basis (one power-iteration step, staged). The anchor never sees the
        # codec itself.
        self.owns_q = bool(run_cfg.anchor_owns_q)
        if self.owns_q and (sketcher is None or not run_cfg.fast.codec.learns_basis):
            raise ConfigError("anchor.owns_q", "an anchor-owned basis needs a fast.codec that learns a basis")
        self.grpo = run_cfg.grpo
        self.param_sh = jax.tree.map(lambda x: x.sharding, params)
        self.rep = NamedSharding(jax.tree.leaves(self.param_sh)[0].mesh, P())
        self.dtype = model_cfg.param_dtype  # the sampler's dtype: snapshots are exactly the generating weights
        self.compute_dtype = model_cfg.compute_dtype  # what the fire's weights cross to the device in (_fire)
        self.tps = run_cfg.ticks_per_step * run_cfg.train.ppo_epochs
        self.buffer = ReplayBuffer(a.cadence, a.delay, self.dtype, ticks_per_step=self.tps)
        self.window = SnapshotWindow.from_config(a.projection) if a.projection.enabled else None
        self.merger_on = a.merger_type != "none"
        self._batch_keys = anchor_batch_keys(run_cfg.grpo)
        # Carry of the fire: merger state and anchor moments (both sharded like params; moments: swap only).
        by_path = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(self.param_sh)[0]}
        self._params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.mom_sh = None
        if a.swap.cadence > 0:
            mom = jax.eval_shape(lambda: init_anchor_moments(params, a.target_scope))
            self.mom_sh = type(mom)(m={k: by_path[k] for k in mom.m}, v={k: by_path[k] for k in mom.v}, fired=self.rep)
        # train.micro_batch_per_device: the fire accumulates over micro-batches like the train step (one micro-batch's
        # activations at a time); checked here against the mesh too (ConfigError naming the field).
        mesh = self.rep.mesh
        grad_fn = make_anchor_grad(
            model_cfg,
            run_cfg.grpo,
            run_cfg.sampler.sampling.max_new_tokens,
            sketcher if self.owns_q else None,
            pipeline=pipeline,
            micro_batch=accumulate.check(run_cfg, pmesh.dp_size(mesh)),
            mesh=mesh,
        )
        # The merger's M (and δ) sharded like their parameters (fsdp: 1/fsdp per device), scalars replicated.
        self.merger_sh = None
        if self.merger_on:
            self.merger_sh = merger_shardings(
                jax.eval_shape(lambda: init_merger(params, a.merger, a.target_scope)), self.param_sh
            )
        carry_sh = {"merger": self.rep if self.merger_sh is None else self.merger_sh, "moments": self.mom_sh}
        # One jitted dense forward/backward (+ EMA and moment updates), compiled once: fixed batch keys/shapes,
        # snapshot params put on the parameter shardings. The carry is donated; the trainer state is not an input.
        # The basis state is a separate, non-donated input (its bases share buffers across fields); the sketch is
        # an output.
        self._fire_jit = dispatch.jit(
            under(mesh, functools.partial(self._fire_fn, grad_fn)),
            in_shardings=(self.param_sh, None, carry_sh, self.rep),
            out_shardings=(carry_sh, self.rep, self.rep),
            donate_argnums=(2,),
        )
        self._swap_jit = None
        self.fires = self.swaps = self.rank1_bypass_ticks = self.warmup_fires = 0
        self.anchor_rows = self.fast_rows = 0
        self._gen_tick = None
        self.skipped = 0  # cumulative non-finite fires and swaps that were not applied (`anchor/skipped`)
        self._step: dict = _new_step()

    # --- circuit state and the jitted pieces ----------------------------------------------------------------
    @property
    def fire_program(self):
        """The fire's jitted program: (snapshot weights in the compute dtype (`fire_weights`), fire batch, carry
        {merger, moments}, basis or None) -> (carry, metrics, sketch). step/programs.py hands it to the shapes-only
        tools."""
        return self._fire_jit

    def init_merger_state(self):
        """cs.merger from tick 1 (fixed structure: no recompile), or None without a merger. Built by a jitted init,
        so its leaves are distinct buffers (the fire and the step donate them)."""
        if not self.merger_on:
            return None
        like, a = self._params_like, self.cfg
        return dispatch.jit(lambda: init_merger(like, a.merger, a.target_scope), out_shardings=self.merger_sh)()

    def init_moments(self):
        """cs.moments (the swap's source), or None without the swap."""
        if self.mom_sh is None:
            return None
        like, scope = self._params_like, self.cfg.target_scope
        return dispatch.jit(lambda: init_anchor_moments(like, scope), out_shardings=self.mom_sh)()

    def fire_due(self, tau: int) -> bool:
        return tau % self.cfg.cadence == 0

    def keeps(self, tau: int) -> bool:
        """Whether tick τ's mini-batch is read by the anchor: retained for a later fire, or replayed by this tick's
        fire (the projection's forecast pairs with the current batch). Only these need the anchor's batch fields."""
        return self.buffer.due(tau) or (self.fire_due(tau) and self.window is not None)

    def merge_due(self, tau: int) -> bool:
        return tau % self.cfg.merger_cadence == 0

    def swap_due(self, tau: int) -> bool:
        a = self.cfg
        return a.swap.cadence > 0 and tau % a.swap.cadence == 0 and self.fires > 0

    def _fire_fn(self, grad_fn, params, batch, carry, basis):
        # The weights arrive in the compute dtype (`fire_weights`) and are widened back to the parameters' dtype
        # here. The forward casts every weight to the compute dtype first (model/qwen2.py), so it reads the same
        # values, and the gradient is taken with respect to the wide copy: its cotangents add up in the parameters'
        # dtype, as with the wide weights themselves. The compiler folds the widen-then-narrow pair, so the wide
        # copy is not materialised; half the bytes cross to the device and sit in the fire's arguments.
        params = jax.tree.map(lambda x, like: x.astype(like.dtype), params, self._params_like)
        grads, metrics, sketch = grad_fn(params, batch, basis)  # the sketch is summed over the global batch
        out = dict(carry)
        if carry.get("merger") is not None:
            out["merger"] = update_ema(carry["merger"], grads, self.cfg.merger)
        if carry.get("moments") is not None:
            out["moments"] = update_anchor_moments(carry["moments"], grads, self.cfg.swap.beta1, self.cfg.swap.beta2)
        # A non-finite gradient, EMA or moment is never applied: the whole carry stays as it was (fired counts too).
        # A select inside the program: no host sync here; the flag is read with the step's metrics (step_metrics).
        ok = all_finite((grads, out))
        out = jax.tree.map(lambda new, old: jnp.where(ok, new, old), out, carry)
        metrics = {**metrics, "anchor/fire_skipped": (~ok).astype(jnp.int32)}
        return out, metrics, sketch if basis is not None else None

    def grad_transform(self, grads, cs):
        """Traced inside the train step, before clip/AdamW: (grads, cs with the next merger state, metrics).
        lax.cond: until M exists (or off the merger cadence) only the identity branch runs, so the merger costs
        nothing before the first fire."""
        if not self.merger_on:
            return grads, cs, {}
        st, fire = cs.merger, cs.clock.anchor_fire

        def on(_):
            return merge(st, grads, self.cfg.merger, fire)

        def off(_):
            shapes = jax.eval_shape(on, None)[2]
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return grads, st, zeros

        g, st_new, metrics = jax.lax.cond(cs.clock.anchor_merge & (st.fired > 0), on, off, None)
        metrics = dict(metrics)
        metrics.pop("merger/coldM_fallbacks", None)  # cumulative: reported per step from the state instead
        return g, cs._replace(merger=st_new), metrics

    # --- per tick -----------------------------------------------------------------------------------------------
    def before_tick(self, tau, gs, first_tick_of_step, minibatch, state, cs, basis=None):
        """Returns (cs, metrics, sketch): `cs` with the fire's merger and moments and this tick's merger clock;
        `sketch` is the fire's dense sketch against `basis` (an anchor-owned basis, on a fire tick), else None."""
        a = self.cfg
        batch = None
        if self.keeps(tau):
            missing = [k for k in self._batch_keys if k not in minibatch]
            if missing:
                raise ValueError(f"anchor: tick {tau}'s mini-batch is kept for a fire but has no {missing}")
            batch = {k: minibatch[k] for k in self._batch_keys}
        self.fast_rows += int(minibatch["tokens"].shape[0])
        # Snapshot on the step's first tick (a params-sized device→host copy, host sync), retain if due.
        self.buffer.on_tick(tau, gs, batch, params=lambda: state.params)
        if first_tick_of_step:
            self._gen_tick = tau
            if self.window is not None and not self.window.ticks:  # base = first generator snapshot: the buffer's
                self.window.add_base(tau, self.buffer.current_snapshot())  # own (read-only), not a second copy
        metrics, sketch = {}, None
        fire = self.fire_due(tau)
        if fire:
            cs, metrics, sketch = self._fire(tau, batch, cs, basis)
        if self.merger_on:
            if not self.fires:
                self.rank1_bypass_ticks += int(a.projection.enabled)  # M not ready: the merger bypasses this tick
            clock = cs.clock._replace(anchor_fire=jnp.asarray(fire), anchor_merge=jnp.asarray(self.merge_due(tau)))
            cs = cs._replace(clock=clock)
        return cs, metrics, sketch

    def _fire(self, tau, batch, cs, basis):
        """One dense forward/backward on the delayed pair (or the forecast with the current batch)."""
        if self.owns_q and basis is None:
            raise ValueError("anchor fire: the anchor owns the basis but no basis state was handed in")
        rep = self.buffer.replay_for_fire(tau)  # raises on broken delay/staleness or a changed snapshot
        weights, fire_batch, metrics = rep.params, rep.batch, {}
        window = None
        if self.window is not None:
            window = self.window.copy()  # a trial copy: a raising forecast leaves the window as it was
            window.add_exact(rep.snapshot_tick, rep.params)
            if window.ready:
                try:
                    weights, r1 = window.forecast(self._gen_tick, self.cfg.projection.strength)
                except FloatingPointError:  # a non-finite snapshot or forecast: this fire is skipped whole (no
                    # backward; M, the moments, Q's sketch and the window stay as they were), counted in
                    # anchor/skipped and warned by step_metrics, like a non-finite gradient
                    self._step["skips"].append(1)
                    return cs, {}, None
                fire_batch = batch  # the current tick's batch, generated by the weights at _gen_tick
                metrics.update(r1)
            else:
                self.warmup_fires += 1
        carry = {"merger": cs.merger, "moments": cs.moments}
        dev = to_global(fire_weights(weights, self.compute_dtype), self.param_sh)  # host → device, in compute dtype
        carry, fm, sketch = self._fire_jit(dev, fire_batch, carry, basis if self.owns_q else None)  # serialised on CPU
        # Nothing above may fail after this point: state changes only now.
        if window is not None:
            self.window = window
        cs = cs._replace(merger=carry["merger"], moments=carry["moments"])
        self.fires += 1
        self.anchor_rows += int(fire_batch["tokens"].shape[0])
        self._step["fire_ticks"].append(tau)
        self._step["replays"].append((rep.data_delay, rep.weight_staleness))
        self._step["skips"].append(fm.pop("anchor/fire_skipped"))  # a device scalar: read in step_metrics
        metrics.update(fm)
        return cs, metrics, sketch

    def after_tick(self, tau, state, cs):
        """The optimizer-state swap when due: (train state with the anchor's moments blended in, metrics)."""
        out = {}
        a = self.cfg
        if self.swap_due(tau):
            if self._swap_jit is None:  # built once, with the trainer's own opt-state shardings
                opt_sh = jax.tree.map(lambda x: x.sharding, state.opt_state)
                fn = functools.partial(
                    swap_optimizer_moments, alpha=a.swap.alpha, scale_match=a.swap.scale_match, mode=a.swap.mode
                )
                self._swap_jit = dispatch.jit(
                    fn, in_shardings=(opt_sh, self.mom_sh), out_shardings=(opt_sh, self.rep), donate_argnums=(0,)
                )
            opt, sm = self._swap_jit(state.opt_state, cs.moments)
            state = state._replace(opt_state=opt)
            self.swaps += 1
            self._step["rhos"].append(sm["swap/rho"])
            self._step["skips"].append(sm["swap/skipped"])
            out["swap/applied"] = sm["swap/applied"]
        return state, out

    # --- reporting and resume -----------------------------------------------------------------------------------
    def step_metrics(self, cs) -> dict:
        """Per GRPO step; resets the per-step accumulators. Reading ρ is a host sync (once per step)."""
        s = self._step
        skipped_now = int(sum(int(x) for x in s["skips"]))  # host sync, beside the ρ read below (once per step)
        self.skipped += skipped_now
        if skipped_now:
            print(
                f"warning: anchor: {skipped_now} fire(s)/swap(s) this step had a non-finite gradient, EMA, moment or "
                f"rank-1 forecast and were skipped (anchor/skipped={self.skipped}); the EMA, moments and AdamW state were kept",
                file=sys.stderr,
            )
        out = {
            "anchor/fires": self.fires,
            "anchor/backwards": self.fires,
            "anchor/fire": float(bool(s["fire_ticks"])),
            "anchor/rank1_bypass_ticks": self.rank1_bypass_ticks,
            "anchor/rank1_warmup_fires": self.warmup_fires,
            "anchor/batch_fraction": self.anchor_rows / max(self.fast_rows, 1),
            "anchor/retained_batches": self.buffer.num_batches,
            "anchor/retained_snapshots": self.buffer.num_snapshots,
            "anchor/skipped": self.skipped,
            **{k: 0 for k in _ZERO_COUNTERS},
        }
        if cs.merger is not None:
            out["anchor/merger_coldM_fallbacks"] = int(cs.merger.cold_m_fallbacks)
        if s["fire_ticks"]:
            out["anchor/fire_tick"] = s["fire_ticks"][-1]
            out["anchor/data_delay"] = float(np.mean([d for d, _ in s["replays"]]))
            out["anchor/weight_staleness"] = float(np.mean([w for _, w in s["replays"]]))
        if self.cfg.swap.cadence > 0:
            out["swap/count"] = self.swaps
            if s["rhos"]:
                out["swap/rho"] = float(np.mean([float(r) for r in s["rhos"]]))
        self._step = _new_step()
        return out

    _COUNTERS = ("fires", "swaps", "rank1_bypass_ticks", "warmup_fires", "anchor_rows", "fast_rows", "skipped")

    def state_dict(self) -> dict:
        """Host state for an exact resume: {"counters": {name: int} (JSON), "gen_tick": int | None, "buffer": the
        replay buffer's state, "window": the projection window's state or None}. The buffer and the window hold
        host arrays, params-sized per held snapshot; every process calls it (a retained batch may be gathered).
        The per-step accumulators are not in it: `step_metrics` empties them at every step's end, before any
        checkpoint."""
        return {
            "counters": {k: getattr(self, k) for k in self._COUNTERS},
            "gen_tick": self._gen_tick,
            "buffer": self.buffer.state_dict(),
            "window": None if self.window is None else self.window.state_dict(),
        }

    def load_state_dict(self, d: dict) -> None:
        """Resume: the counters (a missing one is 0), and the host buffers unless `d["buffer"]` is None (a
        checkpoint saved without them: the fresh, empty ones stay). The device state comes back in the circuit
        state."""
        c = d.get("counters") or {}
        for k in self._COUNTERS:
            setattr(self, k, int(c.get(k, 0)))
        if d.get("buffer") is None:
            return
        self.buffer.load_state_dict(d["buffer"])
        self._gen_tick = d["gen_tick"]
        if self.window is not None and d.get("window") is not None:
            self.window.load_state_dict(d["window"])
