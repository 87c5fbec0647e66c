"""The embedded dense sampler: batched generation with a KV cache, in one jitted function.

Rows are prompt-major (prompt i's n samples are rows i*n .. i*n+n-1), prompts left-padded to a fixed bucket so a
run compiles once per (prompts, samples per prompt, prompt bucket, max_new_tokens); each prompt is prefilled once
for its n samples. The log-prob returned for each sampled token is taken under the distribution actually sampled
from (temperature, top-k, top-p applied and renormalised); at temperature 1 with no truncation that is the model's
own distribution, so it matches a teacher-forced forward. Greedy decoding (temperature 0) reports the untempered
log-prob of the argmax token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from twocircuit_jax.config.sections import ModelConfig, SamplingConfig
from twocircuit_jax.model.qwen2 import decode_step, init_cache, split_layers
from twocircuit_jax.parallel import dispatch
from twocircuit_jax.parallel.host import to_host
from twocircuit_jax.sampler.base import Rollout

_NOISE_BYTES = 64 << 20  # the most Gumbel noise drawn before the decode loop (see generate_tokens)


def process_logits(logits, temperature, top_k, top_p):
    """Log-probs [B, V] of the sampling distribution. temperature 0 -> untempered (argmax is taken outside)."""
    t = jnp.where(temperature > 0, temperature, 1.0)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    # The truncations sort the vocabulary of every row: a branch taken at run time skips that when there is none
    # (top-k 0, top-p 1), without a compile per setting.
    return jax.lax.cond((top_k > 0) | (top_p < 1.0), _truncate, lambda lp, k, p: lp, lp, top_k, top_p)


def _truncate(lp, top_k, top_p):
    V = lp.shape[-1]
    sorted_lp = jnp.sort(lp, axis=-1)[:, ::-1]
    # top-k: keep values >= the k-th largest (k = 0 disables)
    kth = sorted_lp[:, jnp.clip(top_k - 1, 0, V - 1)][:, None]
    keep = jnp.where(top_k > 0, lp >= kth, True)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p
    cum = jnp.cumsum(jnp.exp(sorted_lp), axis=-1)
    n_keep = jnp.sum((cum - jnp.exp(sorted_lp)) < top_p, axis=-1, keepdims=True)
    thresh = jnp.take_along_axis(sorted_lp, jnp.maximum(n_keep - 1, 0), axis=-1)
    keep = keep & jnp.where(top_p < 1.0, lp >= thresh, True)
    masked = jnp.where(keep, lp, -jnp.inf)
    return jax.nn.log_softmax(masked, axis=-1)


@dispatch.jit(static_argnames=("cfg", "max_new_tokens", "n"))
def generate_tokens(
    cfg: ModelConfig, params, prompt, prompt_mask, key, temperature, top_k, top_p, *, max_new_tokens: int, n: int = 1
):
    """prompt [Bp, P] left-padded; `n` samples per prompt, rows prompt-major (row i is prompt i // n). Returns
    tokens [B, N], logps [B, N], lengths [B], truncated [B] with B = Bp * n. Each prompt is prefilled once and its
    KV cache repeated n times: 1/n of the prefill FLOPs of a prefill per row."""
    Bp, P = prompt.shape
    B = Bp * n
    cache = init_cache(cfg, Bp, P + max_new_tokens)
    layers = split_layers(params)  # once, not per generated token
    logits, cache = decode_step(cfg, params, cache, prompt, prompt_mask, layers)
    if n > 1:
        rep = lambda a: jnp.repeat(a, n, axis=0) if a.ndim else a  # noqa: E731 - `length` is a scalar
        cache, logits = jax.tree.map(rep, cache), jnp.repeat(logits[:, -1:], n, axis=0)
    eos = cfg.eos_token_id

    def pick(logits, g):
        lp = process_logits(logits, temperature, top_k, top_p)
        sampled = jnp.argmax(lp + g, axis=-1)
        greedy = jnp.argmax(logits, axis=-1)
        tok = jnp.where(temperature > 0, sampled, greedy)
        return tok.astype(jnp.int32), jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]

    V = logits.shape[-1]
    # Sampling is argmax(log-probs + Gumbel noise), as jax.random.categorical does it, with the noise of token t
    # from fold_in(key, t): drawn for every token in one program before the loop when it is small (one RNG
    # program instead of one a token: a tiny model's generation 0.107 -> 0.092 s), per token else; same noise.
    noise_at = lambda t: jax.random.gumbel(jax.random.fold_in(key, t), (B, V))  # noqa: E731
    upfront = max_new_tokens * B * V * 4 <= _NOISE_BYTES
    noise = jax.vmap(noise_at)(jnp.arange(max_new_tokens)) if upfront else None

    def body(carry, xs):
        cache, last_logits, done = carry
        t, g = xs
        g = g if upfront else noise_at(t)
        tok, lp = pick(last_logits, g)
        tok = jnp.where(done, cfg.pad_token_id, tok)
        lp = jnp.where(done, 0.0, lp)
        new_done = done | (tok == eos)
        logits, cache = decode_step(cfg, params, cache, tok[:, None], jnp.ones((B, 1), jnp.int32), layers)
        return (cache, logits[:, -1], new_done), (tok, lp, done)

    init = (cache, logits[:, -1], jnp.zeros((B,), bool))
    (_, _, done), (toks, lps, was_done) = jax.lax.scan(body, init, (jnp.arange(max_new_tokens), noise))
    toks, lps, was_done = toks.T, lps.T, was_done.T  # [B, N]
    lengths = jnp.sum(~was_done, axis=1)
    return toks, lps, lengths, ~done


class JaxSampler:
    """Sampler on the trainer's own devices; `update_weights` swaps the parameter reference, or with
    `copy_weights` takes a copy (one more set of weights in device memory), for a sampler that generates while the
    trainer's steps donate the buffers it was given (train.async_rollouts)."""

    pads_batch = True  # compiles per batch shape: callers with a varying row count pad to a few sizes

    def __init__(
        self, cfg: ModelConfig, params=None, *, prompt_bucket: int = 32, version: int = 0, copy_weights: bool = False
    ):
        self.cfg, self.version, self.copy_weights = cfg, version, copy_weights
        self.params = self._own(params)
        self.prompt_bucket = prompt_bucket

    def _own(self, params):
        return jax.tree.map(jnp.copy, params) if (self.copy_weights and params is not None) else params

    def update_weights(self, params, version: int) -> None:
        self.params, self.version = self._own(params), version

    def _pad(self, prompts: list[list[int]]):
        P = max(self.prompt_bucket, max(len(p) for p in prompts))
        P = -(-P // self.prompt_bucket) * self.prompt_bucket  # round up to a bucket: few distinct shapes
        tok = np.full((len(prompts), P), self.cfg.pad_token_id, np.int32)
        mask = np.zeros((len(prompts), P), np.int32)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            tok[i, P - len(p) :] = p
            mask[i, P - len(p) :] = 1
        return tok, mask

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> Rollout:
        if self.params is None:
            raise RuntimeError("JaxSampler has no weights; call update_weights first")
        tok, mask = self._pad(prompts)
        out = generate_tokens(
            self.cfg,
            self.params,
            jnp.asarray(tok),
            jnp.asarray(mask),
            jax.random.key(seed),
            jnp.float32(sampling.temperature),
            jnp.int32(sampling.top_k),
            jnp.float32(sampling.top_p),
            max_new_tokens=sampling.max_new_tokens,
            n=n,
        )
        # Host sync: the loop scores text on the host. With params sharded over several processes the outputs may
        # be too; `to_host` then gathers them (every process generates the same rows, so all call it together).
        toks, lps, lengths, trunc = to_host(out)
        tokens = [toks[i, : lengths[i]].tolist() for i in range(len(toks))]
        logps = [lps[i, : lengths[i]].astype(np.float64).tolist() for i in range(len(toks))]
        return Rollout(tokens, logps, [bool(t) for t in trunc], self.version)

    def close(self) -> None:
        self.params = None
