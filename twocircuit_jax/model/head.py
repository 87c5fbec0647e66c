"""The LM head reduced to what the trainer reads, without the [B, T, V] logits.

Every train pass reads two fp32 scalars per token from the logits: the log-prob of the next token and the entropy
of the distribution that predicts it (`TokenStats`; conventions of grpo/loss.py: `logp[:, t]` predicts
`tokens[:, t]` from `logits[:, t - 1]`, column 0 is 0). At Qwen2.5's vocabulary (V = 151,936) one sequence of
4,096 tokens has 2.5 GB of fp32 logits, and autodiff keeps them (and their softmax) for the backward.

`head_stats` takes the decoder's last hidden state (before the final norm, `qwen2.decoder_with_aux`) and runs the
final norm, the [H, V] matmul and the two reductions one chunk of `model.logits_chunk` positions at a time, in a
`lax.scan`. The chunk body is `jax.checkpoint`ed: the forward keeps only its inputs (a slice of the hidden state)
and the backward recomputes one chunk's logits at a time, accumulating the final-norm and head-weight gradients in
the scan's carry (fp32 when the weights are). Peak memory is a few [B, chunk, V] fp32 buffers instead of
[B, T, V]; the price is the head matmul once more in the backward (4 instead of 3 [T, H] x [H, V] matmuls).
Values per position are the same expressions on the same logits, so a chunked pass equals the whole one up to
the float order of the weight-gradient sum over chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from twocircuit_jax.grpo.loss import token_entropy, token_logprobs
from twocircuit_jax.model import qwen2


class TokenStats(NamedTuple):
    """What every pass of the trainer reads from the logits, reduced where the logits are made."""

    logp: jax.Array  # [B, T] fp32: log π(tokens[:, t] | tokens[:, :t]); column 0 is 0 (grpo/loss.py)
    entropy: jax.Array  # [B, T] fp32: entropy of the distribution that predicts tokens[:, t]; column 0 is 0


def token_stats(logits, tokens, entropy_grad: bool = False) -> TokenStats:
    """logits [B, T, V] -> TokenStats; the entropy is a constant to autodiff unless `entropy_grad`."""
    ent = token_entropy(logits if entropy_grad else jax.lax.stop_gradient(logits))
    return TokenStats(token_logprobs(logits, tokens), ent)


def _head_params(params) -> dict:
    """The weights the head reads: the final norm and the embedding (tied) or lm_head (untied)."""
    return {k: params[k] for k in ("final_norm", "embed", "lm_head") if k in params}


def _chunk_stats(cfg, ends, h, nxt, entropy: bool, entropy_grad: bool, hit: bool):
    """h [B, c, H] (before the final norm), nxt [B, c] the tokens its positions predict -> {name: [B, c] fp32}.
    The same expressions as grpo/loss.py token_logprobs / token_entropy on the same logits."""
    logits = qwen2.lm_head(cfg, ends, h)  # [B, c, V] fp32
    picked = jnp.take_along_axis(logits, nxt[..., None], axis=-1)[..., 0]
    out = {"logp": picked - jax.nn.logsumexp(logits, axis=-1)}
    if entropy:
        z = logits if entropy_grad else jax.lax.stop_gradient(logits)
        lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
        out["entropy"] = lse[..., 0] - jnp.sum(jnp.exp(z - lse) * z, axis=-1)
    if hit:  # a constant to autodiff (argmax has no gradient)
        out["hit"] = (jnp.argmax(jax.lax.stop_gradient(logits), axis=-1) == nxt).astype(jnp.float32)
    return out


def _scan_chunks(cfg, params, h, tokens, chunk: int, **want) -> dict:
    """{name: [B, T] fp32, column 0 = 0} of `_chunk_stats` over the T - 1 predicting positions, `chunk` at a time.
    T - 1 not a multiple of the chunk: the last chunk is padded (zero hidden states, token 0) and cut off after."""
    B, T, H = h.shape
    P = T - 1
    n = -(-P // chunk)
    pad = n * chunk - P
    hs = jnp.pad(h[:, :-1], ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, H).swapaxes(0, 1)  # [n, B, c, H]
    ts = jnp.pad(tokens[:, 1:].astype(jnp.int32), ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)

    # Saves nothing but its arguments: the backward recomputes the chunk's logits (one [B, c, V] at a time).
    body = jax.checkpoint(lambda ends, x, t: _chunk_stats(cfg, ends, x, t, **want), prevent_cse=False)
    ends = _head_params(params)
    _, out = jax.lax.scan(lambda carry, xs: (carry, body(ends, *xs)), None, (hs, ts))
    return {k: jnp.pad(v.swapaxes(0, 1).reshape(B, n * chunk)[:, :P], ((0, 0), (1, 0))) for k, v in out.items()}


def chunks_logits(cfg, T: int, chunk=None) -> bool:
    """Whether a [B, T] pass takes the chunked head: `chunk` (None: `model.logits_chunk`) is set and the T - 1
    predicting positions need more than one chunk of it."""
    chunk = cfg.logits_chunk if chunk is None else int(chunk)
    return 0 < chunk < T - 1


def head_stats(cfg, params, h, tokens, entropy_grad: bool = False, chunk=None) -> TokenStats:
    """TokenStats of the logits `qwen2.lm_head(cfg, params, h)` without making them whole.

    h [B, T, H]: the last layer's output before the final norm (compute dtype); tokens [B, T] int. chunk: positions
    per chunk (None: `cfg.logits_chunk`); 0, or a chunk that covers all T - 1 predicting positions, takes today's
    whole-logits path (`token_stats`), bit for bit. `entropy_grad`: whether the entropy carries a gradient (an
    entropy bonus); without it the backward has no entropy term at all."""
    if not chunks_logits(cfg, tokens.shape[1], chunk):
        return token_stats(qwen2.lm_head(cfg, params, h), tokens, entropy_grad)
    chunk = cfg.logits_chunk if chunk is None else int(chunk)
    out = _scan_chunks(cfg, params, h, tokens, chunk, entropy=True, entropy_grad=entropy_grad, hit=False)
    return TokenStats(out["logp"], out["entropy"])


def next_token_nll(cfg, params, h, tokens, chunk=None):
    """(logp [B, T], hit [B, T]) fp32, column 0 = 0, chunked as `head_stats` (whole logits when it would not chunk):
    the next token's log-prob and whether it is the argmax of its logits (the token accuracy; a constant to
    autodiff). The supervised loss's reads."""
    if not chunks_logits(cfg, tokens.shape[1], chunk):
        logits = qwen2.lm_head(cfg, params, h)
        hit = jnp.argmax(logits[:, :-1], axis=-1) == tokens[:, 1:]
        return token_logprobs(logits, tokens), jnp.pad(hit.astype(jnp.float32), ((0, 0), (1, 0)))
    chunk = cfg.logits_chunk if chunk is None else int(chunk)
    out = _scan_chunks(cfg, params, h, tokens, chunk, entropy=False, entropy_grad=False, hit=True)
    return out["logp"], out["hit"]
