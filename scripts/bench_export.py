"""Weight publish cost for the vLLM sampler: orbax export (trainer side) and reload (sampler side).

    python scripts/bench_export.py [--sizes tiny,0.5b] [--engine tiny|all|none] [--dtype float32|bfloat16]

Columns (seconds, median of --reps):
  export   export_weights(): orbax save into a temp folder + atomic rename (trainer blocks on this)
  restore  load_export(): orbax restore to host numpy (no accelerator)
  handoff  to_hf_state_dict() + numpy->torch (what the server hands vLLM's reload_weights)
  reload   in-engine: POST /load round trip measured by the server (restore + map + in-place reload + prefix-cache
           reset); only where --engine starts a vLLM engine for that size ("-" otherwise)
The 0.5B model is randomly initialised with Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14/2 heads, MLP 4864,
vocab 151936, tied embeddings): ~494M parameters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from twocircuit_jax.config.sections import ModelConfig, SamplerConfig  # noqa: E402
from twocircuit_jax.model import init_params, save_hf, to_hf_state_dict  # noqa: E402
from twocircuit_jax.sampler.export import export_weights, load_export, prune  # noqa: E402

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


def _timed(fn, reps):
    out, ts = None, []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return out, statistics.median(ts)


def _handoff(cfg, params):
    import torch

    from twocircuit_jax.sampler.vllm_server import _to_torch

    with torch.no_grad():
        return [(k, _to_torch(v)) for k, v in to_hf_state_dict(cfg, params).items()]


def bench(name, cfg, engine: bool, reps: int, work: str):
    params = jax.block_until_ready(init_params(cfg, jax.random.PRNGKey(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    root = os.path.join(work, name, "exports")
    version = iter(range(1, 1000))
    _, t_export = _timed(lambda: export_weights(params, cfg, root, next(version), keep=2), reps)
    path = sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("v"))[-1]
    (_, host), t_restore = _timed(lambda: load_export(path), reps)
    _, t_handoff = _timed(lambda: _handoff(cfg, host), reps)
    host = None  # free the restored copy before the engine starts
    t_reload = None
    if engine:
        from twocircuit_jax.sampler.vllm_client import VLLMSampler

        model_dir = save_hf(cfg, params, os.path.join(work, name, "model"))
        s = VLLMSampler(
            SamplerConfig(startup_timeout_s=900, request_timeout_s=900),
            model_dir,
            root,
            cfg,
            dtype=cfg.param_dtype,
            kv_cache_bytes=256 << 20,
            max_model_len=256,
        )
        try:
            loads = []
            for _ in range(reps):
                t0 = time.perf_counter()
                s.load(int(os.path.basename(path)[1:]))
                loads.append(time.perf_counter() - t0)
            t_reload = statistics.median(loads)
        finally:
            s.close()
    prune(root, 1)
    return n, t_export, t_restore, t_handoff, t_reload


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,0.5b")
    ap.add_argument(
        "--engine",
        choices=["tiny", "all", "none"],
        default="tiny",
        help="sizes that also start a vLLM engine to time the in-place reload",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", default="", help="scratch folder (default: a temp dir, removed after)")
    a = ap.parse_args(argv)
    import dataclasses

    rows = []
    with tempfile.TemporaryDirectory(dir=a.work or None) as work:
        for name in a.sizes.split(","):
            cfg = dataclasses.replace(SIZES[name], param_dtype=a.dtype, compute_dtype=a.dtype)
            engine = a.engine == "all" or a.engine == name
            rows.append((name, *bench(name, cfg, engine, a.reps, work)))
            print(f"done {name}", file=sys.stderr, flush=True)
    print(
        f"\n{'model':6} {'params':>12} {'dtype':>9} {'export_s':>9} {'restore_s':>10} {'handoff_s':>10} {'reload_s':>9}"
    )
    for name, n, te, tr, th, tl in rows:
        rl = "-" if tl is None else f"{tl:.3f}"
        print(f"{name:6} {n:>12,d} {a.dtype:>9} {te:>9.3f} {tr:>10.3f} {th:>10.3f} {rl:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
