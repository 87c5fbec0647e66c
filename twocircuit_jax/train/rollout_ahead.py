"""Rollouts one step ahead (`train.async_rollouts: 1`): the sampler generates step gs+1's rollouts while the trainer
updates on step gs.

The schedule, with the loop's calls in order:

    step gs:  take(gs)          the rollouts generated during step gs-1 (none yet: the loop collects them now)
              start(gs+1, fn)   generate step gs+1's from the weights the sampler holds, version gs-1
              ...               old/ref log-probs and the optimizer ticks of step gs, meanwhile
              join()            before publishing version gs, so step gs+1's rollouts are all version gs-1
              publish gs

So every rollout is exactly one weight version behind the trainer that uses it (`sampler/staleness` 1; step 1's
and the first after a resume without saved rollouts are 0), and which version made which batch is fixed by the
schedule, not by timing: a run repeats itself, and a resumed run repeats an uninterrupted one, since the finished
step-ahead batch is saved with each checkpoint (`state_dict`/`load_state_dict`). The loop's TIS weights
(grpo.tis) compare the trainer's log-probs with the sampler's, so they correct the one version of lag like any
other mismatch.

Storage: the held batch keeps its 0/1 masks ([R, T] attention_mask int32, response_mask float32) as uint8 and
gives them back in their own dtype on `take`/`held` (exact: only arrays whose values are all 0 or 1 are packed);
16 -> 10 bytes per token with tokens int32 and sampler_logp fp32. `host_bytes(cfg)` counts them from shapes.

The work runs in one background thread when the sampler is a separate process (vLLM) or JAX dispatch may run two
programs at once. On a multi-device XLA:CPU mesh (parallel/dispatch.py) the embedded sampler's program must not
be in flight beside the trainer's, so there `threaded=False` runs it at `start`: the same batches, no overlap.

With several trainer processes and a sampler on process 0 (sampler/process_zero.py) the thread runs no
collective: process 0's thread collects, the others' hold None, and `join`/`take` with `share=share_from_zero`
broadcast process 0's finished batch from every process's main thread, at the same point of the step on each
(before publishing version gs, or at the step that uses them).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Callable, Optional

import numpy as np

from twocircuit_jax.train import safe_blob
from twocircuit_jax.train.rollout import Collected

PACKED = ("attention_mask", "response_mask")  # [R, T] 0/1 masks held as uint8
_TOKEN_BYTES = {"tokens": 4, "attention_mask": 1, "response_mask": 1, "sampler_logp": 4}  # as held, per token
_ROW_BYTES = {"sample_id": 4, "truncated": 1, "advantages": 4, "loss_mask": 4}  # per row


def compact(c: Collected) -> tuple:
    """(Collected with the 0/1 masks as uint8, {field: original dtype}) for the ones packed."""
    batch, dtypes = dict(c.batch), {}
    for k in PACKED:
        a = batch.get(k)
        if isinstance(a, np.ndarray) and a.dtype != np.uint8:
            u = a.astype(np.uint8)
            if np.array_equal(u, a):  # exactly 0/1 (or small non-negative integers): lossless
                batch[k], dtypes[k] = u, a.dtype
    return c._replace(batch=batch), dtypes


def expand(c: Collected, dtypes: dict) -> Collected:
    """The Collected `compact` packed, with every field back in its own dtype."""
    if not dtypes:
        return c
    return c._replace(batch={k: (v.astype(dtypes[k]) if k in dtypes else v) for k, v in c.batch.items()})


def share_from_zero(future: cf.Future) -> tuple:
    """Process 0's finished step-ahead batch, (Collected, dtypes) as `compact` packs it, on every process: the
    `share` of `join`/`take` with a sampler on process 0 of many (sampler/process_zero.py). A collective, in the main
    thread of every process; a failure of process 0's background work is raised on every process."""
    from twocircuit_jax.sampler.process_zero import broadcast_bytes

    def make():
        col, dtypes = future.result()  # process 0: raises the thread's failure, which broadcast_bytes spreads
        return safe_blob.dumps({"collected": tuple(col), "dtypes": {k: np.dtype(v).str for k, v in dtypes.items()}})

    out = safe_blob.loads(broadcast_bytes(make), "process 0's step-ahead rollouts")
    return Collected(*out["collected"]), {k: np.dtype(v) for k, v in out["dtypes"].items()}


def host_bytes(cfg) -> dict:
    """Host bytes of the step-ahead rollouts held (`train.async_rollouts: 1`), from shapes: one step's packed batch
    of prompts_per_step x n rows of max_prompt_len + max_new_tokens tokens, as stored (masks uint8). Single-turn rows;
    0 when async rollouts are off."""
    t, s = cfg.train, cfg.sampler
    if not t.async_rollouts:
        return {"rollout_ahead/bytes": 0}
    rows, T = t.prompts_per_step * s.n, t.max_prompt_len + s.sampling.max_new_tokens
    out = {f"rollout_ahead/{k}": rows * T * b for k, b in _TOKEN_BYTES.items()}
    out.update({f"rollout_ahead/{k}": rows * b for k, b in _ROW_BYTES.items()})
    out["rollout_ahead/bytes"] = sum(out.values())
    return out


class RolloutAhead:
    """At most one step's rollouts in flight or finished, tagged with the step they are for."""

    def __init__(self, threaded: bool = True):
        self.threaded = threaded
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead") if threaded else None
        self._gs: Optional[int] = None
        self._future: Optional[cf.Future] = None
        self._shared = False  # the held result is the same on every process (after `share`)

    def start(self, gs: int, fn: Callable[[], Collected]) -> None:
        """Begin step gs's rollouts: `fn()` in the background thread (or now, unthreaded)."""
        if self._future is not None:
            raise RuntimeError(f"rollouts for step {self._gs} are still held; take or drop them first")
        self._gs, self._shared = gs, False
        # held compactly (`_result` expands); None: another process's batch, received at `share`
        packed = lambda: (lambda c: None if c is None else compact(c))(fn())  # noqa: E731
        if self._pool is not None:
            self._future = self._pool.submit(packed)
        else:
            self._future = cf.Future()
            try:
                self._future.set_result(packed())
            except BaseException as e:  # raised at join/take, like the threaded path
                self._future.set_exception(e)

    def join(self, share: Optional[Callable] = None) -> float:
        """Wait for the rollouts in flight; seconds waited. A failure in the background is raised here. `share`
        (many processes, a sampler on process 0): called with the finished future on every process, it returns
        process 0's (Collected, dtypes), which every process then holds; a collective, so every process must join
        at the same point."""
        if self._future is None:
            return 0.0
        t0 = time.perf_counter()
        if share is None:
            self._future.result()
        elif not self._shared:
            cf.wait([self._future])  # bounded by the sampler's own timeouts and retries
            done: cf.Future = cf.Future()
            done.set_result(share(self._future))  # raises on every process when process 0's work failed
            self._future, self._shared = done, True
        return time.perf_counter() - t0

    def take(self, gs: int, share: Optional[Callable] = None) -> Optional[Collected]:
        """Step gs's rollouts when they are the ones held (waiting for them if needed), else None; either way
        nothing is held afterwards (rollouts for another step are stale and dropped). `share`: as for `join`."""
        if self._future is None:
            return None
        mine = self._gs == gs
        try:
            if mine and share is not None:
                self.join(share)
            return expand(*self._future.result()) if mine else None
        finally:
            if not mine:
                cf.wait([self._future])  # a thread still generating finishes before the next starts
            self._gs = self._future = None

    def drop(self) -> None:
        """Forget what is held (after a rollback: those rollouts came from weights the run no longer has)."""
        if self._future is not None:
            cf.wait([self._future])
        self._gs = self._future = None

    def held(self) -> Optional[tuple]:
        """(step, Collected) of the finished rollouts held, without releasing them; None when none are."""
        f = self._future
        if f is None or not f.done() or f.exception() is not None or f.result() is None:
            return None  # None: another process's batch not shared yet (process 0 writes the checkpoint's copy)
        return self._gs, expand(*f.result())

    def state_dict(self) -> dict:
        """The finished rollouts with their step, for a checkpoint: {"step": int, "collected": the Collected as a
        tuple}, or {} when nothing finished is held (rollouts still in flight are not waited for). Plain data
        (dicts, lists, numbers, numpy arrays) that train/safe_blob.py stores without pickle."""
        held = self.held()
        return {} if held is None else {"step": held[0], "collected": tuple(held[1])}

    def load_state_dict(self, d: dict) -> None:
        """Hold the rollouts `state_dict` gave (a resume); {} holds nothing. Whatever was held is dropped first."""
        self.drop()
        if d:
            # shared again at `take`: every process then uses process 0's copy whatever it read
            self._gs, self._future, self._shared = int(d["step"]), cf.Future(), False
            self._future.set_result(compact(Collected(*d["collected"])))

    def close(self) -> None:
        """Wait for the background thread and stop it. Safe to call twice."""
        if self._future is not None:
            cf.wait([self._future])
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
