"""The trainer's side of the weight sync: `WeightPublisher.publish(params, version)` writes a version in the
sampler's dtype, a delta against the last one when it can (sampler/weight_words.py: the format and the hashes).

A full version is written every `full_every` versions, and whenever the receiver has no base (a restart, a delta it
refused): `publish_full()` rewrites the newest version whole from the publisher's host copy of the last published
words (the parameters' size in the sampler dtype).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import NamedTuple

import numpy as np

from twocircuit_jax.sampler import export as ex
from twocircuit_jax.sampler.weight_words import (
    CHUNK,
    DELTA,
    HOST_POOL,
    M64,
    hash_change,
    leaf_hash,
    leaf_names,
    words,
)

_LOCAL = threading.local()


def _torch_ready() -> None:
    """Import torch for _cast_into, from the calling (main) thread: the trainer's fp32 arrays are read-only views,
    and torch warns once per process that it could write them (it only reads them); that one warning is raised
    here, silenced, rather than from a pool thread."""
    import torch

    ro = np.zeros(1, np.float32)
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.from_numpy(ro)


def _cast_into(out: np.ndarray, src: np.ndarray) -> None:
    """out[:] = src cast to out's dtype (round to nearest even). fp32 -> bf16 goes through torch, whose vectorised
    conversion is ~4x numpy's per-element one (0.5B words, one core: 0.14 s against 0.61 s); torch is there wherever
    a vLLM sampler is (it is vLLM's runtime). Same words as numpy's cast for every non-NaN input; a NaN becomes
    torch's NaN word, in full and delta versions alike (both cast here)."""
    if out.dtype.name == "bfloat16" and src.dtype == np.float32:
        import torch

        if not getattr(_LOCAL, "one_thread", False):
            # torch would split each range over its own OpenMP threads, on top of the pool's: 0.6 s against 0.45 s
            # for the 0.5B diff. The limit is per calling thread under OpenMP (torch's CPU builds), so the
            # caller's other torch work keeps its threads.
            torch.set_num_threads(1)
            _LOCAL.one_thread = True
        torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).copy_(torch.from_numpy(src))
    else:
        np.copyto(out, src, casting="unsafe")


def _new_words(src: np.ndarray, dt, s: int, e: int) -> np.ndarray:
    """Words [s, e) of flat `src` in dtype `dt`: cast here when `src` holds another dtype (the trainer's fp32 on a
    CPU host), so the cast runs per cache-sized range, fused with the compare, instead of as one more pass."""
    c = src[s:e]
    if c.dtype == dt:
        return words(c)
    out = np.empty(c.shape, dt)
    _cast_into(out, c)
    return words(out)


def _diff_range(old: np.ndarray, src: np.ndarray, s: int, e: int, twin: tuple = ()):
    """Changed positions in [s, e), their new words and hash change; writes them into `old` (ranges are
    disjoint). `src` is the new version, flat, in `old`'s dtype or one to cast from. `twin` = (rows, cols) of a leaf
    whose transpose is published too (the untied LM head of a tied embedding): also the changed positions in the
    transpose and its hash change, from the same words."""
    wo, wn = words(old)[s:e], _new_words(src, old.dtype, s, e)
    i = np.flatnonzero(wo != wn)
    v, o = wn[i], wo[i]
    wo[i] = v
    i += s
    out = (i.astype(np.uint32), v, hash_change(i, o, v))
    if twin:
        r, c = np.divmod(i, twin[1])
        t = c * twin[0] + r  # [rows, cols] flat (r, c) -> [cols, rows] flat (c, r)
        return out + (t.astype(np.uint32), hash_change(t, o, v))
    return out


def diff_parts(olds: list, news: list, hashes: list, twin: tuple = ()) -> tuple[list, list]:
    """Per leaf: [(changed positions, new words) per CHUNK range], and the new hashes; every `olds` leaf becomes
    its `news` leaf in place (`news` may hold another float dtype: cast per range). The ranges are spread over a
    thread pool (memory-bound numpy passes: cast, compare, gather, hash, scatter). `twin` = (k, hash): leaf k's
    transpose is published too; its parts (leaf k's words at transposed positions) and new hash come last."""
    k_twin = twin[0] if twin else -1
    jobs = [
        [
            HOST_POOL.submit(
                _diff_range, o.reshape(-1), n.reshape(-1), s, min(s + CHUNK, o.size), o.shape if k == k_twin else ()
            )
            for s in range(0, o.size, CHUNK)
        ]
        for k, (o, n) in enumerate(zip(olds, news))
    ]
    parts, out = [], []
    for k, (h, leaf_jobs) in enumerate(zip(hashes, jobs)):
        done = [f.result() for f in leaf_jobs]
        parts.append([(r[0], r[1]) for r in done])
        out.append((h + sum(r[2] for r in done)) & M64)
        if k == k_twin:
            twin_parts, twin_hash = [(r[3], r[1]) for r in done], (twin[1] + sum(r[4] for r in done)) & M64
    if twin:
        parts.append(twin_parts)
        out.append(twin_hash)
    return parts, out


class PublishStats(NamedTuple):
    kind: str  # "full" | "delta"
    bytes: int  # payload bytes written (words + indices)
    changed_frac: float  # changed words / all words (1.0 for a full version)
    cast_s: float  # device -> host in the sampler dtype
    diff_s: float  # finding the changed words and updating the hashes
    write_s: float  # orbax save + atomic rename


class _HeadOfEmbed:
    """Placeholder leaf: the served `lm_head` is the transpose of `embed` (an untied engine serving a tied model)."""


HEAD = "lm_head"


def _host_leaves(leaves: list, dt) -> list:
    """Each leaf as a host array to read the sampler-dtype words from. An accelerator casts first (half the bytes
    cross to the host; a host sync); on a CPU backend the fp32 words are read where they lie (no copy for a
    single-device array) and cast per range inside the diff, fused with the compare."""
    import jax

    def accel(x):
        return isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices())

    leaves = [x.astype(dt) if accel(x) and x.dtype != dt else x for x in leaves]
    return [np.asarray(x) for x in jax.device_get(leaves)]


def _cast_copy(src: np.ndarray, dt) -> np.ndarray:
    """A new contiguous array of `src` in dtype `dt`, cast in CHUNK ranges over the thread pool."""
    out = np.empty(src.shape, dt)
    f, g = out.reshape(-1), src.reshape(-1)
    list(HOST_POOL.map(lambda s: _cast_into(f[s : s + CHUNK], g[s : s + CHUNK]), range(0, f.size, CHUNK)))
    return out


class WeightPublisher:
    """The trainer's side: `publish(params, version)` writes a delta against the last version when it can."""

    def __init__(self, export_root: str, model_config, dtype: str, *, delta: bool = True, full_every: int = 20):
        import jax.numpy as jnp

        self.root, self.model_config, self.dtype = export_root, model_config, dtype
        self.dt = jnp.dtype(dtype)
        self.delta, self.full_every = bool(delta), max(1, int(full_every))
        # the newest published version, host side: per leaf name its words in the sampler dtype (`host`, None for a
        # head derived from the embedding), `shapes` and `hashes`
        self.names = self.host = self.shapes = self.hashes = self.treedef = None
        self.version = None
        self.since_full = 0
        self._bufs = {}  # delta payload buffers, reused between versions

    def _payload(self, name: str, size: int, dtype, pieces: list) -> np.ndarray:
        """`pieces` and one trailing pad word (orbax cannot save an empty array), in a buffer reused across
        versions (grown by 1/4 when too small)."""
        buf = self._bufs.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._bufs[name] = np.empty(size + size // 4, dtype)
        out = buf[:size]
        np.concatenate(pieces + [np.zeros(1, dtype)], out=out)
        return out

    def need_full(self) -> None:
        """The receiver has no usable base (restart, refused delta): the next publish is full."""
        self.since_full = self.full_every

    def publish(self, params, version: int, keep: int = 3, head_from_embed: bool = False) -> PublishStats:
        """Write `version` of `params` (a full version or a delta against the last one). `head_from_embed`: also
        publish `lm_head` = `embed`.T (an untied engine serving a tied model); its changed words are those of the
        embedding, found once, so the transpose is never built on the trainer between full versions."""
        t0 = time.perf_counter()
        names, leaves, treedef = leaf_names({**params, HEAD: _HeadOfEmbed()} if head_from_embed else params)
        head = names.index(HEAD) if head_from_embed else -1
        emb = names.index("embed") if head_from_embed else -1
        real = [k for k in range(len(names)) if k != head]
        srcs = dict(zip(real, _host_leaves([leaves[k] for k in real], self.dt)))
        if self.dt == np.dtype("bfloat16") and any(x.dtype == np.float32 for x in srcs.values()):
            _torch_ready()
        t1 = time.perf_counter()
        if self.version is None or int(version) <= self.version:
            # A fresh publisher (a start, a resume, a new sampler) or a step back (a guard rollback): versions on
            # disk above this one belong to a discarded history (a killed run's newer full base and deltas). They
            # go, and this version is written whole: no delta may name a base from that history.
            ex.discard_newer(self.root, version)
            self.host = None
        full = not self.delta or self.host is None or names != self.names or self.since_full + 1 >= self.full_every
        # a head that was given before and is derived now (or the reverse) has no host copy to diff against
        full = full or (head >= 0) != any(x is None for x in self.host)
        if full:
            # a new copy in the sampler dtype (never a view of the trainer's buffers, which the next step donates)
            self.host = [None if k == head else _cast_copy(srcs[k], self.dt) for k in range(len(names))]
            self.names, self.treedef = names, treedef
            self.shapes = [self.host[emb].shape[::-1] if k == head else self.host[k].shape for k in range(len(names))]
            whole = self.published()
            self.hashes = [leaf_hash(words(x)) for x in whole]
            t2 = time.perf_counter()
            self._write_full(version, keep, whole)
            n = sum(x.nbytes for x in whole)
            stats = PublishStats("full", n, 1.0, t1 - t0, t2 - t1, time.perf_counter() - t2)
        else:
            # the host copy becomes the new version in place (no second copy of the weights)
            twin = (real.index(emb), self.hashes[head]) if head >= 0 else ()
            parts, hashes = diff_parts(
                [self.host[k] for k in real], [srcs[k] for k in real], [self.hashes[k] for k in real], twin
            )
            if head >= 0:  # diff_parts puts the transpose's entry last: move it to the head's place
                parts.insert(head, parts.pop())
                hashes.insert(head, hashes.pop())
            counts = [sum(int(i.size) for i, _ in p) for p in parts]
            # the payload is gathered into buffers kept between versions: a fresh 100+ MB array would cost a page
            # fault per 4 KiB (~0.3 s here), more than the copy
            flat = [x for p in parts for x in p]
            idx = self._payload("idx", sum(counts) + 1, np.uint32, [i for i, _ in flat])
            val = self._payload("val", sum(counts) + 1, words(self.host[real[0]]).dtype, [v for _, v in flat])
            t2 = time.perf_counter()
            base, self.hashes = self.version, hashes
            self._write_delta(version, base, idx, val, counts, keep)
            n, total = sum(counts), sum(int(np.prod(x)) for x in self.shapes)
            stats = PublishStats("delta", n * (4 + val.itemsize), n / total, t1 - t0, t2 - t1, time.perf_counter() - t2)
        self.version = int(version)
        self.since_full = 0 if full else self.since_full + 1
        return stats

    def published(self) -> list:
        """The newest version's arrays per leaf; a head derived from the embedding is built (a copy: full versions
        and tests only)."""
        if HEAD not in self.names or self.host[self.names.index(HEAD)] is not None:
            return self.host
        emb = self.host[self.names.index("embed")]
        return [np.ascontiguousarray(emb.T) if x is None else x for x in self.host]

    def publish_full(self, keep: int = 3) -> None:
        """Rewrite the newest version whole from the host copy (same version number, same words)."""
        if self.version is None:
            raise RuntimeError("publish_full: nothing has been published yet")
        self._write_full(self.version, keep)
        self.since_full = 0

    def _meta(self, kind: str, **extra) -> dict:
        leaves = {n: {"shape": list(x), "hash": h} for n, x, h in zip(self.names, self.shapes, self.hashes)}
        return {"kind": kind, "dtype": self.dtype, "leaves": leaves, **extra}

    def _write_full(self, version: int, keep: int, leaves=None) -> None:
        import jax

        tree = jax.tree_util.tree_unflatten(self.treedef, self.published() if leaves is None else leaves)
        # alone: the publisher's host copy, written by the one process that drives the engine
        ex.export_weights(tree, self.model_config, self.root, version, keep=keep, meta=self._meta("full"), alone=True)

    def _write_delta(self, version, base, idx, val, counts, keep) -> None:
        meta = self._meta(DELTA, base_version=int(base))
        for n, c in zip(self.names, counts):
            meta["leaves"][n]["count"] = c
        ex.export_weights(
            {"idx": idx, "val": val}, self.model_config, self.root, version, keep=keep, meta=meta, alone=True
        )
