"""The multi-turn collector: trajectories played against the environment, one training row per interaction.

It keeps the environment RNG (a numpy Generator seeded from train.seed); its state goes into every checkpoint's meta,
so a resumed run plays the same environments as an uninterrupted one.
"""

from __future__ import annotations

import time

import numpy as np

from twocircuit_jax.config.sections import SamplingConfig
from twocircuit_jax.envs.episodes import episode_metrics, run_episodes
from twocircuit_jax.envs.rows import pack_episodes
from twocircuit_jax.grpo.batch import Collected
from twocircuit_jax.metrics.stats import binomial_se


class MultiTurn:
    def __init__(self, cfg, family, tokenizer, sampling):
        self.cfg, self.family, self.tokenizer, self.sampling = cfg, family, tokenizer, sampling
        self.rng = np.random.default_rng([cfg.train.seed, 0xE4F])

    def play(self, problems, n, sampler, sampling, seed: int, rng):
        e, t = self.cfg.env, self.cfg.train
        return run_episodes(
            self.family,
            problems,
            n,
            sampler,
            self.tokenizer,
            sampling,
            max_turns=e.max_turns,
            prompt_len=t.max_prompt_len,
            format_penalty=e.format_penalty,
            rng=rng,
            seed_of_turn=lambda k: seed + 104_729 * (k + 1),
        )

    def check_prompts(self, train_problems, eval_problems) -> None:
        """Nothing to check: a turn's conversation is left-truncated to train.max_prompt_len and the cut counted
        (`env/prompt_truncated_frac`)."""

    def collect(self, gs: int, problems, sampler, seed: int) -> Collected:
        e, t, n = self.cfg.env, self.cfg.train, self.cfg.sampler.n
        t0 = time.perf_counter()
        ep = self.play(problems, n, sampler, self.sampling, seed, self.rng)
        env_s = time.perf_counter() - t0 - ep.gen_s  # the environment's own steps: its rewards and observations
        batch, row_turn = pack_episodes(
            ep, n, e.max_turns, t.max_prompt_len, self.sampling.max_new_tokens, self.tokenizer.pad_id, e, self.cfg.grpo
        )
        m = episode_metrics(ep)
        returns = [sum(r) for r in ep.rewards]
        m["reward/mean"] = m["env/return"]  # the trajectory return is this run's reward (health, sweep tables)
        m["reward/std"] = float(np.std(returns))
        m["env/rows"] = float(len(ep.turns))
        m["env/rows_used_frac"] = len(ep.turns) / float(len(row_turn))
        g = np.asarray(returns).reshape(-1, n)
        m["reward/zero_std_frac"] = float(np.mean(g.std(axis=1) == 0))  # groups with no gradient
        return Collected(
            batch,
            m,
            [len(x.tokens) for x in ep.turns],
            [x.truncated for x in ep.turns],
            ep.weight_version,
            ep.gen_s,
            row_turn,
            env_s,
        )

    def evaluator(self, problems, greedy: bool):
        return EpisodeEvaluator(self, problems, greedy)

    def set_config(self, cfg, sampling) -> None:
        """A new run config and rollout sampling (a guard mitigation changed them, e.g. the generation cap)."""
        self.cfg, self.sampling = cfg, sampling

    def state_dict(self) -> dict:
        """{"env_rng": the numpy bit generator's state} (JSON: a dict of ints and a name)."""
        return {"env_rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        """The state `state_dict` gave; an empty one (a checkpoint written before the RNG was saved) keeps the
        freshly seeded RNG."""
        if state and "env_rng" in state:
            self.rng.bit_generator.state = state["env_rng"]


class EpisodeEvaluator:
    """Held-out trajectories, one per problem (greedy by default): `eval/accuracy` is the success rate. Its own
    environment RNG, seeded per call, so evaluation never moves the training one."""

    def __init__(self, collector: MultiTurn, problems, greedy: bool):
        self.c, self.problems = collector, list(problems)
        self.sampling = SamplingConfig(
            temperature=0.0 if greedy else 1.0, max_new_tokens=collector.sampling.max_new_tokens
        )

    def run(self, sampler, seed: int = 0) -> dict:
        if not self.problems:
            return {}
        ep = self.c.play(self.problems, 1, sampler, self.sampling, seed, np.random.default_rng([seed, 0xE5A]))
        m = episode_metrics(ep, prefix="eval/")
        lengths = [len(x.tokens) for x in ep.turns]
        return {
            "eval/accuracy": m["eval/success"],
            "eval/accuracy_se": binomial_se(float(m["eval/success"]), len(self.problems)),
            "eval/score_mean": m["eval/return"],
            "eval/n": len(self.problems),
            "eval/length_mean": float(np.mean(lengths)) if lengths else 0.0,
            "eval/truncated_frac": float(np.mean([x.truncated for x in ep.turns])) if ep.turns else 0.0,
            **{k: v for k, v in m.items() if k != "eval/success"},
        }
