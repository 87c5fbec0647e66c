"""SFT data for an environment: trajectories of its expert (`expert_action`, with `env.expert_noise`), one example
per interaction, prompted exactly as training prompts are (envs/episodes.py: the conversation so far, left-truncated).
A noisy expert leaves the SFT base middling, so that RL has groups with both outcomes to learn from."""

from __future__ import annotations

import numpy as np

from twocircuit_jax.envs.episodes import encode_conversation


def expert_examples(family, env_cfg, tokenizer, prompt_len: int, max_len: int, seed: int) -> dict:
    """tokens [N, max_len] (right-padded), attention_mask, loss_mask (1 on the action and its EOS)."""
    rng = np.random.default_rng([seed, 0x5F7])
    rows = []
    for p in family.train_problems():
        env = family.make(np.random.default_rng(int(rng.integers(2**63))))
        conv = env.reset(p)
        for _ in range(env_cfg.max_turns):
            action = env.expert_action(rng, env_cfg.expert_noise)
            ids, _ = encode_conversation(tokenizer, conv, prompt_len)
            rows.append((ids, tokenizer.encode(action) + [tokenizer.eos_id]))
            res = env.step(action)
            conv += action + res.observation
            if res.done:
                break
    N = len(rows)
    tok = np.full((N, max_len), tokenizer.pad_id, np.int32)
    attn = np.zeros((N, max_len), np.int32)
    lm = np.zeros((N, max_len), np.int32)
    for i, (p, a) in enumerate(rows):
        seq = (p + a)[:max_len]
        tok[i, : len(seq)] = seq
        attn[i, : len(seq)] = 1
        lm[i, len(p) : len(seq)] = 1
    return {"tokens": tok, "attention_mask": attn, "loss_mask": lm}
