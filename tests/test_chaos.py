"""Crash safety: checkpoint commits are durable (fsync before the rename), a resume falls back past an unreadable
newest checkpoint, and scripts/chaos.py's killed-and-resumed run ends bit for bit where an uninterrupted one does."""

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from scripts_module import load_script
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.train import faults
from twocircuit_jax.train.checkpoint import CheckpointManager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chaos():
    return load_script("chaos")


def test_every_file_and_folder_is_fsynced_before_the_commit_rename(tmp_path, monkeypatch):
    """A power loss after the rename must not leave a committed name over unwritten files: every file and folder of
    the new checkpoint is fsynced before it is renamed into place, and the parent folder after (the rename itself)."""
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", os.fspath(src), os.fspath(dst)))
        return real_rename(src, dst)

    cm = CheckpointManager(tmp_path)
    state = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    saves = (
        ("step_00000001", lambda: cm.save(1, state, {"a": 1}, {"x.npz": b"1"})),
        ("best", lambda: cm.save_best(1, state, {}, 0.5)),
    )
    for name, save in saves:
        events.clear()
        save()
        final = tmp_path / name
        commit = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(final))
        tmp = events[commit][1]
        synced_before = {e[1] for e in events[:commit] if e[0] == "fsync"}
        inside = {os.path.join(d, n).replace(str(final), tmp, 1) for d, ds, fs in os.walk(final) for n in ds + fs}
        assert inside | {tmp} <= synced_before, sorted(inside | {tmp} - synced_before)[:5]
        assert ("fsync", str(tmp_path)) in events[commit + 1 :]  # the rename made durable


def test_a_committed_folder_being_deleted_never_looks_committed(tmp_path, monkeypatch):
    """Retention renames a folder to `.tmp-*` before deleting its files: a crash in between leaves debris the next
    start removes, never a `step_*` with its marker and half its arrays."""
    import types

    from twocircuit_jax.train import checkpoint

    cm = CheckpointManager(tmp_path, keep_last=1)
    state = {"w": jnp.ones(4)}
    cm.save(1, state, {})
    seen = []
    # the crash: checkpoint.py's deletions do nothing, as if the process died as each began
    monkeypatch.setattr(
        checkpoint, "shutil", types.SimpleNamespace(rmtree=lambda p, **k: seen.append(os.path.basename(p)))
    )
    cm.save(2, state, {})
    assert seen and all(n.startswith(".tmp-") for n in seen), seen
    assert cm.steps() == [2]


def test_fault_point_spec_is_checked():
    assert faults._parse("ckpt/before_commit:3") == ("ckpt/before_commit", 3, 9)
    assert faults._parse("metrics/after_line:2:TERM")[2] == 15
    for bad in ("ckpt/before_comit:1", "ckpt/before_commit:0", "metrics/after_line:1:HUP", "x"):
        with pytest.raises(ValueError, match="TWOCIRCUIT_CHAOS_POINT"):
            faults._parse(bad)


def _params(run, step):
    return _chaos()._params(str(run), step)


@pytest.mark.slow
def test_resume_falls_back_past_an_unreadable_newest_checkpoint(tmp_path, monkeypatch, capsys):
    """A run stopped after step 3 (checkpoints 2 and 3) whose newest checkpoint is then torn, a corrupt meta.json or
    a missing array file, resumes from step 2 with a warning naming both, keeps the bad one as
    step_00000003.unreadable, and ends exactly as the same run resumed with checkpoint 3 gone."""
    from twocircuit_jax.train import loop

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(tiny_config(grpo={"format_penalty": -1.0}, train={"steps": 4, "checkpoint_every": 1}))
    )
    argv = lambda run: ["train", "--config", str(cfg), "--out", str(run), "--no-progress"]  # noqa: E731
    cut = tmp_path / "cut"
    real = loop.GRPOTrainer.grpo_step

    def dying(self, gs):
        if gs == 4:
            raise KeyboardInterrupt
        return real(self, gs)

    monkeypatch.setattr(loop.GRPOTrainer, "grpo_step", dying)
    assert main(argv(cut)) == 130
    monkeypatch.setattr(loop.GRPOTrainer, "grpo_step", real)
    assert sorted(os.listdir(cut / "checkpoints")) == ["step_00000002", "step_00000003"]
    runs = {name: tmp_path / name for name in ("older", "meta", "arrays")}
    for run in runs.values():
        shutil.copytree(cut, run)
    shutil.rmtree(runs["older"] / "checkpoints" / "step_00000003")
    (runs["meta"] / "checkpoints" / "step_00000003" / "meta.json").write_text('{"step": 3, "hist')
    data = [
        os.path.join(d, f)
        for d, _, fs in os.walk(runs["arrays"] / "checkpoints" / "step_00000003" / "state")
        for f in fs
    ]
    os.remove(max(data, key=os.path.getsize))  # the biggest array file
    capsys.readouterr()
    for name, run in runs.items():
        assert main(argv(run) + ["--resume"]) == 0, name
        err = capsys.readouterr().err
        if name != "older":
            bad = run / "checkpoints" / "step_00000003"
            assert f"warning: checkpoint {bad} is unreadable" in err and "resuming from step_00000002" in err, err
            assert (run / "checkpoints" / "step_00000003.unreadable" / "COMMITTED").is_file()  # kept, not deleted
    ref_rows = [json.loads(x) for x in open(runs["older"] / "metrics.jsonl")]
    ref_params = _params(runs["older"], 4)
    for name in ("meta", "arrays"):
        rows = [json.loads(x) for x in open(runs[name] / "metrics.jsonl")]
        strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
        assert [strip(r) for r in rows] == [strip(r) for r in ref_rows], name
        got = _params(runs[name], 4)
        assert got.keys() == ref_params.keys()
        for k in got:
            assert got[k].tobytes() == ref_params[k].tobytes(), (name, k)
    assert np.isfinite(ref_params[next(iter(ref_params))]).all()


@pytest.mark.slow
def test_chaos_short_run_survives_kills_at_injection_points(tmp_path):
    """scripts/chaos.py, short: a 4-step run SIGKILLed twice at seeded fault points (checkpoint commits, retention,
    best updates, metrics lines), resumed after each, equals the uninterrupted run bit for bit."""
    out = tmp_path / "chaos"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, os.path.join(ROOT, "scripts", "chaos.py"), "--kills", "2", "--steps", "4"]
    res = subprocess.run(argv + ["--timing-share", "0", "--out", str(out)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "2/2 kills survived" in res.stdout and "MISMATCH" not in res.stdout, res.stdout
    assert res.stdout.count("SIGKILL at ") == 2


def test_the_default_config_checkpoints_periodically():
    """A crash with the defaults loses a bounded number of steps, not the whole run (the default was 0: none)."""
    from twocircuit_jax.config.sections import TrainConfig

    assert 0 < TrainConfig().checkpoint_every <= 100


def test_the_resumed_metrics_file_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    """A resume rewrites metrics.jsonl up to its checkpoint's step (temp file, then rename): the temp file is on disk
    before the rename, and the folder after it."""
    from twocircuit_jax.metrics.logger import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(4)))
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b)))
    MetricsLogger(tmp_path, 4, show_progress=False, resume_from_step=2).close()
    at = events.index(("replace", str(tmp_path / "metrics.jsonl.tmp"), str(tmp_path / "metrics.jsonl")))
    assert str(tmp_path / "metrics.jsonl.tmp") in events[:at] and str(tmp_path) in events[at + 1 :], events
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [0, 1, 2]


_PUBLISH = """
import sys
import numpy as np
from twocircuit_jax.sampler.weight_publish import WeightPublisher
pub = WeightPublisher(sys.argv[1], {"tiny": 1}, "float32", full_every=20)
for v in range(4):  # v0 full, v1-v3 deltas; the chaos point kills the 4th export (v3)
    pub.publish({"w": np.arange(64, dtype=np.float32) + v, "b": np.full(8, float(v), np.float32)}, v)
"""


@pytest.mark.parametrize("point", ["export/before_commit", "export/after_commit"])
def test_a_weight_export_killed_at_its_commit_is_cleaned_up_by_the_resume(tmp_path, point):
    """The sampler's weight export SIGKILLed before its rename (a .tmp-* folder left) or after it (a version newer
    than the checkpoint left): the resumed publisher, from checkpoint step 2, removes the debris and the newer
    version, and the versions it writes next rebuild to its own weights."""
    root = str(tmp_path / "exports")
    env = {
        **os.environ,
        faults.ENV: f"{point}:4",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    dead = subprocess.run([sys.executable, "-c", _PUBLISH, root], env=env, capture_output=True, text=True)
    assert dead.returncode == -9, dead.stderr[-2000:]
    from twocircuit_jax.sampler import export as ex, weight_publish as wp, weight_receive as wr

    before = point == "export/before_commit"
    assert ex.list_versions(root) == ([0, 1, 2] if before else [0, 1, 2, 3])
    assert any(n.startswith(".tmp-v00000003-") for n in os.listdir(root)) == before
    mine = {v: {"w": np.arange(64, dtype=np.float32) * 2 + v, "b": np.full(8, -float(v), np.float32)} for v in (2, 3)}
    pub = wp.WeightPublisher(root, {"tiny": 1}, "float32", full_every=20)
    assert pub.publish(mine[2], 2).kind == "full" and ex.list_versions(root) == [0, 1, 2]  # the dead run's v3 gone
    assert pub.publish(mine[3], 3).kind == "delta"
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    assert ex.list_versions(root)[-2:] == [2, 3]
    for v in (2, 3):
        got = wr.rebuild(root, v)[1]
        assert all(got[k].tobytes() == mine[v][k].tobytes() for k in mine[v]), v
