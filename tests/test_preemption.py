"""Preemption: SIGTERM or SIGINT ends a real `twocircuit train` process at the next step boundary with a checkpoint,
exit 0 and one line saying where; `--resume` then ends bit for bit where the uninterrupted run does. And a sweep arm
killed before its first checkpoint restarts on `sweep --resume` instead of failing."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from scripts_module import load_script
from tiny_run import tiny_config

from twocircuit_jax.train.checkpoint import committed_steps

pytestmark = pytest.mark.slow  # real training processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# checkpoint_every 0: the only checkpoint before the end is the one the signal writes
CFG = tiny_config(grpo={"format_penalty": -1.0}, train={"steps": 6, "checkpoint_every": 0, "eval_every": 3})


def _chaos():
    return load_script("chaos")


def _env(point=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop("TWOCIRCUIT_CHAOS_POINT", None)
    if point:
        env["TWOCIRCUIT_CHAOS_POINT"] = point
    return env


def _argv(cfg, run, *extra):
    return [sys.executable, "-m", "twocircuit_jax.cli", "train", "--config", str(cfg), "--out", str(run), *extra]


def _train(cfg, run, *extra, point=None):
    return subprocess.run(_argv(cfg, run, "--no-progress", *extra), env=_env(point), capture_output=True, text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of CFG (a real process), shared: a `train` run and a sweep arm of CFG end equal to it."""
    ref = tmp_path_factory.mktemp("ref")
    (ref / "cfg.yaml").write_text(yaml.safe_dump(CFG))
    done = _train(ref / "cfg.yaml", ref / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    return ref / "run"


def test_sigterm_saves_at_the_step_boundary_and_the_resume_is_exact(tmp_path, reference):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    ref, cut = reference, tmp_path / "cut"
    # a real SIGTERM, sent by the process to itself right after step 2's metrics line (train/faults.py)
    stopped = _train(cfg, cut, point="metrics/after_line:2:TERM")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    ckpt = cut / "checkpoints" / "step_00000002"
    assert f"stopped by SIGTERM after step 2: checkpoint {ckpt}" in stopped.stdout, stopped.stdout
    assert "--resume" in stopped.stdout and json.loads(stopped.stdout.strip().splitlines()[-1])["preempted_at"] == 2
    assert sorted(os.listdir(cut / "checkpoints")) == ["step_00000002"]
    resumed = _train(cfg, cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    n, diffs = _chaos().compare(str(ref), str(cut), 6)
    assert not diffs and n > 1000, diffs[:5]


def test_sigint_from_outside_stops_at_a_step_boundary(tmp_path):
    """Ctrl-C (SIGINT) from another process while the trainer is mid-run: the step in flight ends, is checkpointed,
    exit 0; the line names the checkpoint of the step it stopped after."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**CFG, "train": {**CFG["train"], "steps": 40}}))
    run = tmp_path / "run"
    p = subprocess.Popen(_argv(cfg, run, "--no-progress"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").is_file() or len(open(run / "metrics.jsonl").read().splitlines()) < 3:
        assert p.poll() is None and time.time() < deadline, p.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGSTOP)  # frozen past step 2, so the signal surely lands before the run's end
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGCONT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()[-3000:]
    m = re.search(r"stopped by SIGINT after step (\d+): checkpoint (\S+);", out.decode())
    assert m, out.decode()
    step = int(m.group(1))
    assert 2 <= step < 40 and m.group(2) == str(run / "checkpoints" / f"step_{step:08d}")
    assert (run / "checkpoints" / f"step_{step:08d}" / "COMMITTED").is_file()
    assert json.loads(open(run / "metrics.jsonl").read().splitlines()[-1])["step"] == step


def test_a_sweep_arm_killed_before_its_first_checkpoint_restarts_on_resume(tmp_path, reference):
    """Before: `sweep --resume` took the arm's non-empty folder for a resumable run and exited 2 ("no complete
    checkpoint"). Now the arm starts again (its partial files removed). That restarted arm is then stopped by a
    SIGTERM, and a second `--resume` finishes it: it ends as the uninterrupted run of its config does (the arm {} is
    the base itself: the `reference` run). One chain of three sweep processes, not two chains of two: each process
    start costs seconds, and a restart that left a partial file behind would still show in the exact comparison."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(CFG))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "arms": {"a": {}}}))
    argv = [sys.executable, "-m", "twocircuit_jax.cli", "sweep", "--config", str(tmp_path / "sweep.yaml")]
    cut = tmp_path / "cut"
    dead = subprocess.run(argv + ["--out", str(cut)], env=_env("metrics/after_line:1"), capture_output=True)
    assert dead.returncode == -signal.SIGKILL
    assert (cut / "a" / "metrics.jsonl").is_file() and not os.listdir(cut / "a" / "checkpoints")
    # SIGTERM in the restarted arm: its checkpoint is written, the sweep stops (exit 0) without marking the arm done,
    # and `--resume` finishes it exactly (before: the arm was marked done at the signal and never finished)
    stopped = subprocess.run(
        argv + ["--out", str(cut), "--resume"], env=_env("metrics/after_line:1:TERM"), capture_output=True, text=True
    )
    assert stopped.returncode == 0 and "stopped by a signal in arm a" in stopped.stdout, stopped.stderr[-3000:]
    assert not (cut / "a" / "sweep_done.json").exists() and (cut / "a" / "checkpoints" / "step_00000001").is_dir()
    again = subprocess.run(argv + ["--out", str(cut), "--resume"], env=_env(), capture_output=True, text=True)
    assert again.returncode == 0 and (cut / "a" / "sweep_done.json").is_file(), again.stderr[-3000:]
    n, diffs = _chaos().compare(str(reference), str(cut / "a"), 6)
    assert not diffs and n > 1000, diffs[:5]


_SLOW_REWARD = """
import os, signal, time
def slow_on_third(prompts, completions, **fields):
    # the third scoring call (a step past the first checkpoints) sends the trainer SIGTERM and then takes 30 s; it
    # runs in the trainer's scoring worker (task.reward_timeout_s), a child of the trainer
    path = os.environ["GRACE_COUNTER"]
    n = int(open(path).read()) + 1 if os.path.exists(path) else 1
    open(path, "w").write(str(n))
    if n == 3:
        open(path + ".sent", "w").write(repr(time.time()))
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(30)
    return [float(len(c) % 2) for c in completions]
"""


def test_sigterm_mid_step_past_the_grace_period_exits_143_and_resumes(tmp_path):
    """train.preempt_grace_s: a SIGTERM in a step that cannot end within the grace (a reward function taking 30 s)
    exits 143 within it, saving nothing, with a line naming the checkpoint; `--resume` goes on from there to the end.
    Without the grace the run would wait the 30 s out and exit 0."""
    (tmp_path / "reward.py").write_text(_SLOW_REWARD)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(16)))
    task = {"type": "python", "reward_fns": [f"{tmp_path}/reward.py:slow_on_third"]}
    data = tiny_config(task={**task, "train_files": [str(tmp_path / "rows.jsonl")]})
    data["task"] = {**task, "train_files": [str(tmp_path / "rows.jsonl")]}
    data["train"] = {**data["train"], "steps": 5, "checkpoint_every": 1, "preempt_grace_s": 2.0}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    env = {**_env(), "GRACE_COUNTER": str(tmp_path / "calls")}
    cut = subprocess.run(_argv(cfg, run, "--no-progress"), env=env, capture_output=True, text=True)
    took = time.time() - float((tmp_path / "calls.sent").read_text())  # from the signal to the exit
    assert cut.returncode == 143 and took < 20, (took, cut.stderr[-3000:])
    m = re.search(
        r"grace period expired \(train.preempt_grace_s=2 s\).*nothing saved; resume from checkpoint step (\d)",
        cut.stderr,
    )
    assert m, cut.stderr[-3000:]
    step = int(m.group(1))
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{s:08d}" for s in range(1, step + 1)][-2:]
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl")][-1] == step
    resumed = subprocess.run(_argv(cfg, run, "--no-progress", "--resume"), env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl")] == list(range(6))


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (its children, theirs, ...), read from ps."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    kids = {}
    for line in table.splitlines():
        p, pp = map(int, line.split())
        kids.setdefault(pp, []).append(p)
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _alive(pids) -> list[int]:
    """The pids still running (a zombie counts as gone: it has exited and holds nothing)."""
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(p)
        except FileNotFoundError:
            pass
    return out


def _steps(run) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in open(path)] if path.is_file() else []


def test_a_parallel_sweep_stops_whole_on_sigterm_or_on_its_parents_death_and_resumes(tmp_path):
    """`sweep --jobs 2`: a SIGTERM to the sweep's process group (a preemptor's) reaches each running arm once; each
    saves at its step's end, the sweep exits 0 naming where they stopped, and no process of it is left (before: the
    parent died on the signal and its two workers, having saved, idled for good on a dead parent's queue). A parent
    SIGKILLed mid-run: its arms notice, save and exit on their own. The third arm, waiting for a free job, never
    starts. `--resume` then finishes all three."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**CFG, "train": {**CFG["train"], "steps": 400}}))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "arms": {"a": {}, "b": {}, "c": {}}}))
    out = tmp_path / "s"
    argv = [sys.executable, "-m", "twocircuit_jax.cli", "sweep", "--config", str(tmp_path / "sweep.yaml")]
    argv += ["--out", str(out), "--jobs", "2"]

    def start(*extra):  # a session of its own: its process group is the sweep's, as a job's under a scheduler
        return subprocess.Popen(
            argv + list(extra),
            env=_env(),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def until(p, cond, what):
        deadline = time.time() + 300
        while not cond():
            assert p.poll() is None and time.time() < deadline, (what, p.communicate()[1][-3000:])
            time.sleep(0.1)

    def checkpoints(arm):
        return committed_steps(out / arm / "checkpoints")

    p = start()
    until(p, lambda: all(len(_steps(out / arm)) >= 2 for arm in "ab"), "both arms past step 1")
    procs = _descendants(p.pid)
    assert len(procs) >= 2, procs
    os.killpg(p.pid, signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    assert "sweep: SIGTERM: no new arms; waiting for a, b to save" in stderr, stderr[-3000:]
    assert "continue with --resume" in stdout and not (out / "c").exists(), stdout  # c waited for a free job
    deadline = time.time() + 30  # the parent waited for its runs; their own exits may lag a moment
    while _alive(procs) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(procs), subprocess.run(["ps", "-f", "-p", ",".join(map(str, procs))], capture_output=True)
    first = {}
    for arm in "ab":
        assert not (out / arm / "sweep_done.json").exists()
        first[arm] = checkpoints(arm)[-1]
        assert f"arm {arm} stopped at step {first[arm]}" in stdout and _steps(out / arm)[-1] == first[arm]

    p = start("--resume")
    until(p, lambda: all(_steps(out / arm)[-1] > first[arm] for arm in "ab"), "both arms resumed")
    procs = _descendants(p.pid)
    p.kill()
    p.wait()
    deadline = time.time() + 300
    while _alive(procs) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(procs)
    for arm in "ab":  # each arm saved the step it was in when its parent died
        assert checkpoints(arm)[-1] > first[arm] and _steps(out / arm)[-1] == checkpoints(arm)[-1]
    assert not (out / "c").exists()

    end = max(_steps(out / arm)[-1] for arm in "ab") + 1
    done = subprocess.run(
        argv + ["--resume", "--set", f"train.steps={end}"], env=_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for arm in "abc":
        assert (out / arm / "sweep_done.json").is_file() and _steps(out / arm) == list(range(end + 1))
