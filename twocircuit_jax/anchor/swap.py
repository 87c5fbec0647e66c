"""Optimizer-state swap (design §4.6, seed 004): overwrite the trainer's Adam moments with the anchor's.

The anchor keeps its own fp32 Adam-style moments of the clean replay gradient (`AnchorMoments`). The swap is a
pure function of the optax state: it finds every `optax.ScaleByAdamState` anywhere in the state tree (inside
chain / inject_hyperparams / masked / MultiSteps / multi_transform states), norm-matches the anchor moments to the
fast ones and blends them in. Weights and the Adam `count` are never touched.

Jitting: `mode` must be static (`jax.jit(swap_optimizer_moments, static_argnames="mode")`); `alpha`, `scale_match`
and the anchor's `fired` count may be traced, so the no-op-before-first-fire case needs no recompile. Every
update is elementwise in the shape of the existing moment, so the result keeps the input shardings.
"""

from __future__ import annotations

from typing import Dict, NamedTuple

import jax
import jax.numpy as jnp
import optax

from twocircuit_jax.anchor.merger import select_targets
from twocircuit_jax.names import path_str

RHO_EPS = 1e-12  # keeps ρ finite when the anchor's first moment is exactly zero
SWAP_MODES = ("anchor_moments", "zero")


class AnchorMoments(NamedTuple):
    m: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]} first moment of G_anchor
    v: Dict[str, jax.Array]  # {target path: fp32 [leaf shape]} second moment of G_anchor
    fired: jax.Array  # int32 [] anchor fires folded in; the swap is the identity while 0


def init_anchor_moments(params, target_scope: str = "all") -> AnchorMoments:
    zeros = {k: jnp.zeros(jnp.shape(x), jnp.float32) for k, x in select_targets(params, target_scope).items()}
    return AnchorMoments(m=zeros, v=dict(zeros), fired=jnp.zeros((), jnp.int32))


def update_anchor_moments(mom: AnchorMoments, g_anchor, beta1=0.8, beta2=0.95) -> AnchorMoments:
    """At a fire: m ← β1·m + (1−β1)·G, v ← β2·v + (1−β2)·G², fp32, no bias correction (the swap norm-matches)."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(g_anchor)[0]}
    missing = sorted(set(mom.m) - set(flat))
    if missing:
        raise KeyError(f"anchor gradient lacks moment targets {missing[:4]}")
    b1, b2 = jnp.float32(beta1), jnp.float32(beta2)
    g = {k: jnp.asarray(flat[k], jnp.float32) for k in mom.m}
    return AnchorMoments(
        m={k: b1 * mom.m[k] + (1 - b1) * g[k] for k in mom.m},
        v={k: b2 * mom.v[k] + (1 - b2) * jnp.square(g[k]) for k in mom.m},
        fired=mom.fired + 1,
    )


def all_finite(tree) -> jax.Array:
    """bool []: every floating leaf of `tree` is finite (integer leaves always are). One reduction per leaf."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    ok = jnp.ones((), bool)
    for x in leaves:
        ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def _is_adam(x) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


def _norm(x):
    return jnp.sqrt(jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))))


def _swap_adam(st: optax.ScaleByAdamState, mom: AnchorMoments, kappa, scale_match, mode, applied, rhos, oks):
    mu_flat, treedef = jax.tree_util.tree_flatten_with_path(st.mu)
    nu_leaves = jax.tree_util.tree_leaves(st.nu)
    if len(nu_leaves) != len(mu_flat):
        raise ValueError("Adam mu and nu have different structures; cannot swap")
    new_mu, new_nu = [], []
    for (path, mu), nu in zip(mu_flat, nu_leaves):
        name = path_str(path)
        if name not in mom.m:  # not a target (or masked out): keep as is
            new_mu.append(mu)
            new_nu.append(nu)
            continue
        ma, va = mom.m[name], mom.v[name]
        if ma.shape != mu.shape:
            raise ValueError(f"anchor moment {name} has shape {ma.shape}, Adam mu has {mu.shape}")
        mu32, nu32 = jnp.asarray(mu, jnp.float32), jnp.asarray(nu, jnp.float32)
        if mode == "zero":
            mu_t, nu_t = jnp.zeros_like(mu32), jnp.zeros_like(nu32)
        else:
            rho = jnp.where(scale_match, _norm(mu32) / (_norm(ma) + RHO_EPS), 1.0)
            rhos.append(rho)
            mu_t, nu_t = rho * ma, jnp.maximum(jnp.square(rho) * va, 0.0)
        mu_b = (1 - kappa) * mu32 + kappa * mu_t
        nu_b = (1 - kappa) * nu32 + kappa * nu_t
        oks.append(all_finite((mu_b, nu_b)))
        # jnp.where (not arithmetic) so κ=0 and "never fired" are exact bitwise identities.
        new_mu.append(jnp.where(applied, mu_b.astype(mu.dtype), mu))
        new_nu.append(jnp.where(applied, nu_b.astype(nu.dtype), nu))
    mu_t = jax.tree_util.tree_unflatten(treedef, new_mu)
    nu_t = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(st.nu), new_nu)
    return st._replace(mu=mu_t, nu=nu_t)


def swap_optimizer_moments(
    opt_state, anchor_moments: AnchorMoments, *, alpha=1.0, scale_match=True, mode: str = "anchor_moments"
):
    """(opt_state′, metrics): μ ← (1−κ)μ + κρm_a, ν ← (1−κ)ν + κ·max(ρ²v_a, 0) per target, κ = alpha,
    ρ = ‖μ‖₂/(‖m_a‖₂ + 1e-12) over the whole tensor (1 without scale_match). mode='zero' blends toward zero
    moments instead (κ=1 zeroes both). Identity while the anchor has never fired, and when any blended target moment
    would be non-finite (`swap/skipped` = 1 then)."""
    if mode not in SWAP_MODES:
        raise ValueError(f"swap mode must be one of {SWAP_MODES}, got {mode!r}")
    kappa = jnp.asarray(alpha, jnp.float32)
    due = (jnp.asarray(anchor_moments.fired) > 0) & (kappa > 0)
    rhos, found, oks = [], [], []

    def visit(node, applied):
        if not _is_adam(node):
            return node
        found.append(1)
        return _swap_adam(node, anchor_moments, kappa, scale_match, mode, applied, rhos, oks)

    # Two passes over the (cheap, elementwise) blend: the first only to learn whether every blended target moment
    # is finite; a swap that would write a NaN/inf into AdamW is skipped whole (`swap/skipped`), never applied.
    jax.tree_util.tree_map(lambda n: visit(n, due), opt_state, is_leaf=_is_adam)
    finite = jnp.ones((), bool)
    for ok in oks:
        finite = finite & ok
    applied = due & finite
    rhos, found, oks = [], [], []
    new_state = jax.tree_util.tree_map(lambda n: visit(n, applied), opt_state, is_leaf=_is_adam)
    if not found:
        raise ValueError(
            "no optax ScaleByAdamState (mu, nu, count) found in the optimizer state; "
            "the swap needs an Adam-family optimizer such as optax.adamw"
        )
    rho_mean = (sum(rhos) / len(rhos)) if rhos else jnp.ones((), jnp.float32)
    metrics = {
        "swap/rho": jnp.asarray(rho_mean, jnp.float32),
        "swap/applied": applied.astype(jnp.float32),
        "swap/skipped": (due & ~finite).astype(jnp.int32),  # due but non-finite: the opt state was left as it was
    }
    return new_state, metrics
