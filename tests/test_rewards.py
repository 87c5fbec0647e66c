"""Reward shaping: format penalty, overlong zero/mask/soft, failing verifiers counted as score errors."""

import math

import numpy as np
import pytest

from twocircuit_jax.config.sections import GRPOConfig
from twocircuit_jax.tasks.base import Problem, ScoreResult
from twocircuit_jax.tasks.rewards import overlong_penalty, safe_score, score_batch, shape


class EchoTask:
    """Scores 1 when the completion equals the answer, unparsed when empty, raises on 'boom'."""

    def train_problems(self):
        return []

    def eval_problems(self):
        return []

    def prompt(self, p):
        return p.question

    def score(self, p, text):
        if text == "boom":
            raise RuntimeError("verifier exploded")
        if not text:
            return ScoreResult(0.0, False)
        return ScoreResult(1.0 if text == p.answer else 0.0, True)


P = Problem("p0", "1+1", "2", "2", {})
OK, WRONG, UNPARSED = ScoreResult(1.0, True), ScoreResult(0.0, True), ScoreResult(0.0, False)


def test_format_penalty_only_for_unparsed():
    g = GRPOConfig(format_penalty=-0.5)
    assert shape(UNPARSED, 3, False, 16, g) == (-0.5, 1.0)
    assert shape(WRONG, 3, False, 16, g) == (0.0, 1.0)
    assert shape(OK, 3, False, 16, g) == (1.0, 1.0)
    assert shape(ScoreResult(0.0, False, "err"), 3, False, 16, g) == (
        0.0,
        1.0,
    )  # verifier failure is not a format error


def test_overlong_zero_and_mask():
    zero, mask = GRPOConfig(overlong_mode="zero"), GRPOConfig(overlong_mode="mask")
    assert shape(OK, 16, True, 16, zero) == (0.0, 1.0)
    assert shape(OK, 15, False, 16, zero) == (1.0, 1.0)
    assert shape(OK, 16, True, 16, mask) == (1.0, 0.0)
    assert shape(OK, 16, False, 16, mask) == (1.0, 1.0)


@pytest.mark.parametrize("length, expected", [(8, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (20, -1.0)])
def test_soft_overlong_formula(length, expected):
    # limit 16, buffer 4: penalty ((16 - 4) - len) / 4 for 12 < len <= 16.
    assert math.isclose(overlong_penalty(length, 16, 4), expected)
    g = GRPOConfig(overlong_mode="soft", overlong_buffer=4)
    assert math.isclose(shape(OK, length, length >= 16, 16, g).reward, 1.0 + expected)
    assert shape(OK, length, length >= 16, 16, g).loss_mask == 1.0


def test_safe_score_catches_exceptions():
    s = safe_score(EchoTask(), P, "boom")
    assert s.reward == 0.0 and not s.parsed and "verifier exploded" in s.error
    assert safe_score(EchoTask(), P, "2") == (1.0, True, None)


def test_score_batch_counts_errors_and_masks():
    g = GRPOConfig(overlong_mode="mask", format_penalty=-1.0)
    rewards, mask, raw, m = score_batch(
        EchoTask(), [P] * 5, ["2", "3", "", "boom", "2"], [1, 1, 0, 1, 16], [False, False, False, False, True], 16, g
    )
    np.testing.assert_array_equal(rewards, [1.0, 0.0, -1.0, 0.0, 1.0])
    np.testing.assert_array_equal(mask, [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(raw, [1, 0, 0, 0, 1])
    assert m["reward/score_errors"] == 1.0
    assert m["reward/unparsed_frac"] == pytest.approx(0.2)
    assert m["reward/mean"] == pytest.approx(0.2)
    assert m["reward/loss_mask_frac"] == pytest.approx(0.8)
    assert "p0" in m["reward/first_score_error"]
    with pytest.raises(ValueError, match="lengths differ"):
        score_batch(EchoTask(), [P], ["2", "2"], [1], [False], 16, g)


def test_score_batch_with_real_task():
    from twocircuit_jax.config import from_dict
    from twocircuit_jax.config.sections import TaskConfig
    from twocircuit_jax.tasks import make_task

    task = make_task(
        from_dict(TaskConfig, {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 8, "eval_size": 4})
    )
    ps = task.train_problems()[:4]
    texts = [ps[0].answer, "x", ps[2].answer, ps[3].answer]
    r, _, _, m = score_batch(task, ps, texts, [2, 2, 2, 8], [False, False, False, True], 8, GRPOConfig())
    np.testing.assert_array_equal(r, [1.0, 0.0, 1.0, 0.0])  # row 3 is truncated: zero
    assert m["reward/score_errors"] == 0.0
