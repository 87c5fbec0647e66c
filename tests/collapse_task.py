"""A synthetic collapse for the guard's tests: chain_sum whose training reward turns against the policy for a few
steps. From step `collapse_at`, for `collapse_steps` steps, a train completion scores `scale` × its length (in
characters, up to `long_chars`) / `long_chars`, right or wrong: the reward falls at once (to at most `scale`), and
since GRPO normalises advantages within each group, the policy is pushed at full strength toward longer answers and
away from correct ones, so lengths grow, answers go wrong and held-out accuracy falls. Truncated answers still score
0 (`overlong_mode: zero`). Held-out problems are always scored honestly."""

from dataclasses import dataclass

from twocircuit_jax.config.base import register
from twocircuit_jax.config.sections import ReasoningGymTask as RGConfig, TaskConfig
from twocircuit_jax.tasks.base import ScoreResult
from twocircuit_jax.tasks.reasoning_gym_task import ReasoningGymTask


@register(TaskConfig, "synthetic_collapse")
@dataclass(frozen=True)
class SyntheticCollapseConfig(RGConfig):
    collapse_at: int = 6
    collapse_steps: int = 5
    long_chars: int = 5
    scale: float = 0.1

    def build(self):
        return SyntheticCollapse(self)


class SyntheticCollapse(ReasoningGymTask):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.step = 0

    def begin_step(self, gs: int) -> None:
        self.step = gs

    def poisoned(self) -> bool:
        return self.cfg.collapse_at <= self.step < self.cfg.collapse_at + self.cfg.collapse_steps

    def score(self, problem, completion_text: str) -> ScoreResult:
        honest = super().score(problem, completion_text)
        if not self.poisoned() or "/train/" not in problem.id:
            return honest
        length = min(len(completion_text.strip()), self.cfg.long_chars)
        return ScoreResult(self.cfg.scale * length / self.cfg.long_chars, honest.parsed)
