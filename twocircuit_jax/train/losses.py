"""Supervised next-token loss (the tiny base model's SFT, and the foundation's step tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from twocircuit_jax.model.qwen2 import forward


def next_token_loss(cfg, params, batch, cs=None):
    """Mean cross-entropy of tokens[:, t] given tokens[:, :t] over positions where batch['loss_mask'][:, t] = 1."""
    tokens, mask = batch["tokens"], batch["attention_mask"]
    logits = forward(cfg, params, tokens, mask)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    tgt = tokens[:, 1:]
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    w = batch["loss_mask"][:, 1:].astype(jnp.float32)
    loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)
    acc = jnp.sum((jnp.argmax(logits, -1) == tgt) * w) / jnp.maximum(jnp.sum(w), 1.0)
    return loss, {"sft/token_acc": acc}
