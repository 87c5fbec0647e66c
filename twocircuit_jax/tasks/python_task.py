"""One's own task: reward functions written in Python on rows of one's own data (`task.type: python`).

A reward function is a plain callable `(prompts, completions, **fields) -> list[float]`, TRL's convention: one call
per GRPO step with every sampled row, `prompts[i]` the row's prompt field as given, `completions[i]` the decoded
text, and every other field of the data rows as a keyword list (`answer=[...]`). A `None` in the returned list
means "not applicable": that function adds nothing to the row. Several functions add up, each times its weight;
each is logged raw as `reward/<name>`.

A function that raises or returns something else than one number per row is retried row by row, so that only the
rows it fails on get 0 from it; one that runs longer than `task.reward_timeout_s` (bounded calls run in a worker
process forked once: tasks/bounded.py) gives 0 to every row of that call, so a hung function costs one bound per
step; every failure is counted (`reward/fn_errors`, in
`reward/score_errors`), the first traceback of each function is printed, and a step where more than
`task.max_reward_failure_frac` of the (row, function) calls failed ends the run with `RewardError`.

Data: any iterable of dicts (a list, a Hugging Face `datasets.Dataset`, rows read from local .jsonl/.parquet
files), each with the prompt field (`task.prompt_key`) and whatever fields the rewards read.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import traceback
from collections.abc import Mapping
from typing import Callable, NamedTuple, Optional, Sequence

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.tasks.base import DataError, Problem, ScoreResult, render_template
from twocircuit_jax.tasks.bounded import CallTimeout, worker_for


class RewardError(RuntimeError):
    """Too many reward-function failures in one step (`task.max_reward_failure_frac`)."""


class RewardFn(NamedTuple):
    name: str  # logged as reward/<name>
    fn: Callable
    weight: float


def load_function(spec: str, field: str) -> Callable:
    """`module:function` (importable, or a module in the working directory) or `path/file.py:function`."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(field, f"got {spec!r}; expected module:function or path/to/file.py:function")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise ConfigError(field, f"got {spec!r}; file {mod_name} not found")
            name = "twocircuit_user_" + os.path.splitext(os.path.basename(mod_name))[0]
            loader = importlib.util.spec_from_file_location(name, mod_name)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # `twocircuit train` (a console script) lacks the working directory
                sys.path.append(os.getcwd())
            module = importlib.import_module(mod_name)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to import the user's module is a config error
        raise ConfigError(field, f"got {spec!r}; cannot import {mod_name}: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(field, f"got {spec!r}; {mod_name} has no function {attr!r}")
    return fn


def reward_fns(fns: Sequence, weights: Sequence[float] = (), field: str = "reward_fns") -> list[RewardFn]:
    """Named, weighted reward functions from callables; names are the functions' `__name__` (made unique)."""
    fns = list(fns)
    if not fns:
        raise ConfigError(field, "at least one reward function is required")
    weights = list(weights) if weights else [1.0] * len(fns)
    if len(weights) != len(fns):
        raise ConfigError("reward_weights", f"got {len(weights)} weights for {len(fns)} reward functions")
    out, seen = [], set()
    for i, (fn, w) in enumerate(zip(fns, weights)):
        if not callable(fn):
            raise ConfigError(f"{field}[{i}]", f"got {fn!r}; expected a callable (prompts, completions, **fields)")
        name = getattr(fn, "__name__", None) or f"fn{i}"
        if name == "<lambda>":
            name = f"fn{i}"
        base, k = name, 1
        while name in seen:
            k += 1
            name = f"{base}_{k}"
        seen.add(name)
        out.append(RewardFn(name, fn, float(w)))
    return out


def to_problems(rows, prompt_key: str, split: str, field: str) -> list[Problem]:
    """Problems from any iterable of dicts; each keeps its row (the reward functions' keyword fields)."""
    if rows is None:
        return []
    if isinstance(rows, (str, bytes, Mapping)):
        raise DataError(
            f"{field}: expected an iterable of dicts (a list, a datasets.Dataset), got {type(rows).__name__}"
        )
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"{field}: row {i} is a {type(row).__name__}, not a dict")
        prompt = row.get(prompt_key)
        if not isinstance(prompt, str) or not prompt:
            kind = "missing or empty" if not prompt else f"a {type(prompt).__name__}, not text"
            raise DataError(
                f"{field}: row {i}: the prompt field {prompt_key!r} is {kind} (fields: {sorted(row)}; "
                "task.prompt_key names it; chat-message prompts are not supported, render them to text first)"
            )
        row = dict(row)
        answer = row.get("answer")
        out.append(Problem(f"{split}/{i}", prompt, "" if answer is None else str(answer), "", {"row": row}))
    return out


class PythonTask:
    """The task interface (tasks/base.py) over rows and reward functions; `score_many` scores a whole step."""

    def __init__(self, cfg, fns: list[RewardFn], train_rows=None, eval_rows=None):
        self.cfg, self.fns = cfg, fns
        self._train = to_problems(train_rows, cfg.prompt_key, "train", "train_dataset")
        self._eval = to_problems(eval_rows, cfg.prompt_key, "eval", "eval_dataset")
        if not self._train:
            raise DataError("train_dataset: no rows (task.train_files or the train_dataset argument)")
        self._reported: set = set()  # functions whose first traceback has been printed

    @classmethod
    def from_config(cls, cfg) -> "PythonTask":
        """`task.type: python` from YAML: functions by `module:function`, data from local files."""
        from twocircuit_jax.tasks.math_files_task import read_records

        if not cfg.reward_fns:
            raise ConfigError("task.reward_fns", "at least one module:function is required")
        fns = [load_function(s, f"task.reward_fns[{i}]") for i, s in enumerate(cfg.reward_fns)]
        named = reward_fns(fns, cfg.reward_weights, "task.reward_fns")
        if not cfg.train_files:
            raise ConfigError("task.train_files", "at least one local .jsonl or .parquet file is required")
        train = [r for f in cfg.train_files for _, r in read_records(f)]
        evals = [r for f in cfg.eval_files for _, r in read_records(f)]
        return cls(cfg, named, train, evals)

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    def prompt(self, problem: Problem) -> str:
        fields = {k: v for k, v in problem.meta["row"].items() if isinstance(v, (str, int, float))}
        return render_template(self.cfg.prompt_template, **{**fields, "prompt": problem.question})

    # --- scoring ----------------------------------------------------------------------------------------------
    def score(self, problem: Problem, completion_text: str) -> ScoreResult:
        results, _ = self.score_many([problem], [completion_text], check_failures=False)
        return results[0]

    def score_many(self, problems, completions, check_failures: bool = True):
        """(ScoreResult per row, metrics). Row i answers problems[i]."""
        n = len(problems)
        rows = [p.meta["row"] for p in problems]
        keys = sorted({k for r in rows for k in r if k != self.cfg.prompt_key})
        prompts = [p.question for p in problems]
        fields = {k: [r.get(k) for r in rows] for k in keys}
        total = [0.0] * n
        metrics, failed = {}, 0
        for rf in self.fns:
            values, errors = self._call(rf, prompts, list(completions), fields)
            failed += errors
            got = [v for v in values if v is not None]
            metrics[f"reward/{rf.name}"] = sum(got) / len(got) if got else float("nan")
            for i, v in enumerate(values):
                if v is not None:
                    total[i] += rf.weight * v
        calls = n * len(self.fns)
        metrics["reward/fn_errors"] = float(failed)
        frac = failed / calls if calls else 0.0
        if check_failures and frac > self.cfg.max_reward_failure_frac:
            raise RewardError(
                f"reward functions failed on {failed} of {calls} (row, function) calls this step ({frac:.0%}), more "
                f"than task.max_reward_failure_frac={self.cfg.max_reward_failure_frac}; the first traceback of each "
                "failing function is printed above"
            )
        return [ScoreResult(t, True, None) for t in total], metrics

    def _call(self, rf: RewardFn, prompts, completions, fields):
        """(values, failures): one batched call; on failure, one call per row so only failing rows get 0."""
        try:
            limit = self.cfg.reward_timeout_s
            if limit > 0:  # in this task's worker (tasks/bounded.py): forked once, kept across calls and steps
                k = next(j for j, f in enumerate(self.fns) if f is rf)
                out = worker_for(self, "reward_fns", _call_fn).call((k, prompts, completions, fields), limit)
            else:
                out = rf.fn(prompts, completions, **fields)
            return _values(out, len(prompts)), 0
        except CallTimeout:
            # No row-by-row retry after a timeout: a function that hangs would then cost (rows + 1) x the bound per
            # step (257 x 300 s on the demo's shapes). Every row of the call gets 0 from it, each counted.
            self._report(rf)
            return [0.0] * len(prompts), len(prompts)
        except Exception:  # noqa: BLE001 - a user function's failure is counted, never fatal by itself
            if len(prompts) == 1:
                self._report(rf)
                return [0.0], 1
        values, errors = [], 0
        for i in range(len(prompts)):
            v, e = self._call(
                rf, prompts[i : i + 1], completions[i : i + 1], {k: x[i : i + 1] for k, x in fields.items()}
            )
            values += v
            errors += e
        return values, errors

    def _report(self, rf: RewardFn):
        if rf.name not in self._reported:
            self._reported.add(rf.name)
            print(f"reward function {rf.name!r} raised (reward 0; later failures are only counted):", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)


def _call_fn(task: PythonTask, args):
    """In the worker: reward function k of the task on (prompts, completions, fields)."""
    k, prompts, completions, fields = args
    return task.fns[k].fn(prompts, completions, **fields)


def _values(out, n: int) -> list[Optional[float]]:
    """The function's result as n floats or None; anything else raises (and is counted as a failure)."""
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise TypeError(f"a reward function must return a list of {n} numbers, got {type(out).__name__}")
    if len(out) != n:
        raise ValueError(f"a reward function returned {len(out)} values for {n} completions")
    vals = []
    for v in out:
        if v is None:
            vals.append(None)
            continue
        x = float(v)
        if not math.isfinite(x):
            raise ValueError(f"a reward function returned {x}; rewards must be finite")
        vals.append(x)
    return vals
