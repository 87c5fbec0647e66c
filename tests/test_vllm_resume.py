"""A vLLM-sampler run killed (SIGKILL) past its checkpoint resumes: its first export survives the dead run's newer
ones, and the engine serves the trainer's weights afterwards. Engine-free unit tests: tests/test_export_resume.py.

Before the fix: the dead run's full export v6 (full_every 3) and deltas v7-v8 outranked the resumed run's v5 in
pruning, v5 was deleted as it was written, and the resume exited 1 ("sampler could not load weight version 5").
"""

import json
import os
import subprocess
import sys

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.sampler import export as ex

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CFG = tiny_config(
    name="vllm_resume",
    model={"hidden_size": 64, "head_dim": 32, "intermediate_size": 96, "max_position_embeddings": 64},
    sampler={"backend": "vllm", "sampling": {"max_new_tokens": 6}, "startup_timeout_s": 240, "full_every": 3},
    train={"steps": 10, "checkpoint_every": 5, "final_checkpoint": False},
)

_KILLED_RUN = """
import os, signal, sys
from twocircuit_jax.train import loop
real = loop.GRPOTrainer.grpo_step
def step(self, gs):
    if gs == 9:  # steps 1-8 done and published, checkpoint step 5 on disk
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, gs)
loop.GRPOTrainer.grpo_step = step
from twocircuit_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_vllm_run_killed_after_a_checkpoint_resumes(tmp_path, monkeypatch):
    # libtpu (the test extra) makes vLLM detect a TPU platform beside the CPU one and refuse to start
    monkeypatch.setenv("VLLM_TARGET_DEVICE", os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    run = tmp_path / "run"
    argv = ["train", "--config", str(cfg), "--out", str(run), "--no-progress"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    dead = subprocess.run([sys.executable, "-c", _KILLED_RUN, *argv], env=env, capture_output=True, text=True)
    assert dead.returncode == -9, dead.stderr[-3000:]
    exports = str(run / "sampler" / "exports")
    # the state the dead run left: checkpoint 5, and a newer full export with its deltas
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000005"]
    left = ex.list_versions(exports)
    assert left == [6, 7, 8], left
    assert ex.read_meta(ex.version_dir(exports, 6))["kind"] == "full"

    assert main(argv + ["--resume"]) == 0
    rows = {}
    for line in open(run / "metrics.jsonl"):
        r = json.loads(line)
        rows[r["step"]] = r  # a resumed step's line replaces the dead run's
    assert sorted(rows) == list(range(11))
    for s in range(6, 11):  # the engine serves exactly the resumed trainer's weights (a stale one shows a gap)
        assert rows[s]["sampler/weight_version"] == s - 1
        assert rows[s]["mismatch/prob_gap_mean"] < 1e-4, (s, rows[s]["mismatch/prob_gap_mean"])
        assert rows[s]["mismatch/prob_corr"] > 0.9999
    assert max(ex.list_versions(exports)) == 10
