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
`LowRankCodec` (bottom) is the registered codec, `LowRankConfig` its `fast.codec` section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lowrank import check_can_run, lowrank_reference, project_reconstruct
from pallas_kernels.sharding import shard_rows
from twocircuit_jax.config.base import doc, require
from twocircuit_jax.config.sections import ActivationCodecConfig
from twocircuit_jax.fast.codecs.base import TRAIN, ActivationCodec, register_activation, row_sum, wire_result
from twocircuit_jax.fast.orth import orth
from twocircuit_jax.parallel import dispatch
from twocircuit_jax.parallel.wire import Wire

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
    """State for `cfg` (a LowRankConfig: rank, seed, reortho_eps) at the given boundary layers."""
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


def _codec(h2d, Q, use_kernel: bool, interpret: bool, mesh=None, platform=None):
    if use_kernel:
        kernel = lambda m, q: project_reconstruct(m, q, interpret=interpret, platform=platform)  # noqa: E731
        return shard_rows(kernel, mesh, n_row_args=1)(h2d, Q)
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
    platform=None,
):
    """Boundary hook `hook(layer, h [B, T, H]) -> (h_new, aux)`.

    encode=True: h_new = M̂ (the codec view); encode=False: h passes unchanged (the anchor's dense forward that
    only sketches). aux = {"sketch": [H, r] f32 (zeros when sketch=False), "tokens": [] f32 real tokens,
    "recon_rel_err": [] f32 ‖M − M̂‖_F/‖M‖_F over real tokens}. attention_mask [B, T] (1 = real) keeps padding
    out of the sketch and the error. Layers not in `boundaries` raise: a silent identity would hide a wiring bug.
    cfg (a LowRankConfig), when given, supplies use_kernel (`fast.codec.use_kernel`). The Pallas kernel on CPU needs
    interpret=True (or an explicit lowering `platform`, export only), otherwise this raises (never a silent fallback
    to the jnp path).
    """
    if cfg is not None:
        use_kernel = bool(cfg.use_kernel)
    bset = {int(b) for b in boundaries}
    missing = bset - set(state.Q)
    if missing:
        raise ValueError(f"lowrank hook: no basis for boundaries {sorted(missing)}; state has {sorted(state.Q)}")
    if use_kernel:
        check_can_run(interpret, "lowrank codec (fast.codec.use_kernel=true)", platform)

    def hook(layer, h):
        layer = int(layer)
        if layer not in bset:
            raise ValueError(f"lowrank hook called at layer {layer}, not a boundary {sorted(bset)}")
        Q = jax.lax.stop_gradient(state.Q[layer])
        B, T, H = h.shape
        h2d = h.reshape(B * T, H)
        Mh = _codec(h2d, Q, use_kernel, interpret, mesh, platform).reshape(B, T, H)
        # Diagnostics and sketch in fp32, outside the gradient path (cost: one extra N×H×r product for the sketch).
        M = jax.lax.stop_gradient(h).astype(F32)
        w = jnp.ones((B, T), F32) if attention_mask is None else attention_mask.astype(F32)
        Mw = M * w[..., None]
        diff = M - jax.lax.stop_gradient(Mh).astype(F32)
        w2 = w * w  # ‖(M - Mh) w‖ and ‖M w‖, channels first (codecs/base.py row_sum)
        err = jnp.sqrt(row_sum(diff * diff, w2)) / jnp.maximum(jnp.sqrt(row_sum(M * M, w2)), 1e-30)
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


# ----------------------------------------------------------------------------------------------- the codec
@dataclass(frozen=True)
class LowRankConfig(ActivationCodecConfig):
    """`fast.codec: {type: lowrank}`: project each boundary message on a learned r-dimensional basis (design §3.3)."""

    learns_basis = True  # the anchor may own the basis (anchor.owns_q)
    summed_aux = ("sketch", "tokens")  # the basis sketch Mᵀ(M·Q) and its token count add up over rows
    strength = ("rank", "r")

    rank: int = field(default=77, metadata=doc("rank of the activation projector", "r"))
    update_cadence: int = field(default=1, metadata=doc("GRPO steps between refreshes of a fast-owned basis"))
    warm_start: bool = field(default=True, metadata=doc("power iteration starts from the newest basis, else Q0"))
    sync_basis: bool = field(
        default=True,
        metadata=doc(
            "sum the basis sketch over data replicas before orthonormalising, so every replica has the same Q"
        ),
    )
    reortho_eps: float = field(
        default=1e-6,
        metadata=doc("QR degeneracy threshold relative to the largest column norm; degenerate columns are redrawn"),
    )
    bootstrap: bool = field(default=True, metadata=doc("publish Q1 from one dense sketch before the first step"))
    seed: int = field(default=0, metadata=doc("host seed of Q0"))
    use_kernel: bool = field(default=False, metadata=doc("the Pallas projector kernel; error if it cannot run"))

    def check(self):
        require(self.rank >= 1, "rank", f"got {self.rank}; must be >= 1")
        require(self.update_cadence >= 1, "update_cadence", f"got {self.update_cadence}; must be >= 1")

    def check_fits(self, model, pp_size: int):
        require(
            self.rank < model.hidden_size,
            "rank",
            f"got {self.rank}; must be below model.hidden_size={model.hidden_size}",
        )


@register_activation("lowrank")
class LowRankCodec(ActivationCodec):
    """The codec's state is the basis (`LowRankState`). Who sketches it: the train forward (`owns_basis`, refreshed
    in `update` every `update_cadence` steps) or an external dense pass (the anchor's fire, through `sketcher` and
    `absorb_sketch`)."""

    config = LowRankConfig
    has_kernel = True

    def __init__(self, cfg, *, owns_basis: bool = True, **kw):
        super().__init__(cfg, **kw)
        self.owns_basis = bool(owns_basis)
        if not cfg.rank < self.hidden:
            raise ValueError(f"fast.codec.rank: got {cfg.rank}; must be below the hidden size {self.hidden}")
        self._absorb_jit = self._bootstrap_jit = None

    def init(self):
        return init_lowrank(self.cfg, self.hidden, self.boundaries)

    def hook(self, state, layer, h, path):
        fn = make_lowrank_hook(
            state,
            self.boundaries,
            sketch=(path.tag == TRAIN and self.owns_basis),
            attention_mask=path.attention_mask,
            cfg=self.cfg,
            interpret=self.interpret,
            mesh=self.mesh,
            platform=self.platform,
        )
        return fn(self.check_layer(layer), h)

    def wire(self, state, layer, path):
        """r coefficients per token against the active basis (LowRankWire below; the basis is replicated state, never sent per step)."""
        return LowRankWire(state.Q[self.check_layer(layer)])

    def absorb(self, state, aux_by_layer):
        """A fast-owned basis adds the train forward's sketch (summed over the global batch) to its running V."""
        return accumulate_sketch(state, aux_by_layer) if self.owns_basis else state

    def update(self, state, gs):
        """After the step's last tick: refresh a fast-owned basis when due, activate a staged one, report health."""
        if self.owns_basis and refresh_due(self.cfg, gs):
            # The sketch already is the sum over dp (contracted over the global batch inside jit, or psum-ed in the
            # PowerSGD shard_map), so no axis_name here.
            state = refresh_basis(state, self.cfg, axis_name=None)
        state = activate_staged(state)
        metrics = {k: float(v) for k, v in lowrank_metrics(state).items()}
        metrics.update({f"codec/basis_cond/{b}": float(basis_cond(state.Q[b])) for b in self.boundaries})
        return state, metrics

    def stage(self, state, Q_new):
        """A new basis (the anchor's), active only after the step's last tick (`update`)."""
        return stage(state, Q_new)

    def activate_staged(self, state):
        return activate_staged(state)

    def sketcher(self, state, attention_mask):
        """(hook, layers) for a dense pass that only sketches: activations pass unchanged, the aux carries the sketch
        Mᵀ(M·Q_start) per boundary (`absorb_sketch` folds it in). The anchor's fire takes it from the loop."""
        inner = make_lowrank_hook(state, self.boundaries, sketch=True, attention_mask=attention_mask, encode=False)

        def fn(layer, h):  # the sketch only: the codec's error would cost a projection that nobody reads here
            h, aux = inner(layer, h)
            return h, {"sketch": aux["sketch"], "tokens": aux["tokens"]}

        return fn, self.boundaries

    def absorb_sketch(self, state, sketch):
        """Fold a dense pass's sketch (summed over the global batch) in: one power-iteration step, staged; `update`
        activates it after the step's last tick. One small jitted program."""
        if self._absorb_jit is None:
            cfg = self.cfg
            self._absorb_jit = dispatch.jit(
                lambda low, aux: refresh_basis(accumulate_sketch(low, aux), cfg, axis_name=None)
            )
        return self._absorb_jit(state, sketch)

    def bootstrap(self, state, params, batch, model_cfg):
        """`bootstrap` (either owner): before the first compressed forward, one discarded dense no-grad pass over the
        first batch sketches against Q0 and one power-iteration step publishes Q1, active at once (no codec forward
        has run yet, so no step sees two bases). Cost: one dense forward, no backward. Returns (state, metrics)."""
        if not self.cfg.bootstrap:
            return state, {}
        if self._bootstrap_jit is None:
            from twocircuit_jax.model.qwen2 import forward_with_aux

            def sketch(params, batch, st):
                hook, layers = self.sketcher(st, batch["attention_mask"])
                p = jax.lax.stop_gradient(params)
                return forward_with_aux(
                    model_cfg, p, batch["tokens"], batch["attention_mask"], hook=hook, hook_layers=layers
                )[1]

            self._bootstrap_jit = dispatch.jit(sketch)
        aux = self._bootstrap_jit(params, batch, state)
        low = accumulate_sketch(state, aux)
        return activate_staged(refresh_basis(low, self.cfg, axis_name=None)), {"codec/bootstrapped": 1}

    def wire_bytes(self, tokens, hidden, boundaries, act_bytes=2, basis_bytes=4):
        """N·r per boundary, plus the basis broadcast n_b·H·r fp32 amortised over `update_cadence` steps."""
        nb, N, H, r = len(boundaries), int(tokens), int(hidden), self.cfg.rank
        el_msg, el_basis = nb * N * r, nb * H * r / self.cfg.update_cadence
        return wire_result(
            el_msg * act_bytes + el_basis * basis_bytes, nb * N * H * act_bytes, el_msg + el_basis, nb * N * H
        )


# ------------------------------------------------------------------------------------- the wire format
class LowRankWire(Wire):
    """Y = h·Q in the activation dtype (the emulated codec's own product), rebuilt as Y·Qᵀ."""

    def __init__(self, Q):
        self.Q = jax.lax.stop_gradient(Q)

    def encode(self, h):
        mb, T, H = h.shape
        return lowrank_reference(h.reshape(mb * T, H), self.Q)[0].reshape(mb, T, -1)

    def decode(self, payload, like):
        mb, T, r = payload.shape
        Qc = self.Q.astype(payload.dtype)
        out = jax.lax.dot_general(
            payload.reshape(mb * T, r), Qc, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        return out.astype(like.dtype).reshape(like.shape)
