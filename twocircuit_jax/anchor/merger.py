"""Merger (design §4.4): the EMA M of anchor gradients and the rules that let M correct the fast gradient G.

Optax shape: `init_merger` builds a `MergerState`, `update_ema` folds a fresh anchor gradient into M on a fire,
`merge` rewrites G before clipping. All three are pure and jittable; the config (`AnchorConfig`) is static,
`is_fire_tick` may be traced; `merger_shardings` places the state like the parameters. The caller decides when to call `merge` (every `merger_cadence` ticks); `age`
counts `merge` calls since the last fire tick, which equals ticks at the default cadence of 1.

M, δ and the per-target state are dicts keyed by the '/'-joined parameter path of each *target* leaf, so
`target_scope='decoder'` holds no memory for embeddings or norms; non-target leaves of G pass through untouched.
"""

from __future__ import annotations

import re
from typing import Any, Dict, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from twocircuit_jax.names import path_str

COLD_M_EPS = 1e-12  # ‖M‖ at or below this has no usable direction (design §4.4 cold-M guard)
MERGERS = ("signed_ema", "signed_gate", "delayed_ef", "blend", "none")
_DECODER_RE = re.compile(r"(^|/)layers/(q|k|v|o|gate|up|down)_proj/kernel$")


# ----------------------------------------------------------------------------------------------- target leaves
def is_target(name: str, leaf, target_scope: str) -> bool:
    """design §4.3 target_scope: every floating tensor ('all') or the seven decoder projection kernels ('decoder')."""
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
        return False
    if target_scope == "all":
        return True
    if target_scope == "decoder":
        return bool(_DECODER_RE.search(name))
    raise ValueError(f"target_scope must be 'all' or 'decoder', got {target_scope!r}")


def select_targets(tree, target_scope: str = "all") -> Dict[str, Any]:
    """{path: leaf} for the target leaves of `tree` (sorted by path, the fixed order design §8.8 asks for)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {path_str(p): x for p, x in flat if is_target(path_str(p), x, target_scope)}
    return dict(sorted(out.items()))


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _norm(x):
    return jnp.sqrt(jnp.sum(jnp.square(_f32(x))))


# ------------------------------------------------------------------------------------------------------ state
class MergerState(NamedTuple):
    m: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]} EMA of anchor gradients, 0 before any fire
    delta: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]} delayed_ef δ = M − G(fire tick); {} otherwise
    fired: jax.Array  # int32 [] number of fires folded into M (M exists iff > 0)
    omega: jax.Array  # fp32 [] learned gate ω of signed_gate (ω₀ = 0)
    age: jax.Array  # int32 [] merge calls since the last fire tick (0 on the fire tick)
    cold_m_fallbacks: jax.Array  # int32 [] target tensors that fell back to G because ‖M‖ <= 1e-12


def init_merger(params, cfg=None) -> MergerState:
    """Zero state; `cfg` (AnchorConfig) picks the target scope and whether δ is allocated (delayed_ef only)."""
    scope = getattr(cfg, "target_scope", "all")
    mode = getattr(cfg, "merger", "signed_ema")
    zeros = {k: jnp.zeros(jnp.shape(x), jnp.float32) for k, x in select_targets(params, scope).items()}
    delta = dict(zeros) if mode == "delayed_ef" else {}
    return MergerState(
        m=zeros,
        delta=delta,
        fired=jnp.zeros((), jnp.int32),
        omega=jnp.zeros((), jnp.float32),
        age=jnp.zeros((), jnp.int32),
        cold_m_fallbacks=jnp.zeros((), jnp.int32),
    )


def merger_shardings(state: MergerState, param_shardings) -> MergerState:
    """Where the merger state lives: M and δ (fp32, one per target leaf) sharded like their parameter, so with fsdp
    each device holds 1/fsdp of them (Qwen2.5-1.5B decoder targets: 5.2 GB fp32 replicated); the scalars
    replicated. `state` may be shapes (jax.eval_shape of `init_merger`); `param_shardings` is the params' pytree
    of NamedShardings."""
    flat = jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    by_path = {path_str(p): s for p, s in flat}
    rep = NamedSharding(flat[0][1].mesh, PartitionSpec())
    return MergerState(
        m={k: by_path[k] for k in state.m},
        delta={k: by_path[k] for k in state.delta},
        fired=rep,
        omega=rep,
        age=rep,
        cold_m_fallbacks=rep,
    )


def _anchor_targets(state: MergerState, g_anchor) -> Dict[str, jax.Array]:
    """Pick M's targets out of a params-shaped gradient (or a {path: leaf} dict); a missing target is an error."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(g_anchor)[0]}
    missing = sorted(set(state.m) - set(flat))
    if missing:
        raise KeyError(f"anchor gradient lacks merger targets {missing[:4]}")
    return {k: flat[k] for k in state.m}


def update_ema(state: MergerState, g_anchor, cfg) -> MergerState:
    """On a fire: M ← β_anc·M + (1−β_anc)·G_anchor in fp32; signed_gate also refreshes ω from M_old vs G_anchor."""
    beta = jnp.float32(cfg.beta_anc)
    ga = {k: _f32(x) for k, x in _anchor_targets(state, g_anchor).items()}
    m_new = {k: beta * state.m[k] + (1.0 - beta) * ga[k] for k in state.m}
    omega = state.omega
    if cfg.merger == "signed_gate" and state.m:
        # Agreement of the old EMA's signs with the fresh anchor gradient, averaged over every target element.
        agree = sum(jnp.sum(jnp.sign(state.m[k]) * jnp.sign(ga[k])) for k in state.m)
        count = sum(int(state.m[k].size) for k in state.m)
        omega = 0.5 * omega + 0.5 * jnp.clip(agree / max(count, 1), 0.0, 1.0)
    return state._replace(m=m_new, fired=state.fired + 1, omega=jnp.asarray(omega, jnp.float32))


# ------------------------------------------------------------------------------------------------------ merge
def _signed(g, m, alpha):
    return alpha * g + (1.0 - alpha) * jnp.abs(g) * jnp.sign(m)


def merge(state: MergerState, g, cfg, is_fire_tick):
    """Rewrite the fast gradient G (params pytree) with M. Returns (G′, state′, metrics); G′ = G until M exists."""
    mode = cfg.merger
    if mode not in MERGERS:
        raise ValueError(f"anchor.merger must be one of {MERGERS}, got {mode!r}")
    if mode == "none":
        return g, state, {}
    fire = jnp.asarray(is_fire_tick, bool)
    ready = state.fired > 0
    age = jnp.where(fire, 0, state.age)
    alpha = jnp.float32(cfg.alpha)
    w = state.omega * jnp.float32(cfg.gate_decay) ** age.astype(jnp.float32)
    ef_coef = jnp.float32(cfg.ef_lambda) * jnp.float32(cfg.ef_decay) ** age.astype(jnp.float32)

    flat, treedef = jax.tree_util.tree_flatten_with_path(g)
    names = [path_str(p) for p, _ in flat]
    missing = sorted(set(state.m) - set(names))
    if missing:
        raise KeyError(f"gradient lacks merger targets {missing[:4]}")
    out, rel, delta_new, cold = [], {}, dict(state.delta), jnp.zeros((), jnp.int32)
    for name, (_, leaf) in zip(names, flat):
        if name not in state.m:
            out.append(leaf)
            continue
        gf, m = _f32(leaf), state.m[name]
        m_norm = _norm(m)
        is_cold = m_norm <= COLD_M_EPS
        if mode == "signed_ema":
            new = _signed(gf, m, alpha)
        elif mode == "signed_gate":
            # Fire tick: the full signed rule (w = 1); held ticks: the decayed learned gate.
            wt = jnp.where(fire, 1.0, w)
            new = (1.0 - wt) * gf + wt * _signed(gf, m, alpha)
        elif mode == "blend":
            eta = jnp.float32(cfg.blend_eta)
            scale = _norm(gf) / jnp.where(is_cold, 1.0, m_norm)
            new = (1.0 - eta) * gf + eta * scale * m
        else:  # delayed_ef: δ is the anchor-minus-fast gap measured on the fire tick, decayed while held
            d = jnp.where(fire & ready, m - gf, state.delta[name])
            delta_new[name] = d
            new = gf + ef_coef * d
            is_cold = jnp.zeros((), bool)  # δ needs no direction from M
        use = ready & ~is_cold
        cold = cold + (ready & is_cold).astype(jnp.int32)
        g_new = jnp.where(use, new.astype(leaf.dtype), leaf)
        g_norm = _norm(leaf)
        rel[name] = jnp.where(g_norm > 0, _norm(_f32(g_new) - gf) / jnp.where(g_norm > 0, g_norm, 1.0), 0.0)
        out.append(g_new)

    new_state = state._replace(delta=delta_new, age=age + 1, cold_m_fallbacks=state.cold_m_fallbacks + cold)
    metrics = {f"merger/rel_change/{k}": v for k, v in rel.items()}
    metrics["merger/rel_change"] = (sum(rel.values()) / len(rel)) if rel else jnp.zeros((), jnp.float32)
    metrics["merger/applied"] = ready.astype(jnp.float32)
    metrics["merger/coldM_fallbacks"] = new_state.cold_m_fallbacks
    if mode == "signed_gate":
        metrics["merger/gate_w"] = jnp.where(fire, 1.0, w)
        metrics["merger/omega"] = state.omega
    return jax.tree_util.tree_unflatten(treedef, out), new_state, metrics
