"""A benchmark suite: several reasoning-gym datasets, each marked in-domain or out-of-domain, scored greedy on
held-out problems, for several checkpoints side by side (`twocircuit eval --suite FILE --checkpoint DIR ...`).

Suite file (YAML):

    name: suite10
    tokenizer: char                  # or a local tokenizer dir; 'auto' = the checkpoint's own
    prompt_len: 24                   # prompt tokens the model sees (a longer prompt is an error, not a cut)
    max_new_tokens: 8
    size: 100                        # held-out problems per benchmark (a benchmark may set its own)
    holdout: {train_seed: 1, train_size: 4000}   # the training split an in-domain benchmark is held out from
    benchmarks:
      chain_sum: {domain: in, dataset: chain_sum, options: {max_terms: 3}}
      gcd: {domain: out, dataset: gcd, options: {max_value: 20}, question: "gcd{numbers}"}

A benchmark's held-out problems never share a question with `holdout`'s split of the same generator (in-domain
ones: the split the demo model trained on); out-of-domain ones are generated as they come. Accuracy counts
full-credit answers, as the training loop's evaluation does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import yaml

from twocircuit_jax.config.base import ConfigError

DOMAINS = ("in", "out")


@dataclass(frozen=True)
class Benchmark:
    name: str
    domain: str  # "in" | "out"
    dataset: str
    options: dict = field(default_factory=dict)
    question: str = ""  # template over the entry's metadata ('' = its expression)
    size: int = 100
    eval_seed: int = 7


@dataclass(frozen=True)
class Suite:
    name: str
    benchmarks: tuple  # tuple[Benchmark, ...], in-domain first
    tokenizer: str = "char"
    prompt_len: int = 24
    max_new_tokens: int = 8
    holdout_seed: int = 1
    holdout_size: int = 4000


_SUITE_KEYS = {"name", "tokenizer", "prompt_len", "max_new_tokens", "size", "holdout", "benchmarks"}
_BENCH_KEYS = {"domain", "dataset", "options", "question", "size", "eval_seed"}


def load_suite(path: str) -> Suite:
    """Parse and check a suite file; errors name the file and the field."""
    if not os.path.isfile(path):
        raise ConfigError("", "suite file not found", source=path)
    with open(path) as fh:
        raw = yaml.safe_load(fh) or {}
    if not isinstance(raw, dict):
        raise ConfigError("", "top level must be a mapping", source=path)
    bad = set(raw) - _SUITE_KEYS
    if bad:
        raise ConfigError(sorted(bad)[0], f"unknown key; allowed: {', '.join(sorted(_SUITE_KEYS))}", source=path)
    benches = raw.get("benchmarks")
    if not isinstance(benches, dict) or not benches:
        raise ConfigError(
            "benchmarks", "a non-empty mapping of name -> {domain, dataset, ...} is required", source=path
        )
    size = int(raw.get("size", 100))
    out = []
    for name, b in benches.items():
        where = f"benchmarks.{name}"
        if not isinstance(b, dict):
            raise ConfigError(where, "must be a mapping", source=path)
        extra = set(b) - _BENCH_KEYS
        if extra:
            raise ConfigError(
                f"{where}.{sorted(extra)[0]}", f"unknown key; allowed: {', '.join(sorted(_BENCH_KEYS))}", source=path
            )
        if b.get("domain") not in DOMAINS:
            raise ConfigError(f"{where}.domain", f"got {b.get('domain')!r}; allowed: in, out", source=path)
        if not isinstance(b.get("dataset"), str):
            raise ConfigError(f"{where}.dataset", "a reasoning-gym dataset name is required", source=path)
        out.append(
            Benchmark(
                str(name),
                b["domain"],
                b["dataset"],
                dict(b.get("options") or {}),
                str(b.get("question", "")),
                int(b.get("size", size)),
                int(b.get("eval_seed", 7)),
            )
        )
    out.sort(key=lambda x: DOMAINS.index(x.domain))  # stable: the file's order within each side of the divider
    hold = raw.get("holdout") or {}
    suite = Suite(
        str(raw.get("name", os.path.splitext(os.path.basename(path))[0])),
        tuple(out),
        str(raw.get("tokenizer", "char")),
        int(raw.get("prompt_len", 24)),
        int(raw.get("max_new_tokens", 8)),
        int(hold.get("train_seed", 1)),
        int(hold.get("train_size", 4000)),
    )
    if suite.prompt_len < 1 or suite.max_new_tokens < 1:
        raise ConfigError("prompt_len", "prompt_len and max_new_tokens must be >= 1", source=path)
    return suite


def bench_task(suite: Suite, b: Benchmark):
    """The ReasoningGymTask of one benchmark: held out from `holdout`'s split for in-domain ones."""
    from twocircuit_jax.config.base import from_dict
    from twocircuit_jax.config.sections import TaskConfig
    from twocircuit_jax.tasks import make_task

    cfg = from_dict(
        TaskConfig,
        {
            "type": "reasoning_gym",
            "dataset": b.dataset,
            "options": b.options,
            "question": b.question,
            "train_seed": suite.holdout_seed,
            "train_size": suite.holdout_size if b.domain == "in" else 1,
            "eval_seed": b.eval_seed,
            "eval_size": b.size,
        },
    )
    return make_task(cfg)


def parse_checkpoints(items) -> list[tuple[str, str]]:
    """`LABEL=PATH` or `PATH` (labelled by its last two path parts) -> [(label, path)]."""
    out = []
    for it in items:
        label, path = it.split("=", 1) if "=" in it and not os.path.exists(it) else (None, it)
        if not os.path.exists(path):
            raise ConfigError("--checkpoint", f"{path}: no such checkpoint folder")
        if label is None:
            parts = os.path.normpath(path).split(os.sep)
            label = (
                "/".join(parts[-2:])
                if parts[-1] in ("best", "checkpoints") or parts[-1].startswith("step_")
                else parts[-1]
            )
        out.append((label, path))
    labels = [x[0] for x in out]
    if len(set(labels)) != len(labels):
        raise ConfigError("--checkpoint", f"two checkpoints share a label ({labels}); name them LABEL=PATH")
    return out


def run_suite(suite: Suite, checkpoints, log=print) -> dict:
    """{"suite", "checkpoints": [label], "benchmarks": [{name, domain, dataset, n, accuracy: {label: acc}}]}."""
    from twocircuit_jax.model.tokenizer import load_tokenizer
    from twocircuit_jax.sampler.jax_sampler import JaxSampler
    from twocircuit_jax.train.evaluate import Evaluator
    from twocircuit_jax.train.policy_io import load_policy
    from twocircuit_jax.train.rollout import encode_prompts
    from twocircuit_jax.train.setup import check_vocab

    tasks = {b.name: bench_task(suite, b) for b in suite.benchmarks}
    problems = {}
    for b in suite.benchmarks:
        t = tasks[b.name]
        problems[b.name] = list(t.eval_problems())[: b.size]
    rows = [
        {"name": b.name, "domain": b.domain, "dataset": b.dataset, "n": len(problems[b.name]), "accuracy": {}}
        for b in suite.benchmarks
    ]
    for label, path in checkpoints:
        mcfg, params = load_policy(path)
        spec = path if suite.tokenizer in ("", "auto") else suite.tokenizer
        try:
            tok = load_tokenizer(spec)
        except (OSError, ValueError) as e:
            raise ConfigError("tokenizer", str(e)) from None
        mcfg = check_vocab(mcfg, tok)
        sampler = JaxSampler(mcfg, params, prompt_bucket=suite.prompt_len)
        for b, row in zip(suite.benchmarks, rows):
            task = tasks[b.name]
            try:
                encode_prompts(tok, task, problems[b.name], suite.prompt_len, field=f"benchmarks.{b.name} (prompt_len)")
            except ValueError as e:
                raise ConfigError(
                    f"benchmarks.{b.name}", f"{e}; raise prompt_len or make the question shorter"
                ) from None
            ev = Evaluator(task, tok, problems[b.name], suite.prompt_len, suite.max_new_tokens, greedy=True)
            row["accuracy"][label] = ev.run(sampler, seed=0)["eval/accuracy"]
            log(f"eval {label:>20s}  {b.domain:>3s}  {b.name:<22s} {row['accuracy'][label]:.3f}")
    return {"suite": suite.name, "checkpoints": [c[0] for c in checkpoints], "benchmarks": rows}
