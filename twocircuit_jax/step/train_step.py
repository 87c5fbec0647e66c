"""The pure train step, jitted once with explicit shardings and donated state.

`make_train_step` builds `step(train_state, circuit_state, batch) -> (train_state, circuit_state, metrics)` from
pluggable pure pieces, so the fast circuit and the anchor add behaviour without forking it:
  loss_fn(params, batch, cs) -> (loss, metrics, aux)      GRPO loss (fast circuit: codec hooks inside); aux is the
                                                          codec's raw per-boundary outputs ({} without one), a
                                                          pytree of its own that never leaves the step.
  grad_fn(loss_fn) -> fn(params, batch, cs) -> (grads, loss, metrics, aux, cs)   default: jax.value_and_grad, XLA
                                                          inserts the data-parallel mean; PowerSGD replaces it and
                                                          returns its next state in cs.grad.
  absorb_aux(codec_state, aux) -> codec_state             folds aux into cs.codec (the low-rank sketch)
  grad_transform(grads, cs) -> (grads, cs, metrics)       merger (anchor circuit), before clipping
  optimizer (optax)                                       clip + AdamW
`cs` is the circuit state (step/circuit_state.py). Metrics leave the step as scalars only.
A non-finite gradient norm skips the update: params and optimizer state unchanged, `grad/skipped` = 1.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from twocircuit_jax.model.qwen2 import as_computed
from twocircuit_jax.parallel import dispatch, mesh as pmesh, micro_batch as accumulate
from twocircuit_jax.parallel.mesh_context import under


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


def reference_copy(params, compute_dtype: str):
    """The frozen reference policy the ℓ_ref passes read: a copy (the train state's buffers are donated every tick),
    in the compute dtype where that is narrower than the weights'. Every use of a weight in the forward casts it to
    the compute dtype first (model/qwen2.py: matmuls, biases, norm scales, the embedding and the head), so the
    reference log-probs are the same bits, and the copy costs half the memory (fp32 weights, bf16 compute: 1.44
    of a v5e's 16 GiB for Qwen2.5-1.5B on 4-way FSDP becomes 0.72). Works on arrays and on ShapeDtypeStructs."""

    def one(a):
        dt = as_computed(a.dtype, compute_dtype)
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape, dt, sharding=a.sharding)
        return a.astype(dt) if dt != a.dtype else jnp.copy(a)

    return jax.tree.map(one, params)


def state_shardings(state: TrainState, mesh) -> TrainState:
    rep = pmesh.replicated(mesh)
    return TrainState(
        pmesh.param_shardings(state.params, mesh),
        pmesh.like_param_shardings(state.opt_state, state.params, mesh),
        rep,
        rep,
    )


def default_grad_fn(loss_fn, *, micro_batch: int = 0, mesh=None):
    """XLA's implicit data-parallel mean. `micro_batch` > 0: accumulated over micro-batches of that many rows per
    replica (parallel/micro_batch.py; `mesh` gives the replica count and keeps the batch sharding); 0: no scan."""
    dp = pmesh.dp_size(mesh) if mesh is not None else 1
    vg = accumulate.value_and_grad(loss_fn, micro_batch, dp=dp, mesh=mesh)

    def fn(params, batch, cs):
        (loss, metrics, aux), grads = vg(params, batch, cs)
        return grads, loss, metrics, aux, cs

    return fn


def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    grad_fn: Optional[Callable] = None,
    absorb_aux: Optional[Callable] = None,
    grad_transform: Optional[Callable] = None,
    skip_nonfinite: bool = True,
    micro_batch: int = 0,
    mesh=None,
):
    """Pure (train_state, circuit_state, batch) -> (train_state', circuit_state', scalar metrics). `micro_batch` /
    `mesh`: the default grad_fn's accumulation (a gradient codec's grad_fn takes its own)."""
    compute = grad_fn(loss_fn) if grad_fn else default_grad_fn(loss_fn, micro_batch=micro_batch, mesh=mesh)

    def step(state: TrainState, cs, batch):
        grads, loss, metrics, aux, cs = compute(state.params, batch, cs)
        metrics = dict(metrics)
        if absorb_aux is not None and aux:
            cs = cs._replace(codec=absorb_aux(cs.codec, aux))
        if grad_transform is not None:
            grads, cs, extra = grad_transform(grads, cs)
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
        new_state = TrainState(new_params, new_opt, state.tick + 1, state.skipped + (~ok).astype(jnp.int32))
        return new_state, cs, metrics

    return step


def jit_train_step(
    step, state_sharding: TrainState, circuit_sharding=None, batch_sharding=None, metrics_sharding=None, donate=True
):
    """The one place a train step is jitted (GRPO loop, SFT, scripts/comm_bytes.py, the benchmarks, tests):
    explicit in/out shardings, compiled once per run, train and circuit state donated (their buffers are reused for
    the new states; `donate=False` only for benchmarks and tests that feed one state many times). A `None` sharding
    leaves that input or output where XLA puts it. A donated circuit state must not hold one buffer twice
    (`circuit_state.distinct_buffers`)."""
    return dispatch.jit(
        step,
        in_shardings=(state_sharding, circuit_sharding, batch_sharding),
        out_shardings=(state_sharding, circuit_sharding, metrics_sharding),
        donate_argnums=(0, 1) if donate else (),
    )


def build_train_step(
    loss_fn,
    optimizer,
    state_sharding: TrainState,
    mesh,
    *,
    circuit_sharding=None,
    grad_fn=None,
    absorb_aux=None,
    grad_transform=None,
    skip_nonfinite: bool = True,
    batch_sharding=None,
    donate=True,
    micro_batch: int = 0,
):
    """`make_train_step` + `jit_train_step`; metrics (scalars) come out replicated. `circuit_sharding` is the
    circuit state's sharding tree (the loop's `circuit_shardings`); None leaves it free. `micro_batch`: rows per
    replica per forward/backward of the default grad_fn (train.micro_batch_per_device; 0 = the whole mini-batch)."""
    step = make_train_step(
        loss_fn,
        optimizer,
        grad_fn=grad_fn,
        absorb_aux=absorb_aux,
        grad_transform=grad_transform,
        skip_nonfinite=skip_nonfinite,
        micro_batch=micro_batch,
        mesh=mesh,
    )
    step = under(mesh, step)  # traced with the mesh as context: rows stay split between layers (mesh_context)
    return jit_train_step(step, state_sharding, circuit_sharding, batch_sharding, pmesh.replicated(mesh), donate)
