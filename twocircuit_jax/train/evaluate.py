"""Held-out evaluation with the dense sampler (greedy by default), in fixed-size chunks (one compile).

A verdict between two arms needs a held-out set of thousands (the binomial standard error of an accuracy near 0.5 is
0.011 at 2,000 problems, 0.035 at 200), so every evaluation logs `eval/accuracy_se` = sqrt(p(1-p)/n) beside
`eval/n`. The chunk is the generate call's batch: CHUNK prompts per call, the last chunk padded to the same shape,
so one program serves every call and a larger set costs more calls, not more compiles.
"""

from __future__ import annotations

import numpy as np

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.sections import SamplingConfig
from twocircuit_jax.metrics.stats import binomial_se  # noqa: F401  (re-exported: where the evaluator's callers read it)
from twocircuit_jax.tasks.rewards import score_rows
from twocircuit_jax.train.rollout import encode_prompts

# Prompts per generate call. On the demo model (2,000 held-out problems, 8 new tokens, a loaded 2-core CPU) 64, 128
# and 256 all took 0.3-0.7 s per 1,000 problems warm: the call overhead is small next to the decode, so a larger
# chunk buys nothing here while its KV cache grows with it (a long-generation model evaluates 64 rows where a larger
# chunk could exceed the rollout batch's memory). Thousands of problems cost more calls of one compiled shape.
CHUNK = 64


def heldout_problems(task, size: int) -> list:
    """The first `size` held-out problems. A generated (reasoning-gym) task with fewer is an error naming the fix:
    asking for more held-out problems than exist would otherwise evaluate fewer than asked without a word. Tasks read
    from files or built from Python objects keep the old cap (the first `size` of what there is)."""
    from twocircuit_jax.tasks.reasoning_gym_task import ReasoningGymTask

    problems = list(task.eval_problems())
    if len(problems) >= size or not isinstance(task, ReasoningGymTask):
        return problems[:size]
    tc = task.cfg
    if tc.eval_size < size:
        raise ConfigError(
            "train.eval_size",
            f"got {size}; task.eval_size = {tc.eval_size} generates only {len(problems)} held-out problems: "
            f"set task.eval_size to at least {size} too",
        )
    raise ConfigError(
        "train.eval_size",
        f"got {size}; {tc.dataset} with options {task.options} yielded only {len(problems)} distinct held-out "
        f"problems that are not training problems (task.train_size = {tc.train_size}; the task stops after drawing "
        f"10x task.eval_size): lower train.eval_size and task.eval_size to {len(problems)} or less, lower "
        "task.train_size, or widen the options",
    )


class Evaluator:
    def __init__(
        self, task, tokenizer, problems, prompt_len: int, max_new: int, *, greedy: bool = True, chunk: int = CHUNK
    ):
        self.task, self.tokenizer, self.problems = task, tokenizer, list(problems)
        self.prompts = encode_prompts(tokenizer, task, self.problems, prompt_len)
        self.chunk = max(1, min(chunk, len(self.problems)))
        self.sampling = SamplingConfig(temperature=0.0 if greedy else 1.0, max_new_tokens=max_new)

    def run(self, sampler, seed: int = 0) -> dict:
        if not self.problems:
            return {}
        scores, lengths, truncated = [], [], []
        for start in range(0, len(self.problems), self.chunk):
            idx = list(range(start, min(start + self.chunk, len(self.problems))))
            prompts = [self.prompts[i] for i in idx]
            prompts += [self.prompts[idx[0]]] * (self.chunk - len(idx))  # pad the last chunk: same shapes
            out = sampler.generate(prompts, 1, self.sampling, seed=seed + start)
            texts = [self.tokenizer.decode(out.tokens[j]) for j in range(len(idx))]
            many = getattr(self.task, "score_many", None)  # one call per chunk for a batch scorer (python tasks)
            if many is not None:
                scores += [s.reward for s in many([self.problems[i] for i in idx], texts, check_failures=False)[0]]
            else:
                scores += [s.reward for s in score_rows(self.task, [self.problems[i] for i in idx], texts)]
            for j in range(len(idx)):
                lengths.append(len(out.tokens[j]))
                truncated.append(out.truncated[j])
        # Accuracy counts full-credit answers only: some verifiers give partial credit to a parsable wrong answer.
        acc = float(np.mean(np.asarray(scores) >= 1.0 - 1e-9))
        return {
            "eval/accuracy": acc,
            "eval/accuracy_se": binomial_se(acc, len(scores)),
            "eval/score_mean": float(np.mean(scores)),
            "eval/n": len(scores),
            "eval/length_mean": float(np.mean(lengths)),
            "eval/truncated_frac": float(np.mean(truncated)),
        }
