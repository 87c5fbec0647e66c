"""A run saved before the circuit state became one pytree (checkpoint state layout 1, by commit 051645e) resumes
with this code and repeats, step for step, what the old code logged without the interruption.

tests/data/layout1_run/ was made by the code of 051645e: `twocircuit train --config run.yaml` (lowrank codec with
an anchor-owned basis, PowerSGD past its warm-up, the anchor with merger and swap), stopped after step 3's
checkpoint (step_00000003 and metrics.jsonl kept); uninterrupted_metrics.jsonl was the same run left to finish.
Its steps 4-6 were recorded again when the embedded sampler's noise became keyed by row (the same seed then draws
other tokens, so no code after that change can repeat the old run's later rollouts): by resuming this checkpoint with
that commit's code, whose restore was unchanged from the code that passed this test against 051645e's own steps
(`XLA_FLAGS='--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0' JAX_PLATFORMS=cpu
twocircuit train --config run.yaml --out RUN --resume` on a copy of the folder). Steps 0-3 are still 051645e's.
Its anchor buffers were pickled then (anchor_buffers.pkl); checkpoints never hold pickles now, so that file was
converted once, array for array, to the data-only anchor_buffers.npz (train/safe_blob.py).
"""

import json
import shutil

import pytest

from twocircuit_jax.cli import main
from twocircuit_jax.train.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow  # an end-to-end run: `make test-fast` skips it, `make test` (CI) runs it

DATA = __file__.rsplit("/", 1)[0] + "/data/layout1_run"


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_layout1_checkpoint_resumes_exactly(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(DATA, run)
    assert "state_layout" not in CheckpointManager(run / "checkpoints").read_meta(3)  # really the old layout
    assert main(["train", "--config", str(run / "run.yaml"), "--out", str(run), "--no-progress", "--resume"]) == 0
    old, new = _rows(run / "uninterrupted_metrics.jsonl"), _rows(run / "metrics.jsonl")
    assert [r["step"] for r in new] == list(range(7))
    assert sum(r.get("anchor/fire", 0) for r in old[4:]) >= 1 and old[-1]["swap/count"] > 0
    assert old[-1]["codec/steps"] == new[-1]["codec/steps"] == 6
    for ro, rn in zip(old[4:], new[4:]):
        # the fixture's run predates the health gauges, the per-phase and compile times (train/timing.py) and
        # sampler/staleness (and the bound on scoring, on by default since): the resumed run logs them on top
        later = ("health/", "time/", "sampler/staleness", "anchor/skipped", "eval/accuracy_se", "reward/timeouts")
        assert {k for k in ro if not k.startswith(later)} == {k for k in rn if not k.startswith(later)}, ro["step"]
        assert {k for k in ro if k.startswith("time/")} <= set(rn), ro["step"]
        for k, v in ro.items():
            if k.startswith("time/") or not isinstance(v, (int, float)):
                continue
            # The fixture was recorded on another host and by older code, and XLA:CPU's last bits differ between
            # CPU types and between two orders of one matmul's sums (the model's linears over flattened tokens
            # moved a merger ratio by 2.8e-6): the first resumed step agrees to 1e-5; after it the round-off grows
            # (3e-4 by step 6). A resume from a wrong state (data order, RNG, optimizer or circuit state) is off
            # from the first step.
            rel = 1e-5 if ro["step"] == 4 else 1e-3
            assert rn[k] == pytest.approx(v, abs=1e-6, rel=rel), (ro["step"], k)
    assert CheckpointManager(run / "checkpoints").read_meta(6)["state_layout"] == 2  # new saves use the new one


def test_a_newer_layout_is_a_clear_error(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(DATA, run)
    meta = run / "checkpoints" / "step_00000003" / "meta.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), state_layout=99)))
    rc = main(["train", "--config", str(run / "run.yaml"), "--out", str(run), "--no-progress", "--resume"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "state layout 99" in err and "step_00000003" in err and "reads layouts 1 and 2" in err
