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
the sampler dtype); `WeightStore` is the sampler's side: it applies deltas to a host copy of the served words, or,
once `release`d (an engine that holds the words), only checks a delta and swaps its words into the engine's
tensors (`read_delta`, `swap_in`: the hashes come from the words replaced, which are written back on a mismatch).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np

from twocircuit_jax.names import path_str
from twocircuit_jax.sampler import export as ex

DELTA = "delta"
_WORDS = {2: np.uint16, 4: np.uint32}
_CHUNK = 1 << 20  # elements per numpy pass: temporaries stay a few MiB, which malloc reuses (a fresh mapping costs
# a page fault per 4 KiB: 0.15-2.5 s per GiB first touched on this 2-core machine, by session) and mostly stay
# in cache between the cast, the compare and the gathers (the 0.5B diff, one session: 0.55-0.86 s at 2^20,
# 0.76-0.96 s at 2^22; with torch's cast, another: 1.6 s at 2^16 (per-range overhead), 0.57 s at 2^18, 0.39 s at
# 2^20, and 2^21, 2^22 within noise of 2^20)
_LOCAL = threading.local()
HOST_POOL = cf.ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)))  # numpy's loops release the GIL
_K1, _K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03)
_M64 = (1 << 64) - 1


class DeltaError(ex.ExportError):
    """A delta that cannot be applied (wrong base, corrupt payload, hash mismatch): the sender must write a full
    version. The message names the folder and what did not match."""


def leaf_names(params) -> tuple[list[str], list, object]:
    """(['layers/q_proj/kernel', ...], leaves, treedef) of a parameter pytree, in flattening order."""
    import jax

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [path_str(path) for path, _ in flat]
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

    return sum(HOST_POOL.map(part, range(0, w.size, _CHUNK)), 0) & _M64


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
    out = (i.astype(np.uint32), v, _change(i, o, v))
    if twin:
        r, c = np.divmod(i, twin[1])
        t = c * twin[0] + r  # [rows, cols] flat (r, c) -> [cols, rows] flat (c, r)
        return out + (t.astype(np.uint32), _change(t, o, v))
    return out


def diff_parts(olds: list, news: list, hashes: list, twin: tuple = ()) -> tuple[list, list]:
    """Per leaf: [(changed positions, new words) per _CHUNK range], and the new hashes; every `olds` leaf becomes
    its `news` leaf in place (`news` may hold another float dtype: cast per range). The ranges are spread over a
    thread pool (memory-bound numpy passes: cast, compare, gather, hash, scatter). `twin` = (k, hash): leaf k's
    transpose is published too; its parts (leaf k's words at transposed positions) and new hash come last."""
    k_twin = twin[0] if twin else -1
    jobs = [
        [
            HOST_POOL.submit(
                _diff_range, o.reshape(-1), n.reshape(-1), s, min(s + _CHUNK, o.size), o.shape if k == k_twin else ()
            )
            for s in range(0, o.size, _CHUNK)
        ]
        for k, (o, n) in enumerate(zip(olds, news))
    ]
    parts, out = [], []
    for k, (h, leaf_jobs) in enumerate(zip(hashes, jobs)):
        done = [f.result() for f in leaf_jobs]
        parts.append([(r[0], r[1]) for r in done])
        out.append((h + sum(r[2] for r in done)) & _M64)
        if k == k_twin:
            twin_parts, twin_hash = [(r[3], r[1]) for r in done], (twin[1] + sum(r[4] for r in done)) & _M64
    if twin:
        parts.append(twin_parts)
        out.append(twin_hash)
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
    """A new contiguous array of `src` in dtype `dt`, cast in _CHUNK ranges over the thread pool."""
    out = np.empty(src.shape, dt)
    f, g = out.reshape(-1), src.reshape(-1)
    list(HOST_POOL.map(lambda s: _cast_into(f[s : s + _CHUNK], g[s : s + _CHUNK]), range(0, f.size, _CHUNK)))
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


def _swap(a: np.ndarray, pos: np.ndarray, v: np.ndarray) -> np.ndarray:
    """a[pos] = v; returns the words that were there."""
    o = a[pos]
    a[pos] = v
    return o


class WeightStore:
    """The sampler's side: the served words by leaf name, and `load(path)` for a full or delta version. A sampler
    whose engine holds the words itself keeps only names, shapes and hashes (`release`) and swaps a delta's words
    straight into the engine (`read_delta`, `swap_in`)."""

    def __init__(self):
        self.version = None
        self.names, self.leaves, self.shapes, self.hashes, self.treedef = [], [], [], [], None
        self.word = None  # numpy unsigned type of the served words

    def params(self):
        import jax

        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

    def load(self, path: str) -> dict:
        """Apply version folder `path`; returns {leaf name: changed flat positions, or None for all}.
        DeltaError (and the store unchanged) if a delta does not fit this store or fails its hash check."""
        meta = ex.read_meta(path)
        if meta.get("kind") == DELTA:
            changes = self.read_delta(path, meta)
            if any(x is None for x, (i, _) in zip(self.leaves, changes) if i.size):
                raise DeltaError(f"{path}: this store released the words of a changed leaf (the engine holds them)")
            self.swap_in(path, meta, [(k, words(self.leaves[k]), i, i, v) for k, (i, v) in enumerate(changes)], _swap)
            return {n: i for n, (i, _) in zip(self.names, changes) if i.size}
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
        self.shapes, self.word = [x.shape for x in leaves], words(leaves[0]).dtype if leaves else None
        self.hashes = [want[n] if n in want else leaf_hash(words(x)) for n, x in zip(names, leaves)]
        self.version = int(meta["version"])
        return {n: None for n in names}

    def release(self, keep=()) -> None:
        """Drop the words of every leaf not named in `keep` (the engine holds them); names, shapes and hashes stay."""
        self.leaves = [x if n in keep else None for n, x in zip(self.names, self.leaves)]

    def read_delta(self, path: str, meta: dict) -> list:
        """[(changed flat positions uint32, new words)] per leaf of delta version `path`, checked against this
        store (base version, leaves, payload size, positions within each shape, word type); DeltaError if not."""
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
        out, off = [], 0
        for n, shape, c in zip(self.names, self.shapes, counts):
            i, v = idx[off : off + c], val[off : off + c]
            off += c
            if c and (int(i.max()) >= int(np.prod(shape)) or v.dtype != self.word):
                raise DeltaError(f"{path}: leaf {n}: positions or word type do not fit shape {tuple(shape)}")
            out.append((i, v))
        return out

    def swap_in(self, path: str, meta: dict, writes: list, swap) -> None:
        """Write a delta's words: `writes` = [(leaf index, target, positions in the target, the same words'
        positions in the leaf, new words)], each written by `swap(target, positions, words)`, which returns the
        words it replaced (host arrays, engine tensors). The replaced words give every leaf's new hash; if one
        differs from the version's, every word is written back and DeltaError raised: a refused delta leaves the
        served weights as they were. Writes run in _CHUNK ranges over the thread pool (memory-bound gathers and
        scatters that release the GIL)."""
        ranges = [
            (k, t, p[s : s + _CHUNK], i[s : s + _CHUNK], v[s : s + _CHUNK])
            for k, t, p, i, v in writes
            for s in range(0, len(p), _CHUNK)
        ]

        def one(r):
            k, t, p, i, v = r
            o = swap(t, p, v)
            return o, _change(i, o, v)

        done = list(HOST_POOL.map(one, ranges))
        new = list(self.hashes)
        for (k, *_), (_, d) in zip(ranges, done):
            new[k] = (new[k] + d) & _M64
        bad = [n for n, h in zip(self.names, new) if h != int(meta["leaves"][n]["hash"])]
        if bad:  # in reverse order, one at a time: right even if a (corrupt) payload wrote a position twice
            for (_, t, p, _, _), (o, _) in reversed(list(zip(ranges, done))):
                swap(t, p, o)
            raise DeltaError(f"{path}: leaf {bad[0]}: the result fails its hash check (corrupt delta or wrong base)")
        self.hashes, self.version = new, int(meta["version"])


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
