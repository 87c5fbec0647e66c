"""A sampler that lives on process 0 only, seen by every trainer process through the `Sampler` protocol.

With several trainer processes (jax.distributed, docs/scale.md) an engine per process would export its own
copy of the weights and draw other samples (vLLM's sampling is not reproducible across engines): the processes'
batches would disagree. So process 0 drives one inner sampler (whatever `make_sampler` builds for one process: a
`VLLMSampler`, or a fleet of engines behind the same protocol) and every process trains on its rollouts:

* `generate`: process 0 calls the inner sampler; its Rollout (ragged token and log-prob lists, truncation flags,
  weight version) and the inner sampler's `metrics()` are broadcast to every process. The other processes' prompts
  are not sent: the loop builds the same prompts on every process (the batch digest check in parallel/host.py
  `to_global` refuses a step where they differ).
* `update_weights(params, version)`: the params may be sharded over processes (fsdp across processes). Every
  process takes part in one all-gather per leaf (`multihost_utils.process_allgather`: JAX has no gather-to-one),
  process 0 keeps the gathered leaves and exports them through the inner sampler; the others drop each leaf as soon
  as the collective returns. Host memory: process 0 holds one full host copy of the params in their own dtype
  (8B parameters: 16 GB in bf16, 32 GB in fp32) on top of what the inner sampler's publisher keeps (its copy in
  the sampler dtype, sampler/weight_publish.py); every other process holds one leaf at a time (the largest, an 8B
  model's embedding, ~1.2 GB in bf16). Device memory: the all-gather materialises each leaf replicated on every
  device for the moment of its copy, one leaf at a time.
* `close`: process 0 closes the inner sampler; no collective (close runs on error paths of one process alone).
* `metrics()`: the inner sampler's metrics as of the last collective (generate, update_weights), the same dict on
  every process: the health monitor and the guard read them on every process and must decide alike.

Every collective here runs in the caller's thread and must be called by every process in the same order: the loop
does (all processes run the same steps). The step-ahead rollouts (`train.async_rollouts`) split the work so that
no collective runs in the background thread: `ahead_work` gives the thread process 0's collection with the inner
sampler (no broadcast), and every process's main thread receives process 0's finished batch when it joins or
takes those rollouts (train/rollout_ahead.py `share_from_zero`, with `broadcast_bytes` from here).

A failure on process 0 (an engine that does not start, a generate that runs out of retries) is broadcast in place
of the result, so every process raises it at the same collective instead of waiting in the next one for a process
that has left. A process that dies outright is noticed by jax.distributed's coordination service (its heartbeat
timeout), which ends the others.
"""

from __future__ import annotations

import io
import json

import jax
import numpy as np

from twocircuit_jax.sampler.base import Rollout

_OK, _FAILED = 1, 2


class ProcessZeroError(RuntimeError):
    """Process 0's sampler failed; raised on the other processes at the same collective (the message is its)."""


def _bucket(n: int) -> int:
    """Bytes a payload of n is padded to: a power of two from 1 KiB, so the broadcast program (one per shape)
    compiles a handful of times in a run instead of at every call."""
    return max(1024, 1 << (max(n, 1) - 1).bit_length())


def broadcast_bytes(make) -> bytes:
    """`make()` run on process 0, its bytes returned on every process (a collective: every process calls it). An
    exception in `make` is broadcast instead and raised on every process: process 0 raises its own, the others a
    ProcessZeroError with its message."""
    from jax.experimental import multihost_utils

    source = jax.process_index() == 0
    data, err, status = b"", None, 0
    if source:
        try:
            data, status = make(), _OK
        except Exception as e:  # noqa: BLE001 -- any failure is the others' failure too; re-raised below
            err, status = e, _FAILED
            data = f"{type(e).__name__}: {e}".encode("utf-8", "replace")
    if len(data) >= 1 << 31:  # the header is int32 (JAX without x64); a rollout batch is far smaller
        err, status = ValueError(f"broadcast from process 0: {len(data)} bytes, over the 2 GiB limit"), _FAILED
        data = str(err).encode()
    # A fixed-shape header first (the others do not know the payload's size), then the payload padded to its
    # bucket. broadcast_one_to_all sums every process's copy (zeros but process 0's) on the devices: each local
    # device holds the padded payload for the moment of the call.
    head = np.asarray(multihost_utils.broadcast_one_to_all(np.array([status, len(data)], np.int32)))
    status, size = int(head[0]), int(head[1])
    buf = np.zeros(_bucket(size), np.uint8)
    if source:
        buf[:size] = np.frombuffer(data, np.uint8)
    # a sum with zeros from every other process: bit-exact for uint8
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))[:size].tobytes()
    if status == _FAILED:
        if err is not None:
            raise err
        raise ProcessZeroError(f"process 0's sampler failed: {out.decode('utf-8', 'replace')}")
    if status != _OK:
        raise RuntimeError(f"broadcast from process 0: bad status {status} (processes out of step)")
    return out


def pack_rollout(r: Rollout) -> dict:
    """A Rollout's ragged lists as flat numpy arrays. Log-probs stay float64: the python floats round-trip bit for
    bit, so process 0 trains on exactly what the others get."""
    lengths = np.array([len(t) for t in r.tokens], np.int64)
    if [len(x) for x in r.logprobs] != lengths.tolist():
        raise ValueError("rollout: a row's log-probs and tokens differ in length")
    return {
        "lengths": lengths,
        "tokens": np.array([x for t in r.tokens for x in t], np.int64),
        "logprobs": np.array([x for lp in r.logprobs for x in lp], np.float64),
        "truncated": np.array([bool(x) for x in r.truncated], np.bool_),
        "weight_version": np.array(int(r.weight_version), np.int64),
    }


def unpack_rollout(d: dict) -> Rollout:
    ends = np.cumsum(d["lengths"])
    starts = ends - d["lengths"]
    toks, lps = d["tokens"].tolist(), d["logprobs"].tolist()
    return Rollout(
        tokens=[toks[a:b] for a, b in zip(starts, ends)],
        logprobs=[lps[a:b] for a, b in zip(starts, ends)],
        truncated=[bool(x) for x in d["truncated"]],
        weight_version=int(d["weight_version"]),
    )


def dumps(arrays: dict, meta) -> bytes:
    """Named numpy arrays and a JSON-able `meta` as .npz bytes (no pickle: np.load refuses one on the way back)."""
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return buf.getvalue()


def loads(data: bytes) -> tuple:
    """(arrays, meta) of `dumps`."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(bytes(arrays.pop("__meta__")).decode())


def gather_to_zero(tree):
    """The whole value of every leaf on process 0 as numpy (None on the others). A collective: every process calls
    it with the same tree. Leaves with shards on other processes are all-gathered (every process receives the
    leaf; the others drop it at once), leaves this process holds whole are read locally."""
    from jax.experimental import multihost_utils

    keep = jax.process_index() == 0

    def one(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            h = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        else:
            h = np.asarray(jax.device_get(x)) if keep else None
        return h if keep else None

    out = jax.tree.map(one, tree)
    return out if keep else None


class ProcessZeroSampler:
    """The `Sampler` protocol on every process around `build()`'s sampler, which only process 0 builds and holds."""

    def __init__(self, build):
        self.inner = None
        self._metrics: dict = {}

        def start():
            self.inner = build()
            return dumps({}, self._inner_metrics())

        # every process learns whether process 0's engine started (a failure raises everywhere, here)
        self._metrics = loads(broadcast_bytes(start))[1]

    def _inner_metrics(self) -> dict:
        m = getattr(self.inner, "metrics", None)  # optional in the protocol
        return {k: v.item() if isinstance(v, np.generic) else v for k, v in (m() if m is not None else {}).items()}

    def generate(self, prompts, n: int, sampling, seed: int) -> Rollout:
        def make():
            r = self.inner.generate(prompts, n, sampling, seed)
            return dumps(pack_rollout(r), self._inner_metrics())

        arrays, self._metrics = loads(broadcast_bytes(make))
        return unpack_rollout(arrays)

    def update_weights(self, params, version: int) -> None:
        host = gather_to_zero(params)  # every process: the all-gathers

        def make():
            self.inner.update_weights(host, version)
            return dumps({}, self._inner_metrics())

        self._metrics = loads(broadcast_bytes(make))[1]

    def metrics(self) -> dict:
        return dict(self._metrics)

    def close(self) -> None:
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.close()

    def ahead_work(self, collect, others=None):
        """The background thread's work for step-ahead rollouts (train/rollout_ahead.py), without a collective:
        process 0 runs `collect(inner sampler)` (a Collected); the others run `others()` (the step's host-side
        preparation that must happen on every process, e.g. a task's begin_step) and hold None until every
        process's main thread receives process 0's batch (rollout_ahead.share_from_zero)."""
        if jax.process_index() == 0:
            inner = self.inner
            return lambda: collect(inner)

        def rest():
            if others is not None:
                others()
            return None

        return rest
