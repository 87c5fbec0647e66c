"""Weight versions in the sampler's dtype as integer words, and the per-leaf hashes that check them.

The delta weight sync (sampler/weight_publish.py writes, sampler/weight_receive.py applies) moves words, never floats:
between two RL steps almost every word in the sampler's dtype is unchanged (an update of ~lr moves a bf16 word only
when it crosses a rounding boundary). A version is one of two kinds:

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
"""

from __future__ import annotations

import concurrent.futures as cf
import os

import numpy as np

from twocircuit_jax.names import path_str
from twocircuit_jax.sampler import export as ex

DELTA = "delta"
WORD_TYPES = {2: np.uint16, 4: np.uint32}
CHUNK = 1 << 20  # elements per numpy pass: temporaries stay a few MiB, which malloc reuses (a fresh mapping costs
# a page fault per 4 KiB: 0.15-2.5 s per GiB first touched on this 2-core machine, by session) and mostly stay
# in cache between the cast, the compare and the gathers (the 0.5B diff, one session: 0.55-0.86 s at 2^20,
# 0.76-0.96 s at 2^22; with torch's cast, another: 1.6 s at 2^16 (per-range overhead), 0.57 s at 2^18, 0.39 s at
# 2^20, and 2^21, 2^22 within noise of 2^20)
HOST_POOL = cf.ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)))  # numpy's loops release the GIL
_K1, _K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03)
M64 = (1 << 64) - 1


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
    if a.dtype.itemsize not in WORD_TYPES:
        raise ValueError(f"weight sync handles 2- and 4-byte dtypes, got {a.dtype}")
    return a.view(WORD_TYPES[a.dtype.itemsize])


def _dot(pos: np.ndarray, w: np.ndarray) -> int:
    """sum c(pos) * w mod 2^64 (uint64 arithmetic wraps; `w` may hold wrapped differences)."""
    c = pos.astype(np.uint64)
    c *= _K1
    c += _K2
    c |= np.uint64(1)
    c *= w
    return int(np.sum(c, dtype=np.uint64))


def hash_change(pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """sum c(pos) * (new - old) mod 2^64: what the words at `pos` going from `old` to `new` add to the hash."""
    d = new.astype(np.uint64)
    d -= old.astype(np.uint64)  # wraps mod 2^64: the difference's residue, which is all the sum needs
    return _dot(pos, d)


def leaf_hash(w: np.ndarray) -> int:
    """Hash of one leaf's flat words (cost: one pass over the leaf, in CHUNK ranges over the thread pool; do not
    call it from inside a pool task)."""

    def part(s: int) -> int:
        e = min(s + CHUNK, w.size)
        return _dot(np.arange(s, e, dtype=np.uint64), w[s:e].astype(np.uint64))

    return sum(HOST_POOL.map(part, range(0, w.size, CHUNK)), 0) & M64


def updated_hash(h: int, idx: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """The leaf hash after the words at `idx` change from `old` to `new` (cost: O(len(idx)))."""
    return (h + hash_change(idx, old, new)) & M64
