"""The codec interfaces and their registries (design §3): activation codecs at the pipeline boundaries, gradient
codecs on the data-parallel reduction.

A codec is one class in one file of this folder, registered with its config section:

    @register_activation("my_codec")
    class MyCodec(ActivationCodec):
        config = MyCodecConfig          # a frozen dataclass subclassing config.sections.ActivationCodecConfig

`fast.codec: {type: my_codec, ...}` then parses into `MyCodecConfig` and the fast circuit builds `MyCodec` from it.
Registration happens on import: the built-in codecs are imported by `twocircuit_jax.fast.codecs`; a codec defined
elsewhere (a test, a user module) registers when its module is imported, before the config is loaded.

Contract (all array work pure and jittable; `state` is the codec's field of the circuit state, `cs.codec`):
  init() -> state                     fp32 pytree placed by the caller (None for a stateless codec)
  hook(state, layer, h, path) -> (h̃, aux)   traced inside every codec-view forward at each boundary `layer`;
                                      `path` (a `Path`) says which forward and carries the per-batch PRF context;
                                      aux holds scalars (`recon_rel_err`, `mask_ratio`, ...) and, for codecs that
                                      learn from the activations, summable arrays (the low-rank sketch)
  absorb(state, aux_by_layer) -> state   traced inside the train step: folds the train forward's aux into the state
  update(state, gs) -> (state, metrics)  host, after the step's last tick (the basis refresh)
  wire_bytes(tokens, hidden, boundaries, act_bytes) -> dict   logical bytes of one forward's boundary messages
  wire(state, layer, path) -> parallel.wire.Wire   the packed format on a real stage boundary (mesh.stage > 1)

What differs between codecs is declared on the config section (config.sections.ActivationCodecConfig):
`learns_basis`, `summed_aux` (aux leaves that add up over rows), `strength` (the plots' field and label) and the
`check_fits` method. Nothing outside a codec's file compares its `type:` name. A codec whose section declares
`learns_basis` also provides, for the anchor-owned basis (checked on registration):
  sketcher(state, attention_mask) -> (hook, layers)   a dense pass that only sketches (aux: the summed leaves)
  absorb_sketch(state, sketch) -> state   folds a dense pass's sketch in, staged
  stage(state, basis) -> state / activate_staged(state) -> state   a new basis, active only after the step
  bootstrap(state, params, batch, model_cfg) -> (state, metrics)   optional: before the first compressed forward

A gradient codec is registered the same way (`@register_grad("name")`, section subclassing
config.sections.GradCodecConfig, chosen by `fast.grad_codec.type`). It replaces XLA's implicit data-parallel mean:
the train step takes each replica's gradient inside `jax.shard_map` over the batch axes (fast/grad_fn.py) and
hands it to the codec. Contract (`state` is `cs.grad`):
  check_mesh(mesh)                    raise ValueError if the codec cannot run on this mesh
  init(params_like, n_replicas) -> state    fp32 pytree (global layout: per-replica parts stacked on axis 0)
  state_specs(state, axes) -> PartitionSpec pytree   how shard_map splits the state over the batch axes
  reduce(grads, state, axes) -> (mean, state, metrics)   inside shard_map: this replica's grads in, the
                                      replica-invariant mean estimate out; metrics are scalars
  warmup_reduces -> int               reduces that take the plain mean first (0, the default: none); > 0: the
                                      train step is two programs, and `reduce` takes `phase="plain"` or "compressed"
  wire_bytes(params_like, state=None) -> dict   logical per-replica bytes of one reduction (host; `state` lets a
                                      codec with a warm-up say which branch the last reduction took)
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from twocircuit_jax.config.base import register
from twocircuit_jax.config.sections import ActivationCodecConfig, GradCodecConfig, NoActivationCodec, NoGradCodec
from twocircuit_jax.names import OLD, REF, TRAIN  # noqa: F401  (read from here by the codecs and fast/codecs/__init__)


class Path(NamedTuple):
    """One codec-view forward, as each boundary sees it."""

    tag: str  # TRAIN, OLD or REF (static)
    step: jax.Array  # [] int32 GRPO step gs: the PRF step key
    sample_ids: jax.Array  # [B] int32 row in the global step batch
    positions: jax.Array  # [B, T] int32 counted from each row's first real token
    attention_mask: jax.Array  # [B, T] 1 on real tokens (keeps padding out of metrics and sketches)


def row_sum(x, w):
    """sum over b, t of w[b, t] * sum over h of x[b, t, h], for a codec's error metrics: channels first, then the
    token weights. As one sum over [B, T, H] of x * w[..., None], XLA:CPU fused it with the codec's own work and
    ran it far slower (the demo's prf_mask old-log-prob pass, 3 boundaries: 33 ms, against 19 ms in two stages and
    14 ms dense)."""
    return jnp.sum(jnp.sum(x, axis=-1) * w)


def wire_result(compressed: float, dense: float, el_c: float, el_d: float) -> dict:
    return {
        "comm/bytes_compressed": float(compressed),
        "comm/bytes_dense": float(dense),
        "comm/bytes_ratio": float(compressed) / float(dense) if dense else 1.0,
        "comm/elements_compressed": float(el_c),
        "comm/elements_dense": float(el_d),
    }


class ActivationCodec:
    """Base class: stateless, nothing to absorb or update; subclasses override `hook` and `wire_bytes`."""

    config: ClassVar[type]  # the config section class this codec is built from
    has_kernel: ClassVar[bool] = False  # a Pallas kernel exists (fast.codec.use_kernel may be true)

    def __init__(
        self,
        cfg,
        *,
        hidden: int,
        boundaries: Sequence[int],
        mesh=None,
        interpret: bool = False,
        platform: str | None = None,
        **_,
    ):
        self.cfg, self.hidden, self.boundaries = cfg, int(hidden), tuple(int(b) for b in boundaries)
        # platform: the kernels' lowering target when it is not the local backend (export only; see
        # pallas_kernels/platform.py)
        self.mesh, self.interpret, self.platform = mesh, bool(interpret), platform

    def init(self) -> Any:
        return None

    def hook(self, state, layer: int, h: jax.Array, path: Path):
        raise NotImplementedError

    def wire(self, state, layer: int, path: Path):
        """The boundary's format on a real stage boundary (parallel/wire.py's protocol; the format itself in the codec's file), for the microbatch `path` describes."""
        wired = sorted(n for n, c in activation_codecs().items() if c.wire is not ActivationCodec.wire)
        raise ValueError(
            f"fast.codec {self.name!r} has no wire format for real pipeline stages (mesh.stage > 1); "
            f"use {', '.join(wired + ['none'])}, or mesh.stage: 1"
        )

    def absorb(self, state, aux_by_layer: dict):
        return state

    def update(self, state, gs: int):
        return state, {}

    def wire_bytes(self, tokens: int, hidden: int, boundaries: Sequence[int], act_bytes: int = 2) -> dict:
        raise NotImplementedError

    def check_layer(self, layer: int) -> int:
        layer = int(layer)
        if layer not in self.boundaries:
            raise ValueError(
                f"{type(self).__name__}: layer {layer} is not a boundary; boundaries are {self.boundaries}"
            )
        return layer


class _Registry:
    """Codec classes of one kind by `type:` name, each registered with its config section (`cls.config`, a subclass
    of `section`); `off` is the section of `type: none`, for which `make` returns None."""

    basis_methods = ("sketcher", "absorb_sketch", "stage", "activate_staged")  # a learned basis's life cycle

    def __init__(self, kind: str, section: type, off: type):
        self.kind, self.section, self.off, self.classes = kind, section, off, {}

    def register(self, name: str):
        def deco(cls):
            if not issubclass(cls.config, self.section):
                raise TypeError(f"{cls.__name__}.config must subclass {self.section.__name__}")
            missing = [
                m
                for m in self.basis_methods
                if getattr(cls.config, "learns_basis", False) and not callable(getattr(cls, m, None))
            ]
            if missing:
                raise TypeError(f"{cls.__name__}: its section declares learns_basis but the codec lacks {missing}")
            register(self.section, name)(cls.config)
            self.classes[name] = cls
            cls.name = name
            return cls

        return deco

    def make(self, cfg, **kw):
        if isinstance(cfg, self.off):
            return None
        for cls in self.classes.values():
            if type(cfg) is cls.config:
                return cls(cfg, **kw)
        raise ValueError(
            f"no {self.kind} is registered for {type(cfg).__name__}; registered: {', '.join(sorted(self.classes))}"
        )


_ACTIVATION = _Registry("codec", ActivationCodecConfig, NoActivationCodec)
_GRAD = _Registry("gradient codec", GradCodecConfig, NoGradCodec)


def register_activation(name: str):
    """Class decorator: register a codec under `fast.codec.type: name`, with its config section (`cls.config`)."""
    return _ACTIVATION.register(name)


def activation_codecs() -> dict[str, type]:
    return dict(_ACTIVATION.classes)


def make_activation_codec(cfg, **kw) -> Optional[ActivationCodec]:
    """The codec object for config section `cfg` (None for `type: none`)."""
    return _ACTIVATION.make(cfg, **kw)


class GradCodec:
    """Base class of a data-parallel gradient codec; subclasses override `init`, `state_specs`, `reduce` and
    `wire_bytes` (and `global_specs` when the state's placement differs from its shard_map view)."""

    config: ClassVar[type]  # the config section class this codec is built from
    has_kernel: ClassVar[bool] = False  # a Pallas kernel exists (fast.grad_codec.use_kernel may be true)

    def __init__(self, cfg, *, mesh=None, interpret: bool = False, platform: str | None = None, **_):
        self.cfg, self.mesh, self.interpret, self.platform = cfg, mesh, bool(interpret), platform

    def check_mesh(self, mesh) -> None:
        return None

    def init(self, params_like, n_replicas: int = 1) -> Any:
        raise NotImplementedError

    def state_specs(self, state, axes) -> Any:
        raise NotImplementedError

    def global_specs(self, state, axes) -> Any:
        """Where the state lives on the whole mesh (the circuit state's shardings); `state_specs` by default, the
        shard_map view over the batch axes."""
        return self.state_specs(state, axes)

    @property
    def warmup_reduces(self) -> int:
        """Reduces at the start that take the plain mean (0: none). > 0: the trainer compiles the warm-up and the
        steady reduction as two train-step programs (step/programs.py `PhasedTrainStep`) and `reduce` is called with
        `phase` "plain" or "compressed" (the fidelity probe's program passes none: the codec picks on device)."""
        return 0

    def reduce(self, grads, state, axes):
        raise NotImplementedError

    def wire_bytes(self, params_like, state=None) -> dict:
        raise NotImplementedError


def register_grad(name: str):
    """Class decorator: register a gradient codec under `fast.grad_codec.type: name`, with its config section."""
    return _GRAD.register(name)


def grad_codecs() -> dict[str, type]:
    return dict(_GRAD.classes)


def make_grad_codec(cfg, **kw) -> Optional[GradCodec]:
    """The gradient codec object for config section `cfg` (None for `type: none`: XLA's plain mean)."""
    return _GRAD.make(cfg, **kw)
