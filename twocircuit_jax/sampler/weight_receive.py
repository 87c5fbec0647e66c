"""The sampler's side of the weight sync: `WeightStore` applies a version (sampler/weight_words.py: the format and
the hashes) to a host copy of the served words, or, once `release`d (an engine that holds the words), only checks a
delta and swaps its words into the engine's tensors (`read_delta`, `swap_in`: the hashes come from the words
replaced, which are written back on a mismatch). `swap_words` does one such write into a host array or an engine
tensor (`word_view`); sampler/engine_layout.py says where in the engine's tensors each word lives. `rebuild` turns
a delta chain on disk into parameters.
"""

from __future__ import annotations

import numpy as np

from twocircuit_jax.sampler import export as ex
from twocircuit_jax.sampler.weight_words import (
    CHUNK,
    DELTA,
    HOST_POOL,
    M64,
    DeltaError,
    hash_change,
    leaf_hash,
    leaf_names,
    words,
)

_INT = {2: ("int16", "uint16"), 4: ("int32", "uint32")}  # word size -> (torch dtype, numpy dtype)


def word_view(param):
    """An engine parameter's storage as a flat tensor of signed integers of its width (no copy: writes reach the
    engine); ExportError where there is none (another width, a non-contiguous tensor)."""
    import torch

    size = param.element_size()
    if size not in _INT or not param.data.is_contiguous():
        raise ex.ExportError(f"engine tensor of dtype {param.dtype}, shape {tuple(param.shape)}: no in-place word view")
    return param.data.view(-1).view(getattr(torch, _INT[size][0]))


def swap_words(flat, pos: np.ndarray, new: np.ndarray) -> np.ndarray:
    """flat[pos] = new, returning the words that were there (numpy, unsigned): `flat` is a host array of words or a
    word_view of an engine tensor; `new` holds unsigned integers of its width (bit patterns, no rounding). A CPU
    tensor is written through a numpy view of its storage (numpy's gather and scatter release the GIL, so several
    run at once on the thread pool); a tensor on a GPU by torch indexing on its device (swap_words_torch)."""
    if isinstance(flat, np.ndarray):
        a = flat
    elif flat.device.type == "cpu":
        a = flat.numpy().view(new.dtype)
    else:
        return swap_words_torch(flat, pos, new)
    old = a[pos]
    a[pos] = new
    return old


def swap_words_torch(flat, pos: np.ndarray, new: np.ndarray) -> np.ndarray:
    """swap_words by torch indexing on `flat`'s device: the path of an engine tensor on a GPU, which numpy cannot
    view."""
    import torch

    idx = torch.from_numpy(np.asarray(pos, np.int64)).to(flat.device)
    old = flat[idx].cpu().numpy().view(new.dtype)
    flat[idx] = torch.from_numpy(np.asarray(new).view(f"int{8 * new.itemsize}")).to(flat.device)
    return old


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
            self.swap_in(
                path, meta, [(k, words(self.leaves[k]), i, i, v) for k, (i, v) in enumerate(changes)], swap_words
            )
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
        served weights as they were. Writes run in CHUNK ranges over the thread pool (memory-bound gathers and
        scatters that release the GIL)."""
        ranges = [
            (k, t, p[s : s + CHUNK], i[s : s + CHUNK], v[s : s + CHUNK])
            for k, t, p, i, v in writes
            for s in range(0, len(p), CHUNK)
        ]

        def one(r):
            k, t, p, i, v = r
            o = swap(t, p, v)
            return o, hash_change(i, o, v)

        done = list(HOST_POOL.map(one, ranges))
        new = list(self.hashes)
        for (k, *_), (_, d) in zip(ranges, done):
            new[k] = (new[k] + d) & M64
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
