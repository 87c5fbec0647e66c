"""Many processes: `twocircuit train` as 2 processes x 4 CPU devices on the loopback interface (jax.distributed,
gloo collectives) against 1 process x 8 devices, same config and seed; and the launch flags' validation.

The mesh is fsdp over all 8 devices, so the params, the optimizer state and every batch are split across the two
processes: nothing the loop holds is addressable by one process alone, which is what a host-side `np.asarray`,
a `device_put` of host rows or a checkpoint save gets wrong first.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from tiny_run import tiny_config, wait_all, with_device_count

from twocircuit_jax.cli import main
from twocircuit_jax.parallel.distributed import Launch, resolve
from twocircuit_jax.train.policy_io import load_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# entropy_coeff: the random tiny model earns no reward on chain_sum, so the entropy term is what moves the weights.
# One block: the processes split every leaf the same way at any depth, and each more block unrolls into every
# program that each of the three compiling processes builds, adding only compile time.
CFG = tiny_config(
    model={"num_layers": 1},
    mesh={"data": 1, "fsdp": -1},
    optim={"lr": 1e-2},
    grpo={"kl_coef": 0.0, "entropy_coeff": 0.01},
    train={"steps": 2, "checkpoint_every": 1},
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cfg_path, out, *extra, local_devices_flag=False, env1=None):
    """Start the two processes of one run (`env1`: added to process 1's environment only); returns their Popen
    objects."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC="64")
    env.pop("TWOCIRCUIT_CHAOS_POINT", None)
    if local_devices_flag:
        extra = (*extra, "--local-devices", "4")  # XLA_FLAGS stays at the pytest process's 8: the flag must win
    else:
        env["XLA_FLAGS"] = with_device_count(4)
    port = _free_port()
    cmd = [sys.executable, "-m", "twocircuit_jax.cli", "train", "--config", cfg_path, "--out", out, "--no-progress"]
    cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", *extra]
    return [
        subprocess.Popen(
            cmd + ["--process-id", str(i)],
            cwd=ROOT,
            env={**env, **(env1 or {})} if i == 1 else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def _summaries(stdout) -> list:
    """The run summaries a process printed (gloo prints its connection lines to stdout too)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _metrics(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def _assert_rows_match(one, many):
    """Every metric of the 1-process run, step by step, in the 2-process run: fp32 reduction order differs (a gloo
    all-reduce against one in-process), so to ~1e-6 relative; log-prob gaps near 0 to 1e-6 absolute."""
    assert [r["step"] for r in many] == [r["step"] for r in one]
    for a, b in zip(one, many):
        keys = [k for k in a if not k.startswith("time/")]
        assert set(keys) <= set(b), set(keys) - set(b)
        got, want = np.array([float(b[k]) for k in keys]), np.array([float(a[k]) for k in keys])
        bad = [k for k, x, y in zip(keys, got, want) if not np.isclose(x, y, rtol=1e-5, atol=1e-6)]
        assert not bad, {k: (a[k], b[k]) for k in bad}


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    """Also a preemption of one process of the two: SIGTERM to process 1 alone after step 1. The processes agree on
    the stop at that step boundary (one all-gather a step, train/faults.py StopSignals.agreed): both write their shards
    of one step-1 checkpoint and exit 0. Had process 0 gone on alone, its next collective would wait for a process
    that has left (an error or a hang), and a checkpoint written by one process alone would not load."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    cut = tmp_path / "cut.yaml"  # no periodic checkpoint: the only one before the end is the signal's
    cut.write_text(yaml.safe_dump({**CFG, "train": {**CFG["train"], "checkpoint_every": 0}}))
    one, many = str(tmp_path / "one"), str(tmp_path / "many")

    # the 2-process run's first leg, while this process runs the reference; process 1 sends itself a real SIGTERM
    # right after step 1's metrics point (train/faults.py)
    procs = _launch(str(cut), many, env1={"TWOCIRCUIT_CHAOS_POINT": "metrics/after_line:1:TERM"})
    try:
        assert main(["train", "--config", str(cfg), "--out", one, "--no-progress"]) == 0  # 1 process x 8 devices
    finally:
        # bounded: without the agreement both processes hang in mismatched collectives (measured: past 8 minutes)
        (out0, err0), (out1, err1) = wait_all(procs, timeout=400)
    assert "SIGTERM received" in err1 and "SIGTERM received" not in err0  # one process signalled
    ckpt = os.path.join(many, "checkpoints", "step_00000001")
    assert f"stopped by a signal to another process after step 1: checkpoint {ckpt}" in out0, out0
    # only process 0 writes run-level output: one summary line, one record per step (two writers would append twice)
    assert [(s["steps"], s["preempted_at"]) for s in _summaries(out0)] == [(2, 1)] and _summaries(out1) == []
    assert [r["step"] for r in _metrics(many)] == [0, 1]
    assert sorted(os.listdir(os.path.join(many, "checkpoints"))) == ["step_00000001"]
    _, p0 = load_policy(ckpt)  # the step-1 weights, written in shards by both processes

    # resume from the sharded step-1 checkpoint, to step 2, as 2 processes again (the device count from the flag)
    second = wait_all(_launch(str(cfg), many, "--resume", local_devices_flag=True))
    assert [s["steps"] for s in _summaries(second[0][0])] == [2] and _summaries(second[1][0]) == []
    _assert_rows_match(_metrics(one), _metrics(many))

    # the final weights: the 2-process checkpoint (written in shards by both) against the 1-process one
    _, p1 = load_policy(os.path.join(one, "checkpoints", "step_00000002"))
    _, p2 = load_policy(os.path.join(many, "checkpoints", "step_00000002"))
    flat1, flat2, flat0 = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)]) for p in (p1, p2, p0))
    assert np.abs(flat1 - flat0).max() > 1e-3  # training moved them: the comparison below means something
    # Adam divides by sqrt(v): on entries whose gradient is near 0 a 1e-7 relative difference in it moves the update
    # by up to ~lr * 1e-3 (measured 9e-7 here, 4e-6 at two blocks), against the 2e-2 the weights moved
    np.testing.assert_allclose(flat2, flat1, rtol=1e-5, atol=2e-5)


def _args(**kw):
    base = dict(coordinator=None, num_processes=None, process_id=None, local_devices=None, distributed="auto")
    return type("Args", (), {**base, **kw})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--coordinator", "127.0.0.1:1234"], "--coordinator: needs --num-processes and --process-id too"),
        (
            ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
            "--process-id: got 2; must be in 0 .. 1",
        ),
        (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], "--num-processes: got 0"),
        (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "--coordinator: got 'nohost'"),
        (["--coordinator", "h:70000", "--num-processes", "2", "--process-id", "0"], "port in 1 .. 65535"),
        (["--local-devices", "0"], "--local-devices: got 0"),
        (["--distributed", "off", "--num-processes", "2"], "need --distributed auto (got off)"),
    ],
)
def test_bad_launch_flags_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    cfg = os.path.join(ROOT, "configs", "tiny.yaml")
    assert main(["train", "--config", cfg, "--out", str(out), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_slurm_step_without_srun_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "4")  # an sbatch script's own shell: the task count, no task of a step
    for v in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(v, raising=False)
    cfg = os.path.join(ROOT, "configs", "tiny.yaml")
    assert main(["train", "--config", cfg, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    assert "SLURM_NTASKS: is 4 but SLURM_JOB_ID, SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NODELIST unset" in (
        capsys.readouterr().err
    )


def test_local_devices_needs_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    cfg = os.path.join(ROOT, "configs", "tiny.yaml")
    argv = ["train", "--config", cfg, "--out", str(tmp_path / "run"), "--local-devices", "4"]
    assert main(argv) == 2
    assert "--local-devices: simulates CPU devices, but JAX_PLATFORMS='tpu'" in capsys.readouterr().err


SLURM = {
    "SLURM_NTASKS": "8",
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "n[1-4]",
}


@pytest.mark.parametrize(
    "kw, env, want",
    [
        ({}, {}, Launch("single")),
        ({}, {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, Launch("single")),  # one task: nothing to join
        ({}, SLURM, Launch("slurm", num_processes=8, process_id=3)),
        ({"distributed": "off"}, SLURM, Launch("single")),
        ({"coordinator": "n1:9000", "num_processes": 2, "process_id": 1}, SLURM, Launch("flags", "n1:9000", 2, 1)),
        ({}, {"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, Launch("tpu")),
        ({}, {"TPU_WORKER_HOSTNAMES": "t0"}, Launch("single")),  # a single-host TPU VM
        ({"distributed": "jax", "local_devices": 2}, {}, Launch("jax", local_devices=2)),
    ],
)
def test_resolve_sources(kw, env, want):
    assert resolve(_args(**kw), env) == want


@pytest.mark.parametrize("process_id", [None, 1])
def test_only_process_0_removes_a_run_folder_on_bad_input(tmp_path, monkeypatch, process_id):
    """A run that ends on bad input removes the --out it made. Of two processes only process 0 makes it, after every
    process has checked it; process 1, ending on bad input while process 0 writes there (the folder appearing under
    it, here in the local-path check), must leave it: it did not make it. One process alone removes it."""
    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.train import setup

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    out = tmp_path / "run"

    def appears_then_fails(_cfg):
        out.mkdir()
        (out / ".twocircuit.json").write_text('{"kind": "run", "files": []}')  # process 0's marker
        raise ConfigError("data.path", "missing (for this test)")

    monkeypatch.setattr(setup, "check_local_paths", appears_then_fails)
    flags = [] if process_id is None else ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
    flags += [] if process_id is None else ["--process-id", str(process_id)]
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", *flags]) == 2
    assert out.is_dir() is (process_id is not None)
