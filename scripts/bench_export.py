"""Weight sync cost, trainer -> sampler, for full and delta versions, against a plain copy of the same weights.

    python scripts/bench_export.py [--sizes tiny,0.5b] [--engine tiny|all|none] [--dtype bfloat16|float32]
                                   [--dir /dev/shm] [--lr 1e-6] [--reps 3]

The trainer holds fp32 parameters; the sampler serves --dtype. Between versions every parameter takes one
Adam-sized step (lr times a random sign, so every weight moves, as under Adam), and a version is published as
`full` (every word) or `delta` (changed words only; sampler/weight_words.py). Columns (seconds, median of --reps):

  bytes     payload written per version (words, plus a 4-byte position per changed word for a delta)
  changed   share of words that differ from the previous version in the sampler dtype
  cast      the parameters to the host: an accelerator casts to the sampler dtype first; on a CPU backend the fp32
            words are read where they lie (no copy) and cast inside the diff (trainer)
  diff      cast per range, changed words and hashes (trainer; a full version casts and hashes every word)
  write     orbax save + atomic rename (trainer)
  apply     sampler, engine rows: read the version, check it fits the served one, map a delta's changed words to
            their places in the engine's tensors (a full version: host copy, hash check, every Hugging Face tensor);
            rows without an engine: the same version applied to a host copy (weight_receive.WeightStore) and mapped
  reload    in the vLLM engine: a delta's words swapped into its tensors in place, the result's hashes checked from
            the words they replaced (a full version: every tensor reloaded), then the prefix cache reset; only
            where --engine starts an engine for that size ("-" else)
  total     the trainer's update_weights() call end to end (engine rows), else cast + diff + write + apply
  copy      `cp` of the full fp32 weights' bytes on the same file system, measured in the same run

Before it starts, the script removes the work folders (bench_export-<pid>-*) that killed runs left under --dir,
and exits 2 if --dir is missing or has less room than the run writes there (about 12 bytes a weight with an engine,
8 without).

The 0.5B model is randomly initialised with Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14/2 heads, MLP 4864,
vocab 151936, tied embeddings): ~494M parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from twocircuit_jax.config.sections import ModelConfig, SamplerConfig  # noqa: E402
from twocircuit_jax.model import init_params, save_hf  # noqa: E402
from twocircuit_jax.model.hf_io import hf_names_touched, to_hf_state_dict  # noqa: E402
from twocircuit_jax.sampler import (
    engine_layout,  # noqa: E402
    export as ex,  # noqa: E402
    weight_publish as wp,
    weight_receive as wr,  # noqa: E402
)

SIZES = {
    "tiny": ModelConfig(
        vocab_size=96,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=256,
    ),
    "0.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4864,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_embeddings=True,
    ),
}


@jax.jit
def _adam_like_step(params, key, lr):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [x - lr * jnp.sign(jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)])


def _copy_s(src_dir: str, work: str) -> float:
    dst = os.path.join(work, "copy")
    t0 = time.perf_counter()
    shutil.copytree(src_dir, dst)
    dt = time.perf_counter() - t0
    shutil.rmtree(dst)
    return dt


def _apply_s(store, cfg, path) -> float:
    """The sampler's side without an engine, as /load does it: WeightStore.load, then the engine positions of a
    delta's words (sampler/engine_layout.py) or, for a full version, every Hugging Face tensor."""
    t0 = time.perf_counter()
    changed = store.load(path)
    shapes = dict(zip(store.names, store.shapes))
    if changed and all(v is None for v in changed.values()):
        to_hf_state_dict(cfg, store.params(), only=hf_names_touched(changed, shapes))
    else:
        for leaf, idx in changed.items():
            engine_layout.targets(cfg, leaf, shapes[leaf], idx)
    return time.perf_counter() - t0


def bench(name, cfg, sync_dtype, engine, reps, lr, work):
    params = jax.block_until_ready(init_params(cfg, jax.random.PRNGKey(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    rows = []
    # fp32 reference for the copy column: the weights as the trainer holds them
    ref = ex.export_weights(params, cfg, os.path.join(work, "fp32"), 0)
    copy_s = statistics.median(_copy_s(ref, work) for _ in range(reps))
    shutil.rmtree(os.path.dirname(ref))
    key = jax.random.PRNGKey(1)
    # served as the trainer holds it: a tied model stays tied in the engine (in-place updates; untie_for_vllm)
    serve_cfg = cfg
    sampler = None
    if engine:
        from twocircuit_jax.sampler.vllm_client import VLLMSampler

        host = jax.device_get(params)
        model_dir = save_hf(dataclasses.replace(serve_cfg, param_dtype=sync_dtype), host, os.path.join(work, "model"))
        del host
        sampler = VLLMSampler(
            SamplerConfig(startup_timeout_s=900, request_timeout_s=900),
            model_dir,
            os.path.join(work, "engine_exports"),
            serve_cfg,
            dtype=sync_dtype,
            kv_cache_bytes=256 << 20,
            max_model_len=256,
            full_every=10**6,
        )
    try:
        for mode in ("full", "delta"):
            root = os.path.join(work, mode)
            pub = wp.WeightPublisher(root, serve_cfg, sync_dtype, delta=mode == "delta", full_every=10**6)
            store = wr.WeightStore()
            if sampler is not None:
                sampler.publisher = wp.WeightPublisher(
                    sampler.export_root, serve_cfg, sync_dtype, delta=mode == "delta", full_every=10**6
                )
            version, got = 0, []
            for rep in range(reps + 1):  # the first version is full for both modes: its base
                version += 1
                if sampler is not None:
                    t0 = time.perf_counter()
                    sampler.update_weights(params, 1000 * (mode == "delta") + version)
                    total = time.perf_counter() - t0
                    st, load = sampler.last_publish, sampler.last_load
                    apply_s, reload_s = load["restore_s"], load["reload_s"]
                else:
                    st = pub.publish(params, version, keep=2)
                    apply_s = _apply_s(store, serve_cfg, ex.version_dir(root, version))
                    reload_s = None
                    total = st.cast_s + st.diff_s + st.write_s + apply_s
                if rep > 0:
                    got.append((st, apply_s, reload_s, total))
                key, k = jax.random.split(key)
                params = jax.block_until_ready(_adam_like_step(params, k, lr))
            med = lambda f: statistics.median(f(g) for g in got)  # noqa: E731
            rows.append(
                (
                    name,
                    n,
                    mode,
                    med(lambda g: g[0].bytes),
                    med(lambda g: g[0].changed_frac),
                    med(lambda g: g[0].cast_s),
                    med(lambda g: g[0].diff_s),
                    med(lambda g: g[0].write_s),
                    med(lambda g: g[1]),
                    None if sampler is None else med(lambda g: g[2]),
                    med(lambda g: g[3]),
                    copy_s,
                )
            )
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if sampler is not None:
            sampler.close()
    return rows


PREFIX = "bench_export-"  # work folders are named bench_export-<pid>-<random>


def leftovers(root: str) -> list[str]:
    """Work folders of earlier runs of this script under `root` whose process is gone. A run that is killed (out
    of memory, a timeout) cannot remove its exports, and under /dev/shm they keep holding memory: 12 GB of them once
    made the next run on this machine get killed for memory in turn."""
    out = []
    for name in sorted(os.listdir(root)):
        m = re.match(rf"^{PREFIX}(\d+)-", name)
        if m and int(m.group(1)) != os.getpid() and not ex._pid_alive(int(m.group(1))):
            out.append(os.path.join(root, name))
    return out


def need_bytes(sizes: list, engine: str) -> int:
    """About the most the run keeps under --dir at once: the fp32 export and its `cp` (8 bytes a weight), or, with
    an engine, its model folder and versions besides the two kept by the publisher (~12 bytes a weight)."""
    out = 0
    for name in sizes:
        shapes = jax.eval_shape(lambda k, c=SIZES[name]: init_params(c, k), jax.random.PRNGKey(0))
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
        out = max(out, n * (12 if engine in ("all", name) else 8))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,0.5b")
    ap.add_argument(
        "--engine",
        choices=["tiny", "all", "none"],
        default="tiny",
        help="sizes that also start a vLLM engine and time update_weights() end to end",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="the sampler's dtype")
    ap.add_argument("--lr", type=float, default=1e-6, help="per-step move of every weight (Adam-sized)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="", help="where exports are written (default: a temp dir; /dev/shm = memory)")
    a = ap.parse_args(argv)
    for s in a.sizes.split(","):
        if s not in SIZES:
            print(f"error: --sizes: unknown size {s!r}; allowed {', '.join(SIZES)}", file=sys.stderr)
            return 2
    root = a.dir or tempfile.gettempdir()
    if not os.path.isdir(root):
        print(f"error: --dir {root}: no such folder", file=sys.stderr)
        return 2
    for old in leftovers(root):
        print(f"removing {old}: left by an earlier run whose process is gone", file=sys.stderr)
        shutil.rmtree(old, ignore_errors=True)
    need, free = need_bytes(a.sizes.split(","), a.engine), shutil.disk_usage(root).free
    if free < need:
        print(
            f"error: --dir {root}: {free / 2**30:.1f} GiB free, this run writes up to about {need / 2**30:.1f} GiB "
            "there; free some space or pass another --dir",
            file=sys.stderr,
        )
        return 2
    rows = []
    with tempfile.TemporaryDirectory(dir=root, prefix=f"{PREFIX}{os.getpid()}-") as work:
        for name in a.sizes.split(","):
            cfg = dataclasses.replace(SIZES[name], param_dtype="float32", compute_dtype="float32")
            engine = a.engine == "all" or a.engine == name
            rows += bench(name, cfg, a.dtype, engine, a.reps, a.lr, os.path.join(work, name))
            print(f"done {name}", file=sys.stderr, flush=True)
    head = ("model", "params", "sync", "bytes", "changed", "cast", "diff", "write", "apply", "reload", "total", "copy")
    print(f"\nsampler dtype {a.dtype}, lr {a.lr:g}, exports under {root}")
    print(" ".join(f"{h:>11}" for h in head))
    for r in rows:
        name, n, mode, b, ch, *secs = r
        cells = [name, f"{n:,d}", mode, f"{b / 2**20:.1f}MiB", f"{ch:.4f}"]
        cells += ["-" if x is None else f"{x:.3f}" for x in secs]
        print(" ".join(f"{c:>11}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
