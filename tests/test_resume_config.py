"""A resumed run's config is compared with its checkpoint's: a change that alters the training is refused (exit 2,
naming each key with its old and new value) unless --allow-config-change; run-length, cadence and transport keys
may change freely. Before, `--resume --set optim.lr=…` silently continued as a different run."""

import json
import os

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import to_dict
from twocircuit_jax.train.checkpoint import CheckpointManager
from twocircuit_jax.train.resume_config import ALLOWED_PREFIXES, config_changes, saved_config

CFG = tiny_config(eval={"at_start": False}, train={"steps": 1, "checkpoint_every": 1})


def _changes(**sets):
    old = to_dict(load_config(data=CFG))
    new = to_dict(load_config(data=CFG, overrides=[f"{k}={v}" for k, v in sets.items()]))
    return {k: (a, b, ok) for k, a, b, ok in config_changes(old, new)}


def test_which_changes_are_allowed():
    assert _changes() == {}
    ch = _changes(**{"train.steps": 9, "train.checkpoint_every": 3, "train.eval_every": 2, "sampler.port": 9000})
    assert set(ch) == {"train.steps", "train.checkpoint_every", "train.eval_every", "sampler.port"}
    assert all(ok for _, _, ok in ch.values())
    ch = _changes(
        **{"optim.lr": 0.5, "train.seed": 7, "train.prompts_per_step": 8, "sampler.sampling.max_new_tokens": 6}
    )
    assert ch["optim.lr"] == (0.001, 0.5, False) and ch["train.seed"][2] is False
    assert not ch["train.prompts_per_step"][2] and not ch["sampler.sampling.max_new_tokens"][2]
    assert _changes(**{"health.window": 4})["health.window"][2] is True  # guard off: the gauges only report
    assert _changes(**{"health.window": 4, "guard.enabled": "true"})["health.window"][2] is False
    # a config written before a field existed compares that field at its default: no change
    old = to_dict(load_config(data=CFG))
    del old["grpo"]["clip_high"]
    assert config_changes(old, to_dict(load_config(data=CFG))) == []


@pytest.mark.slow
def test_resume_refuses_a_changed_config_unless_allowed(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    run = str(tmp_path / "run")
    argv = ["train", "--config", str(cfg), "--out", run, "--no-progress", "--resume", "--set", "train.steps=2"]
    assert main(argv[:6]) == 0
    capsys.readouterr()
    meta = CheckpointManager(f"{run}/checkpoints").read_meta(1)
    assert meta["config"]["optim"]["lr"] == 0.001 and saved_config(meta, run)[1] == "checkpoint step 1"

    changed = argv + ["--set", "optim.lr=0.002", "--set", "train.seed=5"]
    assert main(changed) == 2
    err = capsys.readouterr().err
    assert "optim.lr: 0.001 -> 0.002" in err and "train.seed: 0 -> 5" in err and "--allow-config-change" in err
    assert "train.steps" not in err  # allowed: not named
    assert [json.loads(x)["step"] for x in open(f"{run}/metrics.jsonl")] == [1]  # nothing ran

    assert main(changed + ["--allow-config-change"]) == 0
    assert "resuming with changed optim.lr: 0.001 -> 0.002" in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in open(f"{run}/metrics.jsonl")] == [1, 2]
    assert CheckpointManager(f"{run}/checkpoints").read_meta(2)["config"]["optim"]["lr"] == 0.002


def test_an_older_checkpoint_without_a_stored_config_compares_with_config_yaml(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"optim": {"lr": 0.5}}))
    old, where = saved_config({"step": 3}, str(tmp_path))
    assert old == {"optim": {"lr": 0.5}} and where.endswith("config.yaml")
    assert saved_config({"step": 3}, str(tmp_path / "none")) == (None, None)


def test_every_allowed_key_is_documented():
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "reliability.md")).read()
    missing = [p for p in ALLOWED_PREFIXES if f"`{p.rstrip('.')}" not in text]
    assert not missing and "--allow-config-change" in text, missing


def test_a_renamed_key_is_named_with_its_new_name():
    """A checkpoint written before a key was renamed holds the old key: the resume's refusal says what it is now."""
    from twocircuit_jax.train.resume_config import renamed_note

    assert renamed_note("train.micro_batch") == " (renamed: train.micro_batch_per_device)"
    assert renamed_note("train.microbatches") == " (renamed: train.pipeline_microbatches)"
    assert renamed_note("train.train_batch") == " (renamed: train.prompts_per_step)"
    assert renamed_note("train.mini_batch") == " (renamed: train.prompts_per_update)"
    assert renamed_note("anchor.gate_decay") == " (renamed: anchor.merger.decay)"
    assert renamed_note("train.steps") == "" and renamed_note("nothing.here") == ""
