"""The task interface: problems with a reference answer, a prompt renderer and a verifier.

A task is plain python on the host (no jax): the GRPO loop renders `prompt(problem)`, samples completions,
decodes them to text and calls `score(problem, text)`; reward shaping lives in `tasks/rewards.py`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Sequence, runtime_checkable


class DataError(ValueError):
    """Bad task data (missing file, malformed line, missing field). The CLI maps it to exit code 2."""


class Problem(NamedTuple):
    id: str  # stable across runs: "<dataset>/<split>/<index>" or "<file>:<line>"
    question: str  # what the prompt template's {question} receives
    answer: str  # reference final answer (string form)
    solution: str  # reference completion body for SFT (the answer alone for procedural tasks)
    meta: dict  # task-specific extras (reasoning-gym entry, full question, source file, ...)


class ScoreResult(NamedTuple):
    reward: float  # verifier reward in [0, 1] before shaping
    parsed: bool  # a final answer could be extracted from the completion
    error: Optional[str] = None  # set when the verifier itself failed (counted as reward/score_errors)


@runtime_checkable
class Task(Protocol):
    def train_problems(self) -> Sequence[Problem]: ...

    def eval_problems(self) -> Sequence[Problem]: ...

    def prompt(self, problem: Problem) -> str: ...

    def score(self, problem: Problem, completion_text: str) -> ScoreResult: ...

    # Optional: `begin_step(gs)` is called by the GRPO loop before step gs's rollouts, for a task whose scoring
    # changes with the step (a curriculum; the synthetic collapse of tests/test_guard.py).


def render_template(template: str, **fields: Any) -> str:
    """Fill `{name}` placeholders by plain replacement.

    Not `str.format`: math templates carry LaTeX braces (`\\boxed{}`), which format would try to interpret.
    """
    out = template
    for name, value in fields.items():
        out = out.replace("{" + name + "}", str(value))
    return out


def cut_answer(completion: str, answer_suffix: str) -> str:
    """The answer part of a short completion: up to `answer_suffix` (or the first newline when it is empty)."""
    stop = answer_suffix if answer_suffix else "\n"
    return completion.split(stop, 1)[0].strip()


def dedupe_against(train: Sequence[Problem], eval_: Sequence[Problem]) -> list[Problem]:
    """Held-out problems whose question is not in train (procedural generators repeat small problems)."""
    seen = {p.question for p in train}
    return [p for p in eval_ if p.question not in seen]
