"""`--out` never deletes what a user put there: export-hf, import-hf, sft, train and sweep refuse a non-empty folder
twocircuit did not create (exit 2, one line naming it) unless --overwrite, and even then the user's file stays."""

import json
import os

import jax
import numpy as np
import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax import outdir
from twocircuit_jax.cli import main
from twocircuit_jax.config.sections import ModelConfig
from twocircuit_jax.model import init_params
from twocircuit_jax.model.hf_io import CheckpointError, load_hf, save_hf

MCFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
NOTE = "my notes, not a model"


def _user_folder(path):
    os.makedirs(path)
    (path / "notes.txt").write_text(NOTE)
    return path


def _refused(capsys, path):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "--overwrite" in err, err
    assert (path / "notes.txt").read_text() == NOTE and sorted(os.listdir(path)) == ["notes.txt"]


def _same_params(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.fixture
def hf_dir(tmp_path):
    params = jax.device_get(init_params(MCFG, jax.random.PRNGKey(0)))
    return str(save_hf(MCFG, params, str(tmp_path / "src"))), params


def test_export_hf_keeps_a_users_folder(tmp_path, capsys, hf_dir):
    src, params = hf_dir
    out = _user_folder(tmp_path / "mine")
    argv = ["export-hf", "--checkpoint", src, "--out", str(out)]
    assert main(argv) == 2
    _refused(capsys, out)
    assert main(argv + ["--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == NOTE
    assert _same_params(load_hf(str(out))[1], params)
    # the folder is marked now: a second export replaces its own files only, the note stays
    assert main(argv) == 0 and (out / "notes.txt").read_text() == NOTE
    assert json.load(open(out / outdir.MARKER))["files"] == ["config.json", "model.safetensors"]


def test_import_hf_keeps_a_users_folder(tmp_path, capsys, hf_dir):
    from twocircuit_jax.sampler.export import load_export

    src, params = hf_dir
    out = _user_folder(tmp_path / "mine")
    argv = ["import-hf", "--hf-dir", src, "--out", str(out)]
    assert main(argv) == 2
    _refused(capsys, out)
    assert main(argv + ["--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == NOTE
    assert _same_params(load_export(str(out))[1], params)


def test_save_hf_replaces_only_its_own_files(tmp_path, hf_dir):
    _, params = hf_dir
    out = tmp_path / "exp"
    save_hf(MCFG, params, str(out), shard_bytes=20_000)  # a sharded export, then a user's file beside it
    shards = sorted(n for n in os.listdir(out) if n.startswith("model-"))
    assert len(shards) > 1
    (out / "notes.txt").write_text(NOTE)
    other = jax.tree.map(lambda x: x + 1, params)
    save_hf(MCFG, other, str(out))  # one file now: the earlier shards and index are the project's, so they go
    assert sorted(os.listdir(out)) == [outdir.MARKER, "config.json", "model.safetensors", "notes.txt"]
    assert _same_params(load_hf(str(out))[1], other)
    user = _user_folder(tmp_path / "user")
    with pytest.raises(CheckpointError, match="not written by twocircuit"):
        save_hf(MCFG, params, str(user))
    assert sorted(os.listdir(user)) == ["notes.txt"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]  # no temp folder left behind


TINY = tiny_config(name="out_tiny", train={"steps": 1})


@pytest.mark.slow
def test_sft_keeps_a_users_folder(tmp_path, capsys):
    cfg = tiny_config(sft={"steps": 2, "batch": 8, "lr": 3e-3, "warmup_steps": 1, "max_len": 16, "eval_every": 0})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = _user_folder(tmp_path / "mine")
    argv = ["sft", "--config", str(tmp_path / "cfg.yaml"), "--out", str(out)]
    assert main(argv) == 2
    _refused(capsys, out)
    assert main(argv + ["--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == NOTE and (out / "config.json").is_file()
    assert load_hf(str(out))[0].hidden_size == cfg["model"]["hidden_size"]


@pytest.mark.slow
def test_train_keeps_a_users_folder_and_overwrites_only_its_own_run(tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(TINY))
    out = _user_folder(tmp_path / "mine")
    argv = ["train", "--config", str(tmp_path / "cfg.yaml"), "--out", str(out), "--no-progress"]
    assert main(argv) == 2
    _refused(capsys, out)
    assert main(argv + ["--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == NOTE
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [0, 1]
    # its own run folder now: a plain rerun is refused as before, --resume and --overwrite work
    capsys.readouterr()
    assert main(argv) == 2 and "--resume" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0
    (out / "checkpoints" / "step_00000099").mkdir()  # a stale file of the earlier run: --overwrite removes it
    assert main(argv + ["--overwrite"]) == 0
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [0, 1]  # not appended to
    assert not (out / "checkpoints" / "step_00000099").exists() and (out / "notes.txt").read_text() == NOTE
    # a folder holding a name a run writes, not written by twocircuit: refused even with --overwrite
    theirs = _user_folder(tmp_path / "theirs")
    (theirs / "metrics.jsonl").write_text("their metrics\n")
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "cfg.yaml"), "--out", str(theirs), "--overwrite"]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err and (theirs / "metrics.jsonl").read_text() == "their metrics\n"


@pytest.mark.slow
def test_sweep_keeps_a_users_folder(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(TINY))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "arms": {"dense": {}}}))
    out = _user_folder(tmp_path / "mine")
    argv = ["sweep", "--config", str(tmp_path / "sweep.yaml"), "--out", str(out)]
    assert main(argv) == 2
    _refused(capsys, out)
    assert main(argv + ["--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == NOTE and (out / "dense" / "metrics.jsonl").is_file()
