"""The `lowrank` activation codec (design §3.3): per boundary an orthonormal basis Q [H, r] and block power iteration.

Wire model: the sender transmits Y = M·Q (N×r, activation dtype) and the receiver rebuilds M̂ = Y·Qᵀ. Q is fp32,
stop-gradient and replicated, so autodiff sends the backward message grad·QQᵀ through the same projector (no
straight-through estimator).

Basis life cycle, all pure (optax shape, no module state):
  hook(layer, h) -> (M̂, aux)                  aux["sketch"] = Mᵀ(M·Q_start) fp32, an output, never a side effect,
                                               so `jax.checkpoint` rematerialisation cannot double-count it
  accumulate_sketch(state, aux_by_layer)        V += sketch (per tick / mini-batch)
  refresh_basis(state, cfg, axis_name)          psum V over dp, Q_next = orth(V), clear V, stage Q_next
  activate_staged(state)                        after the step's last mini-batch (design §2 step 5)
No forward inside a step sees a new basis: `Q` changes only in `activate_staged`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lowrank import check_can_run, lowrank_reference, project_reconstruct
from pallas_kernels.sharding import shard_rows
from twocircuit_jax.fast.orth import orth

F32 = jnp.float32


class LowRankState(NamedTuple):
    Q: dict  # boundary layer (int) -> [H, r] f32, the active basis (codec uses it)
    Q_next: dict  # boundary -> [H, r] f32, the staged basis (meaningful while `staged`)
    Q_start: dict  # boundary -> [H, r] f32, power-iteration start the sketch multiplies (warm: newest Q)
    Q_init: dict  # boundary -> [H, r] f32, Q₀ from the host seed (re-seed target when warm_start=false)
    sketch: dict  # boundary -> [H, r] f32, running V = Σ Mᵀ(M·Q_start) since the last refresh
    sketch_tokens: jax.Array  # [] f32, real tokens summed into `sketch` (per boundary, same for all)
    staged: jax.Array  # [] bool, a staged basis awaits activation
    q_updates: jax.Array  # [] int32, refreshes that staged a basis
    q_activations: jax.Array  # [] int32, staged bases made active
    q_stage_overwrites: jax.Array  # [] int32, stages that replaced an unactivated stage


def host_seed(seed: int, layer: int) -> int:
    """design §3.3 host seed of Q₀ for one boundary."""
    return (int(seed) * 1_000_003 + int(layer) * 7_919) & 0x7FFFFFFF


def frame_key(seed: int, layer: int) -> jax.Array:
    """Key of orth's refill frame for one boundary: fixed, hence identical on every replica."""
    return jax.random.PRNGKey(host_seed(seed, layer) ^ 0x2545F491)


def initial_basis(seed: int, layer: int, hidden: int, rank: int, eps: float = 1e-6) -> jax.Array:
    """Q₀ = orth(standard normal H×r) drawn with numpy on host from `host_seed` (cost: one H×r draw, once)."""
    if not 1 <= rank <= hidden:
        raise ValueError(f"lowrank: rank must be in [1, hidden={hidden}]; got {rank}")
    draw = np.random.default_rng(host_seed(seed, layer)).standard_normal((hidden, rank))
    return orth(jnp.asarray(draw, F32), eps, frame_key(seed, layer))


def init_lowrank(cfg, hidden: int, boundaries: Sequence[int]) -> LowRankState:
    """State for `cfg` (a FastConfig: rank, seed, reortho_eps) at the given boundary layers."""
    Q0 = {int(b): initial_basis(cfg.seed, b, hidden, cfg.rank, cfg.reortho_eps) for b in boundaries}
    zeros = {b: jnp.zeros_like(q) for b, q in Q0.items()}
    i0 = jnp.zeros((), jnp.int32)
    return LowRankState(
        Q=Q0,
        Q_next=dict(Q0),
        Q_start=dict(Q0),
        Q_init=dict(Q0),
        sketch=zeros,
        sketch_tokens=jnp.zeros((), F32),
        staged=jnp.zeros((), bool),
        q_updates=i0,
        q_activations=i0,
        q_stage_overwrites=i0,
    )


def _codec(h2d, Q, use_kernel: bool, interpret: bool, mesh=None):
    if use_kernel:
        return shard_rows(lambda m, q: project_reconstruct(m, q, interpret=interpret), mesh, n_row_args=1)(h2d, Q)
    return lowrank_reference(h2d, Q)[1]


def make_lowrank_hook(
    state: LowRankState,
    boundaries: Sequence[int],
    sketch: bool,
    *,
    attention_mask: Optional[jax.Array] = None,
    encode: bool = True,
    use_kernel: bool = False,
    interpret: bool = False,
    cfg=None,
    mesh=None,
):
    """Boundary hook `hook(layer, h [B, T, H]) -> (h_new, aux)`.

    encode=True: h_new = M̂ (the codec view); encode=False: h passes unchanged (the anchor's dense forward that
    only sketches). aux = {"sketch": [H, r] f32 (zeros when sketch=False), "tokens": [] f32 real tokens,
    "recon_rel_err": [] f32 ‖M − M̂‖_F/‖M‖_F over real tokens}. attention_mask [B, T] (1 = real) keeps padding
    out of the sketch and the error. Layers not in `boundaries` raise: a silent identity would hide a wiring bug.
    cfg (a FastConfig), when given, supplies use_kernel (`fast.use_kernel`). The Pallas kernel on CPU needs
    interpret=True, otherwise this raises (never a silent fallback to the jnp path).
    """
    if cfg is not None:
        use_kernel = bool(cfg.use_kernel)
    bset = {int(b) for b in boundaries}
    missing = bset - set(state.Q)
    if missing:
        raise ValueError(f"lowrank hook: no basis for boundaries {sorted(missing)}; state has {sorted(state.Q)}")
    if use_kernel:
        check_can_run(interpret, "lowrank codec (fast.use_kernel=true)")

    def hook(layer, h):
        layer = int(layer)
        if layer not in bset:
            raise ValueError(f"lowrank hook called at layer {layer}, not a boundary {sorted(bset)}")
        Q = jax.lax.stop_gradient(state.Q[layer])
        B, T, H = h.shape
        h2d = h.reshape(B * T, H)
        Mh = _codec(h2d, Q, use_kernel, interpret, mesh).reshape(B, T, H)
        # Diagnostics and sketch in fp32, outside the gradient path (cost: one extra N×H×r product for the sketch).
        M = jax.lax.stop_gradient(h).astype(F32)
        w = jnp.ones((B, T), F32) if attention_mask is None else attention_mask.astype(F32)
        Mw = M * w[..., None]
        diff = Mw - jax.lax.stop_gradient(Mh).astype(F32) * w[..., None]
        err = jnp.sqrt(jnp.sum(diff**2)) / jnp.maximum(jnp.sqrt(jnp.sum(Mw**2)), 1e-30)
        if sketch:
            M2 = Mw.reshape(B * T, H)
            S = M2.T @ (M2 @ jax.lax.stop_gradient(state.Q_start[layer]))
        else:
            S = jnp.zeros_like(Q)
        aux = {"sketch": S, "tokens": jnp.sum(w), "recon_rel_err": err}
        return (Mh if encode else h), aux

    return hook


def accumulate_sketch(state: LowRankState, aux_by_layer: dict) -> LowRankState:
    """V += aux sketch for every boundary in aux_by_layer ({layer: aux} as `forward_with_aux` returns it)."""
    sk = dict(state.sketch)
    tokens = state.sketch_tokens
    for i, (layer, aux) in enumerate(sorted(aux_by_layer.items())):
        sk[int(layer)] = sk[int(layer)] + aux["sketch"].astype(F32)
        if i == 0:
            tokens = tokens + aux["tokens"].astype(F32)
    return state._replace(sketch=sk, sketch_tokens=tokens)


def stage(state: LowRankState, Q_new: dict) -> LowRankState:
    """Stage a new basis; it becomes active only in `activate_staged`. Replacing an unactivated stage is counted."""
    return state._replace(
        Q_next={b: Q_new[b] for b in state.Q},
        staged=jnp.ones((), bool),
        q_updates=state.q_updates + 1,
        q_stage_overwrites=state.q_stage_overwrites + state.staged.astype(jnp.int32),
    )


def activate_staged(state: LowRankState) -> LowRankState:
    """Make the staged basis active (call after the step's last mini-batch); a no-op without a stage."""
    s = state.staged
    Q = {b: jnp.where(s, state.Q_next[b], q) for b, q in state.Q.items()}
    return state._replace(Q=Q, staged=jnp.zeros((), bool), q_activations=state.q_activations + s.astype(jnp.int32))


def refresh_basis(state: LowRankState, cfg, axis_name: Optional[str] = None) -> LowRankState:
    """One block power-iteration step from the accumulated sketch, staged (not active).

    With axis_name (inside shard_map / pmap) and cfg.sync_basis, V is summed over that axis first, in sorted
    boundary order, so every replica orthonormalises the same V and gets the same Q. A sketch that saw no tokens
    leaves the state unchanged (orth(0) would stage a random frame). Clears V; the next start is the new Q
    (cfg.warm_start) or Q₀ again.
    """
    layers = sorted(state.Q)
    V = {b: state.sketch[b] for b in layers}
    tokens = state.sketch_tokens
    if axis_name is not None and cfg.sync_basis:
        V, tokens = jax.lax.psum((V, tokens), axis_name)
    Q_new = {b: orth(V[b], cfg.reortho_eps, frame_key(cfg.seed, b)) for b in layers}
    nxt = stage(state, Q_new)
    nxt = nxt._replace(
        sketch={b: jnp.zeros_like(v) for b, v in state.sketch.items()},
        sketch_tokens=jnp.zeros((), F32),
        Q_start=dict(Q_new) if cfg.warm_start else dict(state.Q_init),
    )
    have = tokens > 0
    return jax.tree.map(lambda new, old: jnp.where(have, new, old), nxt, state)


def refresh_due(cfg, step: int) -> bool:
    """Fast-owned basis refreshes every `update_cadence` steps (design §2 step 5)."""
    return step % cfg.update_cadence == 0


def basis_cond(Q: jax.Array) -> jax.Array:
    """σmax/σmin of Q [H, r] (1 for an orthonormal basis); inf when σmin <= 1e-6."""
    s = jnp.linalg.svd(Q.astype(F32), compute_uv=False)
    return jnp.where(s[-1] <= 1e-6, jnp.inf, s[0] / jnp.maximum(s[-1], 1e-30))


def lowrank_metrics(state: LowRankState, aux_by_layer: Optional[dict] = None) -> dict:
    """Codec health: worst basis condition over boundaries, counters, mean reconstruction error if aux given."""
    m = {
        "codec/basis_cond": jnp.max(jnp.stack([basis_cond(state.Q[b]) for b in sorted(state.Q)])),
        "codec/q_updates": state.q_updates,
        "codec/q_activations": state.q_activations,
        "codec/q_stage_overwrites": state.q_stage_overwrites,
    }
    if aux_by_layer:
        m["codec/recon_rel_err"] = jnp.mean(jnp.stack([aux_by_layer[b]["recon_rel_err"] for b in sorted(aux_by_layer)]))
    return m
