"""Trajectories into training rows: returns, group advantages, and a batch of fixed shape.

Each interaction is one row (prompt = the conversation before it, response = the action). A row's return is the
trajectory's return (`returns: final`) or its reward-to-go Σ_k≥t γ^(k-t) r_k (`discounted`). Advantages are taken
per group, the n trajectories of one problem: A = (G - mean) / (std + eps) with the group's mean and std of the
trajectory returns G_0, so every row of one trajectory shares its sign under `final`. A group whose trajectories
all score the same (all at the format floor, say) gets zero advantage: no gradient.
The batch has n_traj * max_turns rows, trajectory t's turn k in row t*max_turns + k; unused turns are empty rows
(no attention, no loss). One shape per run, so every jitted pass compiles once; the cost is compute on empty rows
when trajectories end early.
"""

from __future__ import annotations

import numpy as np

from twocircuit_jax.envs.episodes import Episodes
from twocircuit_jax.grpo.batch import pack_rows

EPS = 1e-6


def rewards_to_returns(rewards, mode: str, gamma: float) -> list[float]:
    """Per-turn returns of one trajectory's per-turn rewards."""
    if mode == "final":
        return [float(sum(rewards))] * len(rewards)
    if mode != "discounted":
        raise ValueError(f"env.returns: got {mode!r}; allowed 'final', 'discounted'")
    out, g = [], 0.0
    for r in reversed(rewards):
        g = r + gamma * g
        out.append(g)
    return out[::-1]


def row_advantages(ep: Episodes, n: int, env_cfg, grpo_cfg) -> list[list[float]]:
    """Per trajectory, per turn: the advantage of that turn's row."""
    rets = [rewards_to_returns(r, env_cfg.returns, env_cfg.gamma) for r in ep.rewards]
    g0 = np.asarray([r[0] if r else 0.0 for r in rets], np.float64).reshape(-1, n)  # no turn: a reset stopped
    mean = g0.mean(axis=1)
    ddof = 1 if grpo_cfg.adv_std == "unbiased" and n > 1 else 0
    std = g0.std(axis=1, ddof=ddof)
    out = []
    for i, r in enumerate(rets):
        m, s = mean[i // n], std[i // n]
        out.append([(g - m) / (s + EPS) if grpo_cfg.std_normalize else g - m for g in r])
    return out


def pack_episodes(ep: Episodes, n: int, max_turns: int, prompt_len: int, max_new: int, pad_id: int, env_cfg, grpo_cfg):
    """(batch, row_turn [R] int32 with -1 on empty rows). batch holds the pack_rows fields plus `advantages` and
    `loss_mask` (0 on empty rows, and on truncated actions under grpo.overlong_mode: mask)."""
    R = len(ep.rewards) * max_turns
    adv = row_advantages(ep, n, env_cfg, grpo_cfg)
    prompts, tokens, logps, trunc = [[]] * R, [[]] * R, [[]] * R, [False] * R  # an empty entry packs an empty row
    row_turn = np.full((R,), -1, np.int32)
    advantages = np.zeros((R,), np.float32)
    loss_mask = np.zeros((R,), np.float32)
    for x in ep.turns:
        s = x.traj * max_turns + x.turn
        prompts[s], tokens[s], logps[s], trunc[s] = x.prompt, x.tokens, x.logprobs, x.truncated
        row_turn[s] = x.turn
        advantages[s] = adv[x.traj][x.turn]
        loss_mask[s] = 0.0 if (x.truncated and grpo_cfg.overlong_mode == "mask") else 1.0
    batch = pack_rows(prompts, tokens, logps, trunc, prompt_len, max_new, pad_id)
    batch["advantages"], batch["loss_mask"] = advantages, loss_mask
    return batch, row_turn
