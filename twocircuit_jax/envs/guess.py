"""Number guessing: a verdict after every move. The problem hides a number in [low, high]; each action names one;
the answer is `<` (the hidden number is lower), `>` (higher) or `=` (found: reward 1, done). Halving the interval
finds any number in ceil(log2(high - low + 1)) moves; guessing at random inside it takes more, so a trajectory cap
near the halving count rewards planning. With `noise` > 0 a `<`/`>` verdict is flipped with that probability,
drawn from the environment's RNG (the run saves its state: a resumed run hears the same verdicts)."""

from __future__ import annotations

import numpy as np

from twocircuit_jax.envs.base import EnvFamily, StepResult, parse_int
from twocircuit_jax.tasks.base import Problem


class GuessGame:
    def __init__(self, low: int, high: int, noise: float, rng: np.random.Generator):
        self.low, self.high, self.noise, self.rng = low, high, noise, rng

    def reset(self, problem: Problem) -> str:
        self.target = int(problem.answer)
        self.lo, self.hi = self.low, self.high  # the interval the verdicts so far leave
        return problem.question

    def step(self, action_text: str) -> StepResult:
        g = parse_int(action_text)
        if g is None or not self.low <= g <= self.high:
            return StepResult("!", 0.0, True, {"format_ok": False, "success": False})
        if g == self.target:
            return StepResult("=", 1.0, True, {"format_ok": True, "success": True})
        higher = self.target > g
        if self.noise and self.rng.random() < self.noise:
            higher = not higher
        if higher:
            self.lo = max(self.lo, g + 1)
        else:
            self.hi = min(self.hi, g - 1)
        return StepResult(">" if higher else "<", 0.0, False, {"format_ok": True})

    def expert_action(self, rng: np.random.Generator, noise: float) -> str:
        lo, hi = (self.lo, self.hi) if self.lo <= self.hi else (self.low, self.high)  # a flipped verdict misled
        if rng.random() < noise:
            return str(int(rng.integers(lo, hi + 1)))
        return str((lo + hi) // 2)


class GuessFamily(EnvFamily):
    name = "guess"
    dedupe_eval = False  # every opening is the same text; the hidden numbers are drawn with another seed

    def generate(self, n: int, seed: int, split: str) -> list[Problem]:
        c = self.cfg
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            t = int(rng.integers(c.low, c.high + 1))
            out.append(Problem(f"guess/{split}/{i}", f"{c.low}-{c.high}?", str(t), str(t), {"target": t}))
        return out

    def make(self, rng: np.random.Generator) -> GuessGame:
        return GuessGame(self.cfg.low, self.cfg.high, self.cfg.noise, rng)
