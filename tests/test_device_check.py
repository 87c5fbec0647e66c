"""scripts/device_check.sh and the Python pieces it runs, checked on a CPU host: the shell script parses and refuses
to pass without a GPU, the kernel and bandwidth scripts run their --cpu-smoke paths (CUDA tiling, interpret mode),
and the GRPO script's configs load through the real config checks. The GRPO --cpu-smoke run itself is left out: a
full train run with an interpreted kernel takes minutes of CPU here (run it by hand:
`python scripts/device_grpo.py --cpu-smoke --out /tmp/g --steps 1`)."""

import os
import subprocess
import sys

import pytest
import yaml
from scripts_module import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "device_check.sh")


def _script(name):
    return load_script(name)


def test_shell_script_parses_and_fails_without_a_gpu(tmp_path):
    subprocess.run(["bash", "-n", SCRIPT], check=True)
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    env.pop("INSTALL_VLLM", None)
    r = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "FAIL preflight: jax has no GPU backend" in r.stdout


@pytest.mark.parametrize("name", ["kernel_check", "bench_kernels"])
def test_cpu_smoke_paths_pass(name, capsys):
    assert _script(name).main(["--cpu-smoke"]) == 0
    out = capsys.readouterr().out
    assert f"{name}: PASS" in out and "FAIL" not in out.replace(f"{name}: PASS", "")


def test_kernel_check_refuses_cpu_without_smoke(capsys):
    assert _script("kernel_check").main([]) == 2


def test_grpo_configs_load_and_verdict(tmp_path):
    from twocircuit_jax.config.run import load_config

    grpo = _script("device_grpo")
    for smoke, backend in ((False, "vllm"), (True, "jax")):
        path = tmp_path / f"{backend}.yaml"
        path.write_text(yaml.safe_dump(grpo.run_config(3, backend, smoke)))
        cfg = load_config(str(path), [])
        assert cfg.sampler.backend == backend and cfg.fast.codec.use_kernel
        assert cfg.fast.kernel_interpret == smoke
    full = load_config(str(tmp_path / "vllm.yaml"), [])
    assert (full.model.hidden_size, full.model.num_layers, full.model.vocab_size) == (896, 24, 151936)
    good = [{"step": 0}] + [
        {"step": s, "loss": 0.1, "mismatch/prob_gap_mean": 1e-3, "sampler/weight_version": s - 1} for s in (1, 2, 3)
    ]
    assert grpo.verdict(good, 3, "vllm") == []
    stale = [dict(r, **{"sampler/weight_version": 0}) for r in good]
    assert any("weight version" in p for p in grpo.verdict(stale, 3, "vllm"))
    nan = [dict(r, loss=float("nan")) for r in good]
    assert any("loss" in p for p in grpo.verdict(nan, 3, "jax"))
    assert any("expected 3" in p for p in grpo.verdict(good[:3], 3, "jax"))
