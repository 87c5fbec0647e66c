"""examples/custom_reward.py, the README's own-task example, runs as shipped (two steps here)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "custom_reward.py")


def test_example_is_short():
    with open(EXAMPLE) as f:
        assert len(f.read().splitlines()) <= 30


@pytest.mark.slow
def test_custom_reward_example_runs(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "2", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "reward/correct" in rows[1] and "reward/brief" in rows[1] and "eval/accuracy" in rows[2]
    assert "'steps': 2" in proc.stdout


def test_readme_shows_the_example_whole():
    with open(EXAMPLE) as f, open(os.path.join(ROOT, "README.md")) as r:
        assert f.read() in r.read()
