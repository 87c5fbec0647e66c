"""Merger (design §4.4): the EMA M of anchor gradients and the rules that let M correct the fast gradient G.

Optax shape: `init_merger` builds the merger's own state (`SignedEmaState`, `SignedGateState`, `BlendState`,
`DelayedEfState`), `update_ema` folds a fresh anchor gradient into M on a fire, `merge` rewrites G before clipping.
All three are pure and jittable; the config (the merger section `anchor.merger`) is static, `is_fire_tick` may be
traced; `merger_shardings` places the state like the parameters. The caller decides when to call `merge` (every
`anchor.merger.cadence` ticks); `age` counts `merge` calls since the last fire tick, which equals ticks at the
default cadence of 1.

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
# One state type per merger (optax style): each holds only what its rule reads. Shared fields keep one meaning:
#   m                 {target path: fp32 [leaf shape]} EMA of anchor gradients, 0 before any fire
#   fired             int32 [] number of fires folded into M (M exists iff > 0)
#   age               int32 [] merge calls since the last fire tick (0 on the fire tick)
#   cold_m_fallbacks  int32 [] target tensors that fell back to G because ‖M‖ <= 1e-12
class SignedEmaState(NamedTuple):
    m: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]}
    fired: jax.Array  # int32 []
    age: jax.Array  # int32 []
    cold_m_fallbacks: jax.Array  # int32 []


class SignedGateState(NamedTuple):
    m: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]}
    fired: jax.Array  # int32 []
    omega: jax.Array  # fp32 [] learned gate ω (ω₀ = 0): sign agreement of successive anchor gradients
    age: jax.Array  # int32 []
    cold_m_fallbacks: jax.Array  # int32 []


class BlendState(NamedTuple):
    m: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]}
    fired: jax.Array  # int32 []
    age: jax.Array  # int32 []
    cold_m_fallbacks: jax.Array  # int32 []


class DelayedEfState(NamedTuple):
    m: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]}
    delta: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]} δ = M − G(fire tick), decayed while held
    fired: jax.Array  # int32 []
    age: jax.Array  # int32 []
    cold_m_fallbacks: jax.Array  # int32 []


STATES = {
    "signed_ema": SignedEmaState,
    "signed_gate": SignedGateState,
    "blend": BlendState,
    "delayed_ef": DelayedEfState,
}


def merger_type(cfg) -> str:
    """The merger's `type:` name of a merger section (config/anchor.py)."""
    from twocircuit_jax.config.anchor import MergerConfig
    from twocircuit_jax.config.base import type_name

    return type_name(MergerConfig, cfg)


def init_merger(params, cfg, target_scope: str = "all"):
    """Zero state of the merger section `cfg` (config/anchor.py) over the `target_scope` leaves of `params`."""
    mode = merger_type(cfg)
    if mode not in STATES:
        raise ValueError(f"anchor.merger.type {mode!r} keeps no state; allowed: {sorted(STATES)}")
    zeros = {k: jnp.zeros(jnp.shape(x), jnp.float32) for k, x in select_targets(params, target_scope).items()}
    fields = {
        "m": zeros,
        "delta": dict(zeros),
        "fired": jnp.zeros((), jnp.int32),
        "omega": jnp.zeros((), jnp.float32),
        "age": jnp.zeros((), jnp.int32),
        "cold_m_fallbacks": jnp.zeros((), jnp.int32),
    }
    cls = STATES[mode]
    return cls(**{k: fields[k] for k in cls._fields})


def merger_shardings(state, param_shardings):
    """Where the merger state lives: M and δ (fp32, one per target leaf) sharded like their parameter, so with fsdp
    each device holds 1/fsdp of them (Qwen2.5-1.5B decoder targets: 5.2 GB fp32 replicated); the scalars
    replicated. `state` may be shapes (jax.eval_shape of `init_merger`); `param_shardings` is the params' pytree
    of NamedShardings."""
    flat = jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    by_path = {path_str(p): s for p, s in flat}
    rep = NamedSharding(flat[0][1].mesh, PartitionSpec())
    return type(state)(*({k: by_path[k] for k in v} if isinstance(v, dict) else rep for v in state))


def _anchor_targets(state, g_anchor) -> Dict[str, jax.Array]:
    """Pick M's targets out of a params-shaped gradient (or a {path: leaf} dict); a missing target is an error."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(g_anchor)[0]}
    missing = sorted(set(state.m) - set(flat))
    if missing:
        raise KeyError(f"anchor gradient lacks merger targets {missing[:4]}")
    return {k: flat[k] for k in state.m}


def update_ema(state, g_anchor, cfg):
    """On a fire: M ← β_anc·M + (1−β_anc)·G_anchor in fp32; signed_gate also refreshes ω from M_old vs G_anchor.
    `cfg` is the merger section (config/anchor.py)."""
    beta = jnp.float32(cfg.beta_anc)
    ga = {k: _f32(x) for k, x in _anchor_targets(state, g_anchor).items()}
    m_new = {k: beta * state.m[k] + (1.0 - beta) * ga[k] for k in state.m}
    new = state._replace(m=m_new, fired=state.fired + 1)
    if isinstance(state, SignedGateState) and state.m:
        # Agreement of the old EMA's signs with the fresh anchor gradient, averaged over every target element.
        agree = sum(jnp.sum(jnp.sign(state.m[k]) * jnp.sign(ga[k])) for k in state.m)
        count = sum(int(state.m[k].size) for k in state.m)
        omega = 0.5 * state.omega + 0.5 * jnp.clip(agree / max(count, 1), 0.0, 1.0)
        new = new._replace(omega=jnp.asarray(omega, jnp.float32))
    return new


# ------------------------------------------------------------------------------------------------------ merge
def _signed(g, m, alpha):
    return alpha * g + (1.0 - alpha) * jnp.abs(g) * jnp.sign(m)


def merge(state, g, cfg, is_fire_tick):
    """Rewrite the fast gradient G (params pytree) with M. Returns (G′, state′, metrics); G′ = G until M exists.
    `cfg` is the merger section (config/anchor.py); its type picks the rule and must match the state's."""
    mode = merger_type(cfg)
    if mode == "none":
        return g, state, {}
    if type(state) is not STATES[mode]:
        raise TypeError(f"merger {mode} got a {type(state).__name__}; expected {STATES[mode].__name__}")
    fire = jnp.asarray(is_fire_tick, bool)
    ready = state.fired > 0
    age = jnp.where(fire, 0, state.age)
    if mode == "signed_gate":
        w = state.omega * jnp.float32(cfg.decay) ** age.astype(jnp.float32)
    if mode == "delayed_ef":
        ef_coef = jnp.float32(cfg.weight) * jnp.float32(cfg.decay) ** age.astype(jnp.float32)

    flat, treedef = jax.tree_util.tree_flatten_with_path(g)
    names = [path_str(p) for p, _ in flat]
    missing = sorted(set(state.m) - set(names))
    if missing:
        raise KeyError(f"gradient lacks merger targets {missing[:4]}")
    out, rel, delta_new, cold = [], {}, dict(getattr(state, "delta", {})), jnp.zeros((), jnp.int32)
    for name, (_, leaf) in zip(names, flat):
        if name not in state.m:
            out.append(leaf)
            continue
        gf, m = _f32(leaf), state.m[name]
        m_norm = _norm(m)
        is_cold = m_norm <= COLD_M_EPS
        if mode == "signed_ema":
            new = _signed(gf, m, jnp.float32(cfg.alpha))
        elif mode == "signed_gate":
            # Fire tick: the full signed rule (w = 1); held ticks: the decayed learned gate.
            wt = jnp.where(fire, 1.0, w)
            new = (1.0 - wt) * gf + wt * _signed(gf, m, jnp.float32(cfg.alpha))
        elif mode == "blend":
            eta = jnp.float32(cfg.eta)
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

    new_state = state._replace(age=age + 1, cold_m_fallbacks=state.cold_m_fallbacks + cold)
    if mode == "delayed_ef":
        new_state = new_state._replace(delta=delta_new)
    metrics = {f"merger/rel_change/{k}": v for k, v in rel.items()}
    metrics["merger/rel_change"] = (sum(rel.values()) / len(rel)) if rel else jnp.zeros((), jnp.float32)
    metrics["merger/applied"] = ready.astype(jnp.float32)
    metrics["merger/coldM_fallbacks"] = new_state.cold_m_fallbacks
    if mode == "signed_gate":
        metrics["merger/gate_w"] = jnp.where(fire, 1.0, w)
        metrics["merger/omega"] = state.omega
    return jax.tree_util.tree_unflatten(treedef, out), new_state, metrics
