"""Reward shaping (design §5): format penalty, the overlong policy, and a verifier that may fail.

Order for one sample: score (a raising scorer, or one slower than `task.reward_timeout_s`, gives 0 and is
counted) -> an unparsable answer gets `format_penalty` instead of its score -> the overlong policy:
  zero  a truncated sample's reward is 0 (whatever it scored), and it stays in the loss;
  mask  the reward is kept (the group statistics still see it) but the sample leaves the loss (loss_mask 0);
  soft  for limit - buffer < length <= limit, add ((limit - buffer) - length) / buffer, from 0 down to -1 at the
        limit (DAPO's soft overlong punishment); truncated samples sit at the limit and get -1 added.
`length` counts generated tokens (EOS included); `limit` is sampling.max_new_tokens.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from twocircuit_jax.tasks.base import Problem, ScoreResult, Task
from twocircuit_jax.tasks.bounded import OK, TIMEOUT, worker_for


class Shaped(NamedTuple):
    reward: float
    loss_mask: float  # 1.0 = in the loss, 0.0 = excluded (overlong_mode: mask)


def safe_score(task: Task, problem: Problem, completion_text: str) -> ScoreResult:
    """`task.score`, except that an exception (verifier bug, parser blow-up) becomes reward 0 with `error` set."""
    try:
        res = task.score(problem, completion_text)
    except Exception as e:  # noqa: BLE001 - any verifier failure must not end the run; it is counted instead
        return ScoreResult(0.0, False, f"{type(e).__name__}: {e}")
    return ScoreResult(float(res.reward), bool(res.parsed), res.error)


def reward_timeout(task) -> float:
    """`task.reward_timeout_s` of the task's config; 0 (no bound) for a task object built without one."""
    return float(getattr(getattr(task, "cfg", None), "reward_timeout_s", 0) or 0)


def score_rows(task: Task, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
    """`safe_score` per row; with `task.reward_timeout_s` > 0 each row's scoring is bounded (tasks/bounded.py): a row
    that takes longer gets reward 0 with a TimeoutError as its error, counted like a raising scorer."""
    return _score_rows(task, problems, completions)[0]


def _score_pair(task, pair) -> ScoreResult:
    return safe_score(task, *pair)


def _score_rows(task, problems, completions) -> tuple[list[ScoreResult], int]:
    """(scores, rows stopped at the bound)."""
    limit = reward_timeout(task)
    pairs = list(zip(problems, completions))
    if limit > 0:  # the task's worker (tasks/bounded.py), forked once and kept for the run
        out = worker_for(task, "score", _score_pair).map(pairs, limit)
    else:
        out = [(OK, safe_score(task, *pt)) for pt in pairs]
    res, timeouts = [], 0
    for kind, value in out:
        if kind == OK:
            res.append(value)
        elif kind == TIMEOUT:
            timeouts += 1
            res.append(
                ScoreResult(0.0, False, f"TimeoutError: the scorer took longer than task.reward_timeout_s={limit:g}")
            )
        else:  # the worker died inside the scorer
            res.append(ScoreResult(0.0, False, f"{type(value).__name__}: {value}"))
    return res, timeouts


def overlong_penalty(length: int, limit: int, buffer: int) -> float:
    """Soft overlong term: 0 up to limit - buffer, then linear down to -1 at the limit (and -1 beyond)."""
    start = limit - buffer
    if length <= start:
        return 0.0
    return max((start - length) / buffer, -1.0)


def shape(score: ScoreResult, length: int, truncated: bool, limit: int, grpo) -> Shaped:
    """Shaped reward of one sample; `grpo` is a GRPOConfig (format_penalty, overlong_mode, overlong_buffer)."""
    if score.error is not None:
        reward = 0.0  # a failed verifier is not the policy's format error
    elif not score.parsed:
        reward = grpo.format_penalty
    else:
        reward = score.reward
    mode = grpo.overlong_mode
    if mode == "zero":
        return Shaped(0.0 if truncated else reward, 1.0)
    if mode == "mask":
        return Shaped(reward, 0.0 if truncated else 1.0)
    if mode == "soft":
        return Shaped(reward + overlong_penalty(length, limit, grpo.overlong_buffer), 1.0)
    raise ValueError(f"grpo.overlong_mode: got {mode!r}; allowed 'zero', 'mask', 'soft'")


def score_batch(
    task: Task,
    problems: Sequence[Problem],
    completions: Sequence[str],
    lengths: Sequence[int],
    truncated: Sequence[bool],
    limit: int,
    grpo,
):
    """Rewards for a batch of rows (row i answers problems[i]).

    Returns (rewards [B] float32, loss_mask [B] float32, raw [B] float32 verifier scores, metrics dict).
    """
    n = len(problems)
    if not (len(completions) == len(lengths) == len(truncated) == n):
        raise ValueError(
            f"score_batch: lengths differ: problems {n}, completions {len(completions)}, "
            f"lengths {len(lengths)}, truncated {len(truncated)}"
        )
    rewards, mask, raw = (np.zeros(n, np.float32) for _ in range(3))
    errors = unparsed = 0
    first_error = None
    many = getattr(task, "score_many", None)  # a task that scores the whole step at once (tasks/python_task.py)
    extra, timeouts = {}, 0
    if many is not None:
        scores, extra = many(list(problems), list(completions))
        errors += int(extra.get("reward/fn_errors", 0))
    else:
        scores, timeouts = _score_rows(task, problems, completions)
    for i, (p, s) in enumerate(zip(problems, scores)):
        if s.error is not None:
            errors += 1
            first_error = first_error or f"{p.id}: {s.error}"
        elif not s.parsed:
            unparsed += 1
        shaped = shape(s, int(lengths[i]), bool(truncated[i]), limit, grpo)
        rewards[i], mask[i], raw[i] = shaped.reward, shaped.loss_mask, s.reward
    metrics = {
        "reward/mean": float(rewards.mean()) if n else 0.0,
        "reward/std": float(rewards.std()) if n else 0.0,
        "reward/raw_mean": float(raw.mean()) if n else 0.0,
        "reward/score_errors": float(errors),
        "reward/unparsed_frac": unparsed / n if n else 0.0,
        "reward/loss_mask_frac": float(mask.mean()) if n else 0.0,
    }
    metrics.update(extra)
    if many is None and reward_timeout(task) > 0:  # per-row scorers stopped at the bound (in score_errors too); a
        # batch scorer (python task) counts its stopped calls as reward/fn_errors, like its raises
        metrics["reward/timeouts"] = float(timeouts)
    if first_error is not None:
        metrics["reward/first_score_error"] = first_error  # a string: the logger may print it, not plot it
    return rewards, mask, raw, metrics
