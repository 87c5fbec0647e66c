"""Host values <-> global arrays, correct with one process or many.

With several processes (parallel/distributed.py) a sharded `jax.Array` spans devices of other processes: this
process holds only its addressable shards. Two moves need care:

* host -> device (`to_global`): every process builds the same host value (same seed, same data order), and
  `jax.make_array_from_callback` gives each process's devices their slice of it. `jax.device_put` of a host value to
  a global sharding would also work, but it first all-gathers the whole value from every process to check that they
  agree (`multihost_utils.assert_equal`): params-sized traffic and host memory per call. Here the agreement is
  checked on a 64-bit digest per leaf instead (`check_same`), one small all-gather per call.
* device -> host (`to_host`): `np.asarray` of an array with shards on another process raises;
  `multihost_utils.process_allgather` brings the whole value to every process. It is a collective: every process
  must call `to_host` on the same arrays in the same order (the loop does: all processes run the same program).

With one process both are the plain `jax.device_put` / `jax.device_get`.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.experimental import multihost_utils


def multiprocess() -> bool:
    return jax.process_count() > 1


def _host_leaf(x):
    """A host copy of a leaf that every process holds whole (numpy, python scalar, fully addressable array)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError("to_global: an array with shards on other processes is already global; device_put it")
    return np.asarray(x)


def to_global(tree, shardings, *, check: bool = True):
    """`tree` (host values, identical on every process) placed by `shardings` (a matching tree or one sharding).
    Leaves that are already global arrays are resharded with `jax.device_put`. `check` compares a digest of the
    host leaves across processes and raises on a mismatch (a process that built different data)."""
    if not multiprocess():
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    shard_leaves = (
        [shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding) else treedef.flatten_up_to(shardings)
    )
    out, host = [], []
    for x, s in zip(leaves, shard_leaves):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            out.append(jax.device_put(x, s))
            continue
        h = _host_leaf(x)
        host.append(h)
        out.append(jax.make_array_from_callback(h.shape, s, lambda idx, h=h: h[idx]))
    if check and host:
        check_same(host, "to_global")
    return jax.tree.unflatten(treedef, out)


def digest(arrays) -> np.ndarray:
    """A 64-bit digest (as two uint32) of the bytes, shapes and dtypes of `arrays`."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), np.uint32).copy()


def check_same(arrays, what: str) -> None:
    """Raise if the host `arrays` differ between processes (all processes must call this together)."""
    mine = digest(arrays)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 2]
    bad = [i for i in range(every.shape[0]) if not np.array_equal(every[i], every[0])]
    if bad:
        raise RuntimeError(
            f"{what}: process(es) {bad} hold different host data than process 0; every process must build the "
            "same batch from the same seed (a nondeterministic task or environment breaks multi-process runs)"
        )


def to_host(tree):
    """Every leaf as numpy on this process: `jax.device_get` where the process holds the whole value (fully
    addressable or replicated), a cross-process all-gather otherwise (a collective, see the module doc)."""
    if not multiprocess():
        return jax.device_get(tree)

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return jax.device_get(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)
