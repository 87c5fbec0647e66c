"""The rollout batch both collectors build (train/collect.py from a task, envs/collector.py from an environment),
kept below them both so that neither imports the other: fixed-shape rows from (prompt, response) pairs, and what a
collector hands the loop. Numpy on the host (layout: docs/architecture.md, "Rollout batch")."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np


class Collected(NamedTuple):
    batch: dict  # numpy, [R, T] / [R]: tokens, attention_mask, response_mask, sampler_logp, sample_id, truncated,
    #              advantages, loss_mask
    metrics: dict  # reward/*, env/* ... (host floats)
    lengths: list  # list[int]: generated tokens per real row
    truncated: list  # list[bool]: per real row
    weight_version: int  # the oldest sampler weight version in the batch
    gen_s: float  # seconds inside the rollout engine
    row_turn: Optional[np.ndarray] = None  # [R] int32 turn index per row (-1 = empty row); None for single-turn
    score_s: float = 0.0  # seconds scoring (the task's rewards; a multi-turn environment's own steps)


def pack_rows(prompts, responses, logprobs, truncated, prompt_len: int, max_new: int, pad_id: int, rows=None) -> dict:
    """One row per (prompt, response) pair: tokens = [left-padded prompt | response right-padded]. `rows` > the
    pairs pads with empty rows (attention, response mask and log-probs all 0), for a batch of fixed shape."""
    B = len(responses) if rows is None else rows
    if B < len(responses):
        raise ValueError(f"pack_rows: {len(responses)} responses do not fit {B} rows")
    T = prompt_len + max_new
    tokens = np.full((B, T), pad_id, np.int32)
    attn = np.zeros((B, T), np.int32)
    resp = np.zeros((B, T), np.float32)
    slogp = np.zeros((B, T), np.float32)
    trunc = np.zeros((B,), bool)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, logprobs)):
        if len(r) != len(lp) or len(r) > max_new:
            raise ValueError(f"sampler row {i}: {len(r)} tokens, {len(lp)} log-probs, limit {max_new}")
        if len(p) > prompt_len:
            raise ValueError(f"row {i}: prompt of {len(p)} tokens; the limit is {prompt_len}")
        tokens[i, prompt_len - len(p) : prompt_len] = p
        attn[i, prompt_len - len(p) : prompt_len + len(r)] = 1
        tokens[i, prompt_len : prompt_len + len(r)] = r
        resp[i, prompt_len : prompt_len + len(r)] = 1.0
        slogp[i, prompt_len : prompt_len + len(r)] = lp
        trunc[i] = truncated[i]
    return {
        "tokens": tokens,
        "attention_mask": attn,
        "response_mask": resp,
        "sampler_logp": slogp,
        "sample_id": np.arange(B, dtype=np.int32),
        "truncated": trunc,
    }
