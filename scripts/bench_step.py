"""Benchmark (not a test): one GRPO step of this project, arm by arm, and optionally of the peer frameworks.

    python scripts/bench_step.py [--setting peers|demo] [--arms dense,prf_mask,...] [--steps 12] [--rounds 1]
                                 [--compile-cache cold|warm] [--interleave] [--set KEY=VALUE ...]
                                 [--peers] [--peers-dir DIR] [--against DIR [--set-here KEY=VALUE ...]]

Each arm runs in a fresh process (its own compiles and peak RSS): a `GRPOTrainer` built from the setting, then
`--steps` calls of `trainer.step()`, each timed as a whole on the host. Printed per arm: the median, min and max
step over steps 3..N, the mean over those of them that compiled nothing (work that comes every few steps, such as
the anchor's fire, counts there at its share; the median hides it), the first step (it compiles), the trainer's
construction, peak RSS, and the median of every per-phase time the trainer logs (`time/<phase>_s`,
`time/compile_s` on steps that compiled).
`--compile-cache cold` (default) gives each arm process an empty persistent compilation cache (train.compile_cache),
so its first step compiles everything; `warm` runs each arm twice on one cache folder and reports the second run,
as a user's second run of the same shapes would see it.

`--interleave` builds every arm's trainer in one process instead and steps them in turn (step i of each arm right
after step i of the others, the order reversed every second step), so a machine whose speed drifts over seconds or
minutes slows every arm alike; it prints each arm's steps over dense's steps taken next to them (median and
quartiles over steps 3..N), and its seconds over dense's summed over the steps 3..N where neither compiled. Separate processes, on this 2-core machine, gave ratios to dense that moved by 0.2-0.4
from round to round; the arms then share compiled programs and memory, so first step, construction and peak RSS
are not per arm ("-"). Peers still run in their own processes.

`--against DIR` compares two versions of the project: each arm also runs from the checkout at DIR (its own bench
script and package; `git worktree add DIR <commit>` makes one), in its own process right after or before this
checkout's, the order swapped every round; it prints each round's ratio of this checkout's median step to the other's,
and their median and range, and the same of the steps' CPU seconds (all the process's threads), which other work on
a busy machine moves far less than wall time. Both sides run this script, over each checkout's own package, configs
and artifacts. `--set-here` puts an override on this checkout's runs only (a knob the other lacks, such
as `train.micro_batch_per_device`).

Settings:
  peers  the peer harnesses' tiny setting (../shared/peers/README.md): random Qwen2 with vocab 128, hidden 128,
         intermediate 256, 4 layers, 4 heads / 2 KV heads, fp32; 8 prompts of 16 tokens x 8 samples x 32 new
         tokens, temperature 1; reward the share of even token ids; KL 0; one AdamW update per step, lr 1e-5, no
         clipping or decay. The project's prompts are text of the built-in character tokenizer (15 characters and
         BOS = 16 ids); its sampler stops a row at EOS, which a random model samples now and then, but every
         rollout still runs all 32 positions (static shapes), so the work per step is the peers'.
  demo   configs/demo.yaml (the tiny char model from artifacts/tiny_base, built on first use).

Arms (fast and anchor sections put over the setting): dense, prf_mask, lowrank, sr_quant, powersgd, two_circuit
(configs/two_circuit.yaml's: lowrank r=3 at one boundary with the anchor); dense_async: dense with train.async_rollouts:
1 (the embedded sampler generating in a thread); vllm and vllm_async: dense with the vLLM engine process as the
sampler, synchronous and with train.async_rollouts: 1 (peak RSS is the trainer's alone). With `--peers`, the peer harnesses run
in the same invocation, interleaved with the arms round by round, when their venvs exist under `--peers-dir`
(default $PEERS: DIR/tunix/bin/python, DIR/trl/bin/python); the table then ends with each arm's median step over
the faster peer's. Ratios are only meaningful on a quiet machine. Every second round runs its arms and peers in reverse
order, so a machine drifting within a round favours no run over a pair of rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time

# The checkout whose configs and artifacts an arm uses: this one, or with `--against` the other one (its worker runs
# this script over that checkout's package and files, so both sides are timed by the same harness).
ROOT = os.environ.get("TWOCIRCUIT_BENCH_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_SRC = os.path.join(os.path.dirname(ROOT), "shared", "peers")
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
PEERS = {"tunix": "tunix_grpo_bench.py", "trl": "trl_grpo_bench.py"}


def _peer_setting(steps: int) -> dict:
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


def _arm_config(setting: str, arm: str, steps: int, cache: str = "", sets=()):
    import dataclasses

    import yaml

    from twocircuit_jax.config import load_config

    over = ARMS[arm]
    if isinstance(over, str):  # a shipped recipe: its fast and anchor sections
        raw = yaml.safe_load(open(os.path.join(ROOT, over)))
        over = {"fast": raw["fast"], "anchor": raw["anchor"]}
        over["fast"] = {**NONE, **over["fast"]}
    if setting == "peers":
        cfg = load_config(data=_merge(_peer_setting(steps), over), overrides=list(sets))
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


def _peer_rows(n_rows: int) -> list[dict]:
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


def _trainer(setting: str, arm: str, steps: int, out_dir: str, cache: str, sets=()):
    from twocircuit_jax.train.loop import GRPOTrainer

    cfg = _arm_config(setting, arm, steps, cache, sets)
    kw = {}
    if setting == "peers":
        kw = {"reward_fns": [even_share], "train_dataset": _peer_rows(8 * steps)}
    return GRPOTrainer(cfg, os.path.join(out_dir, f"{setting}_{arm}"), show_progress=False, **kw)


def worker(setting: str, arm: str, steps: int, out_dir: str, cache: str = "", sets=()) -> dict:
    """One arm in this process: construction, then `steps` timed steps. Returns the arm's figures."""
    t0 = time.perf_counter()
    trainer = _trainer(setting, arm, steps, out_dir, cache, sets)
    setup_s = time.perf_counter() - t0
    walls, cpus, rows = [], [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        rows.append(trainer.step())
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)  # every thread of the process: less moved by other processes
    trainer.close()
    return dict(_figures(arm, walls, rows, setup_s), median_cpu_s=statistics.median(cpus[2:] or cpus))


def worker_interleaved(setting: str, arms: list[str], steps: int, out_dir: str, cache: str = "", sets=()) -> list[dict]:
    """Every arm's trainer in this one process, stepped in turn: step i of each arm runs right after step i of the
    others, in reverse order every second step, so the machine's drift reaches every arm alike. Each arm's figures
    also carry `step_ratios`: its step i over dense's step i, for i >= 3 (with dense among the arms). First steps,
    construction and peak RSS are not per arm here (the arms share compiled programs and memory): NaN."""
    trainers = {a: _trainer(setting, a, steps, out_dir, cache, sets) for a in arms}
    walls, rows = {a: [] for a in arms}, {a: [] for a in arms}
    for i in range(steps):
        for a in arms[::-1] if i % 2 else arms:
            t = time.perf_counter()
            rows[a].append(trainers[a].step())
            walls[a].append(time.perf_counter() - t)
    for t in trainers.values():
        t.close()
    out = []
    for a in arms:
        r = _figures(a, walls[a], rows[a], float("nan"))
        r.update(first_step_s=float("nan"), peak_rss_mb=float("nan"))
        if "dense" in walls:
            r["step_ratios"] = [x / d for x, d in zip(walls[a][2:], walls["dense"][2:])]
            # every step but those that compiled in either arm: periodic work (an anchor fire) counts in full
            keep = [i for i in range(2, steps) if not _compiled(rows[a][i]) and not _compiled(rows["dense"][i])]
            r["sum_ratio"] = [sum(walls[a][i] for i in keep), sum(walls["dense"][i] for i in keep), len(keep)]
        out.append(r)
    return out


def _compiled(row: dict) -> bool:
    return row.get("time/compile_s", 0.0) > 0


def _figures(arm: str, walls: list, rows: list, setup_s: float) -> dict:
    """An arm's row of the table from its step walls and the trainer's metrics rows (steps 3.. are steady). The
    median is the typical step; the mean, over steps 3.. that compiled nothing, counts work that comes every few
    steps (an anchor fire) at its share, which the median hides."""
    steady = walls[2:] or walls
    warm = [w for w, r in zip(walls[2:], rows[2:]) if not _compiled(r)]
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


def _run_arm(setting, arm, steps, out_dir, warm: bool = False, sets=(), root: str = ROOT) -> dict:
    """The arm in a fresh process, on a fresh compilation cache folder (run twice on it when `warm`). `root`: the
    checkout whose bench script and package run it (another one for `--against`)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-xla-cache-") as cache:
        cmd = [sys.executable, __file__, "--worker", arm, "--setting", setting, "--steps", str(steps)]
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


def _run_interleaved(setting, arms, steps, out_dir, sets=()) -> list[dict]:
    """worker_interleaved in a fresh process, on a fresh compilation cache folder."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-xla-cache-") as cache:
        cmd = [sys.executable, __file__, "--worker-interleaved", ",".join(arms), "--setting", setting]
        cmd += ["--steps", str(steps), "--out", out_dir, "--cache", cache] + [f"--set={x}" for x in sets]
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not lines:
            raise RuntimeError(f"arms {arms} (interleaved) failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _run_peer(name, python, env) -> dict:
    p = subprocess.run([python, os.path.join(PEERS_SRC, PEERS[name])], capture_output=True, text=True, env=env)
    m = re.search(r"peer=\S+ median_step_s=([\d.]+) min=([\d.]+) max=([\d.]+) peak_rss_mb=([\d.]+)", p.stdout)
    if p.returncode or m is None:
        raise RuntimeError(f"peer {name} failed (exit {p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    first = re.search(r"^step\s+1 wall_s=([\d.]+)", p.stdout, re.M)
    setup = re.search(r"^setup_s=([\d.]+)", p.stdout, re.M)
    return {
        "arm": f"peer:{name}",
        "median_step_s": float(m.group(1)),
        "mean_step_s": float("nan"),  # the harnesses print medians only
        "min_step_s": float(m.group(2)),
        "max_step_s": float(m.group(3)),
        "first_step_s": float(first.group(1)) if first else float("nan"),
        "setup_s": float(setup.group(1)) if setup else float("nan"),
        "peak_rss_mb": float(m.group(4)),
        "phases": {},
    }


def _per_round(results: list[dict]) -> list[str]:
    """With several rounds, each ratio per round (every arm of a round ran within minutes of the others): on a
    machine whose speed drifts between rounds these move less than the ratio of medians over all rounds. Lines:
    `ARM/dense per round: ...`, `ARM/fastest_peer per round: ...`, `ARM first/tunix first per round: ...`."""
    rounds = sorted({r["round"] for r in results if "round" in r})
    if len(rounds) < 2:
        return []
    at = {(r["arm"], r["round"]): r for r in results if "round" in r}
    arms = list(dict.fromkeys(r["arm"] for r in results if not r["arm"].startswith("peer:")))
    peers = list(dict.fromkeys(r["arm"] for r in results if r["arm"].startswith("peer:")))

    def line(label, num, den):
        got = [(num(rd), den(rd)) for rd in rounds]
        vals = [a / b for a, b in got if a is not None and b and math.isfinite(a / b)]
        if not vals:
            return f"{label} per round: -"
        return f"{label} per round: {' '.join(f'{v:.2f}' for v in vals)} (median {statistics.median(vals):.2f})"

    out = []
    step = lambda arm: lambda rd: at[(arm, rd)]["median_step_s"] if (arm, rd) in at else None  # noqa: E731
    fastest = lambda rd: min((at[(p, rd)]["median_step_s"] for p in peers if (p, rd) in at), default=None)  # noqa: E731
    for arm in arms:
        if arm != "dense" and "dense" in arms:
            out.append(line(f"{arm}/dense", step(arm), step("dense")))
        if peers:
            out.append(line(f"{arm}/fastest_peer", step(arm), fastest))
    if "dense" in arms and "peer:tunix" in peers:
        first = lambda arm: lambda rd: at[(arm, rd)]["first_step_s"] if (arm, rd) in at else None  # noqa: E731
        out.append(line("dense first/tunix first", first("dense"), first("peer:tunix")))
    return out


def round_order(arms: list[str], peers: list[str], rnd: int) -> list[tuple[str, str]]:
    """The runs of round `rnd` (from 0): the arms then the peers, reversed in every second round, so that a machine
    that slows or speeds up during a round does not always favour the same runs (over rounds 1 and 2 every run's
    mean position is the same)."""
    runs = [("arm", a) for a in arms] + [("peer", p) for p in peers]
    return runs[::-1] if rnd % 2 else runs


def _num(x: float, digits: int) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _table(results: list[dict]) -> str:
    by = {}
    for r in results:
        by.setdefault(r["arm"], []).append(r)
    phases = sorted({p for r in results for p in r["phases"]})
    head = ["arm", "median step s", "mean", "min", "max", "first step s", "setup s", "peak RSS MB"]
    head += [p[len("time/") : -2] for p in phases]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, rs in by.items():  # several rounds: the median of the rounds' medians, the range of all
        med = statistics.median(r["median_step_s"] for r in rs)
        mean = statistics.median(r.get("mean_step_s", float("nan")) for r in rs)
        row = [arm, f"{med:.3f}", _num(mean, 3)]
        row += [f"{min(r['min_step_s'] for r in rs):.3f}", f"{max(r['max_step_s'] for r in rs):.3f}"]
        row += [
            _num(statistics.median(r["first_step_s"] for r in rs), 2),
            _num(statistics.median(r["setup_s"] for r in rs), 2),
        ]
        row += [_num(max(r["peak_rss_mb"] for r in rs), 0)]
        # a peer reports no phases: "-", not a zero
        row += [
            f"{statistics.median(r['phases'].get(p, 0.0) for r in rs):.3f}" if rs[0]["phases"] else "-" for p in phases
        ]
        lines.append("| " + " | ".join(row) + " |")
    dense = by.get("dense")
    peers = [statistics.median(r["median_step_s"] for r in rs) for a, rs in by.items() if a.startswith("peer:")]
    if dense:
        d = statistics.median(r["median_step_s"] for r in dense)
        lines.append("")
        for arm, rs in by.items():
            if arm.startswith("peer:"):
                continue
            m = statistics.median(r["median_step_s"] for r in rs)
            ratio = f"{arm}/dense={m / d:.2f}"
            if peers:
                ratio += f" {arm}/fastest_peer={m / min(peers):.2f}"
            lines.append(ratio)
    lines += _per_round(results)
    for arm, rs in by.items():  # interleaved arms: each step over dense's step run next to it
        ratios = [x for r in rs for x in r.get("step_ratios", ())]
        if ratios and arm != "dense":
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            lines.append(
                f"{arm}/dense step by step (interleaved): median {statistics.median(ratios):.2f} "
                f"(quartiles {q[0]:.2f}-{q[2]:.2f}, {len(ratios)} steps)"
            )
        sums = [r["sum_ratio"] for r in rs if "sum_ratio" in r and r["sum_ratio"][1] > 0]
        if sums and arm != "dense":
            lines.append(
                f"{arm}/dense over all steps (interleaved): {sum(a for a, _, _ in sums) / sum(d for _, d, _ in sums):.2f} "
                f"(its seconds over dense's, {sum(n for _, _, n in sums)} steps that compiled nothing)"
            )
    for sync_arm, async_arm in (("dense", "dense_async"), ("vllm", "vllm_async")):
        if sync_arm in by and async_arm in by:
            sync, ahead = (statistics.median(r["median_step_s"] for r in by[a]) for a in (sync_arm, async_arm))
            lines.append(f"{async_arm}/{sync_arm}={ahead / sync:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", choices=("peers", "demo"), default="peers")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the arms (and peers)")
    ap.add_argument("--peers", action="store_true", help="also run the peer harnesses (their venvs must exist)")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS", ""), help="folder of the peers' venvs")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_step"), help="run folders of the arms")
    ap.add_argument(
        "--compile-cache",
        choices=("cold", "warm"),
        default="cold",
        help="cold: each arm compiles from scratch; warm: each arm's second process on the first one's cache",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="all arms in one process, stepped in turn (ratios to dense step by step; no per-arm first step or RSS)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override put over every arm, after the arm's own (as `twocircuit train --set`); repeatable",
    )
    ap.add_argument(
        "--against",
        metavar="DIR",
        help="another checkout (say `git worktree add DIR <commit>`): each arm runs there too, in its own process "
        "right before or after this checkout's (the order swapped every round); prints this/that per round",
    )
    ap.add_argument(
        "--set-here",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --against: an override for this checkout's runs only (a knob the other one lacks); repeatable",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-interleaved", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        r = worker(args.setting, args.worker, args.steps, args.out, args.cache, args.set)
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    if args.worker_interleaved:
        arms = args.worker_interleaved.split(",")
        print(
            "RESULT " + json.dumps(worker_interleaved(args.setting, arms, args.steps, args.out, args.cache, args.set))
        )
        return 0
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        print(f"error: --arms: unknown {bad or 'empty'}; allowed {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if args.steps < 3:
        print(f"error: --steps: got {args.steps}; at least 3 (steps 1-2 compile and warm up)", file=sys.stderr)
        return 2
    if args.set:  # a bad override: one line naming it, before any arm starts
        from twocircuit_jax.config.base import ConfigError

        try:
            for arm in arms:
                _arm_config(args.setting, arm, args.steps, "", args.set)
        except ConfigError as e:
            print(f"error: --set: {e}", file=sys.stderr)
            return 2
    if args.interleave and args.compile_cache == "warm":
        print("error: --compile-cache warm: not with --interleave (no per-arm first step there)", file=sys.stderr)
        return 2
    peers = {}
    if args.peers:
        for name in PEERS:
            py = os.path.join(args.peers_dir, name, "bin", "python")
            if not os.path.isfile(py) or not os.path.isfile(os.path.join(PEERS_SRC, PEERS[name])):
                print(
                    f"error: --peers: no {py} (or harness in {PEERS_SRC}); see ../shared/peers/README.md",
                    file=sys.stderr,
                )
                return 2
            peers[name] = py
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.against:
        return _against(args, arms)
    results = []
    for rnd in range(args.rounds):
        runs = round_order(["*"] if args.interleave else arms, list(peers), rnd)
        for kind, name in runs:
            if name == "*":  # every arm in one process, stepped in turn
                rs = _run_interleaved(args.setting, arms, args.steps, args.out, args.set)
                rs = [dict(r, round=rnd + 1) for r in rs]
                for r in rs:
                    print(f"round {rnd + 1} {r['arm']} (interleaved): median {r['median_step_s']:.3f} s", flush=True)
                results += rs
                continue
            if kind == "peer":
                r = dict(_run_peer(name, peers[name], env), round=rnd + 1)
                print(f"round {rnd + 1} peer {name}: median {r['median_step_s']:.3f} s", flush=True)
            else:
                warm = args.compile_cache == "warm"
                r = dict(_run_arm(args.setting, name, args.steps, args.out, warm, args.set), round=rnd + 1)
                print(
                    f"round {rnd + 1} {name}: median {r['median_step_s']:.3f} s, first {r['first_step_s']:.2f} s",
                    flush=True,
                )
            results.append(r)
    print(_table(results))
    return 0


def _against(args, arms) -> int:
    """Each arm from this checkout and from `args.against`, in fresh processes, alternately (this, that; then that,
    this), `args.rounds` rounds: a machine drifting over minutes slows both alike. Per round the ratio of this
    checkout's median step to the other's; printed: each round's, their median and range, and the medians' table."""
    other = os.path.abspath(args.against)
    if not os.path.isfile(os.path.join(other, "scripts", "bench_step.py")):
        print(f"error: --against: {other} has no scripts/bench_step.py (a checkout of this project)", file=sys.stderr)
        return 2
    here_sets = list(args.set) + list(args.set_here)
    results, ratios = [], {a: [] for a in arms}
    for rnd in range(args.rounds):
        for arm in arms:
            sides = [("here", ROOT, here_sets), ("that", other, list(args.set))]
            got = {}
            for side, root, sets in sides if rnd % 2 == 0 else sides[::-1]:
                r = _run_arm(args.setting, arm, args.steps, args.out, False, sets, root)
                got[side] = r
                label = arm if side == "here" else f"{arm}@{os.path.basename(other)}"
                results.append(dict(r, arm=label, round=rnd + 1))
                print(
                    f"round {rnd + 1} {label}: median {r['median_step_s']:.3f} s, CPU {r['median_cpu_s']:.3f} s",
                    flush=True,
                )
            ratios[arm].append([got["here"][k] / got["that"][k] for k in ("median_step_s", "median_cpu_s")])
    print(_table(results))
    for arm, rs in ratios.items():
        for i, what in enumerate(("median step", "median CPU seconds of a step")):
            xs = [r[i] for r in rs]
            print(
                f"{arm} here/{os.path.basename(other)} ({what}, per round): "
                + " ".join(f"{x:.3f}" for x in xs)
                + f"; median {statistics.median(xs):.3f}, range {min(xs):.3f}-{max(xs):.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
