"""The pure train step, jitted once with explicit shardings and donated state.

`make_train_step` wires four pluggable pieces, so the fast circuit and the anchor add behaviour without forking it:
  loss_fn(params, batch, ctx) -> (loss, metrics)          GRPO loss (fast circuit: codec hooks inside)
  grad_fn(loss_fn) -> fn(params, batch, ctx) -> (grads, loss, metrics)   default: jax.value_and_grad; XLA inserts
                                                          the data-parallel mean. PowerSGD replaces it.
  grad_transform(grads, ctx) -> (grads, metrics)          merger (anchor circuit), before clipping
  optimizer (optax)                                       clip + AdamW
A non-finite gradient norm skips the update: params and optimizer state unchanged, `grad/skipped` = 1.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from twocircuit_jax.parallel import dispatch, mesh as pmesh


class TrainState(NamedTuple):
    params: Any  # param pytree, param_dtype, sharded by parallel.mesh rules
    opt_state: Any  # optax state; moments sharded like params, counts replicated
    tick: jax.Array  # [] int32: optimizer ticks taken (skipped ones included)
    skipped: jax.Array  # [] int32: ticks whose update was skipped (non-finite gradient)


def make_optimizer(optim_cfg, total_ticks: int = 0) -> optax.GradientTransformation:
    """Global-norm clip then AdamW, learning rate with linear warm-up. Moments are fp32 whatever the params."""
    lr = optim_cfg.lr
    if optim_cfg.warmup_steps > 0:
        lr = optax.linear_schedule(0.0, optim_cfg.lr, optim_cfg.warmup_steps)
    parts = []
    if optim_cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(optim_cfg.grad_clip))
    parts.append(
        optax.adamw(
            lr,
            b1=optim_cfg.b1,
            b2=optim_cfg.b2,
            eps=optim_cfg.eps,
            weight_decay=optim_cfg.weight_decay,
            mu_dtype=jnp.float32,
        )
    )
    return optax.chain(*parts)


def learning_rate(optim_cfg, tick) -> float:
    if optim_cfg.warmup_steps > 0:
        return float(optim_cfg.lr * min(1.0, tick / optim_cfg.warmup_steps))
    return float(optim_cfg.lr)


def init_state(params, optimizer) -> TrainState:
    return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def state_shardings(state: TrainState, mesh) -> TrainState:
    rep = pmesh.replicated(mesh)
    return TrainState(
        pmesh.param_shardings(state.params, mesh),
        pmesh.like_param_shardings(state.opt_state, state.params, mesh),
        rep,
        rep,
    )


def default_grad_fn(loss_fn):
    def fn(params, batch, ctx):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, ctx)
        return grads, loss, metrics

    return fn


def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    grad_fn: Optional[Callable] = None,
    grad_transform: Optional[Callable] = None,
    skip_nonfinite: bool = True,
):
    """Pure (state, batch, ctx) -> (state', metrics). `ctx` carries per-call inputs that are not donated
    (codec state, step key, merger state)."""
    compute = (grad_fn or default_grad_fn)(loss_fn)

    def step(state: TrainState, batch, ctx):
        grads, loss, metrics = compute(state.params, batch, ctx)
        metrics = dict(metrics)
        if grad_transform is not None:
            grads, extra = grad_transform(grads, ctx)
            metrics.update(extra)
        gnorm = optax.tree.norm(grads)
        ok = jnp.isfinite(gnorm) if skip_nonfinite else jnp.array(True)
        # Zero out a bad gradient before the optimizer sees it, then keep the old state: no NaN reaches Adam.
        safe = jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)
        updates, new_opt = optimizer.update(safe, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        new_params = jax.tree.map(lambda p, q: p.astype(q.dtype), keep(new_params, state.params), state.params)
        new_opt = keep(new_opt, state.opt_state)
        metrics.update({"loss": loss, "grad/norm": gnorm, "grad/skipped": (~ok).astype(jnp.int32)})
        return TrainState(new_params, new_opt, state.tick + 1, state.skipped + (~ok).astype(jnp.int32)), metrics

    return step


def jit_train_step(
    step, state_sharding: TrainState, batch_sharding=None, ctx_sharding=None, metrics_sharding=None, donate=True
):
    """The one place a train step is jitted (GRPO loop, SFT, scripts/comm_bytes.py, the benchmarks, tests):
    explicit in/out shardings, compiled once per run, state donated (its buffers are reused for the new state;
    `donate=False` only for benchmarks that feed one state many times). A `None` sharding leaves that input or
    output where XLA puts it."""
    return dispatch.jit(
        step,
        in_shardings=(state_sharding, batch_sharding, ctx_sharding),
        out_shardings=(state_sharding, metrics_sharding),
        donate_argnums=(0,) if donate else (),
    )


def build_train_step(
    loss_fn,
    optimizer,
    state_sharding: TrainState,
    mesh,
    *,
    grad_fn=None,
    grad_transform=None,
    skip_nonfinite: bool = True,
    batch_sharding=None,
    ctx_sharding="auto",
    donate=True,
):
    """`make_train_step` + `jit_train_step` with the project's sharding rule for ctx and metrics: replicated, except
    with a gradient codec (PowerSGD), whose per-replica error memory lives split over data parallel and leaves the
    step with the metrics; there both stay free (forcing replication would all-gather the memory every tick).
    `ctx_sharding` overrides the ctx rule (compiling from shapes alone needs explicit shardings)."""
    step = make_train_step(
        loss_fn, optimizer, grad_fn=grad_fn, grad_transform=grad_transform, skip_nonfinite=skip_nonfinite
    )
    free = None if grad_fn is not None else pmesh.replicated(mesh)
    ctx_sharding = free if ctx_sharding == "auto" else ctx_sharding
    return jit_train_step(step, state_sharding, batch_sharding, ctx_sharding, free, donate)


def shard_state(state: TrainState, shardings: TrainState) -> TrainState:
    return jax.device_put(state, shardings)
