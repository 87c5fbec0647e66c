"""The environment interface: a problem starts a trajectory, every action text gets an observation and a reward.

    env = family.make(rng)            # one environment per trajectory; rng: numpy Generator (the env's randomness)
    obs = env.reset(problem)          # the opening observation: the first prompt of the conversation
    obs, reward, done, info = env.step(action_text)

A trajectory's conversation is the opening observation followed by each action and the observation it got, as
text; turn t's prompt is that conversation up to turn t (envs/episodes.py). `info["format_ok"]` is False for an
action the environment could not read: the episode runner gives it `env.format_penalty` and ends the trajectory.
`info["success"]` marks a solved trajectory. A family also plays an expert, for the SFT base (`expert_action`).
Everything here is plain Python on the host.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import numpy as np

from twocircuit_jax.tasks.base import Problem


class StepResult(NamedTuple):
    observation: str  # appended to the conversation after the action
    reward: float
    done: bool
    info: dict  # format_ok: bool, success: bool (when done), anything else the env reports


class Env(Protocol):
    def reset(self, problem: Problem) -> str: ...

    def step(self, action_text: str) -> StepResult: ...

    def expert_action(self, rng: np.random.Generator, noise: float) -> str:
        """An action of a good player from the current state; with probability `noise` a legal unguided one."""


class EnvFamily:
    """Problems and environments of one kind, from an EnvConfig subclass (`cfg`)."""

    name = "env"
    dedupe_eval = True  # held-out problems never share an opening with a train problem (False: the openings repeat)

    def __init__(self, cfg):
        self.cfg = cfg
        self._train = self.generate(cfg.train_size, cfg.train_seed, "train")
        if self.dedupe_eval:
            train_q = {p.question for p in self._train}
            cands = self.generate(cfg.eval_size * 4, cfg.eval_seed, "eval")
            self._eval = [p for p in cands if p.question not in train_q][: cfg.eval_size]
        else:
            self._eval = self.generate(cfg.eval_size, cfg.eval_seed, "eval")

    def generate(self, n: int, seed: int, split: str) -> list[Problem]:
        raise NotImplementedError

    def make(self, rng: np.random.Generator) -> Env:
        raise NotImplementedError

    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def eval_problems(self) -> Sequence[Problem]:
        return self._eval


def parse_int(text: str):
    """The integer `text` spells (optional sign, digits only), or None."""
    t = text.strip()
    body = t[1:] if t[:1] == "-" else t
    return int(t) if body.isdigit() and len(body) <= 9 else None
