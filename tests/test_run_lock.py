"""A run folder belongs to one trainer at a time: a second `twocircuit train` on it (`--resume`, or `--overwrite`)
while the first is alive exits 2 naming the folder and the holder's pid, and touches nothing; the lock goes with the
holder's process, however it dies."""

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.train import faults

pytestmark = pytest.mark.slow  # real `twocircuit train` processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def _lock_holder(run):
    try:
        return open(run / faults.LOCK_FILE).read().strip()
    except FileNotFoundError:
        return None


def test_a_second_trainer_on_a_live_runs_folder_exits_2(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(train={"steps": 200, "checkpoint_every": 1})))
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "twocircuit_jax.cli", "train", "--config", str(cfg), "--out", str(run)]
    first = subprocess.Popen(argv + ["--no-progress"], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while _lock_holder(run) != str(first.pid) or not (run / "metrics.jsonl").is_file():
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "the first trainer never took the lock"
            time.sleep(0.2)
        while not any(n.startswith("step_") for n in os.listdir(run / "checkpoints")):  # something to resume from
            assert time.time() < deadline and first.poll() is None
            time.sleep(0.2)
        first.send_signal(signal.SIGSTOP)  # alive, holding the folder, and writing nothing while we look
        before = sorted(os.listdir(run))
        for extra in (["--resume"], ["--overwrite"]):
            second = subprocess.run(argv + ["--no-progress", *extra], env=_env(), capture_output=True, text=True)
            assert second.returncode == 2, (extra, second.stderr[-3000:])
            assert f"{run} is in use by another trainer (pid {first.pid}" in second.stderr, second.stderr
            assert sorted(os.listdir(run)) == before  # --overwrite removed nothing of the live run
        first.send_signal(signal.SIGKILL)
        first.wait()
        # the kernel released the dead holder's lock: the folder can be taken at once
        take = (
            "import sys; from twocircuit_jax.train import faults; faults.lock_run_folder(sys.argv[1]); print('taken')"
        )
        got = subprocess.run([sys.executable, "-c", take, str(run)], env=_env(), capture_output=True, text=True)
        assert got.returncode == 0 and got.stdout.strip() == "taken", got.stderr[-2000:]
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()


def test_a_trainer_that_fails_to_build_releases_the_folder(tmp_path):
    """A construction error after the lock was taken (here: a mesh the mini-batch's rows cannot split over, found
    once the model is loaded) releases it, so the same process (a sweep, a notebook) or another one can use the
    folder; before, the failed trainer's process held it until it exited."""
    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.train.loop import GRPOTrainer

    run = tmp_path / "run"
    cfg = tiny_config(train={"steps": 1, "train_batch": 3, "mini_batch": 3}, sampler={"n": 1})
    with pytest.raises(ConfigError, match="data-parallel size"):
        GRPOTrainer(cfg, str(run), show_progress=False)
    assert os.path.realpath(run) not in faults._held
    take = "import sys; from twocircuit_jax.train import faults; faults.lock_run_folder(sys.argv[1]); print('taken')"
    out = subprocess.run([sys.executable, "-c", take, str(run)], env=_env(), capture_output=True, text=True)
    assert out.stdout.strip() == "taken", out.stderr[-2000:]
