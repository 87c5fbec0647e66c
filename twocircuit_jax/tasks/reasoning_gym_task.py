"""Procedural problems from the `reasoning-gym` package, scored by that package's own `score_answer`.

Splits. reasoning-gym seeds entry i with `Random(seed + i)`, so seeds 1 and 2 give the same problems shifted by
one. Each split therefore generates from `seed * SEED_STRIDE`, which keeps the index ranges of different seeds
disjoint; held-out problems whose question also occurs in train (small problem spaces repeat) are dropped, and
generation continues until `eval_size` distinct held-out problems exist or the space looks exhausted.

Prompt. A tiny character model cannot afford "State the final answer to the following arithmetic problem: ...".
When the entry carries `metadata['expression']` (basic_arithmetic, chain_sum, ...) the question is that expression
with spaces removed, so the default template `{question}=` renders `4-1+7=`; the original text stays in
`meta['full_question']` and is available to templates as `{full_question}`. `task.question` renders the question from
the entry's metadata instead (`gcd{numbers}` -> `gcd[780,461]`), for datasets without an expression. The reference completion is the answer
followed by `answer_suffix`; a completion's answer is the text before `answer_suffix` (or the first newline).

Options. `task.options` override `DEMO_OPTIONS[dataset]` key by key: one-digit operands, 2-3 terms, + and - only,
a space a ~100k-parameter char model can partly learn in minutes on CPU (2-term facts are memorisable; held-out
problems are mostly 3-term ones, which need composition). Give any key explicitly to change it.
"""

from __future__ import annotations

import re
from typing import Optional

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.tasks.base import Problem, ScoreResult, cut_answer, dedupe_against, render_template

SEED_STRIDE = 1_000_003  # > any split size we generate, so seed ranges never overlap

DEMO_OPTIONS = {
    "basic_arithmetic": dict(
        min_terms=2,
        max_terms=3,
        min_digits=1,
        max_digits=1,
        operators=["+", "-"],
        allow_parentheses=False,
        allow_negation=False,
    ),
    "chain_sum": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1),
}

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _create(name: str, seed: int, size: int, options: dict):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **options)
    except ValueError as e:
        if "not registered" in str(e):
            raise ConfigError("task.dataset", f"got {name!r}; not a reasoning-gym dataset ({e})") from e
        raise ConfigError("task.options", f"reasoning-gym rejected {options!r} for {name!r}: {e}") from e
    except (TypeError, AssertionError) as e:  # unknown option / failed range check in the dataset config
        raise ConfigError("task.options", f"reasoning-gym rejected {options!r} for {name!r}: {e}") from e


def _compact(entry: dict, template: str = "") -> str:
    meta = entry.get("metadata") or {}
    if template:  # e.g. "gcd{numbers}" -> "gcd[780,461]": a question a char model's context can hold
        q = render_template(template, **meta)
        if re.search(r"\{\w+\}", q):
            raise ConfigError("task.question", f"{template!r} names a field the entries lack; they have {sorted(meta)}")
        return "".join(q.split())
    expr = meta.get("expression")
    if isinstance(expr, str) and expr.strip():
        return "".join(expr.split())
    return entry["question"]


class ReasoningGymTask:
    def __init__(self, cfg):
        self.cfg = cfg
        self.options = {**DEMO_OPTIONS.get(cfg.dataset, {}), **dict(cfg.options)}
        for name in ("train_size", "eval_size"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"task.{name}", f"got {getattr(cfg, name)}; must be >= 1")
        self._datasets = {}  # split -> list of generated reasoning-gym datasets (scoring needs the object)
        self._train: Optional[list[Problem]] = None
        self._eval: Optional[list[Problem]] = None

    # --- generation -------------------------------------------------------------------------------------------
    def _problems(self, split: str, seed: int, size: int, start: int = 0) -> list[Problem]:
        ds = _create(self.cfg.dataset, seed * SEED_STRIDE + start, size, self.options)
        self._datasets.setdefault(split, []).append(ds)
        out = []
        for i in range(size):
            entry = ds[i]
            out.append(
                Problem(
                    id=f"{self.cfg.dataset}/{split}/{start + i}",
                    question=_compact(entry, self.cfg.question),
                    answer=str(entry["answer"]),
                    solution=str(entry["answer"]),
                    meta={
                        "entry": entry,
                        "full_question": entry["question"],
                        "split": split,
                        "dataset_index": len(self._datasets[split]) - 1,
                    },
                )
            )
        return out

    def train_problems(self) -> list[Problem]:
        if self._train is None:
            self._train = self._problems("train", self.cfg.train_seed, self.cfg.train_size)
        return self._train

    def eval_problems(self) -> list[Problem]:
        if self._eval is None:
            train, want = self.train_problems(), self.cfg.eval_size
            kept, seen, start = [], set(), 0
            # Stop after 10x the wanted size: the space is then (nearly) covered by train.
            while len(kept) < want and start < 10 * want:
                for p in dedupe_against(train, self._problems("eval", self.cfg.eval_seed, want, start)):
                    if p.question not in seen and len(kept) < want:
                        seen.add(p.question)
                        kept.append(p)
                start += want
            if not kept:
                raise ConfigError(
                    "task.options",
                    f"every held-out {self.cfg.dataset} problem also occurs in train "
                    f"(options {self.options}); widen the problem space or lower task.train_size",
                )
            self._eval = kept
        return self._eval

    # --- prompting and scoring --------------------------------------------------------------------------------
    def prompt(self, problem: Problem) -> str:
        return render_template(
            self.cfg.prompt_template,
            question=problem.question,
            full_question=problem.meta.get("full_question", problem.question),
        )

    def reference_completion(self, problem: Problem) -> str:
        return problem.solution + self.cfg.answer_suffix

    def extract(self, problem: Problem, completion_text: str) -> Optional[str]:
        """The final answer in a completion, or None when there is none (numeric answers must look numeric)."""
        ans = cut_answer(completion_text, self.cfg.answer_suffix)
        if not ans:
            return None
        if _NUMBER.fullmatch(problem.answer.strip()) and not _NUMBER.fullmatch(ans.replace(",", "")):
            return None
        return ans

    def score(self, problem: Problem, completion_text: str) -> ScoreResult:
        ans = self.extract(problem, completion_text)
        if ans is None:
            return ScoreResult(0.0, False, None)
        made = self._datasets.get(problem.meta.get("split"), [])
        i = problem.meta.get("dataset_index", 0)
        # A problem from another instance (e.g. a restored run) is scored by a fresh generator of the same config.
        ds = made[i] if i < len(made) else _create(self.cfg.dataset, 0, 1, self.options)
        return ScoreResult(float(ds.score_answer(ans, problem.meta["entry"])), True, None)
