"""A resumed run's config against the checkpoint's: a change to anything that alters the training is refused.

A resume continues exactly when the config is the one the checkpoint was written under; a changed learning rate,
seed, batch size, codec or anchor cadence silently makes a different run that looks like a continuation. So
`--resume` compares the new config with the one stored in the checkpoint's meta (`meta["config"]`; for checkpoints
written before it was stored, the run folder's config.yaml, which each start rewrites) and refuses a change to any
key outside `ALLOWED` with a ConfigError (exit 2) naming each key, the old and the new value, unless
`--allow-config-change` (`GRPOTrainer(allow_config_change=True)`) is given; then the changes are printed as one
warning line.

ALLOWED: what a resume may change because the trained parameters do not depend on it:
- how long and how often: `train.steps`, checkpoint cadence (`train.checkpoint_*`, `train.final_checkpoint`,
  `train.preempt_grace_s`), evaluation (`train.eval_*`, `eval.*`), the dense probe (`train.probe_every`, a measurement), the run's `name`;
- where and how it runs: `train.compile_cache`, `mesh.*`, `train.micro_batch_per_device`/`train.pipeline_microbatches` and
  `train.fused_old_pass` (the same math, float order only), memory knobs of the model (`model.remat`, `model.logits_chunk`,
  `model.attention_block`), `fast.kernel_interpret`, the vLLM process's transport (`sampler.host`, `port`,
  `gpu_memory_utilization`, `startup_timeout_s`, `request_timeout_s`, `max_retries`, `export_dir`, `weight_sync`,
  `full_every`, `weight_update`), `sft.*` (read by `twocircuit sft` only);
- the bounds on user code (`task.reward_timeout_s`, `env.step_timeout_s`): they change nothing while the code is
  well behaved;
- `health.*` only while the collapse guard is off in both configs (the guard acts on the gauges' alarms).
Everything else is refused: model, optimizer, GRPO loss, fast circuit, anchor, task and environment, the sampler's
backend, dtype, `n` and sampling, seeds, batch sizes, `train.max_prompt_len`, `train.async_rollouts`, the guard.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import yaml

from twocircuit_jax.config.base import ConfigError, ConfigWarning, from_dict, to_dict

ALLOWED_PREFIXES = (
    "name",
    "train.steps",
    "train.checkpoint_",
    "train.final_checkpoint",
    "train.preempt_grace_s",
    "train.eval_",
    "train.probe_every",
    "train.compile_cache",
    "train.micro_batch_per_device",
    "train.fused_old_pass",
    "train.pipeline_microbatches",
    "eval.",
    "mesh.",
    "model.remat",
    "model.logits_chunk",
    "model.attention_block",
    "fast.kernel_interpret",
    "sampler.host",
    "sampler.port",
    "sampler.gpu_memory_utilization",
    "sampler.startup_timeout_s",
    "sampler.request_timeout_s",
    "sampler.max_retries",
    "sampler.export_dir",
    "sampler.weight_sync",
    "sampler.full_every",
    "sampler.weight_update",
    "sft.",
    "task.reward_timeout_s",
    "env.step_timeout_s",
)
_ABSENT = "<absent>"


def _flat(d, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def _normalise(raw: dict) -> dict:
    """Through the current config classes when possible, so fields added since the old config was written compare
    at their defaults; as written otherwise (a key that no longer exists)."""
    from twocircuit_jax.config.run import RunConfig

    try:
        # A checkpoint's config of an older layout (flat anchor or fast keys) is moved to the current one, so both
        # compare key by key; the moves were announced when that run started, not again here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            raw = to_dict(from_dict(RunConfig, copy.deepcopy(raw)))  # from_dict pops `type:` keys from what it reads
    except (ConfigError, TypeError, ValueError):
        pass
    return _flat(yaml.safe_load(yaml.safe_dump(raw, sort_keys=False)))  # tuples, numbers: as YAML gives them back


def allowed(key: str, guard_on: bool) -> bool:
    if key.startswith("health."):
        return not guard_on
    return any(key == p or (p.endswith((".", "_")) and key.startswith(p)) for p in ALLOWED_PREFIXES)


def config_changes(old: dict, new: dict) -> list[tuple[str, object, object, bool]]:
    """[(key, old, new, allowed)] for every leaf key whose value differs (dicts as to_dict writes them)."""
    a, b = _normalise(old), _normalise(new)
    guard_on = bool(a.get("guard.enabled")) or bool(b.get("guard.enabled"))
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
        if va != vb:
            out.append((k, va, vb, allowed(k, guard_on)))
    return out


def saved_config(meta: dict, run_dir: str):
    """(config dict, where it came from) of the checkpoint: its meta, else the run folder's config.yaml, else None."""
    if isinstance(meta.get("config"), dict):
        return meta["config"], f"checkpoint step {meta.get('step')}"
    path = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(path):
        with open(path) as fh:
            return yaml.safe_load(fh) or {}, path
    return None, None


def check_resume_config(new_cfg, ckpt, run_dir: str, allow_change: bool) -> list:
    """Before a resume loads anything: refuse (ConfigError on `--resume`) a config that changes a key outside
    ALLOWED against the latest checkpoint's (`ckpt`, a CheckpointManager), unless `allow_change`. Returns the
    changes found (allowed ones included); nothing to compare without a checkpoint (the resume itself says so)."""
    meta = None
    for step in reversed(ckpt.steps()):  # the newest readable meta: an unreadable one is the resume's to skip
        try:
            meta = ckpt.read_meta(step)
            break
        except (OSError, ValueError):
            continue
    if meta is None:
        return []
    old, where = saved_config(meta, run_dir)
    if old is None:
        print(f"warning: --resume: {run_dir} holds no saved config; the config cannot be compared", file=sys.stderr)
        return []
    changes = config_changes(old, to_dict(new_cfg))
    refused = [c for c in changes if not c[3]]
    text = "; ".join(f"{k}: {va!r} -> {vb!r}{renamed_note(k)}" for k, va, vb, _ in refused)
    if refused and not allow_change:
        raise ConfigError(
            "--resume",
            f"the config differs from the one of {where} in keys that change the training: {text}. Resume with the "
            "checkpoint's values, or pass --allow-config-change (the run then differs from an uninterrupted one)",
        )
    if refused:
        print(f"warning: --resume --allow-config-change: resuming with changed {text}", file=sys.stderr)
    return changes


def renamed_note(key: str) -> str:
    """ " (renamed: NEW)" when `key` is a key of older configs that its section's `moved` table names (a checkpoint
    written before the rename holds the old key; the values are compared as they stand)."""
    import typing

    from twocircuit_jax.config.run import RunConfig

    cls, parts = RunConfig, key.split(".")
    for part in parts[:-1]:
        cls = typing.get_type_hints(cls).get(part) if hasattr(cls, "__dataclass_fields__") else None
        if cls is None:
            return ""
    new = getattr(cls, "moved", {}).get(parts[-1])
    return f" (renamed: {'.'.join(parts[:-1] + [new])})" if new else ""
