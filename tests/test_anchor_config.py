"""The anchor's typed config (config/anchor.py): each merger type parses from its own section, and the flat keys of
earlier configs move to their sections with a ConfigWarning (a checkpoint's saved config compares equal after it)."""

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
from twocircuit_jax.config.base import ConfigWarning
from twocircuit_jax.train.resume_config import config_changes

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


def test_old_flat_keys_move_to_their_sections_with_a_warning():
    with pytest.warns(ConfigWarning) as rec:
        old = _anchor(OLD_SAVED)
    text = "\n".join(str(w.message) for w in rec)
    for moved in ("anchor.merger is an old flat key: moved to anchor.merger.type", "moved to anchor.merger.decay",
                  "anchor.swap_alpha is an old flat key: moved to anchor.swap.alpha",
                  "moved to anchor.projection.enabled", "anchor.replay_paired_batch: removed key",
                  "anchor.ef_lambda: ignored; merger signed_gate has no such field"):  # fmt: skip
        assert moved in text, moved
    new = _quiet(
        {
            "enabled": True,
            "cadence": 4,
            "delay": 4,
            "merger": {"type": "signed_gate", "beta_anc": 0.5},
            "projection": {"window": 2, "min_snapshots": 2},
        }
    )
    assert old == new
    # Each flat key lands in its field (non-default values, so a key dropped on the way would show).
    with pytest.warns(ConfigWarning):
        a = _anchor(
            {
                "merger": "delayed_ef",
                "ef_lambda": 0.5,
                "ef_decay": 0.9,
                "beta_anc": 0.25,
                "merger_cadence": 2,
                "cadence": 4,
                "gate_decay": 0.5,
                "strength": 0.5,
                "window": 3,
                "window_mode": "growing_fixed_base",
                "max_snapshots": 5,
                "swap_cadence": 8,
                "swap_beta1": 0.7,
                "swap_beta2": 0.9,
                "swap_scale_match": False,
                "swap_mode": "zero",
                "enabled": True,
            }  # fmt: skip
        )
    assert a.merger == DelayedEfMerger(beta_anc=0.25, cadence=2, weight=0.5, decay=0.9)  # gate_decay not taken
    p, s = a.projection, a.swap
    assert (p.enabled, p.strength, p.window, p.window_mode, p.max_snapshots) == (True, 0.5, 3, "growing_fixed_base", 5)
    assert (s.cadence, s.beta1, s.beta2, s.scale_match, s.mode) == (8, 0.7, 0.9, False, "zero")
    with pytest.warns(ConfigWarning) as rec:
        assert _anchor({"merger": "blend", "blend_eta": 0.3}).merger == BlendMerger(eta=0.3)
    assert "anchor.blend_eta is an old flat key: moved to anchor.merger.eta" in [str(w.message) for w in rec]


def test_a_flat_set_wins_over_the_section():
    with pytest.warns(ConfigWarning):
        a = _anchor({"enabled": True, "merger": {"alpha": 0.5}, "swap": {"cadence": 2}}, ["anchor.alpha=0.75"])
    assert a.merger.alpha == 0.75 and a.swap.cadence == 2
    with pytest.warns(ConfigWarning):
        a = _anchor({"projection": {"window": 3}}, ["anchor.projection=false"])
    assert not a.projection.enabled


def test_removed_single_valued_keys():
    for key, value in (("replay_paired_batch", False), ("batch_scope", "rollout_batch"), ("warmup_mode", "q_only")):
        with pytest.raises(ConfigError, match=rf"anchor.{key}: got {value!r}; removed key, only"):
            _anchor({key: value})


def test_a_sectioned_child_beats_its_flat_base(tmp_path):
    """`base:` composition: a base file still flat, a child with sections: the child's values win."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"anchor": {"merger": "blend", "blend_eta": 0.3, "window": 2}}))
    (tmp_path / "child.yaml").write_text(
        yaml.safe_dump({"base": "base.yaml", "anchor": {"merger": {"eta": 0.6}, "projection": {"window": 3}}})
    )
    with pytest.warns(ConfigWarning):
        a = load_config(str(tmp_path / "child.yaml")).anchor
    assert a.merger == BlendMerger(eta=0.6) and a.projection.window == 3


def test_an_old_checkpoint_config_compares_equal_after_migration():
    """train/resume_config.py: the flat anchor of an old checkpoint's config and the same run in sections differ in
    no key, and the comparison prints no migration warnings (they were the old run's to give)."""
    new = to_dict(
        load_config(
            data={
                "anchor": {
                    "enabled": True,
                    "cadence": 4,
                    "delay": 4,
                    "merger": {"type": "signed_gate"},
                    "projection": {"window": 2},
                }
            }
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_changes({"anchor": OLD_SAVED}, new) == []
        changed = dict(OLD_SAVED, gate_decay=0.5)
        assert [c[:3] for c in config_changes({"anchor": changed}, new)] == [("anchor.merger.decay", 0.5, 0.75)]
