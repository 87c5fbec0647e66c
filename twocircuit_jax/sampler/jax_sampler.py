"""The embedded dense sampler: batched generation with a KV cache, in jitted calls of a bounded size.

Rows are prompt-major (prompt i's n samples are rows i*n .. i*n+n-1), prompts left-padded to a fixed bucket so a
run compiles once per (prompts per call, samples per prompt, prompt bucket, max_new_tokens); each prompt is prefilled
once for its n samples. The log-prob returned for each sampled token is taken under the distribution actually
sampled from (temperature, top-k, top-p applied and renormalised); at temperature 1 with no truncation that is the
model's own distribution, so it matches a teacher-forced forward. Greedy decoding (temperature 0) reports the
untempered log-prob of the argmax token.

At scale (a GRPO step of 512 prompts x 8 samples x 4k tokens) one program over every row would hold all their KV
caches at once. So:
  * a step's rows are generated in calls of at most `sampler.max_rows_per_call` rows (whole prompt groups; `auto`
    sizes a call from the device memory left: `rows_that_fit`);
  * inside a call the rows are split over the mesh's batch axes (data x fsdp), each device holding its own rows'
    KV cache, and the weights are gathered once per call in the compute dtype (parallel/mesh.py
    decode_param_shardings) instead of once per token and layer;
  * a call ends when all its rows have emitted EOS (a while loop), not at max_new_tokens;
  * the vocabulary is sorted only when top-k or top-p asks for it (a static flag: evaluation and rollouts never do).
The noise of row r's token t is drawn from fold_in(fold_in(key, r), t), r counted over the whole request, so the
same seed gives the same tokens whatever the split into calls and over devices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from twocircuit_jax.config.sections import ModelConfig, SamplingConfig
from twocircuit_jax.model.qwen2 import (
    decode_step,
    dtype_of,
    fuse_decode_layer,
    init_cache,
    layer_params,
    param_count,
)
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.parallel.host import to_host
from twocircuit_jax.sampler.base import Rollout

_NOISE_BYTES = 64 << 20  # the most Gumbel noise drawn before the decode loop (see generate_tokens)
_FUSED_AWAY = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # read through qkv_proj / gate_up_proj


def process_logits(logits, temperature, top_k, top_p, truncate: bool = True):
    """Log-probs [B, V] of the sampling distribution. temperature 0 -> untempered (argmax is taken outside).
    `truncate` (static): apply top-k/top-p, which sorts the vocabulary of every row; False leaves them out of the
    program (what rollouts and greedy evaluation use: a log-softmax is the only work over the vocabulary)."""
    t = jnp.where(temperature > 0, temperature, 1.0)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    return _truncate(lp, top_k, top_p) if truncate else lp


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


def decode_weights(cfg: ModelConfig, params, mesh=None):
    """(top-level weights, [per-layer weights]) as generation reads them: in the compute dtype (exactly what every
    use casts them to), each layer's q/k/v and gate/up fused into one dot (model/qwen2.py fuse_decode_layer), and with a mesh
    whole on each device of the batch axes. Layer by layer, so the copy in flight is the fused bf16 weights plus one
    layer, not a second whole model."""
    dt = dtype_of(cfg.compute_dtype)
    cast = lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    put = lambda t: t  # noqa: E731
    if mesh is not None:
        put = lambda t: jax.lax.with_sharding_constraint(t, pmesh.decode_param_shardings(t, mesh))  # noqa: E731
    top = put(jax.tree.map(cast, {k: v for k, v in params.items() if k != "layers"}))
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    layers = []
    for i in range(n):
        lp = fuse_decode_layer(jax.tree.map(cast, layer_params(params, i)))
        layers.append(put({k: v for k, v in lp.items() if k not in _FUSED_AWAY}))
    return top, layers


def _on_rows(tree, mesh):
    """Row-major arrays split over the batch axes (each device its own rows) where the rows divide; scalars
    replicated."""
    if mesh is None:
        return tree

    def one(x):
        spec = pmesh.row_spec(x.shape[0], mesh, x.ndim) if x.ndim else jax.sharding.PartitionSpec()
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(one, tree)


def _extend(cache, extra: int):
    """The prefill's cache (prompt slots only) with `extra` empty slots after them for the generated tokens: the
    prefill then attends over the prompt alone ([P, P] scores, not [P, P + max_new])."""
    pad = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, extra), (0, 0)])  # noqa: E731
    return cache._replace(
        k=tuple(pad(a) for a in cache.k),
        v=tuple(pad(a) for a in cache.v),
        valid=jnp.pad(cache.valid, [(0, 0), (0, extra)]),
    )


@dispatch.jit(static_argnames=("cfg", "max_new_tokens", "n", "truncate", "greedy", "stop_early", "mesh"))
def generate_tokens(
    cfg: ModelConfig,
    params,
    prompt,
    prompt_mask,
    key,
    temperature,
    top_k,
    top_p,
    first_row,
    *,
    max_new_tokens: int,
    n: int = 1,
    truncate: bool = False,
    greedy: bool = False,
    stop_early: bool = True,
    mesh=None,
):
    """prompt [Bp, P] left-padded; `n` samples per prompt, rows prompt-major (row i is prompt i // n), row i of this
    call being row `first_row + i` of the request (its noise). Returns tokens [B, N], logps [B, N], lengths [B],
    truncated [B] with B = Bp * n, and the decode steps run ([]: the longest row's length with `stop_early`). Each prompt is prefilled once and its KV cache repeated n times: 1/n of the
    prefill FLOPs of a prefill per row. Static: `truncate` (top-k/top-p in the program), `greedy` (argmax, no
    noise drawn), `stop_early` (end when every row has finished; False decodes to max_new_tokens, for
    benchmarks), `mesh` (rows over its batch axes, weights gathered: see the module doc)."""
    Bp, P = prompt.shape
    B, N = Bp * n, max_new_tokens
    top, layers = decode_weights(cfg, params, mesh)
    prompt, prompt_mask = _on_rows((prompt, prompt_mask), mesh)
    cache = _on_rows(init_cache(cfg, Bp, P), mesh)
    logits, cache = decode_step(cfg, top, cache, prompt, prompt_mask, layers, last_only=True)
    logits = logits[:, -1]
    if n > 1:
        rep = lambda a: jnp.repeat(a, n, axis=0) if a.ndim else a  # noqa: E731 - `length` is a scalar
        cache, logits = jax.tree.map(rep, cache), rep(logits)
    cache, logits = _on_rows((_extend(cache, N), logits), mesh)
    eos, pad = cfg.eos_token_id, cfg.pad_token_id
    V = logits.shape[-1]

    def pick(logits, g):
        lp = process_logits(logits, temperature, top_k, top_p, truncate)
        tok = jnp.argmax(logits, axis=-1) if greedy else jnp.argmax(lp + g, axis=-1)
        return tok.astype(jnp.int32), jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]

    # Sampling is argmax(log-probs + Gumbel noise), as jax.random.categorical does it. Row r's noise at token t comes
    # from fold_in(fold_in(key, r), t): independent of how the request is split. Drawn for every token in one
    # program before the loop when it is small (one RNG program instead of one a token: a tiny model's generation
    # 0.107 -> 0.092 s), per token else; the same noise either way.
    row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(first_row + jnp.arange(B))
    noise_at = lambda t: jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, t), (V,)))(row_keys)  # noqa: E731
    upfront = not greedy and N * B * V * 4 <= _NOISE_BYTES
    noise = jax.vmap(noise_at)(jnp.arange(N)) if upfront else None

    def cond(carry):
        t, done = carry[0], carry[3]
        return (t < N) & ~jnp.all(done) if stop_early else t < N

    def body(carry):
        t, cache, last_logits, done, toks, lps, lengths = carry
        g = None if greedy else (noise[t] if upfront else noise_at(t))
        tok, lp = pick(last_logits, g)
        tok = jnp.where(done, pad, tok)
        lp = jnp.where(done, 0.0, lp)
        lengths = lengths + (~done).astype(jnp.int32)
        toks, lps = toks.at[t].set(tok), lps.at[t].set(lp)  # [N, B]: row t of the buffer, one contiguous write
        logits, cache = decode_step(cfg, top, cache, tok[:, None], jnp.ones((B, 1), jnp.int32), layers)
        return t + 1, cache, logits[:, -1], done | (tok == eos), toks, lps, lengths

    init = (
        jnp.int32(0),
        cache,
        logits,
        jnp.zeros((B,), bool),
        jnp.full((N, B), pad, jnp.int32),
        jnp.zeros((N, B), jnp.float32),
        jnp.zeros((B,), jnp.int32),
    )
    steps, _, _, done, toks, lps, lengths = jax.lax.while_loop(cond, body, init)
    return toks.T, lps.T, lengths, ~done, steps


def rows_that_fit(cfg: ModelConfig, free_bytes: float, prompt_len: int, max_new: int, n: int, shards: int,
                  tensor: int = 1) -> int:  # fmt: skip
    """Rows of one generate call that fit in `free_bytes` per device (an estimate: the plan compiles the call and
    checks it). Fixed: the weights in the compute dtype, split over `tensor` only. Per row, on the device that holds
    it: its KV cache at prompt + max_new positions, about four vocabulary-long float32 vectors (logits,
    log-softmax, noise, the pick), its token buffers, and 1/n of its prompt's prefill (the prompt-only cache, its
    attention scores and MLP activations). 10 % of the memory is left to the compiler. Whole prompt groups (a
    multiple of n), at least one group."""
    it = jnp.dtype(dtype_of(cfg.compute_dtype)).itemsize
    L, H, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    D, nkv, nq = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads
    P, S = prompt_len, prompt_len + max_new
    kv_token = 2 * L * nkv * D * it
    fixed = param_count(cfg) * it / tensor
    prefill = kv_token * P * 2 + 4 * nq * P * P + P * (2 * F + 4 * H) * 4
    per_row = kv_token * S + S + 16 * V + 8 * max_new + prefill / n
    per_device = max(0, math.floor((0.9 * free_bytes - fixed) / per_row))
    return max(n, (per_device * shards) // n * n)


def call_prompts(rows: int, n: int, prompts: int, shards: int) -> int:
    """Prompts of one generate call of at most `rows` rows: whole groups of `n`, a multiple of the batch `shards`
    when there are that many (each device an equal share), never more than the request's `prompts`."""
    per = max(1, rows // n)
    if per >= shards:
        per -= per % shards
    return min(per, prompts)


def free_device_bytes() -> float | None:
    """Device memory not in use on the first device (its allocator's limit minus what is allocated), or None where
    the backend reports none (XLA:CPU: host memory, one call for every row)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


class JaxSampler:
    """Sampler on the trainer's own devices; `update_weights` swaps the parameter reference, or with
    `copy_weights` takes a copy (one more set of weights in device memory), for a sampler that generates while the
    trainer's steps donate the buffers it was given (train.async_rollouts). `max_rows_per_call`: rows of one
    generate call (an int, or "auto": `rows_that_fit` the device memory free at the first call, every row at once
    where the backend reports no memory). With sharded parameters the rows go over their mesh's batch axes.
    `stop_early=False` decodes every call to max_new_tokens (scripts/bench_sampler.py measures what stopping saves)."""

    pads_batch = True  # compiles per batch shape: callers with a varying row count pad to a few sizes

    def __init__(
        self,
        cfg: ModelConfig,
        params=None,
        *,
        prompt_bucket: int = 32,
        version: int = 0,
        copy_weights: bool = False,
        max_rows_per_call: int | str = "auto",
        stop_early: bool = True,
    ):
        self.cfg, self.version, self.copy_weights = cfg, version, copy_weights
        self.params = self._own(params)
        self.prompt_bucket = prompt_bucket
        self.max_rows_per_call, self.stop_early = max_rows_per_call, stop_early
        self._auto_rows: dict = {}  # (prompt bucket, max_new, n) -> rows, sized once

    def _own(self, params):
        return jax.tree.map(jnp.copy, params) if (self.copy_weights and params is not None) else params

    def update_weights(self, params, version: int) -> None:
        self.params, self.version = self._own(params), version

    @property
    def mesh(self):
        """The mesh the parameters are sharded over (None: one device, or not a NamedSharding)."""
        sh = getattr(jax.tree.leaves(self.params)[0], "sharding", None)
        return sh.mesh if isinstance(sh, NamedSharding) and sh.mesh.size > 1 else None

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

    def prompts_per_call(self, prompts: int, n: int, prompt_len: int, max_new: int) -> int:
        """Prompts of one generate call of a request of `prompts` (call_prompts of max_rows_per_call)."""
        rows = self.max_rows_per_call
        mesh = self.mesh
        shards = pmesh.dp_size(mesh) if mesh is not None else 1
        if rows == "auto":
            key = (prompt_len, max_new, n)
            if key not in self._auto_rows:
                free = free_device_bytes()
                tensor = mesh.shape["tensor"] if mesh is not None else 1
                fit = rows_that_fit(self.cfg, free, prompt_len, max_new, n, shards, tensor) if free else None
                self._auto_rows[key] = fit
            rows = self._auto_rows[key]
            if rows is None:
                return prompts
        return call_prompts(rows, n, prompts, shards)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> Rollout:
        if self.params is None:
            raise RuntimeError("JaxSampler has no weights; call update_weights first")
        tok, mask = self._pad(prompts)
        per = self.prompts_per_call(len(prompts), n, tok.shape[1], sampling.max_new_tokens)
        key, mesh = jax.random.key(seed), self.mesh
        scalars = (jnp.float32(sampling.temperature), jnp.int32(sampling.top_k), jnp.float32(sampling.top_p))
        static = {
            "max_new_tokens": sampling.max_new_tokens,
            "n": n,
            "truncate": sampling.top_k > 0 or sampling.top_p < 1.0,
            "greedy": sampling.temperature == 0,
            "stop_early": self.stop_early,
            "mesh": mesh,
        }
        parts = []
        for start in range(0, len(prompts), per):
            t, m = tok[start : start + per], mask[start : start + per]
            short = per - len(t)  # the last call padded with copies of its first prompt: one compiled shape
            if short:
                t, m = np.concatenate([t, t[:1].repeat(short, 0)]), np.concatenate([m, m[:1].repeat(short, 0)])
            out = generate_tokens(
                self.cfg, self.params, jnp.asarray(t), jnp.asarray(m), key, *scalars, jnp.int32(start * n), **static
            )
            # Host sync: the loop scores text on the host. With params sharded over several processes the outputs
            # may be too; `to_host` then gathers them (every process generates the same rows, so all call it).
            parts.append([x[: (per - short) * n] for x in to_host(out[:4])])
        toks, lps, lengths, trunc = (np.concatenate(x) for x in zip(*parts))
        tokens = [toks[i, : lengths[i]].tolist() for i in range(len(toks))]
        logps = [lps[i, : lengths[i]].astype(np.float64).tolist() for i in range(len(toks))]
        return Rollout(tokens, logps, [bool(t) for t in trunc], self.version)

    def close(self) -> None:
        self.params = None
