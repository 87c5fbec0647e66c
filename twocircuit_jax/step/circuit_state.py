"""The circuit state: everything the two circuits carry between ticks, as one pytree (design §2).

The jitted train step is `step(train_state, circuit_state, batch) -> (train_state, circuit_state, metrics)`; the
fast circuit and the anchor each own some fields and update them with pure functions, and the loop threads the
whole tree through. Nothing of it lives in module or object state, so a checkpoint of (train_state, circuit_state)
plus the host counters is a complete resume point.

Each field is `None` when the piece that owns it is off, so the tree's structure is fixed for a run (the step
compiles once) and the dense trainer's circuit state is a clock and four `None`s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Clock(NamedTuple):
    """Per-tick scalars the loop writes before each tick (host decisions, fed to the step as data)."""

    step: jax.Array  # [] int32 GRPO step gs: the PRF step key of every codec forward (never the tick)
    first_minibatch: jax.Array  # [] bool: this tick's parameters produced ℓ_old (the PPO ratio is exactly 1)
    anchor_fire: jax.Array  # [] bool: an anchor fire folded a fresh gradient into M just before this tick
    anchor_merge: jax.Array  # [] bool: the merger corrects this tick's gradient (anchor.merger.cadence)


class CircuitState(NamedTuple):
    clock: Clock
    codec: Any  # activation codec state: LowRankState (the basis, fp32 [H, r] per boundary, replicated) or None
    grad: Any  # gradient codec state: PowerSGDState (Q [m, r] replicated, error memory split over dp) or None
    merger: Any  # the merger's own state (anchor/merger.py STATES: fp32, target-leaf shaped, sharded like the params) or None
    moments: Any  # AnchorMoments (fp32 m, v sharded like the params; the swap's source) or None


def init_clock(step: int = 0) -> Clock:
    """Every field its own buffer: a donated clock must not hold one buffer twice."""
    return Clock(jnp.asarray(step, jnp.int32), jnp.asarray(False), jnp.asarray(False), jnp.asarray(True))


def dense_state() -> CircuitState:
    """The circuit state of a run with neither circuit (the dense trainer, SFT)."""
    return CircuitState(init_clock(), None, None, None, None)


def set_clock(cs: CircuitState, **fields) -> CircuitState:
    """A new state whose clock has `fields` replaced (python values become device scalars of the clock's dtypes)."""
    clock = cs.clock._replace(**{k: jnp.asarray(v, getattr(cs.clock, k).dtype) for k, v in fields.items()})
    return cs._replace(clock=clock)


def distinct_buffers(tree):
    """Copy every leaf whose device buffer already appeared earlier in `tree`.

    The train step donates the circuit state, and a donated input must not hold one buffer twice: the low-rank
    state starts with the same Q₀ in four fields, a refresh stages one new basis into two, and `device_put` of one
    array twice hands back two array objects over one buffer. Host-side and cheap: a buffer address per local
    shard and leaf, a device copy only for repeats."""
    seen: set[int] = set()

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        ptrs = [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
        if any(p in seen for p in ptrs):
            return jnp.copy(x)
        seen.update(ptrs)
        return x

    return jax.tree.map(one, tree)


def place(cs: CircuitState, shardings) -> CircuitState:
    """The circuit state as the jitted step takes it: every leaf committed to its sharding (fresh clock scalars
    from the host included, so the step sees one input signature and compiles once) and no buffer held twice.
    `device_put` of a leaf already placed there moves nothing."""
    return distinct_buffers(jax.device_put(cs, shardings))
