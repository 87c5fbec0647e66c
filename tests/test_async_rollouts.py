"""`train.async_rollouts: 1`: each step trains on rollouts generated during the step before, from the weights one
version back; the schedule, not timing, fixes which weights made which batch, so an inline run, a threaded run and
a resumed run are the same run."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny_config, with_device_count

from twocircuit_jax.config import ConfigError, load_config
from twocircuit_jax.train.loop import GRPOTrainer
from twocircuit_jax.train.run_checkpoints import AHEAD_BLOB

pytestmark = pytest.mark.slow

CFG = tiny_config(
    grpo={"tis": "token"},
    train={"steps": 4, "async_rollouts": 1, "checkpoint_every": 2, "eval_every": 0},
    eval={"at_start": False, "at_end": False},
)
TIMING = ("time/", "sampler/generate_ahead_s", "sampler/score_ahead_s")


def _rows(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def _same(a, b):
    """Every key but wall-clock ones equal, exactly."""
    ka = {k for k in a if not k.startswith(TIMING)}
    assert ka == {k for k in b if not k.startswith(TIMING)}
    bad = {k: (a[k], b[k]) for k in ka if a[k] != b[k]}
    assert not bad, bad


def _logp(tr, params, col):
    dev = tr.built.shard({k: col.batch[k] for k in ("tokens", "attention_mask", "sample_id")})
    lp = np.asarray(tr.built.programs.logp_dense(jax.tree.map(jnp.asarray, params), dev, tr.cs)[0])
    return np.max(np.abs(lp - col.batch["sampler_logp"]) * col.batch["response_mask"])


@pytest.fixture(scope="module")
def inline_run(tmp_path_factory):
    """4 async steps on the 8-device CPU mesh, where the embedded sampler generates step gs+1's rollouts inline at
    the start of step gs; the weights of every version and each step's sampler-vs-trainer gaps."""
    run = str(tmp_path_factory.mktemp("async") / "a")
    tr = GRPOTrainer(load_config(data=CFG), run, show_progress=False)
    assert tr.built.ahead is not None and not tr.built.ahead.threaded
    params, gaps = {0: jax.tree.map(np.asarray, tr.state.params)}, {}
    with tr:
        for gs in range(1, 5):
            tr.step()
            params[gs] = jax.tree.map(np.asarray, tr.state.params)
            if gs < 4:  # step gs+1's rollouts are finished (joined before version gs was published)
                step, col = tr.built.ahead.held()
                assert step == gs + 1
                gaps[gs + 1] = {v: _logp(tr, params[v], col) for v in (gs - 1, gs)}
    return run, gaps


def test_each_step_trains_on_the_previous_versions_rollouts(inline_run):
    run, gaps = inline_run
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["sampler/weight_version"] == 0 and rows[0]["sampler/staleness"] == 0
    for r in rows[1:]:
        assert r["sampler/weight_version"] == r["step"] - 2 and r["sampler/staleness"] == 1
        assert r["sampler/generate_ahead_s"] > 0 and "time/generate_s" not in r
        assert r["tis/weight_max"] != 1.0  # TIS weighs the stale rollouts
    for gs, g in gaps.items():
        # The sampler's log-probs are those of version gs-2 (the trainer's forward, up to kernel round-off), and
        # visibly not those of version gs-1, the weights the trainer holds when it trains on them.
        assert g[gs - 2] < 1e-5, (gs, g)
        assert g[gs - 1] > 100 * max(g[gs - 2], 1e-7), (gs, g)


def test_a_resumed_run_repeats_the_uninterrupted_one(inline_run, tmp_path):
    run, _ = inline_run
    ref = _rows(run)
    # Resume from step 2: the step-ahead rollouts saved with the checkpoint are step 3's.
    res = str(tmp_path / "resumed")
    shutil.copytree(run, res)
    shutil.rmtree(os.path.join(res, "checkpoints", "step_00000004"))
    with open(os.path.join(res, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in ref[:2])
    assert os.path.exists(os.path.join(res, "checkpoints", "step_00000002", "blobs", AHEAD_BLOB))
    GRPOTrainer(load_config(data=CFG), res, resume=True, show_progress=False).run()
    got = _rows(res)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got[2:], ref[2:]):
        _same(a, b)


_THREADED_AND_INLINE = """
import json, sys
from tiny_run import tiny_config
from twocircuit_jax.config import load_config
from twocircuit_jax.train import built_run, loop
cfg = load_config(data=json.loads(sys.argv[1]))
tr = loop.GRPOTrainer(cfg, sys.argv[2], show_progress=False)
assert tr.built.ahead.threaded, "one device: the embedded sampler generates in the background"
tr.run()
real = built_run.RolloutAhead  # the run's assembly makes it (train/built_run.py)
built_run.RolloutAhead = lambda threaded: real(threaded=False)
loop.GRPOTrainer(cfg, sys.argv[3], show_progress=False).run()
"""


def test_threaded_generation_repeats_the_inline_run(tmp_path):
    """One device (a child process): no collectives, so the embedded sampler generates in a background thread
    while the train step runs; the same run as inline generation."""
    env = {**os.environ, "XLA_FLAGS": with_device_count(1)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), env.get("PYTHONPATH")]))
    a, b = str(tmp_path / "threaded"), str(tmp_path / "inline")
    out = subprocess.run(
        [sys.executable, "-c", _THREADED_AND_INLINE, json.dumps(CFG), a, b],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ra, rb = _rows(a), _rows(b)
    assert [r["sampler/staleness"] for r in ra] == [0, 1, 1, 1]
    for x, y in zip(ra, rb, strict=True):
        _same(x, y)


def test_async_rollouts_is_checked():
    with pytest.raises(ConfigError, match="train.async_rollouts.*allowed 0 or 1"):
        load_config(data=tiny_config(train={"async_rollouts": 2}))
