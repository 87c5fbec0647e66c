"""Host side of one GRPO step: prompts in, a fixed-shape rollout batch out (layout: docs/architecture.md).

Everything here is numpy on the host. Shapes are fixed per run (prompt bucket + max_new_tokens) so the jitted
functions compile once.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from twocircuit_jax.grpo.advantages import group_advantages
from twocircuit_jax.grpo.batch import Collected, pack_rows  # noqa: F401  (Collected: read from here by train/collect.py)
from twocircuit_jax.sampler.base import Rollout
from twocircuit_jax.tasks.rewards import score_batch


def encode_prompts(tokenizer, task, problems, prompt_len: int, field: str = "train.max_prompt_len") -> list[list[int]]:
    out = []
    for p in problems:
        ids = tokenizer.encode(task.prompt(p))
        if tokenizer.bos_id is not None and tokenizer.is_char:
            ids = [tokenizer.bos_id] + ids
        if len(ids) > prompt_len:
            raise ValueError(f"{field}: prompt of problem {p.id} has {len(ids)} tokens; the limit is {prompt_len}")
        out.append(ids)
    return out


def pack_batch(
    prompts: Sequence[Sequence[int]], rollout: Rollout, n: int, prompt_len: int, max_new: int, pad_id: int
) -> dict:
    """Rows prompt-major. tokens = [left-padded prompt | response right-padded]."""
    B = len(rollout.tokens)
    return pack_rows(
        [prompts[i // n] for i in range(B)],
        rollout.tokens,
        rollout.logprobs,
        rollout.truncated,
        prompt_len,
        max_new,
        pad_id,
    )


def score_and_advantages(task, tokenizer, problems, rollout: Rollout, n: int, max_new: int, grpo_cfg):
    """Rewards (shaped), loss mask per row, advantages, reward metrics, decoded completions."""
    rows = [problems[i // n] for i in range(len(rollout.tokens))]
    texts = [tokenizer.decode(t) for t in rollout.tokens]
    lengths = [len(t) for t in rollout.tokens]
    rewards, loss_mask, raw, metrics = score_batch(task, rows, texts, lengths, rollout.truncated, max_new, grpo_cfg)
    adv = advantages(rewards, n, grpo_cfg)
    return np.asarray(rewards, np.float32), np.asarray(loss_mask, np.float32), adv, metrics, texts


# One program per (group size, options) rather than a handful of op-by-op ones, each compiled on the first step.
_group_advantages = jax.jit(group_advantages, static_argnames=("n", "std_normalize", "eps", "ddof"))


def advantages(rewards, n: int, grpo_cfg) -> np.ndarray:
    """Group advantages [B] float32 as the GRPO config asks (std_normalize, adv_std)."""
    ddof = 1 if grpo_cfg.adv_std == "unbiased" else 0
    r = np.asarray(rewards, np.float32)
    return np.asarray(_group_advantages(r, n=n, std_normalize=grpo_cfg.std_normalize, ddof=ddof), np.float32)


def split_minibatches(batch: dict, n_mini: int) -> list[dict]:
    """Contiguous row blocks: each block holds whole prompt groups."""
    B = batch["tokens"].shape[0]
    size = B // n_mini
    return [{k: v[j * size : (j + 1) * size] for k, v in batch.items()} for j in range(n_mini)]
