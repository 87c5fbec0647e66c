"""JAX sampler throughput (generated tokens/s) for the model shapes of the shipped configs, on this machine.

Prints a table; no assertion. Random weights of each config's model shape (base_model is not loaded: the speed of
generation does not depend on the values). Usage: python scripts/bench_sampler.py [--configs a.yaml b.yaml]

`--early-stop`: the seconds of one generate call that ends when every row has finished against one decoded to
max_new_tokens, side by side in one process, rounds interleaved (the default weights of each config, or a trained
checkpoint's with --checkpoint, whose answers end well before the cap):
  python scripts/bench_sampler.py --early-stop --configs configs/demo.yaml --checkpoint artifacts/tiny_base \
      --max-new 64 --prompts 64 --n 4 --reps 5
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
    ap.add_argument("--early-stop", action="store_true", help="seconds per call, stopping early vs at the cap")
    ap.add_argument("--checkpoint", default="", help="native checkpoint folder of the weights (default: random)")
    ap.add_argument("--max-new", type=int, default=0, help="generation cap (default: each config's)")
    args = ap.parse_args()
    if args.early_stop:
        return early_stop(args)
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


def early_stop(args) -> int:
    import statistics

    import jax

    from twocircuit_jax.config import SamplingConfig, load_config
    from twocircuit_jax.model import init_params
    from twocircuit_jax.sampler.jax_sampler import JaxSampler

    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; {args.reps} interleaved rounds, medians")
    print(f"{'config':22}{'rows':>6}{'cap':>6}{'mean len':>10}{'longest':>9}{'stop s':>9}{'cap s':>9}{'ratio':>7}")
    for path in args.configs:
        cfg = load_config(path)
        m = cfg.model
        cap = args.max_new or cfg.sampler.sampling.max_new_tokens
        sp = SamplingConfig(temperature=1.0, max_new_tokens=cap)
        if args.checkpoint:  # trained weights and the task's own prompts: answers of the trained length
            import dataclasses

            from twocircuit_jax.tasks import make_task
            from twocircuit_jax.train.policy_io import load_policy
            from twocircuit_jax.train.rollout import encode_prompts
            from twocircuit_jax.train.setup import check_vocab, load_run_tokenizer

            m, params = load_policy(args.checkpoint)
            tok = load_run_tokenizer(dataclasses.replace(cfg, base_model=args.checkpoint))
            m = check_vocab(m, tok)
            task = make_task(cfg.task)
            problems = list(task.eval_problems())[: args.prompts]
            prompts = encode_prompts(tok, task, problems, cfg.train.max_prompt_len)
        else:
            params = init_params(m, jax.random.key(0))
            prompts = [[1] + [5 + (i + j) % 60 for j in range(8)] for i in range(args.prompts)]
        arms = {k: JaxSampler(m, params, prompt_bucket=cfg.train.max_prompt_len, stop_early=k) for k in (True, False)}
        secs = {True: [], False: []}
        for r in range(args.reps + 1):  # round 0 compiles
            for k, s in arms.items():
                t0 = time.perf_counter()
                out = s.generate(prompts, args.n, sp, seed=r)
                if r:
                    secs[k].append(time.perf_counter() - t0)
        lens = [len(t) for t in out.tokens]
        a, b = statistics.median(secs[True]), statistics.median(secs[False])
        print(
            f"{os.path.basename(path):22}{len(lens):>6}{cap:>6}{sum(lens) / len(lens):>10.1f}{max(lens):>9}"
            f"{a:>9.3f}{b:>9.3f}{a / b:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
