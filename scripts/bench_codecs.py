"""Benchmark (not a test): compressed train-step time over dense train-step time on the same mesh, per codec.

    python scripts/bench_codecs.py [--config configs/tiny.yaml] [--set key=value ...] [--iters 20] [--devices 8]

Random weights and a synthetic full-length batch of the config's mini-batch shape; each codec's step is jitted
once, warmed up, then timed (median of `--iters`, block_until_ready). One line per arm (`--arms`; each arm is a set of `fast` sections put over the config, see ARMS):
    arm=prf_mask step_ms=... dense_ms=... ratio=...
The design target for the jnp reference codecs is ratio <= 1.15 (printed as ok/over; never asserted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

NONE = ["fast.codec={type: none}", "fast.grad_codec={type: none}"]
ARMS = {  # the settings of configs/tiny.yaml's codecs (hidden 64)
    "dense": NONE,
    "prf_mask": NONE + ["fast.codec={type: prf_mask, p: 0.95}"],
    "lowrank": NONE + ["fast.codec={type: lowrank, rank: 3}"],
    "sr_quant": NONE + ["fast.codec={type: sr_quant, quant_bits: 1, quant_block: 32}"],
    "powersgd": NONE + ["fast.grad_codec={type: powersgd, rank: 2, start_after: 0}"],
}


def _step_fn(cfg, mesh, params):
    import jax
    import jax.numpy as jnp

    from twocircuit_jax.fast.circuit import FastCircuit
    from twocircuit_jax.step.circuit_state import CircuitState, distinct_buffers, init_clock
    from twocircuit_jax.step.grpo_step import make_grpo_loss
    from twocircuit_jax.step.train_step import build_train_step, init_state, make_optimizer, state_shardings

    on = cfg.fast.codec_type != "none" or cfg.fast.grad_codec_type != "none"
    c = FastCircuit(cfg, cfg.model, mesh) if on else None
    act = c if (c and c.has_activation_codec) else None
    opt = make_optimizer(cfg.optim)
    loss = make_grpo_loss(cfg.model, cfg.grpo, cfg.sampler.sampling.max_new_tokens, act)
    state = init_state(jax.tree.map(jnp.copy, params), opt)  # the step donates its state
    sh = state_shardings(state, mesh)
    cs = CircuitState(init_clock(1), None, None, None, None)
    if c:
        cs = cs._replace(codec=c.init_codec_state(), grad=c.init_grad_state(params))
    cs = distinct_buffers(cs)  # the step donates it
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
    ap.add_argument("--arms", default=",".join(a for a in ARMS if a != "dense"), help=f"of {', '.join(ARMS)}")
    args = ap.parse_args(argv)
    if "jax" not in sys.modules and not os.environ.get("JAX_PLATFORMS"):
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.model.qwen2 import init_params
    from twocircuit_jax.parallel import mesh as pmesh

    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"--arms: unknown {unknown}; allowed {', '.join(ARMS)}", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.set)
    mesh = pmesh.make_mesh(cfg.mesh)
    params = init_params(cfg.model, jax.random.key(0))
    t, s = cfg.train, cfg.sampler
    B, T, new = t.prompts_per_update * s.n, t.max_prompt_len + s.sampling.max_new_tokens, s.sampling.max_new_tokens
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
    step, state, cs = _step_fn(load_config(args.config, args.set + ARMS["dense"]), mesh, params)
    dense_ms = _time(step, state, batch, cs, args.iters)
    for arm in arms:
        step, state, cs = _step_fn(load_config(args.config, args.set + ARMS[arm]), mesh, params)
        ms = _time(step, state, batch, cs, args.iters)
        r = ms / dense_ms
        print(
            f"arm={arm} step_ms={ms:.2f} dense_ms={dense_ms:.2f} ratio={r:.3f} {'ok' if r <= 1.15 else 'over'}(target<=1.15)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
