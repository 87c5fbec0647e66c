"""Benchmark (not a test): time and memory of an anchor fire and of the optimizer-state swap, relative to one
fast train step (dense GRPO step; the codec adds to the fast side only).

    .venv/bin/python scripts/bench_anchor.py [--hidden 64 --layers 4 --batch 16 --seq 48 --reps 10]

Times are medians over --reps calls after a warm-up call (compile excluded). "fire" is the whole host-side fire
(`before_tick` on a fire tick: replay lookup, host→device copy of the snapshot, dense forward/backward, EMA and
moment updates); "fire_jit" is the jitted device part alone. Memory is XLA's compiled memory analysis
(arguments + outputs + temporaries − aliased), i.e. the peak the executable needs, and on GPU also the device's
peak_bytes_in_use. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from twocircuit_jax.anchor.circuit import AnchorCircuit
from twocircuit_jax.config import load_config
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.parallel import mesh as pmesh
from twocircuit_jax.step.circuit_state import CircuitState, init_clock
from twocircuit_jax.step.grpo_step import make_grpo_loss
from twocircuit_jax.step.train_step import build_train_step, init_state, make_optimizer, state_shardings


def _mem(compiled) -> int:
    m = compiled.memory_analysis()
    if m is None:
        return -1
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _median(fn, reps):
    fn()  # warm-up (compile)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    heads = max(1, a.hidden // 32)
    cfg = load_config(
        data={
            "model": {
                "vocab_size": a.vocab,
                "hidden_size": a.hidden,
                "num_layers": a.layers,
                "num_heads": heads,
                "num_kv_heads": 1,
                "head_dim": a.hidden // heads,
                "intermediate_size": 3 * a.hidden,
            },
            "fast": {"pp_size": 1},
            "anchor": {
                "enabled": True,
                "cadence": 1,
                "delay": 1,
                "projection": {"enabled": False},
                "swap": {"cadence": 1},
            },
            "train": {"prompts_per_step": 2, "prompts_per_update": 1},
        }
    )
    mesh = pmesh.make_mesh(cfg.mesh)
    params = init_params(cfg.model, jax.random.PRNGKey(0))
    opt = make_optimizer(cfg.optim)
    state = init_state(params, opt)
    sh = state_shardings(state, mesh)
    state = jax.device_put(state, sh)
    r = np.random.default_rng(0)
    B, T = a.batch, a.seq
    b = {
        "tokens": r.integers(3, a.vocab, (B, T)).astype(np.int32),
        "attention_mask": np.ones((B, T), np.int32),
        "response_mask": (np.arange(T)[None] >= T // 3).repeat(B, 0).astype(np.float32),
        "advantages": r.normal(size=B).astype(np.float32),
        "sample_id": np.arange(B, dtype=np.int32),
        "sampler_logp": np.zeros((B, T), np.float32),
        "old_logp": -np.ones((B, T), np.float32),
        "ref_logp": -np.ones((B, T), np.float32),
        "ref_logp_dense": -np.ones((B, T), np.float32),
    }
    batch = jax.device_put(b, pmesh.batch_shardings(b, mesh))

    circ = AnchorCircuit(cfg, cfg.model, state.params)
    cs = CircuitState(init_clock(), None, None, circ.init_merger_state(), circ.init_moments())
    loss_fn = make_grpo_loss(cfg.model, cfg.grpo, T)
    step = build_train_step(loss_fn, opt, sh, mesh, grad_transform=circ.grad_transform, donate=False)
    # no donation: the same state is reused

    tick = [0]

    def fire():
        tick[0] += 1
        nonlocal cs
        cs, m, _ = circ.before_tick(tick[0], tick[0], True, batch, state, cs)
        return cs.merger.m

    t_fire = _median(fire, a.reps)
    t_step = _median(lambda: step(state, cs, batch)[0].params, a.reps)
    dev = jax.device_put(jax.device_get(state.params), sh.params)
    carry = {"merger": cs.merger, "moments": cs.moments}
    fire_c = circ._fire_jit.lower(dev, dict((k, batch[k]) for k in circ._batch_keys), carry, None).compile()
    t_fire_jit = _median(
        lambda: (
            circ._fire_jit(dev, {k: batch[k] for k in circ._batch_keys}, jax.tree.map(jnp.copy, carry), None)[0][
                "merger"
            ].m
        ),
        a.reps,
    )
    host_opt = jax.device_get(state.opt_state)
    copies = [jax.device_put(host_opt, sh.opt_state) for _ in range(a.reps + 2)]  # the swap donates its input
    circ.after_tick(1, state._replace(opt_state=copies.pop()), cs)  # builds the swap jit (state's shardings)
    swap = circ._swap_jit
    swap_c = swap.lower(state.opt_state, cs.moments).compile()
    t_swap = _median(lambda: swap(copies.pop(), cs.moments)[0], a.reps)
    step_c = step.lower(state, cs, batch).compile()
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    out = {
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "params": int(n_params),
        "batch": [B, T],
        "time_s": {"fast_step": t_step, "fire": t_fire, "fire_jit": t_fire_jit, "swap": t_swap},
        "time_rel_fast_step": {"fire": t_fire / t_step, "fire_jit": t_fire_jit / t_step, "swap": t_swap / t_step},
        "mem_bytes": {"fast_step": _mem(step_c), "fire_jit": _mem(fire_c), "swap": _mem(swap_c)},
    }
    out["mem_rel_fast_step"] = {
        k: out["mem_bytes"][k] / max(out["mem_bytes"]["fast_step"], 1) for k in ("fire_jit", "swap")
    }
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    if stats and "peak_bytes_in_use" in stats:
        out["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
