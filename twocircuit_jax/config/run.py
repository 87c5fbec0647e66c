"""The root config of a run, and loading it from YAML with overrides."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Optional

import yaml

from twocircuit_jax.boundaries import codec_stage_mismatch
from twocircuit_jax.config.base import ConfigError, doc, from_dict, registered, require, to_dict
from twocircuit_jax.config.env import EnvConfig
from twocircuit_jax.config.health import GuardConfig, HealthConfig
from twocircuit_jax.config.sections import (
    ActivationCodecConfig,
    AnchorConfig,
    EvalConfig,
    FastConfig,
    GRPOConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    SamplerConfig,
    SFTConfig,
    TaskConfig,
    TrainConfig,
)


@dataclass(frozen=True)
class RunConfig:
    name: str = field(default="run", metadata=doc("run name; the run folder defaults to runs/<name>"))
    base_model: str = field(
        default="", metadata={"doc": "checkpoint dir (orbax or HF) to start from; '' = random init"}
    )
    tokenizer: str = field(default="char", metadata={"doc": "'char' (built in) or a local HF tokenizer dir"})
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    optim: OptimConfig = OptimConfig()
    sampler: SamplerConfig = SamplerConfig()
    grpo: GRPOConfig = GRPOConfig()
    fast: FastConfig = FastConfig()
    anchor: AnchorConfig = AnchorConfig()
    task: TaskConfig = field(default_factory=lambda: from_dict(TaskConfig, {}))
    env: EnvConfig = field(
        default_factory=lambda: from_dict(EnvConfig, {}),
        metadata={"doc": "multi-turn environment; `type: none` = the single-turn task above"},
    )
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    sft: SFTConfig = SFTConfig()
    health: HealthConfig = HealthConfig()
    guard: GuardConfig = GuardConfig()

    def check(self):
        """Cross-section rules (design §4 config checks, §3 validation)."""
        f, a = self.fast, self.anchor
        # pp_size places the activation codec's boundaries: with no codec it places nothing and is not checked. A
        # checkpoint's layer count is known only once loaded (fast/circuit.py checks it then).
        if f.codec_type != "none" and not self.base_model:
            require(
                f.pp_size <= self.model.num_layers,
                "fast.pp_size",
                f"got {f.pp_size}; must not exceed model.num_layers={self.model.num_layers}",
            )
        fits = getattr(f.codec, "check_fits", None)  # the codec's own rules against the model and the stages
        if fits is not None:
            try:
                fits(self.model, f.pp_size)
            except ConfigError as e:
                raise ConfigError(f"fast.codec.{e.path}", e.message) from None
        if a.owns_q is True:
            require(
                f.codec.learns_basis,
                "anchor.owns_q",
                f"owns_q: true needs a fast.codec that learns a basis{_learners()}",
            )
        if self.guard.enabled:
            for m in self.guard.mitigations:
                if m in ("swap", "anchor_cadence"):
                    require(self.anchor.enabled, "guard.mitigations", f"{m} needs anchor.enabled: true")
        self._check_stages()
        ticks_per_step = self.train.prompts_per_step // self.train.prompts_per_update
        require(ticks_per_step >= 1, "train.prompts_per_update", "must not exceed train.prompts_per_step")

    def _check_stages(self):
        """mesh.stage > 1 splits the layer stack into equal stages; the codec's boundaries must be stage boundaries
        (there is nothing to compress where no stage ends)."""
        S, L, f = self.mesh.stages, self.model.num_layers, self.fast
        if S == 1:
            require(
                self.train.pipeline_microbatches in (0, 1),
                "train.pipeline_microbatches",
                f"got {self.train.pipeline_microbatches}; microbatches split the pipeline's forward, which needs mesh.stage > 1",
            )
            return
        if self.base_model:  # a checkpoint's layer count is checked once it is loaded (parallel/pipeline.py)
            return
        require(L % S == 0, "mesh.stage", f"got {S}; must divide model.num_layers={L} (equal stages)")
        if f.codec_type != "none":
            problem = codec_stage_mismatch(L, f.pp_size, S)
            require(problem is None, "fast.pp_size", problem)

    @property
    def anchor_owns_q(self) -> bool:
        if self.anchor.owns_q == "auto":  # design §4: the anchor owns the basis iff the codec learns one
            return self.fast.codec.learns_basis and self.anchor.enabled
        return self.anchor.owns_q is True

    @property
    def ticks_per_step(self) -> int:
        return self.train.prompts_per_step // self.train.prompts_per_update


def _learners() -> str:
    """' (type: lowrank, ...)': the registered codecs that learn a basis, for an error message."""
    names = [n for n, c in registered(ActivationCodecConfig).items() if c.learns_basis]
    return f" (type: {', '.join(sorted(names))})" if names else ""


def parse_set(item: str) -> tuple[list[str], object]:
    """`a.b=c` -> (['a', 'b'], yaml-parsed c)."""
    if "=" not in item:
        raise ConfigError("--set", f"got {item!r}; expected key=value (dotted key, YAML value)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError("--set", f"got key {key!r}; expected a dotted key like train.steps")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value {raw!r} is not valid YAML: {e}") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)
    for item in overrides or []:
        path, value = parse_set(item)
        node = data
        for p in path[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if isinstance(nxt, str):  # a section named by its type alone (`codec: lowrank`) takes a knob
                nxt = node[p] = {"type": nxt}
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(path), f"{p} is not a section")
            node = nxt
        if path[-1] == "type" and node.get("type", value) != value:
            node.clear()  # another type of a polymorphic section: the old type's fields would not fit
        node[path[-1]] = value
    return data


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError("", "config file not found", source=path)
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as e:
        raise ConfigError("", f"not valid YAML: {e}", source=path) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "top level must be a mapping", source=path)
    # `base: other.yaml` composes: this file's keys override the base's (paths relative to this file).
    base = data.pop("base", None)
    if base:
        parent = _read_yaml(os.path.join(os.path.dirname(path), base))
        data = _compose(parent, data)
    return data


def _compose(a: dict, b: dict) -> dict:
    """b's keys over a's, nested sections merged; a polymorphic section whose `type` changes is replaced whole
    (the other type's fields would not fit)."""
    out = dict(a)
    for k, v in b.items():
        old = out.get(k)
        if isinstance(old, str) and isinstance(v, dict) and "type" not in v:  # `codec: lowrank` under its knobs
            old = {"type": old}
        same_type = not (isinstance(old, dict) and isinstance(v, dict) and "type" in v and v["type"] != old.get("type"))
        out[k] = (
            _compose(old, v) if isinstance(v, dict) and isinstance(old, dict) and k != "options" and same_type else v
        )
    return out


def load_config(
    path: Optional[str] = None, overrides: Optional[list[str]] = None, data: Optional[dict] = None
) -> RunConfig:
    """Load a RunConfig from YAML (or a dict), apply `--set` overrides, validate. Errors name the file and field."""
    source = path or "<config>"
    try:
        raw = _read_yaml(path) if path else copy.deepcopy(data or {})
        raw = apply_overrides(raw, overrides or [])
        return from_dict(RunConfig, raw)
    except ConfigError as e:
        raise e.with_source(e.source or source) from None


def save_config(cfg: RunConfig, path: str) -> None:
    with open(path, "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
