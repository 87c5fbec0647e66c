"""Delta weight sync without an engine: the hash, the publisher/store round trip, the on-disk chain and refusals.

The engine side (vLLM taking a delta's words in place, a restart, a corrupted delta sent again whole) is in
tests/test_vllm_sampler.py."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import TINY_VLLM
from scripts_module import load_script

from twocircuit_jax.model import init_params
from twocircuit_jax.model.hf_io import hf_names_touched, to_hf_state_dict
from twocircuit_jax.sampler import export as ex, weight_publish as wp, weight_receive as wr, weight_words as ww

CFG = TINY_VLLM


def _step(params, key, lr=1e-4, frac=0.05):
    """A sparse small update, like one optimizer step seen in a low-precision dtype: few words move."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, 2 * len(leaves))
    out = [
        x + lr * jax.random.normal(keys[2 * i], x.shape) * (jax.random.uniform(keys[2 * i + 1], x.shape) < frac)
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, out)


def _words_of(tree, dtype):
    return [
        ww.words(np.asarray(x)) for x in jax.tree.leaves(jax.device_get(jax.tree.map(lambda a: a.astype(dtype), tree)))
    ]


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_hash_detects_every_single_word_change_and_updates_incrementally():
    rng = np.random.default_rng(0)
    w = rng.integers(0, 2**16, size=5000, dtype=np.uint16)
    h = ww.leaf_hash(w)
    for i in rng.integers(0, w.size, size=200):
        v = w.copy()
        v[i] ^= np.uint16(1 << int(rng.integers(0, 16)))
        assert ww.leaf_hash(v) != h  # one flipped bit anywhere changes the hash
    # a word moved to another position changes it too (the hash is positional)
    v = w.copy()
    v[[3, 4]] = v[[4, 3]]
    assert (w[3] == w[4]) or ww.leaf_hash(v) != h
    idx = np.sort(rng.choice(w.size, 300, replace=False)).astype(np.uint32)
    new = w.copy()
    new[idx] = rng.integers(0, 2**16, size=idx.size, dtype=np.uint16)
    assert ww.updated_hash(h, idx, w[idx], new[idx]) == ww.leaf_hash(new)
    # chunked hashing (leaves larger than one pass) agrees with the incremental form
    big = rng.integers(0, 2**32, size=ww.CHUNK + 777, dtype=np.uint32)
    hb = ww.leaf_hash(big)
    j = np.array([5, ww.CHUNK + 3], np.uint32)
    nb = big.copy()
    nb[j] += np.uint32(1)
    assert ww.updated_hash(hb, j, big[j], nb[j]) == ww.leaf_hash(nb)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_twenty_updates_rebuild_bit_identical_to_full_exports(tmp_path, dtype):
    params = init_params(CFG, jax.random.PRNGKey(0))
    root = str(tmp_path / "exports")
    pub = wp.WeightPublisher(root, CFG, dtype, full_every=8)
    store = wr.WeightStore()
    key = jax.random.PRNGKey(1)
    kinds = []
    for v in range(1, 21):
        stats = pub.publish(params, v, keep=3)
        kinds.append(stats.kind)
        changed = store.load(ex.version_dir(root, v))
        want = _words_of(params, jnp.dtype(dtype))
        assert _same([ww.words(x) for x in store.leaves], want), v  # the store holds exactly the cast weights
        _, rebuilt = wr.rebuild(root, v)  # from disk alone: newest full base + its deltas
        assert _same([ww.words(x) for x in jax.tree.leaves(rebuilt)], want), v
        if stats.kind == "delta":
            assert 0 < stats.changed_frac < 0.2 and len(changed) < len(store.names) + 1
            assert all(i.dtype == np.uint32 for i in changed.values())
        key, k = jax.random.split(key)
        params = _step(params, k)
    assert kinds == ["full"] + ["delta"] * 7 + ["full"] + ["delta"] * 7 + ["full"] + ["delta"] * 3
    # prune kept 3 versions and every delta's base back to a full one: all are rebuildable
    kept = ex.list_versions(root)
    assert kept[-3:] == [18, 19, 20] and kept[0] == 17
    assert ex.read_meta(ex.version_dir(root, 17))["kind"] == "full"


def test_delta_payload_is_small_and_refused_by_plain_load(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0))
    root = str(tmp_path)
    pub = wp.WeightPublisher(root, CFG, "bfloat16")
    full = pub.publish(params, 1)
    delta = pub.publish(_step(params, jax.random.PRNGKey(2), frac=0.01), 2)
    assert full.kind == "full" and delta.kind == "delta"
    assert delta.bytes < 0.1 * full.bytes  # 1% of words move: index + word per change
    with pytest.raises(ex.ExportError, match="a delta version .*against version 1.*rebuild"):
        ex.load_export(ex.version_dir(root, 2))


def test_delta_on_wrong_base_or_corrupt_is_refused_and_store_untouched(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0))
    root = str(tmp_path)
    pub = wp.WeightPublisher(root, CFG, "float32")
    pub.publish(params, 1)
    p2 = _step(params, jax.random.PRNGKey(3))
    pub.publish(p2, 2)
    fresh = wr.WeightStore()  # a restarted sampler: no base
    with pytest.raises(ww.DeltaError, match="delta against version 1, but this sampler holds None"):
        fresh.load(ex.version_dir(root, 2))
    store = wr.WeightStore()
    store.load(ex.version_dir(root, 1))
    before = [x.copy() for x in store.leaves]
    # corrupt one word of the payload, leaving a readable checkpoint: only the hash can tell
    path = ex.version_dir(root, 2)
    _, payload = ex.load_export(path, allow_delta=True)
    meta = ex.read_meta(path)
    payload["val"][0] ^= np.uint32(1)
    extra = {k: v for k, v in meta.items() if k not in ("version", "model_config")}
    ex.export_weights(payload, CFG, root, 2, meta=extra)
    with pytest.raises(ww.DeltaError, match="fails its hash check"):
        store.load(path)
    assert store.version == 1 and _same(store.leaves, before)
    pub.publish_full()  # a sender that is told to resend writes the same version whole
    assert ex.read_meta(path)["kind"] == "full"
    store.load(path)
    assert _same([ww.words(x) for x in store.leaves], _words_of(p2, jnp.float32))
    p3 = _step(p2, jax.random.PRNGKey(4))
    pub.publish(p3, 3)
    meta3 = os.path.join(ex.version_dir(root, 3), "meta.json")
    with open(meta3) as fh:
        m = json.load(fh)
    m["leaves"]["embed"]["count"] += 1  # the payload no longer matches its description
    with open(meta3, "w") as fh:
        json.dump(m, fh)
    with pytest.raises(ww.DeltaError, match="payload holds"):
        store.load(ex.version_dir(root, 3))
    assert store.version == 2


def test_hf_names_touched_maps_stacked_layers():
    params = jax.device_get(init_params(CFG, jax.random.PRNGKey(0)))
    names, leaves, _ = ww.leaf_names(params)
    shapes = {n: x.shape for n, x in zip(names, leaves)}
    per = int(np.prod(shapes["layers/q_proj/kernel"][1:]))
    got = hf_names_touched({"layers/q_proj/kernel": np.array([per + 3], np.uint32), "final_norm": None}, shapes)
    assert got == {"model.layers.1.self_attn.q_proj.weight", "model.norm.weight"}
    every = hf_names_touched({n: None for n in names}, shapes)
    assert every == set(to_hf_state_dict(CFG, params))  # all leaves touched = every HF tensor
    only = to_hf_state_dict(CFG, params, only=got)
    assert set(only) == got
    np.testing.assert_array_equal(
        only["model.layers.1.self_attn.q_proj.weight"], params["layers"]["q_proj"]["kernel"][1].T
    )


def _vllm_layout(cfg, params) -> dict:
    """vLLM's tensors built the slow way: HF tensors with q/k/v and gate/up concatenated row-wise."""
    hf = to_hf_state_dict(cfg, params)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for fused, parts in (("self_attn.qkv_proj", ("q", "k", "v")), ("mlp.gate_up_proj", ("gate", "up"))):
            for kind in ("weight", "bias"):
                names = [f"{pre}{fused.split('.')[0]}.{p}_proj.{kind}" for p in parts]
                if names[0] in hf:
                    hf[f"{pre}{fused}.{kind}"] = np.concatenate([hf.pop(n) for n in names])
    return {k: np.array(v, copy=True) for k, v in hf.items()}


def test_engine_layout_writes_a_delta_where_vllm_keeps_each_word():
    """Writing each changed word at engine_layout.targets' positions turns vLLM's tensors of the old parameters
    into those of the new ones, for every leaf kind (fused q/k/v and gate/up, biases, norms, embedding, head)."""
    from twocircuit_jax.sampler import engine_layout

    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    old = jax.device_get(init_params(cfg, jax.random.PRNGKey(0)))
    old = {**old, "lm_head": old["embed"].T.copy()} if "lm_head" not in old else old
    new = jax.device_get(_step(old, jax.random.PRNGKey(1), frac=0.2))
    engine, want = _vllm_layout(cfg, old), _vllm_layout(cfg, new)
    assert not all(np.array_equal(engine[k], want[k]) for k in want)
    names, olds, _ = ww.leaf_names(old)
    _, news, _ = ww.leaf_names(new)
    for name, o, n in zip(names, olds, news):
        idx = np.flatnonzero(ww.words(o) != ww.words(n)).astype(np.uint32)
        vals = np.asarray(n).reshape(-1)[idx]
        for t in engine_layout.targets(cfg, name, o.shape, idx):
            assert engine[t.name].shape == engine_layout.engine_shape(cfg, name, o.shape)
            engine[t.name].reshape(-1)[t.pos] = vals[t.lo : t.hi]
    bad = [k for k in want if not np.array_equal(engine[k], want[k])]
    assert not bad, bad[:4]


def test_diff_parts_in_chunks_equals_the_direct_diff(monkeypatch):
    monkeypatch.setattr(wp, "CHUNK", 1000)  # many ranges per leaf, spread over the thread pool
    rng = np.random.default_rng(1)
    olds = [rng.integers(0, 2**16, size=n, dtype=np.uint16) for n in (10, 4321, 2000)]
    news = [o.copy() for o in olds]
    for n in news:
        k = rng.choice(n.size, n.size // 7, replace=False)
        n[k] ^= np.uint16(3)
    hashes = [ww.leaf_hash(o) for o in olds]
    work = [o.copy() for o in olds]
    parts, new_h = wp.diff_parts(work, news, hashes)
    idx = [np.concatenate([i for i, _ in p]) for p in parts]
    val = [np.concatenate([v for _, v in p]) for p in parts]
    for o, n, i, v, h, w in zip(olds, news, idx, val, new_h, work):
        np.testing.assert_array_equal(i, np.flatnonzero(o != n))
        np.testing.assert_array_equal(v, n[i])
        assert h == ww.leaf_hash(n) and np.array_equal(w, n)  # the old copy became the new one in place


def test_diff_parts_casts_fp32_per_range_and_finds_a_transposes_changes(monkeypatch):
    """New versions given in fp32 are cast per range to the host copy's bf16 (bit-identical to XLA's cast); the twin
    entry holds the changed words of the transpose at its own positions, with its hash."""
    monkeypatch.setattr(wp, "CHUNK", 777)
    rng = np.random.default_rng(2)
    shapes = [(37, 53), (4000,)]
    f32 = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    olds = [np.asarray(jnp.asarray(x).astype(jnp.bfloat16)) for x in f32]
    news = [x + np.float32(1e-2) * (rng.random(x.shape) < 0.1) for x in f32]
    hashes = [ww.leaf_hash(ww.words(o)) for o in olds]
    t_old = np.ascontiguousarray(olds[0].T)
    twin_hash = ww.leaf_hash(ww.words(t_old))
    work = [o.copy() for o in olds]
    parts, new_h = wp.diff_parts(work, news, hashes, twin=(0, twin_hash))
    assert len(parts) == 3
    for k, (o, n) in enumerate(zip(olds, news)):
        want = ww.words(np.asarray(jnp.asarray(n).astype(jnp.bfloat16)))  # XLA's rounding, word for word
        i = np.concatenate([i for i, _ in parts[k]])
        np.testing.assert_array_equal(i, np.flatnonzero(ww.words(o) != want))
        np.testing.assert_array_equal(np.concatenate([v for _, v in parts[k]]), want[i])
        assert np.array_equal(ww.words(work[k]), want) and new_h[k] == ww.leaf_hash(want)
    t_new = np.ascontiguousarray(work[0].T)  # the transpose of the new version
    j = np.concatenate([i for i, _ in parts[2]])
    np.testing.assert_array_equal(np.sort(j), np.flatnonzero(ww.words(t_old) != ww.words(t_new)))
    np.testing.assert_array_equal(np.concatenate([v for _, v in parts[2]]), ww.words(t_new)[j])
    assert new_h[2] == ww.leaf_hash(ww.words(t_new)) and new_h[2] != twin_hash


def test_head_from_embed_publishes_what_an_explicit_transposed_head_does(tmp_path):
    """A tied model served untied: the head derived from the embedding's changes gives every version the same
    words and hashes as publishing `lm_head = embed.T` built by hand, through full and delta versions."""
    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(0))
    assert "lm_head" not in params
    served = dataclasses.replace(cfg, tie_embeddings=False)
    derived = wp.WeightPublisher(str(tmp_path / "a"), served, "bfloat16", full_every=4)
    explicit = wp.WeightPublisher(str(tmp_path / "b"), served, "bfloat16", full_every=4)
    sa, sb = wr.WeightStore(), wr.WeightStore()
    key = jax.random.PRNGKey(1)
    for v in range(1, 7):
        a = derived.publish(params, v, head_from_embed=True)
        b = explicit.publish({**params, "lm_head": params["embed"].T}, v)
        assert (a.kind, a.bytes) == (b.kind, b.bytes) and derived.hashes == explicit.hashes, v
        ca, cb = sa.load(ex.version_dir(derived.root, v)), sb.load(ex.version_dir(explicit.root, v))
        assert sa.names == sb.names and "lm_head" in sa.names
        assert _same([ww.words(x) for x in sa.leaves], [ww.words(x) for x in sb.leaves]), v
        if a.kind == "delta":
            assert a.changed_frac > 0 and np.array_equal(np.sort(ca["lm_head"]), cb["lm_head"])
        key, k = jax.random.split(key)
        params = _step(params, k, frac=0.2)
    assert _same([ww.words(x) for x in derived.published()], [ww.words(x) for x in explicit.published()])
    # switching between a given and a derived head leaves nothing to diff the head against: a full version
    assert derived.publish({**params, "lm_head": params["embed"].T}, 7).kind == "full"
    assert derived.publish(params, 8, head_from_embed=True).kind == "full"
    assert derived.publish(params, 9, head_from_embed=True).kind == "delta"


def test_a_tied_model_is_served_untied_only_where_the_engine_reloads_whole_modules():
    """In place (the default) the engine's head is its embedding tensor, which a delta writes: a tied model is
    served tied and nothing publishes a transposed copy. `weight_update: reload` gets an explicit, equal head (a
    reload there leaves a tied head on its start-up words)."""
    from twocircuit_jax.sampler.vllm_client import untie_for_vllm

    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(0)))
    c, p = untie_for_vllm(cfg, params, "inplace")
    assert c.tie_embeddings and "lm_head" not in p
    c, p = untie_for_vllm(cfg, params, "reload")
    assert not c.tie_embeddings and np.array_equal(p["lm_head"], params["embed"].T)
    untied = dataclasses.replace(CFG, tie_embeddings=False)
    assert untie_for_vllm(untied, params, "reload") == (untied, params)


def _bench_export():
    return load_script("bench_export")


def test_bench_export_runs_and_a_delta_writes_less(tmp_path, capsys):
    """scripts/bench_export.py on the tiny shapes without an engine: one row per sync kind, the delta's payload a
    small share of the full one's (the timings are a benchmark's, never asserted); a bad size exits 2."""
    bench = _bench_export()
    assert bench.main(["--sizes", "tiny,huge"]) == 2
    assert "--sizes" in capsys.readouterr().err
    assert bench.main(["--sizes", "tiny", "--engine", "none", "--reps", "1", "--dir", str(tmp_path)]) == 0
    rows = {r.split()[2]: r.split() for r in capsys.readouterr().out.splitlines() if r.strip().startswith("tiny")}
    assert set(rows) == {"full", "delta"}
    mib = {k: float(v[3].removesuffix("MiB")) for k, v in rows.items()}
    changed = {k: float(v[4]) for k, v in rows.items()}
    assert changed["full"] == 1.0 and 0 < changed["delta"] < 0.2
    assert mib["delta"] < 0.5 * mib["full"]


def test_bench_export_removes_what_killed_runs_left_and_refuses_a_missing_dir(tmp_path, capsys, monkeypatch):
    """A killed run leaves its work folder behind (under /dev/shm it holds memory): the next run removes the
    folders of runs whose process is gone, and only those. A --dir that does not exist, or lacks the room the run
    needs, exits 2, naming it."""
    import shutil
    import subprocess
    import sys

    bench = _bench_export()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid now belongs to no process (reaped)
    dead = tmp_path / f"{bench.PREFIX}{gone.pid}-abc"
    alive = tmp_path / f"{bench.PREFIX}{os.getppid()}-def"  # a live process's folder
    other = tmp_path / "bench_export-notapid-x"
    for d in (dead, alive, other):
        (d / "v00000001").mkdir(parents=True)
    assert bench.leftovers(str(tmp_path)) == [str(dead)]
    assert bench.main(["--sizes", "tiny", "--engine", "none", "--reps", "1", "--dir", str(tmp_path)]) == 0
    assert f"removing {dead}" in capsys.readouterr().err
    assert not dead.exists() and alive.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])  # its own folder is gone
    assert bench.main(["--sizes", "tiny", "--dir", str(tmp_path / "nope")]) == 2
    assert f"--dir {tmp_path / 'nope'}: no such folder" in capsys.readouterr().err
    # the room it asks for: 8 bytes a weight without an engine (the fp32 export and its copy), 12 with one
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(init_params(bench.SIZES["tiny"], jax.random.PRNGKey(0))))
    assert bench.need_bytes(["tiny"], "none") == 8 * n and bench.need_bytes(["tiny"], "tiny") == 12 * n
    # a --dir with less room than that is refused before anything is written (a run asking for 1 TiB more than the
    # real free space of tmp_path)
    monkeypatch.setattr(bench, "need_bytes", lambda sizes, engine: shutil.disk_usage(tmp_path).free + 2**40)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert bench.main(["--sizes", "tiny", "--engine", "none", "--dir", str(tmp_path)]) == 2
    assert "GiB free, this run writes up to about" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_swap_words_writes_bit_patterns_and_returns_the_old_ones(dtype):
    """The server's in-place write: the word at each position becomes the given bit pattern (no rounding) and the
    replaced words come back, through the numpy view (CPU tensors), torch indexing (the GPU path, run here on CPU
    tensors) and a host array of words; writing the old words back restores the tensor."""
    torch = pytest.importorskip("torch")

    rng = np.random.default_rng(0)
    wd = np.uint16 if dtype == "bfloat16" else np.uint32
    for path in ("numpy", "torch", "host"):
        param = torch.nn.Parameter(torch.randn(6, 10).to(getattr(torch, dtype)), requires_grad=False)
        ints = {2: torch.int16, 4: torch.int32}[param.element_size()]
        words = param.data.view(-1).view(ints).numpy().view(wd)
        before = words.copy()
        flat = {"numpy": wr.word_view(param), "torch": wr.word_view(param), "host": words}[path]
        swap = wr.swap_words_torch if path == "torch" else wr.swap_words
        pos = np.sort(rng.choice(60, 17, replace=False))
        new = rng.integers(0, np.iinfo(wd).max, 17, dtype=wd)
        old = swap(flat, pos, new)
        want = before.copy()
        want[pos] = new
        assert old.dtype == wd and np.array_equal(old, before[pos]) and np.array_equal(words, want), path
        swap(flat, pos, old)
        assert np.array_equal(words, before), path


def test_swap_in_checks_hashes_from_the_replaced_words_and_restores_on_a_mismatch(tmp_path, monkeypatch):
    """A store that released its words (the engine holds them) applies a delta to outside arrays: the right delta
    leaves them equal to the new version; one against another base (right version number, other words) fails the
    hash check and every word is written back, though it was written first."""
    monkeypatch.setattr(wr, "CHUNK", 50)  # several ranges per leaf
    params = init_params(CFG, jax.random.PRNGKey(0))
    root = str(tmp_path)
    pub = wp.WeightPublisher(root, CFG, "bfloat16")
    pub.publish(params, 1)
    p2 = _step(params, jax.random.PRNGKey(3), frac=0.3)
    pub.publish(p2, 2)
    store = wr.WeightStore()
    store.load(ex.version_dir(root, 1))
    engine = [ww.words(x).reshape(-1).copy() for x in store.leaves]  # the "engine's" tensors, outside the store
    store.release()
    assert all(x is None for x in store.leaves) and store.shapes
    with pytest.raises(ww.DeltaError, match="released"):
        store.load(ex.version_dir(root, 2))
    other = [e.copy() for e in engine]
    other[0][5] ^= np.uint16(1)  # the engine holds different words under the same version number
    before = [e.copy() for e in other]
    path = ex.version_dir(root, 2)
    changes = store.read_delta(path, ex.read_meta(path))
    writes = [(k, other[k], i.astype(np.int64), i, v) for k, (i, v) in enumerate(changes)]
    with pytest.raises(ww.DeltaError, match="fails its hash check"):
        store.swap_in(path, ex.read_meta(path), writes, wr.swap_words)
    assert _same(other, before) and store.version == 1
    writes = [(k, engine[k], i.astype(np.int64), i, v) for k, (i, v) in enumerate(changes)]
    store.swap_in(path, ex.read_meta(path), writes, wr.swap_words)
    assert store.version == 2 and store.hashes == pub.hashes
    assert _same(engine, [ww.words(x).reshape(-1) for x in _words_of(p2, jnp.bfloat16)])
