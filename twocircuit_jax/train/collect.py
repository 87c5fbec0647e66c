"""Rollout collectors: what one GRPO step trains on, from a single-turn task or a multi-turn environment.

A collector turns the step's problems into a packed batch of fixed shape (train/rollout.py's fields plus
`advantages` and `loss_mask`) and its host metrics; the GRPO loop does the rest the same way for both. The single
-turn collector is one sampler call per step; the multi-turn one (envs/collector.py) one call per turn.
"""

from __future__ import annotations

import time

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.train import rollout as ro
from twocircuit_jax.train.evaluate import Evaluator
from twocircuit_jax.train.rollout import Collected


class SingleTurn:
    """One prompt per problem, `sampler.n` completions each, scored by the task."""

    def __init__(self, cfg, task, tokenizer, sampling):
        self.cfg, self.task, self.tokenizer, self.sampling = cfg, task, tokenizer, sampling

    def collect(self, gs: int, problems, sampler, seed: int) -> Collected:
        t, n, max_new = self.cfg.train, self.cfg.sampler.n, self.sampling.max_new_tokens
        prompts = ro.encode_prompts(self.tokenizer, self.task, problems, t.max_prompt_len)
        t0 = time.perf_counter()
        out = sampler.generate(prompts, n, self.sampling, seed=seed)
        gen_s = time.perf_counter() - t0
        _, loss_mask, adv, metrics, _ = ro.score_and_advantages(
            self.task, self.tokenizer, problems, out, n, max_new, self.cfg.grpo
        )
        score_s = time.perf_counter() - t0 - gen_s
        batch = ro.pack_batch(prompts, out, n, t.max_prompt_len, max_new, self.tokenizer.pad_id)
        batch["advantages"], batch["loss_mask"] = adv, loss_mask
        lengths = [len(x) for x in out.tokens]
        return Collected(batch, metrics, lengths, list(out.truncated), out.weight_version, gen_s, None, score_s)

    def check_prompts(self, train_problems, eval_problems) -> None:
        """Before step 1: every training and held-out prompt fits `train.max_prompt_len`; a longer one is a
        ConfigError (exit 2) naming its file and row, instead of a ValueError hours in, when it is drawn. Costs one
        encoding of both sets at start (the sets are held in memory already)."""
        limit = self.cfg.train.max_prompt_len
        for split, problems in (("train", train_problems), ("eval", eval_problems)):
            for i, p in enumerate(problems):
                n = len(ro.encode_prompts(self.tokenizer, self.task, [p], 1 << 62)[0])
                if n > limit:
                    files = getattr(self.cfg.task, f"{split}_files", ())
                    src = p.meta.get("source") if isinstance(p.meta, dict) else None
                    where = f"{src}, problem {p.id}" if src else f"problem {p.id} (files {list(files)})"
                    raise ConfigError(
                        "train.max_prompt_len",
                        f"{split} row {i}: {where}: the prompt has {n} tokens; the limit is {limit} "
                        "(raise train.max_prompt_len or remove the row)",
                    )

    def evaluator(self, problems, greedy: bool) -> Evaluator:
        t = self.cfg.train
        return Evaluator(
            self.task, self.tokenizer, problems, t.max_prompt_len, self.sampling.max_new_tokens, greedy=greedy
        )

    def set_config(self, cfg, sampling) -> None:
        """A new run config and rollout sampling (a guard mitigation changed them, e.g. the generation cap)."""
        self.cfg, self.sampling = cfg, sampling

    def state_dict(self) -> dict:
        """No host state: the problems of a step come from the loop's seeded order."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"the single-turn collector has no state; got keys {sorted(state)}")


def make_collector(cfg, tokenizer, sampling, task=None):
    """(collector, problem source): the environment's when `env.type` is set, else the task's (`task` when given:
    one built from Python objects, else the one `cfg.task` names)."""
    if cfg.env.enabled:
        from twocircuit_jax.envs import make_env
        from twocircuit_jax.envs.collector import MultiTurn

        family = make_env(cfg.env)
        return MultiTurn(cfg, family, tokenizer, sampling), family
    from twocircuit_jax.tasks import make_task

    task = task if task is not None else make_task(cfg.task)
    return SingleTurn(cfg, task, tokenizer, sampling), task
