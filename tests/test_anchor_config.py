"""The anchor's typed config (config/anchor.py): each merger type parses from its own section, and the flat keys of
earlier configs are refused with the key that holds each now."""

import warnings

import pytest
import yaml

from twocircuit_jax.config import ConfigError, load_config, to_dict
from twocircuit_jax.config.anchor import (
    BlendMerger,
    DelayedEfMerger,
    NoMerger,
    SignedEmaMerger,
    SignedGateMerger,
)

# The anchor section as the code before the typed sections saved it (to_dict of a run of configs/two_circuit.yaml,
# the `config` a checkpoint's meta holds): every key flat, the three single-valued ones included.
OLD_SAVED = {
    "enabled": True,
    "cadence": 4,
    "delay": 4,
    "replay_paired_batch": True,
    "batch_scope": "ppo_minibatch",
    "beta_anc": 0.5,
    "target_scope": "all",
    "owns_q": "auto",
    "merger": "signed_gate",
    "alpha": 0.25,
    "merger_cadence": 1,
    "gate_decay": 0.75,
    "ef_lambda": 1.0,
    "ef_decay": 1.0,
    "blend_eta": 0.5,
    "projection": True,
    "strength": 1.0,
    "window": 2,
    "min_snapshots": 2,
    "window_mode": "sliding_window",
    "max_snapshots": 8,
    "warmup_mode": "stale_correct",
    "swap_cadence": 0,
    "swap_alpha": 1.0,
    "swap_beta1": 0.8,
    "swap_beta2": 0.95,
    "swap_scale_match": True,
    "swap_mode": "anchor_moments",
}


def _anchor(section=None, sets=()):
    return load_config(data={"anchor": section or {}}, overrides=list(sets)).anchor


def _quiet(section=None, sets=()):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new layout moves nothing: no warning at all
        return _anchor(section, sets)


@pytest.mark.parametrize(
    "section, cls, fields",
    [
        ({"type": "none"}, NoMerger, {}),
        ({"type": "signed_ema", "alpha": 0.5, "beta_anc": 0.25, "cadence": 2}, SignedEmaMerger, {"alpha": 0.5}),
        ({"type": "signed_gate", "alpha": 0.1, "decay": 0.5}, SignedGateMerger, {"alpha": 0.1, "decay": 0.5}),
        ({"type": "blend", "eta": 0.3}, BlendMerger, {"eta": 0.3}),
        ({"type": "delayed_ef", "weight": 0.5, "decay": 0.9}, DelayedEfMerger, {"weight": 0.5, "decay": 0.9}),
    ],
)
def test_each_merger_type_parses_its_own_section(section, cls, fields):
    a = _quiet({"merger": section})
    assert type(a.merger) is cls and a.merger_type == section["type"]
    assert {k: getattr(a.merger, k) for k in fields} == fields
    assert a.merger_cadence == section.get("cadence", 1)
    again = load_config(data=yaml.safe_load(yaml.safe_dump({"anchor": to_dict(a)}))).anchor
    assert again == a  # the saved form (to_dict, with its type: key) reads back the same


def test_merger_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"anchor.merger.type: got 'sgd'; allowed: blend, delayed_ef, none"):
        _anchor({"merger": {"type": "sgd"}})
    with pytest.raises(ConfigError, match=r"anchor.merger.eta: unknown key; allowed keys here: alpha, beta_anc"):
        _anchor({"merger": {"type": "signed_ema", "eta": 0.3}})  # blend's field on another merger
    with pytest.raises(ConfigError, match=r"anchor.merger.decay: got 1.0; allowed \(0, 1\)"):
        _anchor({"merger": {"type": "signed_gate", "decay": 1.0}})
    with pytest.raises(ConfigError, match=r"anchor.merger.beta_anc: got 1.0; allowed \[0, 1\)"):
        _anchor({"merger": {"type": "blend", "beta_anc": 1.0}})
    with pytest.raises(ConfigError, match=r"anchor.projection.min_snapshots: got 3; allowed 2..window"):
        _anchor({"projection": {"window": 2, "min_snapshots": 3}})
    # A --set of another type replaces the section whole (apply_overrides), so the old type's fields do not stay.
    a = _quiet({"merger": {"type": "signed_gate", "decay": 0.5}}, ["anchor.merger.type=blend"])
    assert a.merger == BlendMerger()


def test_flat_keys_of_older_configs_are_refused_with_the_key_to_write():
    """Every flat key of the anchor as the code before the typed sections saved it (OLD_SAVED) is refused, naming
    the key that holds it now; the removed single-valued keys are refused as removed."""
    now = {"enabled", "cadence", "delay", "target_scope", "owns_q", "merger", "projection"}
    moved = {
        "beta_anc": "merger.beta_anc", "alpha": "merger.alpha", "merger_cadence": "merger.cadence",
        "gate_decay": "merger.decay", "ef_lambda": "merger.weight", "ef_decay": "merger.decay",
        "blend_eta": "merger.eta", "strength": "projection.strength", "window": "projection.window",
        "min_snapshots": "projection.min_snapshots", "window_mode": "projection.window_mode",
        "max_snapshots": "projection.max_snapshots", "swap_cadence": "swap.cadence", "swap_alpha": "swap.alpha",
        "swap_beta1": "swap.beta1", "swap_beta2": "swap.beta2", "swap_scale_match": "swap.scale_match",
        "swap_mode": "swap.mode",
    }  # fmt: skip
    removed = {"replay_paired_batch", "batch_scope", "warmup_mode"}
    assert set(OLD_SAVED) == now | set(moved) | removed  # the table covers the old layout's every key
    for key, value in OLD_SAVED.items():
        if key in now:
            continue
        with pytest.raises(ConfigError) as e:
            _anchor({"enabled": True, key: value})
        assert e.value.path == f"anchor.{key}", str(e.value)
        want = f"write anchor.{moved[key]} instead" if key in moved else "a removed key"
        assert want in e.value.message, str(e.value)
    assert _quiet({"merger": "blend"}).merger == BlendMerger()  # a merger's name alone: that type, its defaults
    with pytest.raises(ConfigError, match="anchor.projection"):
        _anchor({"projection": True})  # the old boolean: the section is a mapping now (projection.enabled)
