"""Supervised next-token loss (the tiny base model's SFT, and the foundation's step tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from twocircuit_jax.model.head import chunks_logits, next_token_nll
from twocircuit_jax.model.qwen2 import decoder_with_aux, forward


def next_token_loss(cfg, params, batch, cs=None):
    """Mean cross-entropy of tokens[:, t] given tokens[:, :t] over positions where batch['loss_mask'][:, t] = 1.
    With `model.logits_chunk` chunking the sequence, the log-probs and the token accuracy come from the chunked head
    (model/head.py) and the [B, T, V] logits are never whole. (loss, metrics, aux): no codec, so no aux."""
    tokens, mask = batch["tokens"], batch["attention_mask"]
    w = batch["loss_mask"][:, 1:].astype(jnp.float32)
    if chunks_logits(cfg, tokens.shape[1]):
        logp, hit = next_token_nll(cfg, params, decoder_with_aux(cfg, params, tokens, mask)[0], tokens)
        nll, hit = -logp[:, 1:], hit[:, 1:]
    else:
        logits = forward(cfg, params, tokens, mask)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        tgt = tokens[:, 1:]
        nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        hit = jnp.argmax(logits, -1) == tgt
    loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)
    acc = jnp.sum(hit * w) / jnp.maximum(jnp.sum(w), 1.0)
    return loss, {"sft/token_acc": acc}, {}
