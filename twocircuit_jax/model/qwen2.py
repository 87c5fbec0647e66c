"""Qwen2-family decoder as a pure function of a parameter pytree (layout: docs/architecture.md).

Covers Qwen2 / Qwen2.5 / Qwen2.5-Math (q/k/v biases) and Qwen3's per-head q/k RMSNorm (`qk_norm`). Norms, softmax
and logits run in fp32 whatever the compute dtype; matmuls run in `compute_dtype`.

Positions count from each row's first real token (`attention_mask.cumsum - 1`), so left padding does not change a
row's logits. The same code path serves training (no cache) and the sampler (KV cache, `decode_step`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from twocircuit_jax.config.sections import ModelConfig
from twocircuit_jax.model import attention
from twocircuit_jax.parallel.mesh_context import constrain_rows, embed_lookup

Hook = Callable[[int, jax.Array], tuple]  # (layer, h [B,T,H]) -> (h_new, aux)
_NEG = -1e30  # finite "minus infinity": fully masked rows (padding queries) stay finite


def dtype_of(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def as_computed(dtype, compute_dtype: str):
    """The dtype a weight of `dtype` is read in under `compute_dtype`: every use casts a floating weight to the
    compute dtype first, so a copy in the compute dtype, where that is narrower, gives the same forward."""
    dt = jnp.dtype(dtype_of(compute_dtype))
    floating = jnp.issubdtype(dtype, jnp.floating)
    return dt if floating and jnp.finfo(dtype).bits > jnp.finfo(dt).bits else jnp.dtype(dtype)


def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # HF casts back to the input dtype before the scale multiply; keep the same order for parity.
    return scale.astype(x.dtype) * y.astype(x.dtype)


def rope_tables(positions, head_dim: int, theta: float):
    """cos/sin [B, T, D] for integer positions [B, T] (non-interleaved halves, as HF Qwen2)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    # cos and sin of each angle once, then duplicated (the same table words as taking them of [ang, ang]). The
    # barrier keeps the tables one buffer each: XLA otherwise fused the transcendentals into every consumer and
    # evaluated them again in each layer's q and k rotation, forward and backward (20 sin and 20 cos passes over
    # [B, T, D] in the peers' 4-layer train step). The rotations now read the tables from memory, and XLA may then
    # round their multiply-adds differently in the last bit: a run is not bit-identical to one before this change.
    c, s = jax.lax.optimization_barrier((jnp.cos(ang), jnp.sin(ang)))
    return jnp.concatenate([c, c], axis=-1), jnp.concatenate([s, s], axis=-1)


def apply_rope(x, cos, sin):
    """x [B, T, N, D]."""
    d = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., d:], x[..., :d]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * c + rot.astype(jnp.float32) * s).astype(x.dtype)


def default_positions(attention_mask):
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def _linear(x, p, dt):
    # Tokens flattened to one row axis: a [B, T, H] @ [H, N] dot's weight gradient contracts over two axes (B, T),
    # which XLA:CPU runs through transposed copies; over one axis it is a plain matmul (the backward of the peers'
    # tiny model on 2 cores: 0.21 -> 0.15 s). The reshape is free (row-major) and keeps a batch sharding.
    lead = x.shape[:-1]
    y = x.reshape(-1, x.shape[-1]) @ p["kernel"].astype(dt)
    if "bias" in p:
        y = y + p["bias"].astype(dt)
    return y.reshape(*lead, y.shape[-1])


def _attention(cfg: ModelConfig, lp, x, cos, sin, bias, kv=None, slot=None):
    """Self-attention of one layer. With `kv` (k_cache, v_cache [B, Nkv, S, D]) writes this chunk at `slot`.
    `bias`: the [B, T, S] additive mask (the xla path and decode), or an `attention.KeyMask` (the other kernels)."""
    dt = dtype_of(cfg.compute_dtype)
    B, T, _ = x.shape
    nq, nkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "qkv_proj" in lp:  # decode (split_layers): one dot for the three projections
        q, k, v = jnp.split(_linear(x, lp["qkv_proj"], dt), [nq * D, (nq + nkv) * D], axis=-1)
    else:
        q, k, v = (_linear(x, lp[f"{n}_proj"], dt) for n in "qkv")
    q, k, v = q.reshape(B, T, nq, D), k.reshape(B, T, nkv, D), v.reshape(B, T, nkv, D)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if isinstance(bias, attention.KeyMask):
        return _linear(attention.attend(bias, q, k, v), lp["o_proj"], dt), None
    # keys and values head-major [B, Nkv, S, D], the layout the score and output dots read: the decode cache is
    # kept so, and then no step transposes the whole cache.
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    new_kv = None
    if kv is not None:
        kc = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), slot, axis=2)
        vc = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), slot, axis=2)
        k, v, new_kv = kc, vc, (kc, vc)
    g = nq // nkv
    q = q.reshape(B, T, nkv, g, D)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k.astype(q.dtype)).astype(jnp.float32) / jnp.sqrt(float(D))
    scores = scores + bias[:, None, None, :, :]
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v.astype(dt))  # a plain batched matmul over the cache's layout
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, nq * D)
    return _linear(out, lp["o_proj"], dt), new_kv


def _mlp(cfg, lp, x):
    dt = dtype_of(cfg.compute_dtype)
    if "gate_up_proj" in lp:  # decode (split_layers): one dot for both
        gate, up = jnp.split(_linear(x, lp["gate_up_proj"], dt), 2, axis=-1)
    else:
        gate, up = _linear(x, lp["gate_proj"], dt), _linear(x, lp["up_proj"], dt)
    return _linear(jax.nn.silu(gate) * up, lp["down_proj"], dt)


def _layer(cfg, lp, x, cos, sin, bias, kv=None, slot=None):
    a, new_kv = _attention(cfg, lp, rms_norm(x, lp["input_norm"], cfg.rms_norm_eps), cos, sin, bias, kv, slot)
    x = x + a
    x = x + _mlp(cfg, lp, rms_norm(x, lp["post_norm"], cfg.rms_norm_eps))
    return x, new_kv


def layer_params(params, i: int):
    return jax.tree.map(lambda a: a[i], params["layers"])


def lm_head(cfg, params, x):
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return (x @ w.astype(x.dtype)).astype(jnp.float32)


def embed_tokens(cfg, params, tokens):
    return embed_lookup(params["embed"], tokens).astype(dtype_of(cfg.compute_dtype))


REMAT_POLICIES = {
    "full": None,  # save nothing: the layer's input is kept, everything inside it is recomputed
    # The token-flattened projections and MLP matmuls (_linear: no batch dims) are kept; attention's batched dots,
    # the norms, RoPE and the activation function are recomputed.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def layer_inputs(cfg: ModelConfig, attention_mask, positions):
    """(cos, sin, mask) every decoder layer of a forward reads: the RoPE tables and the attention mask in the form
    the configured kernel takes (the [B, T, T] bias for xla, the [B, T] key mask otherwise)."""
    T = attention_mask.shape[1]
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    impl = attention.resolve(cfg, T)
    if impl == "xla":
        causal = jnp.tril(jnp.ones((T, T), bool))
        allowed = causal[None] & (attention_mask[:, None, :] > 0)
        return cos, sin, jnp.where(allowed, 0.0, _NEG).astype(jnp.float32)
    return cos, sin, attention.KeyMask(attention_mask, impl, cfg.attention_block)


def run_layers(cfg: ModelConfig, layers, x, cos, sin, mask, *, first: int = 0, hook=None, hook_layers=()):
    """x through the stacked `layers` [n, ...] (model layers first .. first + n - 1) with `cfg.remat` per layer;
    `hook(layer, h) -> (h, aux)` after each of `hook_layers` in that range. Returns (x, {layer: aux}).

    scan_layers: each run of layers between hooked layers is one `jax.lax.scan` over its slice of the stack (one
    `lax.split`, whose transpose is one concatenate of the gradients), the hooks are called in Python between the
    runs: the program holds one layer body per run, so compile time grows with the hooks, not the depth. Off: a
    Python loop over the layers (each a separate copy in the program), today's path."""
    n = jax.tree.leaves(layers)[0].shape[0]
    hooked = sorted(i for i in set(hook_layers) if first <= i < first + n) if hook is not None else []

    def one(lp, h):
        return constrain_rows(_layer(cfg, lp, constrain_rows(h), cos, sin, mask)[0])

    if cfg.remat != "none":
        # prevent_cse only matters outside a scan (where XLA could merge the recomputation into the forward)
        one = jax.checkpoint(one, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    aux = {}
    if not cfg.scan_layers:
        for j in range(n):
            x = one(jax.tree.map(lambda a: a[j], layers), x)
            if first + j in hooked:
                x, aux[first + j] = hook(first + j, x)
        return x, aux
    ends = [i - first + 1 for i in hooked if i - first + 1 < n]  # local split points after each hooked layer
    sizes = [b - a for a, b in zip([0] + ends, ends + [n])]
    parts = jax.tree.map(lambda a: jax.lax.split(a, sizes), layers) if len(sizes) > 1 else None
    for s, size in enumerate(sizes):
        seg = jax.tree.map(lambda _, p: p[s], layers, parts) if parts is not None else layers
        x, _ = jax.lax.scan(lambda h, lp: (one(lp, h), None), x, seg)
        last = first + sum(sizes[: s + 1]) - 1
        if last in hooked:
            x, aux[last] = hook(last, x)
    return x, aux


def decoder_with_aux(
    cfg: ModelConfig,
    params,
    tokens,
    attention_mask=None,
    *,
    positions=None,
    hook: Optional[Hook] = None,
    hook_layers: Sequence[int] = (),
):
    """The hidden state leaving the last layer [B, T, H] (compute dtype, before the final norm) and {layer: aux}
    from `hook` applied to the hidden state leaving `hook_layers`. The LM head is the caller's: `lm_head` for whole
    logits, or a chunked head that never holds [B, T, V] (the train passes)."""
    B, T = tokens.shape
    if attention_mask is None:
        attention_mask = jnp.ones((B, T), jnp.int32)
    if positions is None:
        positions = default_positions(attention_mask)
    cos, sin, mask = layer_inputs(cfg, attention_mask, positions)
    x = embed_tokens(cfg, params, tokens)
    return run_layers(cfg, params["layers"], x, cos, sin, mask, hook=hook, hook_layers=hook_layers)


def forward_with_aux(
    cfg: ModelConfig,
    params,
    tokens,
    attention_mask=None,
    *,
    positions=None,
    hook: Optional[Hook] = None,
    hook_layers: Sequence[int] = (),
):
    """Logits [B, T, V] (fp32) and {layer: aux} from `hook` applied to the hidden state leaving `hook_layers`."""
    x, aux = decoder_with_aux(
        cfg, params, tokens, attention_mask, positions=positions, hook=hook, hook_layers=hook_layers
    )
    return lm_head(cfg, params, x), aux


def forward(cfg: ModelConfig, params, tokens, attention_mask=None, *, positions=None, hook=None, hook_layers=()):
    """Logits [B, T, V] in fp32."""
    return forward_with_aux(
        cfg, params, tokens, attention_mask, positions=positions, hook=hook, hook_layers=hook_layers
    )[0]


class KVCache(NamedTuple):
    k: tuple  # L x [B, Nkv, S, D] compute dtype: one buffer a layer, updated in place inside a scan
    v: tuple  # L x [B, Nkv, S, D] compute dtype
    valid: jax.Array  # [B, S] bool: slot holds a real token
    length: jax.Array  # [] int32: slots written so far
    next_pos: jax.Array  # [B] int32: RoPE position of the next token


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    dt = dtype_of(cfg.compute_dtype)
    zeros = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return KVCache(
        zeros,
        zeros,
        jnp.zeros((batch, max_len), bool),
        jnp.zeros((), jnp.int32),
        jnp.zeros((batch,), jnp.int32),
    )


def split_layers(params) -> list:
    """The per-layer parameter dicts of the stacked `params["layers"]`: slice once, outside a decode loop, so each
    step does not copy its weights out of the stack again (XLA:CPU does not hoist those slices)."""
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    return [fuse_decode_layer(layer_params(params, i)) for i in range(n)]


def fuse_decode_layer(lp):
    """A layer's q/k/v and gate/up kernels (and biases) concatenated along their outputs: one dot each per decoded
    token instead of three and two (a tiny model's decode step is dominated by the count of dots). Costs a copy of
    those kernels while a generation runs."""

    def cat(names):
        parts = [lp[n] for n in names]
        return {key: jnp.concatenate([p[key] for p in parts], axis=-1) for key in parts[0]}

    return {**lp, "qkv_proj": cat(("q_proj", "k_proj", "v_proj")), "gate_up_proj": cat(("gate_proj", "up_proj"))}


def decode_step(cfg: ModelConfig, params, cache: KVCache, tokens, token_mask, layers=None, *, last_only=False):
    """Run `tokens` [B, Tq] (with `token_mask` [B, Tq], 1 = real) through the model at the next cache slots.

    Returns (logits [B, Tq, V] fp32, cache'). A prefill is one call with the whole left-padded prompt; each
    generated token is one call with Tq = 1. `layers`: `split_layers(params)`, when the caller has it.
    `last_only`: logits of the last position only ([B, 1, V]): what a prefill samples from; the whole prompt's
    would be Tq x V floats a row (1,024 x 151,936 x 4 B = 622 MB for a Qwen2.5 prompt).
    """
    B, Tq = tokens.shape
    S = cache.valid.shape[1]
    slot = cache.length
    positions = cache.next_pos[:, None] + jnp.cumsum(token_mask.astype(jnp.int32), axis=1) - 1
    positions = jnp.maximum(positions, 0)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, token_mask > 0, slot, axis=1)
    q_slots = slot + jnp.arange(Tq)
    allowed = (jnp.arange(S)[None, :] <= q_slots[:, None])[None] & valid[:, None, :]
    bias = jnp.where(allowed, 0.0, _NEG).astype(jnp.float32)
    x = embed_tokens(cfg, params, tokens)
    layers = split_layers(params) if layers is None else layers
    ks, vs = [], []
    for i in range(cfg.num_layers):
        x, (kc, vc) = _layer(cfg, layers[i], x, cos, sin, bias, (cache.k[i], cache.v[i]), slot)
        ks.append(kc)
        vs.append(vc)
    new = KVCache(
        tuple(ks), tuple(vs), valid, slot + Tq, cache.next_pos + jnp.sum(token_mask.astype(jnp.int32), axis=1)
    )
    return lm_head(cfg, params, x[:, -1:] if last_only else x), new


def param_count(m) -> int:
    """Parameters of a ModelConfig's tree (init_params), from its shapes."""
    H, F, D = m.hidden_size, m.intermediate_size, m.head_dim
    q, kv = m.num_heads * D, m.num_kv_heads * D
    layer = 2 * H + H * q + 2 * H * kv + q * H + 3 * H * F
    layer += (q + 2 * kv) * m.qkv_bias + 2 * D * m.qk_norm
    return m.num_layers * layer + m.vocab_size * H * (1 if m.tie_embeddings else 2) + H


def init_params(cfg: ModelConfig, key, std: float = 0.02):
    """Random parameters (normal(std) matrices, unit norms, zero biases) in `param_dtype`."""
    dt = dtype_of(cfg.param_dtype)
    L, H, V, F = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    nq, nkv, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    keys = iter(jax.random.split(key, 16))

    def mat(*shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    def proj(n_in, n_out, bias):
        p = {"kernel": mat(L, n_in, n_out)}
        if bias:
            p["bias"] = jnp.zeros((L, n_out), dt)
        return p

    layers = {
        "input_norm": jnp.ones((L, H), dt),
        "post_norm": jnp.ones((L, H), dt),
        "q_proj": proj(H, nq, cfg.qkv_bias),
        "k_proj": proj(H, nkv, cfg.qkv_bias),
        "v_proj": proj(H, nkv, cfg.qkv_bias),
        "o_proj": proj(nq, H, False),
        "gate_proj": proj(H, F, False),
        "up_proj": proj(H, F, False),
        "down_proj": proj(F, H, False),
    }
    if cfg.qk_norm:
        layers["q_norm"] = jnp.ones((L, D), dt)
        layers["k_norm"] = jnp.ones((L, D), dt)
    params = {"embed": mat(V, H), "layers": layers, "final_norm": jnp.ones((H,), dt)}
    if not cfg.tie_embeddings:
        params["lm_head"] = mat(H, V)
    return params
