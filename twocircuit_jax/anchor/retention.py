"""Delayed pairing and retention (design §4.2): which batch and which exact weights the anchor replays.

Host-side and stateful on purpose: it owns host memory (numpy snapshots in the sampler dtype, retained batches),
which the anchor reads like a remote participant that only ever receives delayed, exact weight transfers.

Ticks are 1-based. On a step's first tick the buffer snapshots θ (exactly the sampler's weights) with a canary;
a tick's batch is retained iff τ ≡ −K (mod cadence), so at most ⌊K/cadence⌋+1 batches are ever held; a fire at
τ replays the batch of tick τ−K with the snapshot of that batch's step (before τ−K exists: the oldest retained).
Snapshot arrays are stored read-only and the canary is re-checked bitwise on every load.

Host memory (`host_bytes(cfg)`, from shapes): the live snapshots, each the parameters in the sampler dtype, at most
`max_snapshots` at once (the steps of the retained batches plus the current one, ≤ ⌊K/cadence⌋ + 2), and
the projection window's, which are the buffer's own snapshot objects (`current_snapshot`, shared, not copied). The
retained batches are the loop's device arrays (the anchor's fields only), counted apart as device bytes.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import jax
import ml_dtypes
import numpy as np

from twocircuit_jax.names import path_str
from twocircuit_jax.parallel.host import to_host


class CanaryMismatchError(RuntimeError):
    """A stored snapshot no longer matches the canary taken when it was stored."""


class ReplayInvariantError(AssertionError):
    """Delay or staleness differs from what the schedule guarantees after warm-up."""


class Replay(NamedTuple):
    batch: Any  # the retained batch, as handed to on_tick
    params: Any  # host numpy pytree in the sampler dtype (read-only arrays)
    snapshot_step: int  # global step whose first-tick weights generated the batch
    snapshot_tick: int  # first tick of that step
    batch_tick: int  # tick the batch was trained on by the fast circuit
    data_delay: int  # τ − batch_tick (= K after warm-up)
    weight_staleness: int  # τ − snapshot_tick (K … K + ticks_per_step − 1 after warm-up)
    warm: bool  # τ − K ≥ 1, so the delay assertions applied


def _to_dtype(name):
    return ml_dtypes.bfloat16 if str(name) == "bfloat16" else np.dtype(name)


def _is_float(x) -> bool:
    return np.issubdtype(x.dtype, np.floating) or x.dtype == ml_dtypes.bfloat16


def host_snapshot(params, dtype) -> Any:
    """Copy params to host numpy, floating leaves cast to the sampler dtype; arrays are made read-only."""

    def one(x):
        a = to_host(x)  # a gather when the params are sharded over several processes (collective)
        a = np.array(a.astype(dtype) if _is_float(a) else a, copy=True)
        a.setflags(write=False)
        return a

    return jax.tree_util.tree_map(one, params)


def canary(params) -> Tuple[Tuple[str, bytes], ...]:
    """fp32 norm and element sum (as raw bytes) of the 2-D+ tensors sorting first and last by path name."""
    flat = sorted(
        (path_str(p), np.asarray(x))
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if np.ndim(x) >= 2 and _is_float(np.asarray(x))
    )
    if not flat:
        return ()
    picks = [flat[0]] if len(flat) == 1 else [flat[0], flat[-1]]
    out = []
    for name, x in picks:
        x64 = x.astype(np.float32).astype(np.float64)
        stats = np.array([np.sqrt(np.sum(x64 * x64)), np.sum(x64)], np.float32)
        out.append((name, stats.tobytes()))
    return tuple(out)


class _Snapshot(NamedTuple):
    step: int
    tick: int
    params: Any
    canary: Tuple[Tuple[str, bytes], ...]


class ReplayBuffer:
    """Retained batches and the snapshots they reference, bounded by ⌊K/cadence⌋ + 1 batches."""

    def __init__(self, cadence: int, delay: int, sampler_dtype: str = "bfloat16", ticks_per_step: Optional[int] = None):
        if cadence < 1 or delay < 0:
            raise ValueError(f"need cadence >= 1 and delay >= 0, got cadence={cadence}, delay={delay}")
        self.cadence, self.delay, self.dtype = int(cadence), int(delay), _to_dtype(sampler_dtype)
        self.ticks_per_step = ticks_per_step
        self.max_batches = self.delay // self.cadence + 1
        self._snapshots: Dict[int, _Snapshot] = {}
        self._batches: List[Tuple[int, int, Any]] = []  # (tick, step, batch), oldest first
        self._tau: Optional[int] = None
        self._step: Optional[int] = None
        self._step_ticks: Dict[int, int] = {}  # ticks seen per step, to infer ticks_per_step

    # ------------------------------------------------------------------------------------------ recording
    def due(self, tau: int) -> bool:
        return (tau + self.delay) % self.cadence == 0

    def on_tick(self, tau: int, step: int, batch, params=None) -> bool:
        """Record tick τ of global step `step`. On a step's first tick `params` (a pytree, or a zero-argument
        callable returning one) is snapshotted. Returns whether the batch was retained."""
        if tau < 1 or (self._tau is not None and tau != self._tau + 1):
            raise ValueError(f"ticks must be 1-based and consecutive; got {tau} after {self._tau}")
        if self._step is None or step != self._step:
            if self._step is not None and step < self._step:
                raise ValueError(f"global step went backwards: {step} after {self._step}")
            if params is None:
                raise ValueError(f"tick {tau} is the first tick of step {step}: params are needed for the snapshot")
            snap = host_snapshot(params() if callable(params) else params, self.dtype)
            self._snapshots[step] = _Snapshot(step, tau, snap, canary(snap))
            self._step = step
        self._tau = tau
        self._step_ticks[step] = self._step_ticks.get(step, 0) + 1
        retained = self.due(tau)
        if retained:
            self._batches.append((tau, step, batch))
        self._prune()
        if len(self._batches) > self.max_batches:
            raise ReplayInvariantError(f"holding {len(self._batches)} batches > bound {self.max_batches}")
        return retained

    def _prune(self):
        live = {s for _, s, _ in self._batches} | {self._step}
        for s in [s for s in self._snapshots if s not in live]:
            del self._snapshots[s]

    # --------------------------------------------------------------------------------------------- replay
    def replay_for_fire(self, tau: int) -> Replay:
        """The delayed pair for a fire at τ (call after on_tick(τ, ...)); consumed batches are then released."""
        if tau != self._tau:
            raise ValueError(f"replay_for_fire({tau}) must follow on_tick({tau}); last tick is {self._tau}")
        if not self._batches:
            raise RuntimeError(f"no retained batch for the fire at tick {tau}")
        want = tau - self.delay
        warm = want >= 1
        match = [b for b in self._batches if b[0] == want]
        if warm and not match and self._batches[0][0] < want:
            raise ReplayInvariantError(f"batch of tick {want} was not retained for the fire at {tau}")
        b_tick, b_step, batch = match[0] if match else self._batches[0]
        snap = self._snapshots[b_step]
        if canary(snap.params) != snap.canary:
            raise CanaryMismatchError(f"snapshot of step {b_step} (tick {snap.tick}) changed since it was stored")
        out = Replay(batch, snap.params, b_step, snap.tick, b_tick, tau - b_tick, tau - snap.tick, warm and bool(match))
        if out.warm:
            tps = self.ticks_per_step or max(self._step_ticks.values())
            if out.data_delay != self.delay:
                raise ReplayInvariantError(f"data delay {out.data_delay} != K={self.delay} at tick {tau}")
            if not self.delay <= out.weight_staleness <= self.delay + tps - 1:
                raise ReplayInvariantError(
                    f"weight staleness {out.weight_staleness} outside "
                    f"[{self.delay}, {self.delay + tps - 1}] at tick {tau}"
                )
        self._batches = [b for b in self._batches if b[0] > want]
        self._prune()
        return out

    # ------------------------------------------------------------------------------------------- host state
    def state_dict(self) -> dict:
        """What an exact resume needs: the snapshots {step: (step, tick, params, canary)}, the retained batches
        [(tick, step, batch)] brought to host, the last tick and step, the ticks seen per step. Plain data (numpy
        arrays, bytes canaries, ints): no object that needs pickle; params-sized per held snapshot. Every process
        calls it: a sharded batch may be gathered."""
        return {
            "snapshots": {k: tuple(v) for k, v in self._snapshots.items()},
            "batches": [(t, s, to_host(x)) for t, s, x in self._batches],
            "tau": self._tau,
            "step": self._step,
            "step_ticks": dict(self._step_ticks),
        }

    def load_state_dict(self, d: dict) -> None:
        """The state `state_dict` gave. Snapshot arrays are made read-only again (a file gives writable ones), so
        the canary check on every replay still guards them."""
        snaps = {
            int(k): _Snapshot(int(v[0]), int(v[1]), v[2], tuple(tuple(c) for c in v[3]))
            for k, v in d["snapshots"].items()
        }
        for snap in snaps.values():
            jax.tree_util.tree_map(lambda a: a.setflags(write=False), snap.params)
        self._snapshots = snaps
        self._batches = [(int(t), int(s), x) for t, s, x in d["batches"]]
        self._tau = None if d["tau"] is None else int(d["tau"])
        self._step = None if d["step"] is None else int(d["step"])
        self._step_ticks = {int(k): int(v) for k, v in d["step_ticks"].items()}

    # ------------------------------------------------------------------------------------------ inspection
    def current_snapshot(self):
        """The current step's snapshot (host pytree, read-only): for a holder that needs the same weights (the
        projection window's base), so they are kept once."""
        return self._snapshots[self._step].params

    @property
    def num_batches(self) -> int:
        return len(self._batches)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def retained_ticks(self) -> List[int]:
        return [t for t, _, _ in self._batches]


def max_snapshots(cadence: int, delay: int, ticks_per_step: int) -> int:
    """Most snapshots a ReplayBuffer holds at once (fires every `cadence` ticks): one per step among the retained
    batches plus the current step's. Walks the schedule (ticks only, periodic in lcm(cadence, ticks_per_step) after
    the first K ticks); at most min(⌊K/cadence⌋, ⌊K/ticks_per_step⌋) + 2."""
    held, most = [], 0
    for tau in range(1, delay + 2 * math.lcm(cadence, ticks_per_step) + 2 * cadence + 1):
        if (tau + delay) % cadence == 0:
            held.append(tau)
        most = max(most, len({(b - 1) // ticks_per_step for b in held} | {(tau - 1) // ticks_per_step}))
        if tau % cadence == 0:
            held = [b for b in held if b > tau - delay]
    return most


def host_bytes(cfg, params_like=None) -> dict:
    """Host bytes the anchor holds at most, from shapes (`cfg` the RunConfig; `params_like` the parameter shapes,
    built from cfg.model when None): snapshots in the sampler dtype (the replay buffer's bound, plus the projection
    window's W beyond the buffer's as an upper bound), and the retained batches' bytes (device arrays)."""
    a = cfg.anchor
    if not a.enabled:
        return {"anchor/host_bytes": 0}
    if params_like is None:
        from twocircuit_jax.model.qwen2 import init_params  # shapes only

        params_like = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
    item = np.dtype(_to_dtype(cfg.model.param_dtype)).itemsize
    snap = sum(
        int(np.prod(x.shape)) * (item if _float_dtype(x.dtype) else np.dtype(x.dtype).itemsize)
        for x in jax.tree.leaves(params_like)
    )
    tps = cfg.ticks_per_step * cfg.train.ppo_epochs
    n_buf = max_snapshots(a.cadence, a.delay, tps)
    p = a.projection
    n_win = (p.window if p.window_mode == "sliding_window" else p.max_snapshots) if p.enabled else 0
    from twocircuit_jax.anchor.loss import anchor_batch_keys

    rows, T = (
        cfg.train.prompts_per_update * cfg.sampler.n,
        cfg.train.max_prompt_len + cfg.sampler.sampling.max_new_tokens,
    )
    per_row = {"tokens": 4 * T, "attention_mask": 4 * T, "response_mask": 4 * T, "advantages": 4}
    per_row.update(ref_logp_dense=4 * T, sampler_logp=4 * T)
    batch = rows * sum(per_row[k] for k in anchor_batch_keys(cfg.grpo))
    out = {
        "anchor/snapshot_bytes": snap,
        "anchor/snapshots": n_buf,
        "anchor/window_snapshots": n_win,
        "anchor/retained_batches": a.delay // a.cadence + 1,
        "anchor/retained_batch_device_bytes": (a.delay // a.cadence + 1) * batch,
    }
    out["anchor/host_bytes"] = (n_buf + n_win) * snap
    return out


def _float_dtype(dt) -> bool:
    return np.issubdtype(np.dtype(dt), np.floating) or np.dtype(dt) == ml_dtypes.bfloat16
