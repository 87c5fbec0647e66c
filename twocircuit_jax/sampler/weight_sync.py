"""Delta weight sync: publish only the words that changed since the sampler's current version, losslessly.

Between two RL steps almost every weight word in the sampler's dtype is unchanged (an update of ~lr moves a bf16
word only when it crosses a rounding boundary). A version is therefore written as one of two kinds:

    full   the whole parameter pytree in the sampler's dtype (sampler/export.py's layout, `kind: full`)
    delta  per leaf, the flat positions of the words that differ from `base_version` and their new words:
           one orbax checkpoint {"idx": uint32 [n + 1], "val": words [n + 1]}, leaf after leaf, each leaf's
           count in meta.json; the last entry is padding (orbax cannot save an empty array: n may be 0)

Every version's meta.json carries `hashes`: one 64-bit hash per leaf of the *whole* result, so a receiver that
applied a delta to the wrong base, or a delta corrupted on disk, is caught before any weight is replaced:
    H = sum_i c(i) * w_i  mod 2^64,   c(i) = (K1 * i + K2) | 1   (an odd multiplier per position i)
Changing the word at one position always changes H (c(i) is odd, so invertible mod 2^64, and |new - old| < 2^32),
moving a word to another position changes it (c differs), and it updates in O(changed words) with a few integer
passes: H(new) = H(old) + sum c(i) * (new_i - old_i) over the changed positions i. It guards against corruption
and wrong bases, not against an adversary.
A full version is written every `full_every` versions, and whenever the receiver has no base (a restart, a delta
it refused): `WeightPublisher.publish_full()` rewrites the newest version whole from the publisher's host copy.

`WeightPublisher` is the trainer's side (keeps one host copy of the last published words: the parameters' size in
the sampler dtype); `WeightStore` is the sampler's side (keeps the served words and applies deltas to them).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from typing import NamedTuple

import numpy as np

from twocircuit_jax.sampler import export as ex

DELTA = "delta"
_WORDS = {2: np.uint16, 4: np.uint32}
_CHUNK = 1 << 22  # elements per numpy pass: temporaries stay under ~32 MiB, which malloc reuses (a fresh mapping
# costs a page fault per 4 KiB: 2.5 s per GiB first touched on this 2-core machine, 20x the pass itself)
_POOL = cf.ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)))  # numpy's loops release the GIL
_K1, _K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03)
_M64 = (1 << 64) - 1


class DeltaError(ex.ExportError):
    """A delta that cannot be applied (wrong base, corrupt payload, hash mismatch): the sender must write a full
    version. The message names the folder and what did not match."""


def leaf_names(params) -> tuple[list[str], list, object]:
    """(['layers/q_proj/kernel', ...], leaves, treedef) of a parameter pytree, in flattening order."""
    import jax

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in flat]
    return names, [x for _, x in flat], treedef


def words(a: np.ndarray) -> np.ndarray:
    """The array's words as a flat unsigned view (no copy for a contiguous array)."""
    a = np.ascontiguousarray(a).reshape(-1)
    if a.dtype.itemsize not in _WORDS:
        raise ValueError(f"weight sync handles 2- and 4-byte dtypes, got {a.dtype}")
    return a.view(_WORDS[a.dtype.itemsize])


def _dot(pos: np.ndarray, w: np.ndarray) -> int:
    """sum c(pos) * w mod 2^64 (uint64 arithmetic wraps; `w` may hold wrapped differences)."""
    c = pos.astype(np.uint64)
    c *= _K1
    c += _K2
    c |= np.uint64(1)
    c *= w
    return int(np.sum(c, dtype=np.uint64))


def _change(pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """sum c(pos) * (new - old) mod 2^64: what the words at `pos` going from `old` to `new` add to the hash."""
    d = new.astype(np.uint64)
    d -= old.astype(np.uint64)  # wraps mod 2^64: the difference's residue, which is all the sum needs
    return _dot(pos, d)


def leaf_hash(w: np.ndarray) -> int:
    """Hash of one leaf's flat words (cost: one pass over the leaf, in _CHUNK ranges over the thread pool; do not
    call it from inside a pool task)."""

    def part(s: int) -> int:
        e = min(s + _CHUNK, w.size)
        return _dot(np.arange(s, e, dtype=np.uint64), w[s:e].astype(np.uint64))

    return sum(_POOL.map(part, range(0, w.size, _CHUNK)), 0) & _M64


def _diff_range(wo: np.ndarray, wn: np.ndarray, s: int, e: int):
    """Changed positions in [s, e), their new words and hash change; writes them into `wo` (ranges are disjoint)."""
    i = np.flatnonzero(wo[s:e] != wn[s:e])
    i += s
    v, o = wn[i], wo[i]
    wo[i] = v
    return i.astype(np.uint32), v, _change(i, o, v)


def diff_parts(olds: list, news: list, hashes: list) -> tuple[list, list]:
    """Per leaf: [(changed positions, new words) per _CHUNK range], and the new hashes; every `olds` leaf becomes
    its `news` leaf in place. The ranges are spread over a thread pool (memory-bound numpy passes: compare, gather,
    hash, scatter)."""
    jobs = [
        [_POOL.submit(_diff_range, words(o), words(n), s, min(s + _CHUNK, o.size)) for s in range(0, o.size, _CHUNK)]
        for o, n in zip(olds, news)
    ]
    parts, out = [], []
    for h, leaf_jobs in zip(hashes, jobs):
        done = [f.result() for f in leaf_jobs]
        parts.append([(i, v) for i, v, _ in done])
        out.append((h + sum(d for _, _, d in done)) & _M64)
    return parts, out


def updated_hash(h: int, idx: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """The leaf hash after the words at `idx` change from `old` to `new` (cost: O(len(idx)))."""
    return (h + _change(idx, old, new)) & _M64


class PublishStats(NamedTuple):
    kind: str  # "full" | "delta"
    bytes: int  # payload bytes written (words + indices)
    changed_frac: float  # changed words / all words (1.0 for a full version)
    cast_s: float  # device -> host in the sampler dtype
    diff_s: float  # finding the changed words and updating the hashes
    write_s: float  # orbax save + atomic rename


class WeightPublisher:
    """The trainer's side: `publish(params, version)` writes a delta against the last version when it can."""

    def __init__(self, export_root: str, model_config, dtype: str, *, delta: bool = True, full_every: int = 20):
        self.root, self.model_config, self.dtype = export_root, model_config, dtype
        self.delta, self.full_every = bool(delta), max(1, int(full_every))
        self.names = self.host = self.hashes = self.treedef = None  # the newest published version, host side
        self.version = None
        self.since_full = 0
        self._bufs = {}  # delta payload buffers, reused between versions

    def _host(self, params):
        import jax
        import jax.numpy as jnp

        dt = jnp.dtype(self.dtype)
        # The cast runs where the parameters live; device_get then copies the sampler-dtype words (a host sync).
        # Tried: casting into the previous call's (donated) buffer and reading it through dlpack without a copy;
        # no faster here (the cast itself, ~0.4 s for 0.5B shapes on 2 cores, is the cost).
        return jax.device_get(jax.tree.map(lambda x: x.astype(dt) if x.dtype != dt else x, params))

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

    def publish(self, params, version: int, keep: int = 3) -> PublishStats:
        t0 = time.perf_counter()
        names, leaves, treedef = leaf_names(self._host(params))
        t1 = time.perf_counter()
        full = not self.delta or self.host is None or names != self.names or self.since_full + 1 >= self.full_every
        if full:
            # a writable copy: device_get may hand back read-only views of device buffers
            # a writable copy: device_get may hand back read-only views of device buffers
            self.names, self.host, self.treedef = names, [np.array(x, copy=True) for x in leaves], treedef
            self.hashes = [leaf_hash(words(x)) for x in self.host]
            t2 = time.perf_counter()
            self._write_full(version, keep)
            n = sum(x.nbytes for x in self.host)
            stats = PublishStats("full", n, 1.0, t1 - t0, t2 - t1, time.perf_counter() - t2)
        else:
            # the host copy becomes the new version in place (no second copy of the weights)
            parts, hashes = diff_parts(self.host, leaves, self.hashes)
            counts = [sum(int(i.size) for i, _ in p) for p in parts]
            # the payload is gathered into buffers kept between versions: a fresh 100+ MB array would cost a page
            # fault per 4 KiB (~0.3 s here), more than the copy
            flat = [x for p in parts for x in p]
            idx = self._payload("idx", sum(counts) + 1, np.uint32, [i for i, _ in flat])
            val = self._payload("val", sum(counts) + 1, words(self.host[0]).dtype, [v for _, v in flat])
            t2 = time.perf_counter()
            base, self.hashes = self.version, hashes
            self._write_delta(version, base, idx, val, counts, keep)
            n = sum(counts)
            total = sum(x.size for x in self.host)
            stats = PublishStats(
                "delta", n * (4 + self.host[0].itemsize), n / total, t1 - t0, t2 - t1, time.perf_counter() - t2
            )
        self.version = int(version)
        self.since_full = 0 if full else self.since_full + 1
        return stats

    def publish_full(self, keep: int = 3) -> None:
        """Rewrite the newest version whole from the host copy (same version number, same words)."""
        if self.version is None:
            raise RuntimeError("publish_full: nothing has been published yet")
        self._write_full(self.version, keep)
        self.since_full = 0

    def _meta(self, kind: str, **extra) -> dict:
        leaves = {n: {"shape": list(x.shape), "hash": h} for n, x, h in zip(self.names, self.host, self.hashes)}
        return {"kind": kind, "dtype": self.dtype, "leaves": leaves, **extra}

    def _write_full(self, version: int, keep: int) -> None:
        import jax

        tree = jax.tree_util.tree_unflatten(self.treedef, self.host)
        ex.export_weights(tree, self.model_config, self.root, version, keep=keep, meta=self._meta("full"))

    def _write_delta(self, version, base, idx, val, counts, keep) -> None:
        meta = self._meta(DELTA, base_version=int(base))
        for n, c in zip(self.names, counts):
            meta["leaves"][n]["count"] = c
        ex.export_weights({"idx": idx, "val": val}, self.model_config, self.root, version, keep=keep, meta=meta)


class WeightStore:
    """The sampler's side: the served words by leaf name, and `load(path)` for a full or delta version."""

    def __init__(self):
        self.version = None
        self.names, self.leaves, self.hashes, self.treedef = [], [], [], None
        self.delta_words = {}  # {leaf: the new words at the changed positions} of the last delta applied

    def params(self):
        import jax

        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

    def load(self, path: str) -> dict:
        """Apply version folder `path`; returns {leaf name: changed flat positions, or None for all}.
        DeltaError (and the store unchanged) if a delta does not fit this store or fails its hash check."""
        meta = ex.read_meta(path)
        if meta.get("kind") != DELTA:
            _, params = ex.load_export(path)
            names, leaves, treedef = leaf_names(params)
            leaves = [np.array(x, copy=True) for x in leaves]
            want = {n: d["hash"] for n, d in meta.get("leaves", {}).items()}
            if want:
                got = {n: leaf_hash(words(x)) for n, x in zip(names, leaves)}
                bad = sorted(n for n in got if got[n] != want.get(n))
                if bad or set(want) != set(got):
                    raise ex.ExportError(f"{path}: full version fails its hash check (leaves {bad[:3]})")
            self.names, self.leaves, self.treedef = names, leaves, treedef
            self.hashes = [want[n] if n in want else leaf_hash(words(x)) for n, x in zip(names, leaves)]
            self.version = int(meta["version"])
            return {n: None for n in names}
        return self._apply_delta(path, meta)

    def _apply_delta(self, path: str, meta: dict) -> dict:
        base = int(meta["base_version"])
        if self.version != base:
            raise DeltaError(f"{path}: delta against version {base}, but this sampler holds {self.version}")
        spec = meta["leaves"]
        if list(spec) != self.names:
            raise DeltaError(f"{path}: delta leaves {list(spec)[:3]}... do not match the served leaves")
        try:
            _, payload = ex.load_export(path, allow_delta=True)
        except ex.ExportError as e:
            raise DeltaError(str(e)) from None
        idx, val = np.asarray(payload["idx"]).reshape(-1), np.asarray(payload["val"]).reshape(-1)
        counts = [int(spec[n]["count"]) for n in self.names]
        if idx.size != sum(counts) + 1 or val.size != idx.size:
            raise DeltaError(
                f"{path}: payload holds {idx.size} positions / {val.size} words; meta says {sum(counts)} (+1 pad)"
            )
        # Check everything before writing anything: a refused delta leaves the served weights untouched.
        plans, off = [], 0
        for n, leaf, c in zip(self.names, self.leaves, counts):
            i, v = idx[off : off + c], val[off : off + c]
            off += c
            w = words(leaf)
            if c and (int(i.max()) >= w.size or v.dtype != w.dtype):
                raise DeltaError(f"{path}: leaf {n}: positions or word type do not fit shape {leaf.shape}")
            plans.append((w, i, v))
        # the hash change and, once every leaf passed, the writes: in _CHUNK ranges over the thread pool
        ranges = [(w, i[s : s + _CHUNK], v[s : s + _CHUNK]) for w, i, v in plans for s in range(0, i.size, _CHUNK)]
        owner = [k for k, (_, i, _) in enumerate(plans) for _ in range(0, i.size, _CHUNK)]
        new_hashes = list(self.hashes)
        for k, d in zip(owner, _POOL.map(lambda r: _change(r[1], r[0][r[1]], r[2]), ranges)):
            new_hashes[k] = (new_hashes[k] + d) & _M64
        for n, new_h in zip(self.names, new_hashes):
            if new_h != int(spec[n]["hash"]):
                raise DeltaError(f"{path}: leaf {n}: the result fails its hash check (corrupt delta or wrong base)")
        changed, self.delta_words = {}, {}
        list(_POOL.map(lambda r: r[0].__setitem__(r[1], r[2]), ranges))
        for k, ((w, i, v), new_h) in enumerate(zip(plans, new_hashes)):
            self.hashes[k] = new_h
            if i.size:
                changed[self.names[k]], self.delta_words[self.names[k]] = i, v
        self.version = int(meta["version"])
        return changed


def rebuild(export_root: str, version: int):
    """(model_config dict, numpy params) of `version`, applying the deltas on disk to their newest full base."""
    chain = []
    for v in reversed([v for v in ex.list_versions(export_root) if v <= version]):
        chain.append(v)
        if ex.read_meta(ex.version_dir(export_root, v)).get("kind") != DELTA:
            break
    if not chain or chain[0] != version:
        raise ex.ExportError(f"{ex.version_dir(export_root, version)}: no such version")
    if ex.read_meta(ex.version_dir(export_root, chain[-1])).get("kind") == DELTA:
        raise ex.ExportError(f"{export_root}: version {version} has no full base on disk (pruned?)")
    store = WeightStore()
    for v in reversed(chain):
        store.load(ex.version_dir(export_root, v))
    return ex.read_meta(ex.version_dir(export_root, version))["model_config"], store.params()
