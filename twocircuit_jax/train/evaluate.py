"""Held-out evaluation with the dense sampler (greedy by default), in fixed-size chunks (one compile)."""

from __future__ import annotations

import numpy as np

from twocircuit_jax.config.sections import SamplingConfig
from twocircuit_jax.tasks.rewards import score_rows
from twocircuit_jax.train.rollout import encode_prompts


class Evaluator:
    def __init__(
        self, task, tokenizer, problems, prompt_len: int, max_new: int, *, greedy: bool = True, chunk: int = 64
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
        return {
            "eval/accuracy": float(np.mean(np.asarray(scores) >= 1.0 - 1e-9)),
            "eval/score_mean": float(np.mean(scores)),
            "eval/n": len(scores),
            "eval/length_mean": float(np.mean(lengths)),
            "eval/truncated_frac": float(np.mean(truncated)),
        }
