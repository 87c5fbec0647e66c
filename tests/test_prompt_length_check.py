"""Every prompt's length is checked before step 1: a training or held-out row longer than train.max_prompt_len
exits 2 at start, naming the file, the row, its length and the limit. Before, such a row was found only when a
step drew it (exit 1, hours in), and a long held-out row ended the start with a ValueError (exit 1)."""

import json

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main


def _rows(path, questions):
    path.write_text("".join(json.dumps({"problem": q, "answer": "1"}) + "\n" for q in questions))
    return str(path)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_too_long_row_exits_2_at_start_naming_it(tmp_path, capsys, split):
    short = [f"{i}+0" for i in range(8)]
    long = short[:5] + ["9" * 60] + short[5:]  # the char tokenizer: one token per character (+BOS)
    files = {"train": _rows(tmp_path / "train.jsonl", long if split == "train" else short)}
    files["eval"] = _rows(tmp_path / "eval.jsonl", long if split == "eval" else short)
    task = {
        "type": "math_files",
        "train_files": [files["train"]],
        "eval_files": [files["eval"]],
        "prompt_template": "{question}=",
    }
    cfg = tiny_config(name="t", train={"steps": 2, "prompts_per_step": 2, "eval_size": 8, "max_prompt_len": 16})
    cfg["task"] = task
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    assert main(["train", "--config", str(path), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{files[split]}:6" in err  # the file and its line (the sixth row)
    assert f"{split} row 5" in err and "62 tokens" in err and "limit is 16" in err and "train.max_prompt_len" in err
    assert not out.exists()  # nothing half-written
