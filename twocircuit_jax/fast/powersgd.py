"""Gradient PowerSGD with error feedback on the data-parallel axis (design §3.5), optax-shaped.

Call `powersgd_reduce` INSIDE `jax.shard_map` over the data axis, on this replica's gradients:

    for each compressible leaf (2-D [n, m], or stacked [L, n, m] treated per layer):
        M = g + e (fp32);  P = M·Q;  psum P;  P̂ = orth(P);  Q = Mᵀ·P̂;  pmean Q;  Ĝ = P̂·Qᵀ;  e ← M − Ĝ
    everything else (vectors, small matrices, embeddings/lm_head unless compress_embeddings): pmean.

Exactly three all-reduces per tick, each one packed fp32 vector in a fixed sorted-path order (design §8 inv. 8):
all P (sum), all Q (mean), all uncompressed leaves (mean; one extra fp32 element carries ‖e‖² for the
`powersgd/error_norm` metric so it is replica-invariant). P is summed, not averaged: it is orthonormalised next.

State layout: Q is replicated; the error memory e is per replica. Globally e has the leaf's shape with axis 0
multiplied by the replica count (replica i owns rows [i·n0, (i+1)·n0)), so shard_map with
`state_specs(state, axis)` (P(axis) on e) hands every replica an e of the leaf's own shape.

Hierarchical (mesh.fsdp or mesh.tensor > 1): PowerSGD compresses only the slow reduction across `data` replicas.
The shard_map is manual over `data` alone; inside a replica group the parameters, gradients and e stay sharded
like the parameters (fsdp, tensor), and XLA's partitioner adds the fast-interconnect reductions of P = M·Q and
Q = Mᵀ·P̂ over fsdp. `leaf_specs` (the parameter specs) pins grads, e, Ĝ and the mean to those shardings, and the
uncompressed leaves that are sharded (embed, lm_head: 0.93 GB fp32 each in Qwen2.5-1.5B) are reduced one
collective each instead of packed, because a flat pack would gather them over fsdp (one more all-reduce per such
leaf; P, Q and the replicated leaves stay packed). The factors are pinned too (`_factor_pinner`): P to M's split of
n, Q to its split of m, both whole after their reduction, so each device multiplies its own block of M and only
factors cross fsdp (left free, XLA gathered M whole per device and built Ĝ by an all-reduce of the matrix). e is
then globally [R·n0, ...] split over `data` on axis 0 and over the parameter's own axes everywhere
(`global_specs(..., param_specs=...)`): per device, 1/(fsdp·tensor) of the leaf. With data = 1 there is no slow reduction to compress: the codec refuses (`check_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels.lowrank import check_can_run
from pallas_kernels.powersgd import ef_project
from twocircuit_jax.config.base import doc, require
from twocircuit_jax.config.sections import GradCodecConfig
from twocircuit_jax.fast.bytes import powersgd_bytes, powersgd_plain_bytes
from twocircuit_jax.fast.codecs.base import GradCodec, register_grad
from twocircuit_jax.fast.leaf_plan import LeafPlan, flat_leaves, plan_leaves  # noqa: F401  (LeafPlan: re-export)
from twocircuit_jax.fast.orth import orth

F32 = jnp.float32
_SALT = 0x50575344  # "PWSD": keeps the Q₀ and refill keys apart from other users of cfg.seed


@dataclass(frozen=True)
class PowerSGDConfig(GradCodecConfig):
    """`fast.grad_codec: {type: powersgd}`: rank-r PowerSGD with error feedback on the data-parallel reduction."""

    rank: int = field(default=4, metadata=doc("PowerSGD rank", "r"))
    min_compression_rate: float = field(default=2.0, metadata=doc("compress a matrix only if it shrinks this much"))
    start_after: int = field(default=100, metadata=doc("plain all-reduce for the first N reduces"))
    error_feedback: bool = field(
        default=True, metadata=doc("keep the compression residual and add it to the next reduce; false = drop it")
    )
    compress_embeddings: bool = field(
        default=False, metadata=doc("also compress embed and lm_head; false = they take the plain mean")
    )
    warm_start: bool = field(default=True, metadata=doc("Q starts from the last step's Q, else a fresh draw"))
    reortho_eps: float = field(
        default=1e-6,
        metadata=doc("QR degeneracy threshold relative to the largest column norm; degenerate columns are redrawn"),
    )
    seed: int = field(default=0, metadata=doc("seed of the shared Q draws"))
    use_kernel: bool = field(default=False, metadata=doc("the Pallas projection kernel; error if it cannot run"))

    def check(self):
        require(self.rank >= 1, "rank", f"got {self.rank}; must be >= 1")
        require(self.min_compression_rate >= 1, "min_compression_rate", "must be >= 1")
        require(self.start_after >= 0, "start_after", f"got {self.start_after}; must be >= 0")


class PowerSGDState(NamedTuple):
    Q: dict  # leaf path -> [m, r] or [L, m, r] f32, replicated warm-start basis
    e: dict  # leaf path -> [R·n, m] or [R·L, n, m] f32 error memory, R replicas stacked on axis 0
    step: jax.Array  # [] int32 reduces done (plain-mean warm-up ones included)


def _fresh_q(cfg, idx: int, p: LeafPlan, step) -> jax.Array:
    """Shared normal draw [..., m, r] for leaf idx at `step` (0: Q₀). Same key on every replica -> replicated."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(cfg.seed ^ _SALT), idx), step)
    return jax.random.normal(key, p.shape[:-2] + (p.m, cfg.rank), F32)


def init_powersgd(cfg, params_like, n_replicas: int = 1) -> PowerSGDState:
    """Q₀ from a shared key (same on every replica); zero error memory for `n_replicas` replicas."""
    Q, e = {}, {}
    for i, p in enumerate(plan_leaves(cfg, params_like)):
        if p.compress:
            Q[p.path] = _fresh_q(cfg, i, p, 0)
            e[p.path] = jnp.zeros((p.shape[0] * n_replicas,) + p.shape[1:], F32)
    return PowerSGDState(Q=Q, e=e, step=jnp.zeros((), jnp.int32))


def state_specs(state: PowerSGDState, axis_name: str) -> PowerSGDState:
    """shard_map specs: Q and step replicated, e split over the replica axis."""
    return PowerSGDState(
        Q={k: PartitionSpec() for k in state.Q}, e={k: PartitionSpec(axis_name) for k in state.e}, step=PartitionSpec()
    )


def _axes_of(entry) -> tuple:
    return () if entry is None else tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def global_specs(
    state: PowerSGDState, axes, stage: str | None = None, param_specs: dict | None = None
) -> PowerSGDState:
    """Where the state lives on the mesh. With real stages (`stage` names the axis), a layer-stack leaf's Q [L, m, r]
    is split over `stage` like its layers, and its e [R·L, n, m] over the replica axes then `stage` (replica i's
    block of L rows, each stage holding its L/S layers): no stage holds another's error memory.
    Hierarchical (`param_specs`: {leaf path: the parameter's PartitionSpec}): e [R·n0, ...] is split over the
    replica axes on axis 0, then like its parameter (axis 0's own axes after the replica axes, so replica i's
    block is split over them); Q stays replicated ([m, r]: small)."""
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    spec = state_specs(state, axes)
    if param_specs is not None:
        if stage is not None:
            raise ValueError("powersgd: hierarchical (fsdp/tensor) state with real stages is not built")
        e = {}
        for k in state.e:
            ps = tuple(param_specs[k])
            e[k] = PartitionSpec(axes + _axes_of(ps[0] if ps else None), *ps[1:])
        return spec._replace(e=e)
    if stage is None:
        return spec
    return PowerSGDState(
        Q={k: PartitionSpec(stage) if _stacked(k) else v for k, v in spec.Q.items()},
        e={k: PartitionSpec(axes + (stage,)) if _stacked(k) else v for k, v in spec.e.items()},
        step=spec.step,
    )


def _pack(xs):
    return jnp.concatenate([x.astype(F32).reshape(-1) for x in xs]) if xs else jnp.zeros((0,), F32)


def _stacked(path: str) -> bool:
    """A leaf of the layer stack [L, ...]: split over `stage` when the pipeline is real (parallel/mesh.py)."""
    return path.startswith("layers/")


def _reduce_packed(xs, paths, collective, staged: bool):
    """collective(one packed fp32 buffer) per group, unpacked back into xs' shapes (fp32).

    Unstaged: one flat buffer of every leaf. On a staged mesh the layer-stack leaves [L, ...] pack along axis 1 into
    one [L, Σ] buffer, which keeps their split over `stage` (each stage reduces its own layers, over `data` only),
    and the rest pack flat: two collectives. One flat buffer there would make the partitioner gather every stage's
    layers first (measured: the whole layer stack's gradient all-gathered over `stage` per tick)."""
    if not staged:
        return _unpack(collective(_pack(xs)), xs)
    out = [None] * len(xs)
    lay = [i for i, p in enumerate(paths) if p is not None and _stacked(p)]
    rest = [i for i in range(len(xs)) if i not in lay]
    if lay:
        L = xs[lay[0]].shape[0]
        buf = collective(jnp.concatenate([xs[i].astype(F32).reshape(L, -1) for i in lay], axis=1))
        o = 0
        for i in lay:
            w = xs[i].size // L
            out[i] = buf[:, o : o + w].reshape(xs[i].shape)
            o += w
    if rest:
        for i, v in zip(rest, _unpack(collective(_pack([xs[i] for i in rest])), [xs[i] for i in rest])):
            out[i] = v
    return out


def _sharded(spec) -> bool:
    return any(_axes_of(a) for a in tuple(spec))


def _pinner(leaf_specs):
    """pin(path, x): x constrained to its leaf's sharding over the shard_map's automatic axes (identity without
    `leaf_specs`). Inside the shard_map the mesh is the abstract one whose replica axis is manual."""
    if leaf_specs is None:
        return lambda path, x: x

    def pin(path, x):
        spec = leaf_specs.get(path)
        if spec is None or not _sharded(spec):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))

    return pin


def _factor_pinner(leaf_specs):
    """pin(path, x, dim): a factor of leaf `path` (P [.., n, r]: dim -2; Q [.., m, r]: dim -1; None: replicated)
    constrained to the leaf's split of that dimension, r whole (identity without `leaf_specs`). Left free, the
    partitioner may all-gather M over fsdp to form P = M·Q or Q = Mᵀ·P̂ on every device, and build Ĝ = P̂·Qᵀ by an
    all-reduce of the whole matrix; pinned, each device multiplies its own block of M and only the [.., n, r] /
    [.., m, r] factors move (payload-sized)."""
    if leaf_specs is None:
        return lambda path, x, dim=None: x

    def pin(path, x, dim=None):
        spec = leaf_specs.get(path)
        if spec is None or not _sharded(spec):
            return x
        full = tuple(spec) + (None,) * (x.ndim - len(tuple(spec)))
        if dim is None:
            out = [None] * x.ndim
        else:  # the leaf's leading (layer) axes' split, then its n (P) or m (Q) split on the factor's rows, r whole
            out = list(full[: x.ndim - 2]) + [full[x.ndim + dim], None]
        return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec(*out)))

    return pin


def _unpack(vec, likes):
    out, o = [], 0
    for x in likes:
        out.append(vec[o : o + x.size].reshape(x.shape))
        o += x.size
    return out


def _orth_batched(P, eps, key):
    """orth over the leading (layer) axes of P [..., n, r]."""
    lead = P.shape[:-2]
    flat = P.reshape((-1,) + P.shape[-2:])
    Q = jax.vmap(lambda v: orth(v, eps, key))(flat)
    return Q.reshape(lead + P.shape[-2:])


def _project(g, e, Q, cfg, interpret, platform):
    """P = (g + e)·Q in fp32, through the Pallas kernel when cfg.use_kernel."""
    if cfg.use_kernel:
        if g.ndim > 3:  # the kernel takes [n, m] or [L, n, m]
            lead = g.shape[:-2]
            g, e, Q = (a.reshape((-1,) + a.shape[-2:]) for a in (g, e, Q))
            P = ef_project(g, e, Q, interpret=interpret, platform=platform)
            return P.reshape(lead + P.shape[-2:])
        return ef_project(g, e, Q, interpret=interpret, platform=platform)
    return jnp.einsum("...nm,...mr->...nr", g.astype(F32) + e, Q)


def powersgd_reduce(
    grads,
    state: PowerSGDState,
    cfg,
    axis_name: str,
    *,
    skip=False,
    interpret: bool = False,
    platform=None,
    staged: bool = False,
    leaf_specs: dict | None = None,
    phase: str | None = None,
):
    """One tick of the dp reduction. Returns (mean_grad_estimate like grads, new_state, metrics).

    skip (bool or traced bool): leave e and Q unchanged (design §2: a skipped update keeps the error memories);
    a non-finite estimate skips by itself. Plain pmean for the first `cfg.start_after` steps (e, Q untouched).
    metrics: powersgd/error_norm (RMS over replicas of ‖e‖ entering the tick), powersgd/compressed,
    powersgd/skipped, powersgd/bytes_compressed, powersgd/bytes_dense (per replica, logical, design §3.6).
    staged: the mesh has real pipeline stages: each collective is two buffers, the layer stack's [L, Σ] (kept split
    over `stage`) and the rest (`_reduce_packed`); the values are the same.
    leaf_specs ({path: PartitionSpec over the non-manual axes}, hierarchical only): inside a shard_map manual over
    the replica axis alone, grads, e, Ĝ and the mean are constrained to these shardings, and a sharded uncompressed
    leaf is reduced by its own collective (a flat pack would gather it over fsdp); the values are the same.
    phase: None picks the plain mean or the compressed reduction on device from `state.step` (one program holds
    both, in a `lax.cond`: XLA keeps both branches' buffers, about 1 GiB more at Qwen2.5-1.5B on a v5e-8);
    "plain" or "compressed" builds that one alone (the trainer's two train-step programs, `PhasedTrainStep`): the
    caller owns the choice, and the values are those the cond would give at that step.
    """
    if phase not in (None, "plain", "compressed"):
        raise ValueError(f"powersgd_reduce: phase must be None, 'plain' or 'compressed'; got {phase!r}")
    if cfg.use_kernel:
        check_can_run(interpret, "powersgd (fast.grad_codec.use_kernel=true)", platform)
    leaves = flat_leaves(grads)
    plan = plan_leaves(cfg, grads)
    comp = [p for p in plan if p.compress]
    unc = [p for p in plan if not p.compress]
    e2 = sum((jnp.sum(state.e[p.path] ** 2) for p in comp), jnp.zeros((), F32))

    pin = _pinner(leaf_specs)
    fpin = _factor_pinner(leaf_specs)
    leaves = {k: pin(k, v) for k, v in leaves.items()}
    e_in = {k: pin(k, v) for k, v in state.e.items()}
    state = state._replace(e=e_in)

    def reduce(xs, paths, kind):
        op = (lambda v: jax.lax.psum(v, axis_name)) if kind == "sum" else (lambda v: jax.lax.pmean(v, axis_name))
        if leaf_specs is None or kind == "sum":  # P (the only sum) is [.., n, r]: small, packed flat
            return _reduce_packed(xs, paths, op, staged)
        own = [i for i, p in enumerate(paths) if p is not None and _sharded(leaf_specs[p])]
        out = [None] * len(xs)
        rest = [i for i in range(len(xs)) if i not in own]
        for i in own:
            out[i] = pin(paths[i], op(pin(paths[i], xs[i].astype(F32))))
        for i, v in zip(rest, _reduce_packed([xs[i] for i in rest], [paths[i] for i in rest], op, staged)):
            out[i] = v
        return out

    def plain(_):
        outs = reduce([leaves[p.path] for p in plan] + [e2], [p.path for p in plan] + [None], "mean")
        return {p.path: o for p, o in zip(plan, outs)}, state.Q, state.e, outs[-1]

    def compressed(_):
        M = {p.path: leaves[p.path].astype(F32) + state.e[p.path] for p in comp}
        Ps = [
            fpin(
                p.path,
                _project(leaves[p.path], state.e[p.path], fpin(p.path, state.Q[p.path]), cfg, interpret, platform),
                -2,
            )
            for p in comp
        ]
        Ps = [fpin(p.path, x) for p, x in zip(comp, reduce(Ps, [p.path for p in comp], "sum"))]
        Ph = [_orth_batched(P, cfg.reortho_eps, jax.random.PRNGKey(cfg.seed ^ _SALT ^ i)) for i, P in enumerate(Ps)]
        Ph = [fpin(p.path, ph) for p, ph in zip(comp, Ph)]
        Qs = [fpin(p.path, jnp.einsum("...nm,...nr->...mr", M[p.path], ph), -1) for p, ph in zip(comp, Ph)]
        Qs = [fpin(p.path, x) for p, x in zip(comp, reduce(Qs, [p.path for p in comp], "mean"))]
        uouts = reduce([leaves[p.path] for p in unc] + [e2], [p.path for p in unc] + [None], "mean")
        out = {p.path: o for p, o in zip(unc, uouts)}
        new_e = {}
        for p, ph, q in zip(comp, Ph, Qs):
            G = pin(p.path, jnp.einsum("...nr,...mr->...nm", ph, q))  # pinned: each device builds its block only
            out[p.path] = G
            new_e[p.path] = pin(p.path, M[p.path] - G) if cfg.error_feedback else state.e[p.path]
        if cfg.warm_start:
            new_Q = {p.path: q for p, q in zip(comp, Qs)}
        else:  # a fresh shared draw each tick: same key on every replica, so Q stays replicated
            new_Q = {p.path: _fresh_q(cfg, plan.index(p), p, state.step + 1) for p in comp}
        return out, new_Q, new_e, uouts[-1]

    if phase == "plain":
        out, new_Q, new_e, e2m = plain(None)
        is_comp = jnp.zeros((), bool)
    elif phase == "compressed" or cfg.start_after <= 0:
        out, new_Q, new_e, e2m = compressed(None)
        is_comp = jnp.ones((), bool)
    else:
        is_comp = state.step >= cfg.start_after
        out, new_Q, new_e, e2m = jax.lax.cond(is_comp, compressed, plain, None)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in out.values()]))
    skipped = jnp.logical_or(jnp.asarray(skip), ~finite)
    keep = lambda new, old: jnp.where(skipped, old, new)  # noqa: E731
    new_state = PowerSGDState(
        Q=jax.tree.map(keep, new_Q, state.Q), e=jax.tree.map(keep, new_e, state.e), step=state.step + 1
    )
    dtypes = {p.path: leaves[p.path].dtype for p in plan}
    mean = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(grads), [pin(p, out[p].astype(dtypes[p])) for p in sorted(out, key=_order(grads))]
    )
    b_comp = powersgd_bytes(grads, cfg)
    metrics = {
        "powersgd/error_norm": jnp.sqrt(e2m),
        "powersgd/compressed": is_comp.astype(F32),
        "powersgd/skipped": skipped.astype(F32),
        "powersgd/bytes_compressed": jnp.where(
            is_comp, b_comp["comm/bytes_compressed"], powersgd_plain_bytes(grads)
        ).astype(F32),
        "powersgd/bytes_dense": jnp.asarray(b_comp["comm/bytes_dense"], F32),
    }
    return mean, new_state, metrics


@register_grad("powersgd")
class PowerSGDCodec(GradCodec):
    """`fast.grad_codec: {type: powersgd}` behind the gradient-codec interface (fast/codecs/base.py)."""

    config = PowerSGDConfig
    has_kernel = True  # pallas_kernels/powersgd.py: the error-feedback projection

    def check_mesh(self, mesh) -> None:
        """fsdp/tensor > 1 runs hierarchical (module doc): PowerSGD across `data`, XLA's reductions inside a group.
        Refused: data = 1 there (nothing crosses replicas: use grad_codec none, whose fsdp reduction is XLA's),
        real stages with fsdp/tensor (not built), and the Pallas kernel (its pallas_call is not partitioned over
        fsdp: XLA would gather M whole onto every device)."""
        sub = mesh.shape["fsdp"] * mesh.shape["tensor"]
        if sub == 1:
            return
        if mesh.shape["data"] == 1:
            raise ValueError(
                "powersgd compresses the reduction across mesh.data replicas; with data=1 and "
                f"fsdp={mesh.shape['fsdp']}, tensor={mesh.shape['tensor']} there is none (the fsdp reduction is "
                "XLA's): set fast.grad_codec.type=none, or mesh.data > 1"
            )
        if mesh.shape.get("stage", 1) > 1:
            raise ValueError(
                "powersgd with real stages needs mesh.fsdp=1 and mesh.tensor=1 (hierarchical staged state not "
                f"built; got fsdp={mesh.shape['fsdp']}, tensor={mesh.shape['tensor']})"
            )
        if self.cfg.use_kernel:
            raise ValueError(
                "use_kernel=true needs mesh.fsdp=1 and mesh.tensor=1: the projection kernel is not partitioned "
                f"over fsdp/tensor (got fsdp={mesh.shape['fsdp']}, tensor={mesh.shape['tensor']}); set it false"
            )

    @property
    def hierarchical(self) -> bool:
        return self.mesh is not None and self.mesh.shape["fsdp"] * self.mesh.shape["tensor"] > 1

    @property
    def replica_axes(self):
        """The axes the gradient shard_map is manual over and PowerSGD reduces across (fast/grad_fn.py): `data`
        alone when hierarchical, else None (the caller's batch axes, data x fsdp with fsdp = 1)."""
        return ("data",) if self.hierarchical else None

    def init(self, params_like, n_replicas: int = 1) -> PowerSGDState:
        return init_powersgd(self.cfg, params_like, n_replicas)

    def state_specs(self, state, axes) -> PowerSGDState:
        return state_specs(state, axes)

    def global_specs(self, state, axes) -> PowerSGDState:
        if self.hierarchical:
            axes = self.replica_axes
            R = self.mesh.shape["data"]
            shapes = {k: (v.shape[0] // R,) + tuple(v.shape[1:]) for k, v in state.e.items()}
            return global_specs(state, axes, param_specs=self._leaf_specs(shapes))
        return global_specs(state, axes, "stage" if self._staged else None)

    def _leaf_specs(self, shapes: dict) -> dict:
        from twocircuit_jax.parallel.mesh import param_spec  # the parameters' own rules (parallel/mesh.py)

        return {k: param_spec(k, tuple(s), self.mesh) for k, s in shapes.items()}

    @property
    def _staged(self) -> bool:
        return self.mesh is not None and self.mesh.shape.get("stage", 1) > 1

    @property
    def warmup_reduces(self) -> int:
        """Reduces that take the plain mean before the compression starts (`start_after`)."""
        return int(self.cfg.start_after)

    def reduce(self, grads, state, axes, phase=None):
        specs = None
        if self.hierarchical:
            specs = self._leaf_specs({k: x.shape for k, x in flat_leaves(grads).items()})
        return powersgd_reduce(
            grads,
            state,
            self.cfg,
            axes,
            interpret=self.interpret,
            platform=self.platform,
            staged=self._staged,
            leaf_specs=specs,
            phase=phase,
        )

    def wire_bytes(self, params_like, state=None) -> dict:
        """Compressed-branch bytes; while the warm-up still holds at `state` (its last reduction took the plain
        mean), the plain branch's. Reading `state.step` is a host sync (once per step, after the step)."""
        out = powersgd_bytes(params_like, self.cfg)
        if state is not None and int(state.step) <= self.cfg.start_after:
            out = dict(out, **{"comm/bytes_compressed": powersgd_plain_bytes(params_like)})
        return out


def _order(tree):
    """Key function putting paths back into the tree's own flatten order (for tree_unflatten)."""
    pos = {p: i for i, p in enumerate(flat_leaves(tree))}
    return lambda p: pos[p]


def powersgd_reference(replica_grads: list, state: PowerSGDState, cfg, *, skip: bool = False):
    """Single-device reference of `powersgd_reduce` for tests: the replicas are a Python list, collectives are
    sums over it (same math, different summation order, so it matches to fp32 round-off, not bit for bit).
    `state` uses the global layout (e of replica i in rows [i·n0, (i+1)·n0)). Returns (mean, new_state, metrics)."""
    R = len(replica_grads)
    flats = [flat_leaves(g) for g in replica_grads]
    plan = plan_leaves(cfg, replica_grads[0])
    comp = [p for p in plan if p.compress]

    def e_of(p, i):
        n0 = p.shape[0]
        return state.e[p.path][i * n0 : (i + 1) * n0]

    e2 = sum(float(jnp.sum(state.e[p.path] ** 2)) for p in comp) / R
    mean_plain = {p.path: sum(f[p.path].astype(F32) for f in flats) / R for p in plan}
    if int(state.step) < cfg.start_after:
        out, new_Q, new_e = mean_plain, state.Q, state.e
        compressed = False
    else:
        compressed = True
        out, new_Q, new_e = dict(mean_plain), {}, {}
        for i_leaf, p in enumerate(comp):
            Ms = [f[p.path].astype(F32) + e_of(p, i) for i, f in enumerate(flats)]
            P = sum(jnp.einsum("...nm,...mr->...nr", M, state.Q[p.path]) for M in Ms)
            Ph = _orth_batched(P, cfg.reortho_eps, jax.random.PRNGKey(cfg.seed ^ _SALT ^ i_leaf))
            Qn = sum(jnp.einsum("...nm,...nr->...mr", M, Ph) for M in Ms) / R
            G = jnp.einsum("...nr,...mr->...nm", Ph, Qn)
            out[p.path] = G
            new_e[p.path] = jnp.concatenate([M - G for M in Ms], 0) if cfg.error_feedback else state.e[p.path]
            new_Q[p.path] = Qn if cfg.warm_start else _fresh_q(cfg, plan.index(p), p, state.step + 1)
    skipped = bool(skip) or not all(bool(jnp.all(jnp.isfinite(v))) for v in out.values())
    if skipped:
        new_Q, new_e = state.Q, state.e
    leaves = flats[0]
    mean = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(replica_grads[0]), [out[p].astype(leaves[p].dtype) for p in leaves]
    )
    metrics = {
        "powersgd/error_norm": e2**0.5,
        "powersgd/compressed": float(compressed),
        "powersgd/skipped": float(skipped),
    }
    return mean, PowerSGDState(Q=dict(new_Q), e=dict(new_e), step=state.step + 1), metrics
