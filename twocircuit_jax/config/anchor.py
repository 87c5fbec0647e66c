"""The anchor circuit's config (design §4): the top-level cadence and delay, and one section per part, the merger
typed by `type:` like the fast circuit's codecs (config/base.py `register`), the projection and the swap.

A flat knob of earlier configs (`gate_decay: 0.75`, `swap_cadence: 4`, ...) is refused with the key to write instead
(`AnchorConfig.moved`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from twocircuit_jax.config.base import doc, register, require, type_name


# ------------------------------------------------------------------------------------------------------- merger
@dataclass(frozen=True)
class MergerConfig:
    """How the anchor EMA M rewrites the fast gradient (design §4.4); the subclass is chosen by `type:`."""

    default_type = "signed_ema"


@register(MergerConfig, "none")
@dataclass(frozen=True)
class NoMerger(MergerConfig):
    """No merger: the fast gradient is not rewritten and no EMA M is kept."""


@dataclass(frozen=True)
class _EmaMerger(MergerConfig):
    """The fields every merger with an EMA M has (not a `type:` of its own)."""

    beta_anc: float = field(default=0.5, metadata=doc("EMA factor of the anchor gradient, in [0, 1)", "β_anc"))
    cadence: int = field(
        default=1, metadata=doc("ticks between merger applications; must divide anchor.cadence with the projection")
    )

    def check(self):
        require(0 <= self.beta_anc < 1, "beta_anc", f"got {self.beta_anc}; allowed [0, 1)")
        require(self.cadence >= 1, "cadence", f"got {self.cadence}; must be >= 1")


@register(MergerConfig, "signed_ema")
@dataclass(frozen=True)
class SignedEmaMerger(_EmaMerger):
    """G′ = α·G + (1−α)·|G|·sign(M)."""

    alpha: float = field(default=0.25, metadata=doc("weight on the fast gradient, in [0, 1]", "α"))

    def check(self):
        super().check()
        require(0 <= self.alpha <= 1, "alpha", f"got {self.alpha}; allowed [0, 1]")


@register(MergerConfig, "signed_gate")
@dataclass(frozen=True)
class SignedGateMerger(SignedEmaMerger):
    """The signed rule weighed by a learned gate ω (sign agreement of successive anchor gradients), decayed while
    the fire is held."""

    decay: float = field(default=0.75, metadata=doc("per-merge decay of the gate between fires, in (0, 1)"))

    def check(self):
        super().check()
        require(0 < self.decay < 1, "decay", f"got {self.decay}; allowed (0, 1)")


@register(MergerConfig, "blend")
@dataclass(frozen=True)
class BlendMerger(_EmaMerger):
    """G′ = (1−η)·G + η·(‖G‖/‖M‖)·M."""

    eta: float = field(default=0.5, metadata=doc("blend weight of M, in [0, 1]", "η"))

    def check(self):
        super().check()
        require(0 <= self.eta <= 1, "eta", f"got {self.eta}; allowed [0, 1]")


@register(MergerConfig, "delayed_ef")
@dataclass(frozen=True)
class DelayedEfMerger(_EmaMerger):
    """G′ = G + λ·decayᵃᵍᵉ·δ, δ = M − G measured on the fire tick."""

    weight: float = field(default=1.0, metadata=doc("weight of the anchor-minus-fast gap added to the gradient", "λ"))
    decay: float = field(default=1.0, metadata=doc("per-merge decay of that weight between fires"))


# --------------------------------------------------------------------------------------------- projection, swap
@dataclass(frozen=True)
class ProjectionConfig:
    """The rank-1 forecast (design §4.2): a fire replays on a forecast of the current generator weights."""

    enabled: bool = field(
        default=True, metadata=doc("fire on a rank-1 forecast of the current generator weights with the current batch")
    )
    strength: float = field(
        default=1.0,
        metadata=doc("scale of the rank-1 forecast's step past the newest snapshot; 0 = the newest snapshot"),
    )
    window: int = field(default=4, metadata=doc("snapshots the sliding window keeps (>= 2)", "W"))
    min_snapshots: int = field(
        default=2, metadata=doc("snapshots needed before the forecast is used; earlier fires replay the delayed pair")
    )
    window_mode: Literal["sliding_window", "growing_fixed_base"] = field(
        default="sliding_window",
        metadata=doc(
            "sliding_window keeps the newest window snapshots; growing_fixed_base keeps the base and the newest"
        ),
    )
    max_snapshots: int = field(default=8, metadata=doc("growing_fixed_base: snapshots kept in all, base included"))

    def check(self):
        require(self.window >= 2, "window", f"got {self.window}; must be >= 2")
        require(2 <= self.min_snapshots <= self.window, "min_snapshots", f"got {self.min_snapshots}; allowed 2..window")
        require(self.strength >= 0, "strength", f"got {self.strength}; must be >= 0")


@dataclass(frozen=True)
class SwapConfig:
    """The optimizer-state swap (design §4.5): Adam's moments blended toward the anchor's every `cadence` ticks."""

    cadence: int = field(default=0, metadata=doc("optimizer-state swap period in ticks; 0 = off"))
    alpha: float = field(default=1.0, metadata=doc("blend of the swap", "κ"))
    beta1: float = field(
        default=0.8, metadata=doc("EMA factor of the anchor's first moment of its gradient, in [0, 1)", "β1")
    )
    beta2: float = field(
        default=0.95, metadata=doc("EMA factor of the anchor's second moment of its gradient, in [0, 1)", "β2")
    )
    scale_match: bool = field(
        default=True, metadata=doc("rescale the anchor moments to the norm of Adam's first moment before the swap")
    )
    mode: Literal["anchor_moments", "zero"] = field(
        default="anchor_moments",
        metadata=doc("anchor_moments: blend Adam's moments toward the anchor's; zero: toward zero"),
    )

    def check(self):
        require(self.cadence >= 0, "cadence", f"got {self.cadence}; must be >= 0 (0 = off)")
        require(0 <= self.alpha <= 1, "alpha", f"got {self.alpha}; allowed [0, 1]")
        require(0 <= self.beta1 < 1, "beta1", f"got {self.beta1}; allowed [0, 1)")
        require(0 <= self.beta2 < 1, "beta2", f"got {self.beta2}; allowed [0, 1)")


# ------------------------------------------------------------------------------------------------------- anchor
@dataclass(frozen=True)
class AnchorConfig:
    """The anchor circuit (design §4): delayed dense replays of the fast circuit's own mini-batches (the paired
    replay, the only one implemented) whose gradient corrects the fast one."""

    enabled: bool = field(
        default=False,
        metadata=doc("run the anchor circuit: delayed dense replays whose gradient corrects the fast one"),
    )
    cadence: int = field(default=20, metadata=doc("optimizer ticks between fires"))
    delay: int = field(default=20, metadata=doc("replay delay in ticks", "K"))
    target_scope: Literal["all", "decoder"] = field(
        default="all",
        metadata=doc("tensors the merger and swap act on: all floating tensors, or decoder = the 7 projection kernels"),
    )
    owns_q: Literal["auto", True, False] = field(
        default="auto", metadata=doc("who owns the low-rank basis; auto = anchor iff lowrank")
    )
    merger: MergerConfig = field(default_factory=SignedEmaMerger)
    projection: ProjectionConfig = ProjectionConfig()
    swap: SwapConfig = SwapConfig()

    @property
    def merger_type(self) -> str:
        return type_name(MergerConfig, self.merger)

    @property
    def merger_cadence(self) -> int:
        """Ticks between merger applications (1 without a merger: nothing is due)."""
        return getattr(self.merger, "cadence", 1)

    # Flat keys of earlier configs, refused with the key to write instead (config/base.py from_dict); None: a key
    # that is gone (its one accepted value is how the anchor runs).
    moved: ClassVar[dict] = {
        "beta_anc": "merger.beta_anc",
        "merger_cadence": "merger.cadence",
        "alpha": "merger.alpha",
        "gate_decay": "merger.decay",
        "blend_eta": "merger.eta",
        "ef_lambda": "merger.weight",
        "ef_decay": "merger.decay",
        **{k: f"projection.{k}" for k in ("strength", "window", "min_snapshots", "window_mode", "max_snapshots")},
        **{f"swap_{k}": f"swap.{k}" for k in ("cadence", "alpha", "beta1", "beta2", "scale_match", "mode")},
        **{k: None for k in ("replay_paired_batch", "batch_scope", "warmup_mode")},
    }

    def check(self):
        require(self.cadence >= 1, "cadence", f"got {self.cadence}; must be >= 1")
        require(self.delay >= 0, "delay", f"got {self.delay}; must be >= 0")
        if self.projection.enabled and self.enabled:
            require(self.merger_type != "none", "projection", "projection needs a merger (anchor.merger.type != none)")
            require(
                self.cadence % self.merger_cadence == 0,
                "cadence",
                f"got {self.cadence}; must be divisible by merger.cadence={self.merger_cadence}",
            )
        if self.swap.cadence > 0:
            require(self.enabled, "swap.cadence", "the optimizer-state swap needs anchor.enabled: true")
