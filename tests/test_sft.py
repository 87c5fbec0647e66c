"""`twocircuit sft` end to end on the tiny config: a few supervised steps through the shared train-step builder
(state and circuit state donated), the loss falls, and a Hugging Face directory comes out that loads back."""

import json

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main

pytestmark = pytest.mark.slow  # a CLI run: `make test-fast` skips it, `make test` (CI) runs it


def test_sft_runs_and_writes_a_loadable_model(tmp_path, capsys):
    cfg = tiny_config(sft={"steps": 6, "batch": 16, "lr": 3e-3, "warmup_steps": 1, "max_len": 16, "eval_every": 3})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "base"
    assert main(["sft", "--config", str(tmp_path / "cfg.yaml"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    losses = [float(line.split("loss ")[1].split()[0]) for line in text.splitlines() if line.startswith("sft step")]
    assert len(losses) == 2 and losses[1] < losses[0], text
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == cfg["model"]["num_layers"]

    from twocircuit_jax.model.hf_io import load_hf

    mcfg, params = load_hf(str(out))
    assert mcfg.hidden_size == cfg["model"]["hidden_size"] and "embed" in params


def test_sft_eval_every_zero_evaluates_after_the_last_step_only(tmp_path, capsys):
    cfg = tiny_config(sft={"steps": 3, "batch": 8, "lr": 3e-3, "warmup_steps": 1, "max_len": 16, "eval_every": 0})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["sft", "--config", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "base")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sft step")]
    assert [line.split()[2] for line in lines] == ["3/3"], lines
