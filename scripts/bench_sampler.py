"""JAX sampler throughput (generated tokens/s) for the model shapes of the shipped configs, on this machine.

Prints a table; no assertion. Random weights of each config's model shape (base_model is not loaded: the speed of
generation does not depend on the values). Usage: python scripts/bench_sampler.py [--configs a.yaml b.yaml]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import jax

    from twocircuit_jax.config import SamplingConfig, load_config
    from twocircuit_jax.model import init_params
    from twocircuit_jax.sampler.jax_sampler import JaxSampler

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=sorted(glob.glob("configs/*.yaml")))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}")
    print(f"{'config':28}{'params':>10}{'rows':>6}{'new':>5}{'compile s':>11}{'tokens/s':>11}")
    for path in args.configs:
        cfg = load_config(path)
        m = cfg.model
        params = init_params(m, jax.random.key(0))
        nparams = sum(x.size for x in jax.tree.leaves(params))
        sampler = JaxSampler(m, params, prompt_bucket=cfg.train.max_prompt_len)
        prompts = [[1] + [5 + (i + j) % 60 for j in range(8)] for i in range(args.prompts)]
        sp = SamplingConfig(temperature=1.0, max_new_tokens=cfg.sampler.sampling.max_new_tokens)
        t0 = time.perf_counter()
        sampler.generate(prompts, args.n, sp, seed=0)
        compile_s = time.perf_counter() - t0
        toks, t0 = 0, time.perf_counter()
        for r in range(args.reps):
            out = sampler.generate(prompts, args.n, sp, seed=r + 1)
            toks += sum(len(t) for t in out.tokens)
        dt = time.perf_counter() - t0
        print(
            f"{os.path.basename(path):28}{nparams:>10,}{args.prompts * args.n:>6}{sp.max_new_tokens:>5}"
            f"{compile_s:>11.1f}{toks / dt:>11.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
