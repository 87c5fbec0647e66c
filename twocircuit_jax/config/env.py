"""The `env` config section: multi-turn environments (twocircuit_jax/envs/). `type: none` (the default) keeps the
single-turn task of the `task` section; any other type replaces it: the environment brings its own problems."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from twocircuit_jax.config.base import doc, register, require

MAX_TURNS = 50


@dataclass(frozen=True)
class EnvConfig:
    """A multi-turn environment; the subclass is chosen by `type:`."""

    default_type = "none"
    max_turns: int = field(default=8, metadata=doc("interactions per trajectory, at most 50; each one trains as a row"))
    returns: Literal["final", "discounted"] = field(
        default="final",
        metadata=doc("final: every row gets the trajectory's return; discounted: row t gets its reward-to-go"),
    )
    gamma: float = field(default=1.0, metadata=doc("discount of the reward-to-go (returns: discounted)", "γ"))
    format_penalty: float = field(
        default=0.0, metadata=doc("reward of a malformed action, which ends the trajectory (the reward floor)")
    )
    train_size: int = field(default=2000, metadata=doc("training problems generated (unused with type none)"))
    eval_size: int = field(
        default=200, metadata=doc("held-out problems generated, none shared with training (unused with type none)")
    )
    train_seed: int = field(default=1, metadata=doc("seed of the training problems (unused with type none)"))
    eval_seed: int = field(default=2, metadata=doc("seed of the held-out problems (unused with type none)"))
    expert_noise: float = field(
        default=0.3, metadata=doc("share of the expert's SFT actions replaced by a legal but unguided one")
    )
    # On by default, like task.reward_timeout_s: the calls run in one long-lived worker per environment family
    # (tasks/bounded.py). 60 s: one step is one action of one trajectory (a game move, a tool call, a test run);
    # the steps of a turn run one after another, so a bound of minutes would let a few hung steps stall a turn long.
    step_timeout_s: float = field(
        default=60.0,
        metadata=doc(
            "seconds one environment step or reset may take; a slower step is stopped, its action gets reward 0 and "
            "ends the trajectory (env/step_timeouts); a slower reset fails its trajectory before its first turn "
            "(env/reset_timeouts); both warn; 0 = no bound (the environments run in the trainer's process). Bounded "
            "calls run in a worker process forked once; each environment travels there and back with its call, so "
            "its state stays the trainer's, but module-level state of its code lives in the worker"
        ),
    )

    def check(self):
        require(self.step_timeout_s >= 0, "step_timeout_s", f"got {self.step_timeout_s}; must be >= 0 (0 = none)")
        require(1 <= self.max_turns <= MAX_TURNS, "max_turns", f"got {self.max_turns}; allowed 1..{MAX_TURNS}")
        require(0.0 < self.gamma <= 1.0, "gamma", f"got {self.gamma}; must be in (0, 1]")
        require(self.train_size >= 1 and self.eval_size >= 0, "train_size", "train_size >= 1 and eval_size >= 0")
        require(0.0 <= self.expert_noise <= 1.0, "expert_noise", f"got {self.expert_noise}; must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return not isinstance(self, NoEnv)


@register(EnvConfig, "none")
@dataclass(frozen=True)
class NoEnv(EnvConfig):
    """No environment: one prompt, one completion, scored by the task."""


@register(EnvConfig, "guess")
@dataclass(frozen=True)
class GuessEnv(EnvConfig):
    """Number guessing: the policy names a number in [low, high] and hears `<` (lower), `>` (higher) or `=`."""

    low: int = field(default=1, metadata=doc("smallest secret number"))
    high: int = field(default=31, metadata=doc("largest secret number (<= 9999)"))
    noise: float = field(default=0.0, metadata=doc("probability that a verdict is flipped (drawn from the env RNG)"))

    def check(self):
        super().check()
        require(0 <= self.low < self.high <= 9999, "high", f"got low={self.low}, high={self.high}; 0 <= low < high")
        require(0.0 <= self.noise < 0.5, "noise", f"got {self.noise}; must be in [0, 0.5)")


@register(EnvConfig, "calculator")
@dataclass(frozen=True)
class CalculatorEnv(EnvConfig):
    """Tool-use arithmetic: `c:EXPR` calls the calculator (it answers `=VALUE;`), `a:NUMBER` answers and ends."""

    min_terms: int = field(default=2, metadata=doc("fewest operands in a problem (>= 2)"))
    max_terms: int = field(default=3, metadata=doc("most operands in a problem (<= 6)"))
    max_operand: int = field(default=20, metadata=doc("operands are drawn from 1..max_operand"))
    ops: str = field(default="+-*", metadata=doc("operators the problems use"))

    def check(self):
        super().check()
        require(2 <= self.min_terms <= self.max_terms <= 6, "max_terms", "need 2 <= min_terms <= max_terms <= 6")
        require(self.max_operand >= 1, "max_operand", f"got {self.max_operand}; must be >= 1")
        require(bool(self.ops) and set(self.ops) <= set("+-*"), "ops", f"got {self.ops!r}; a subset of '+-*'")
