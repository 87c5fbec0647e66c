"""Benchmark (not a test): compressed train-step time over dense train-step time on the same mesh, per codec.

    python scripts/bench_codecs.py [--config configs/tiny.yaml] [--set key=value ...] [--iters 20] [--devices 8]

Random weights and a synthetic full-length batch of the config's mini-batch shape; each codec's step is jitted
once, warmed up, then timed (median of `--iters`, block_until_ready). One line per codec:
    codec=prf_mask step_ms=... dense_ms=... ratio=...
The design target for the jnp reference codecs is ratio <= 1.15 (printed as ok/over; never asserted).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

CODECS = [("prf_mask", "none"), ("lowrank", "none"), ("sr_quant", "none"), ("none", "powersgd")]


def _step_fn(cfg, mesh, params, fast_override):
    import jax
    import jax.numpy as jnp

    from twocircuit_jax.fast.circuit import FastCircuit
    from twocircuit_jax.train.circuit_state import CircuitState, distinct_buffers, init_clock
    from twocircuit_jax.train.grpo_step import make_grpo_loss
    from twocircuit_jax.train.step import build_train_step, init_state, make_optimizer, state_shardings

    cfg = dataclasses.replace(cfg, fast=dataclasses.replace(cfg.fast, **fast_override))
    on = cfg.fast.codec != "none" or cfg.fast.grad_codec != "none"
    c = FastCircuit(cfg, cfg.model, mesh) if on else None
    act = c if (c and c.has_activation_codec) else None
    opt = make_optimizer(cfg.optim)
    loss = make_grpo_loss(cfg.model, cfg.grpo, cfg.sampler.sampling.max_new_tokens, act)
    state = init_state(jax.tree.map(jnp.copy, params), opt)  # the step donates its state
    sh = state_shardings(state, mesh)
    cs = CircuitState(init_clock(1), None, None, None, None)
    if c:
        cs = distinct_buffers(cs._replace(codec=c.init_codec_state(), grad=c.init_grad_state(params)))
    step = build_train_step(
        loss, opt, sh, mesh, grad_fn=c.grad_fn(None) if c else None, absorb_aux=c.absorb_aux if c else None
    )
    return step, jax.device_put(state, sh), cs


def _time(step, state, batch, cs, iters):
    import jax

    state, cs, m = step(state, cs, batch)  # compile + warm-up
    jax.block_until_ready(m)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        state, cs, m = step(state, cs, batch)
        jax.block_until_ready((state, m))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"))
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices when no accelerator is present")
    ap.add_argument("--codecs", default=",".join(f"{a}+{g}" for a, g in CODECS))
    args = ap.parse_args(argv)
    if "jax" not in sys.modules and not os.environ.get("JAX_PLATFORMS"):
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.model.qwen2 import init_params
    from twocircuit_jax.parallel import mesh as pmesh

    cfg = load_config(args.config, args.set)
    mesh = pmesh.make_mesh(cfg.mesh)
    params = init_params(cfg.model, jax.random.key(0))
    t, s = cfg.train, cfg.sampler
    B, T, new = t.mini_batch * s.n, t.max_prompt_len + s.sampling.max_new_tokens, s.sampling.max_new_tokens
    resp = np.zeros((B, T), np.float32)
    resp[:, T - new :] = 1
    batch = {
        "tokens": jax.random.randint(jax.random.PRNGKey(1), (B, T), 3, cfg.model.vocab_size, jnp.int32),
        "attention_mask": jnp.ones((B, T), jnp.int32),
        "response_mask": jnp.asarray(resp),
        "advantages": jax.random.normal(jax.random.PRNGKey(2), (B,)),
        "sample_id": jnp.arange(B, dtype=jnp.int32),
        "old_logp": jnp.full((B, T), -4.0),
        "ref_logp": jnp.full((B, T), -4.0),
    }
    batch = jax.device_put(batch, pmesh.batch_shardings(batch, mesh))
    print(f"backend={jax.default_backend()} devices={len(jax.devices())} mesh={dict(mesh.shape)} batch={B}x{T}")
    dense_ms = _time(
        *_step_fn(cfg, mesh, params, {"codec": "none", "grad_codec": "none"})[:2],
        batch,
        {"step": jnp.asarray(1, jnp.int32)},
        args.iters,
    )
    for item in args.codecs.split(","):
        a, g = item.split("+")
        step, state, cs = _step_fn(cfg, mesh, params, {"codec": a, "grad_codec": g})
        ms = _time(step, state, batch, cs, args.iters)
        r = ms / dense_ms
        print(
            f"codec={a} grad_codec={g} step_ms={ms:.2f} dense_ms={dense_ms:.2f} ratio={r:.3f} "
            f"{'ok' if r <= 1.15 else 'over'}(target<=1.15)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
