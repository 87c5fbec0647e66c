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

from twocircuit_jax.config.base import ConfigError
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
    cfg = tiny_config(train={"steps": 1, "prompts_per_step": 3, "prompts_per_update": 3}, sampler={"n": 1})
    with pytest.raises(ConfigError, match="data-parallel size"):
        GRPOTrainer(cfg, str(run), show_progress=False)
    assert os.path.realpath(run) not in faults._held
    take = "import sys; from twocircuit_jax.train import faults; faults.lock_run_folder(sys.argv[1]); print('taken')"
    out = subprocess.run([sys.executable, "-c", take, str(run)], env=_env(), capture_output=True, text=True)
    assert out.stdout.strip() == "taken", out.stderr[-2000:]


def test_a_forked_worker_does_not_keep_a_killed_trainers_folder(tmp_path):
    """The scoring and environment workers are forks of the trainer (tasks/bounded.py), and a flock belongs to the
    open file the fork shares: a worker that kept its copy held the folder after its trainer was SIGKILLed, until it
    noticed its parent was gone, and a resume started at once was refused. Here a process takes the lock, forks a
    child that lives on (sleeping), and is SIGKILLed; the folder is taken at once, with the child still alive, and
    the child's own lock-file copy is gone."""
    run = tmp_path / "run"
    run.mkdir()
    seen = tmp_path / "held_in_child"
    holder = (
        "import multiprocessing as mp, os, sys, time\n"
        "from twocircuit_jax.train import faults\n"
        "faults.lock_run_folder(sys.argv[1])\n"
        "def child():\n"
        "    open(sys.argv[2] + '.tmp', 'w').write(str(len(faults._held)))\n"
        "    os.rename(sys.argv[2] + '.tmp', sys.argv[2])\n"
        "    time.sleep(120)\n"
        "p = mp.get_context('fork').Process(target=child, daemon=False); p.start()\n"
        "print('child', p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(run), str(seen)],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child = None
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("child "):
            line = proc.stdout.readline()
        assert line, "the holder died before forking"
        child = int(line.split()[1])
        deadline = time.time() + 60
        while not seen.exists():
            assert time.time() < deadline, "the fork never reported"
            time.sleep(0.05)
        assert seen.read_text() == "0"  # the fork kept no lock file of its own
        with pytest.raises(ConfigError, match="in use"):
            faults.lock_run_folder(str(run))  # the live holder still holds it
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # the fork is still alive
        key = faults.lock_run_folder(str(run))  # and the folder is free at once
        faults.unlock_run_folder(key)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
