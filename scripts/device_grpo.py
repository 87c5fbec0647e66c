"""A few GRPO steps of a randomly initialised Qwen2.5-0.5B-shaped model on one GPU, rollouts from the vLLM sampler
process, the PRF mask's Pallas kernel on every codec path: the accelerator end-to-end check of scripts/device_check.sh.

    python scripts/device_grpo.py --out DIR [--steps 3] [--backend vllm]
    python scripts/device_grpo.py --out DIR --cpu-smoke   # toy model, interpret-mode kernel, CPU: checks the script

No network: the model is built from shapes (24 layers, hidden 896, 14/2 heads, MLP 4864, vocab 151936, tied
embeddings) and the char tokenizer, so the run needs no checkpoint or tokenizer download; the vLLM engine is started
from the run's own exported weights. PASS when every step is logged with a finite loss and, with vLLM, the
sampler/trainer log-prob gap is finite and, with vLLM, the engine served the weights of the previous update (a
random model has no task reward to check). Memory: JAX takes at most
half the GPU (XLA_PYTHON_CLIENT_MEM_FRACTION, set before jax starts), vLLM `gpu_memory_utilization` 0.3 of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

QWEN05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 4864,
    "rope_theta": 1000000.0,
    "tie_embeddings": True,
    "qkv_bias": True,
    "max_position_embeddings": 2048,
    "param_dtype": "float32",
    "compute_dtype": "bfloat16",
}
TOY = {"vocab_size": 100, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
       "intermediate_size": 64, "max_position_embeddings": 64}  # fmt: skip


def run_config(steps: int, backend: str, smoke: bool) -> dict:
    batch, new_tokens, prompt = (2, 4, 16) if smoke else (8, 64, 64)
    fast = {"codec": {"type": "prf_mask", "p": 0.9, "use_kernel": True}, "pp_size": 2 if smoke else 4}
    if smoke:
        fast["kernel_interpret"] = True  # CPU: the kernel runs in the interpreter
    return {
        "name": "device_grpo_smoke" if smoke else "device_grpo_qwen05b",
        "tokenizer": "char",
        "model": TOY if smoke else QWEN05B,
        "mesh": {"data": -1},
        "optim": {"lr": 1.0e-5},
        "task": {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 64, "eval_size": 8},
        "sampler": {"backend": backend, "n": 4, "sampling": {"max_new_tokens": new_tokens},
                    "gpu_memory_utilization": 0.3, "startup_timeout_s": 300},
        "fast": fast,
        "train": {"steps": steps, "prompts_per_step": batch, "prompts_per_update": batch, "eval_every": 0, "eval_size": 8,
                  "max_prompt_len": prompt, "checkpoint_every": 0},
    }  # fmt: skip


def verdict(rows: list, steps: int, backend: str) -> list[str]:
    """Problems found in the run's metrics rows (empty: PASS)."""
    trained = [r for r in rows if r.get("step", 0) >= 1]
    problems = []
    if len(trained) != steps:
        problems.append(f"{len(trained)} step rows logged, expected {steps}")
    for r in trained:
        step = r.get("step")
        for key in ("loss", "mismatch/prob_gap_mean"):
            v = r.get(key)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                problems.append(f"step {step}: {key} = {v!r}")
        # vLLM serves the weights exported after the previous update (staleness 0): a reload that did not happen
        # shows up here
        if backend == "vllm" and r.get("sampler/weight_version") != step - 1:
            problems.append(f"step {step}: sampler weight version {r.get('sampler/weight_version')!r}, not {step - 1}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="run directory (created)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default=None, choices=("vllm", "jax"), help="default: vllm, jax with --cpu-smoke")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy model on CPU, kernel in interpret mode")
    args = ap.parse_args(argv)
    backend = args.backend or ("jax" if args.cpu_smoke else "vllm")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # leave the rest of the GPU to vLLM
    import jax
    import yaml

    from twocircuit_jax.cli import main as cli_main

    if not args.cpu_smoke and jax.default_backend() != "gpu":
        print(f"device_grpo: FAIL jax backend is {jax.default_backend()!r}, not gpu (is jax[cuda] installed?)")
        return 2
    os.makedirs(args.out, exist_ok=True)
    cfg_path = os.path.join(args.out, "config.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(run_config(args.steps, backend, args.cpu_smoke), f)
    run_dir = os.path.join(args.out, "run")
    t0 = time.perf_counter()
    rc = cli_main(["train", "--config", cfg_path, "--out", run_dir, "--no-progress"])
    wall = time.perf_counter() - t0
    metrics = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    problems = ([f"train exited {rc}"] if rc else []) + verdict(rows, args.steps, backend)
    for r in rows:
        if r.get("step", 0) >= 1:
            gap = r.get("mismatch/prob_gap_mean")
            print(f"step {r['step']}: loss={r.get('loss')} step_s={r.get('time/step_s')} prob_gap_mean={gap} "
                  f"weight_version={r.get('sampler/weight_version')}")  # fmt: skip
    for p in problems:
        print(f"device_grpo: problem: {p}")
    print(f"device_grpo: {'FAIL' if problems else 'PASS'} {args.steps} GRPO steps, backend={backend}, "
          f"device={jax.devices()[0].device_kind}, {wall:.0f}s (compile, sampler start-up included)")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
