"""One arm of scripts/bench_step.py: the settings and arms (that script's docstring describes them), an arm's config
and trainer, `worker` (the arm's timed steps in this process), `figures` (its row of the table) and `run_arm` (the
arm in a fresh process of the entry point, which runs `worker` and prints its figures as a RESULT line).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

# The checkout whose configs and artifacts an arm uses: this one, or with `--against` the other one (its worker runs
# this checkout's scripts over that checkout's package and files, so both sides are timed by the same harness).
ROOT = os.environ.get("TWOCIRCUIT_BENCH_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The worker processes run the entry point, which reads their flags.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_step.py")
NONE = {"codec": {"type": "none"}, "grad_codec": {"type": "none"}}
ARMS = {
    "dense": {"fast": NONE, "anchor": {"enabled": False}},
    "prf_mask": {"fast": {**NONE, "codec": {"type": "prf_mask", "p": 0.95}, "pp_size": 4}},
    "lowrank": {"fast": {**NONE, "codec": {"type": "lowrank", "rank": 4}, "pp_size": 4}},
    "sr_quant": {"fast": {**NONE, "codec": {"type": "sr_quant", "quant_bits": 1, "quant_block": 32}, "pp_size": 4}},
    "powersgd": {"fast": {**NONE, "grad_codec": {"type": "powersgd", "rank": 2, "start_after": 0}}},
    "two_circuit": "configs/two_circuit.yaml",
    # dense with the vLLM engine process as the sampler: generate, then train; and generation one step ahead
    "dense_async": {"fast": NONE, "anchor": {"enabled": False}, "train": {"async_rollouts": 1}},
    "vllm": {"fast": NONE, "anchor": {"enabled": False}, "sampler": {"backend": "vllm"}},
    "vllm_async": {
        "fast": NONE,
        "anchor": {"enabled": False},
        "sampler": {"backend": "vllm"},
        "train": {"async_rollouts": 1},
    },
}


def peer_setting(steps: int) -> dict:
    return {
        "name": "bench_peers",
        "tokenizer": "char",
        "model": {
            "vocab_size": 128,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 32,
            "qkv_bias": True,
            "tie_embeddings": True,
            "rope_theta": 10000.0,
        },
        "optim": {"lr": 1e-5, "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 0},
        "sampler": {"backend": "jax", "n": 8, "sampling": {"max_new_tokens": 32}},
        "grpo": {"kl_coef": 0.0, "clip_low": 0.2, "clip_high": 0.2, "loss_agg": "seq-mean-token-mean"},
        "fast": NONE,
        "anchor": {"enabled": False},
        "train": {
            "steps": steps,
            "prompts_per_step": 8,
            "prompts_per_update": 8,
            "ppo_epochs": 1,
            "max_prompt_len": 16,
            "eval_every": 0,
            "checkpoint_every": 0,
            "final_checkpoint": False,
        },
        "eval": {"at_start": False, "at_end": False},
    }


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def arm_config(setting: str, arm: str, steps: int, cache: str = "", sets=()):
    import dataclasses

    import yaml

    from twocircuit_jax.config import load_config

    over = ARMS[arm]
    if isinstance(over, str):  # a shipped recipe: its fast and anchor sections
        raw = yaml.safe_load(open(os.path.join(ROOT, over)))
        over = {"fast": raw["fast"], "anchor": raw["anchor"]}
        over["fast"] = {**NONE, **over["fast"]}
    if setting == "peers":
        cfg = load_config(data=_merge(peer_setting(steps), over), overrides=list(sets))
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile_cache=cache))
    from twocircuit_jax.train.sft import base_once

    base_once(os.path.join(ROOT, "configs", "tiny_base.yaml"), os.path.join(ROOT, "artifacts", "tiny_base"), "base")
    arm_sets = [
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
    ]
    arm_sets += [
        "eval.at_start=false",
        "eval.at_end=false",
        f"base_model={os.path.join(ROOT, 'artifacts', 'tiny_base')}",
    ]
    arm_sets += [f"{sec}={json.dumps(over[sec])}" for sec in ("fast", "anchor") if sec in over]
    arm_sets += [
        f"{k}={json.dumps(v)}" for sec, v in over.items() if sec not in ("fast", "anchor") for k, v in _dotted(sec, v)
    ]
    arm_sets += [f"train.compile_cache={json.dumps(cache)}"]
    return load_config(os.path.join(ROOT, "configs", "demo.yaml"), arm_sets + list(sets))  # --set items last


def _dotted(prefix: str, d: dict):
    """(dotted key, value) of every leaf of a nested dict: `--set` items that leave the section's other keys be."""
    for k, v in d.items():
        yield from _dotted(f"{prefix}.{k}", v) if isinstance(v, dict) else [(f"{prefix}.{k}", v)]


def peer_rows(n_rows: int) -> list[dict]:
    """8 prompts a step of 15 characters each, drawn like the peers' ids (numpy default_rng(1234))."""
    import numpy as np

    from twocircuit_jax.model.tokenizer import CHARS

    ids = np.random.default_rng(1234).integers(0, len(CHARS), (n_rows, 15))
    return [{"prompt": "".join(CHARS[i] for i in row)} for row in ids]


def even_share(prompts, completions, **_):
    """The peers' reward: the share of even token ids among the generated ones."""
    from twocircuit_jax.model.tokenizer import load_tokenizer

    tok = even_share.tok = getattr(even_share, "tok", None) or load_tokenizer("char")
    out = []
    for c in completions:
        ids = tok.encode(c)
        out.append(sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1))
    return out


def build_trainer(setting: str, arm: str, steps: int, out_dir: str, cache: str, sets=()):
    from twocircuit_jax.train.loop import GRPOTrainer

    cfg = arm_config(setting, arm, steps, cache, sets)
    kw = {}
    if setting == "peers":
        kw = {"reward_fns": [even_share], "train_dataset": peer_rows(8 * steps)}
    return GRPOTrainer(cfg, os.path.join(out_dir, f"{setting}_{arm}"), show_progress=False, **kw)


def worker(setting: str, arm: str, steps: int, out_dir: str, cache: str = "", sets=()) -> dict:
    """One arm in this process: construction, then `steps` timed steps. Returns the arm's figures."""
    t0 = time.perf_counter()
    trainer = build_trainer(setting, arm, steps, out_dir, cache, sets)
    setup_s = time.perf_counter() - t0
    walls, cpus, rows = [], [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        rows.append(trainer.step())
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)  # every thread of the process: less moved by other processes
    trainer.close()
    return dict(figures(arm, walls, rows, setup_s), median_cpu_s=statistics.median(cpus[2:] or cpus))


def compiled(row: dict) -> bool:
    return row.get("time/compile_s", 0.0) > 0


def figures(arm: str, walls: list, rows: list, setup_s: float) -> dict:
    """An arm's row of the table from its step walls and the trainer's metrics rows (steps 3.. are steady). The
    median is the typical step; the mean, over steps 3.. that compiled nothing, counts work that comes every few
    steps (an anchor fire) at its share, which the median hides."""
    steady = walls[2:] or walls
    warm = [w for w, r in zip(walls[2:], rows[2:]) if not compiled(r)]
    from twocircuit_jax.train.timing import PHASES

    names = {f"time/{p}_s" for p in PHASES + ("compile",)}
    phases = sorted({k for r in rows for k in r if k in names})
    return {
        "arm": arm,
        "median_step_s": statistics.median(steady),
        "mean_step_s": statistics.fmean(warm) if warm else float("nan"),
        "min_step_s": min(steady),
        "max_step_s": max(steady),
        "first_step_s": walls[0],
        "setup_s": setup_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "phases": {p: statistics.median([r.get(p, 0.0) for r in rows[2:] or rows]) for p in phases},
        "first_compile_s": rows[0].get("time/compile_s", 0.0),
        "first_cache_hits": rows[0].get("time/compile_cache_hits", 0),
    }


def run_arm(setting, arm, steps, out_dir, warm: bool = False, sets=(), root: str = ROOT) -> dict:
    """The arm in a fresh process, on a fresh compilation cache folder (run twice on it when `warm`). `root`: the
    checkout whose package, configs and artifacts it runs on (another one for `--against`; the harness is this
    checkout's scripts either way)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-xla-cache-") as cache:
        cmd = [sys.executable, SCRIPT, "--worker", arm, "--setting", setting, "--steps", str(steps)]
        cmd += ["--out", out_dir, "--cache", cache] + [f"--set={x}" for x in sets]
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # the arm's own cache
        env["PYTHONPATH"] = os.pathsep.join([root] + [x for x in [env.get("PYTHONPATH", "")] if x])  # its package
        env["TWOCIRCUIT_BENCH_ROOT"] = root  # its configs and artifacts
        for _ in range(1 + warm):
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
            lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
            if p.returncode or not lines:
                raise RuntimeError(f"arm {arm} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])
