"""A clean first screen on a host without a TPU, libtpu installed (the test extras): `twocircuit train` and
`twocircuit plan --topology tpu:*` write no TPU-runtime line to stderr (twocircuit_jax/platforms.py), the choices
that keeps the user's are left alone, and `twocircuit --version` names the package's version and its runtimes'."""

import importlib.util
import os
import re
import subprocess
import sys

import jax
import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax import __version__, platforms
from twocircuit_jax.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the TPU runtime wrote on a host without a TPU (an INVALID_ARGUMENT error, "Failed to find host bounds", the
# source-location trace), and any log line in glog's format (E0000 00:00:... file.cc:N]).
RUNTIME_LINE = re.compile(
    r"E0000|INVALID_ARGUMENT|libtpu|TPU|InitGoogle|Source Location Trace|host bounds|^[EWIF]\d{4} ", re.MULTILINE
)
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _no_tpu_here():
    if platforms.tpu_attached():
        pytest.skip("a TPU is attached to this host: its runtime's lines are its own")


def _user_env(**extra) -> dict:
    """The environment a user's shell has: none of the test session's platform choice and fake devices (conftest),
    none of the TPU variables this process's jax and twocircuit_jax set; XLA's other flags (the suite's optimisation
    level) kept."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    return {**env, **extra}


def _clean(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [line for line in proc.stderr.splitlines() if RUNTIME_LINE.search(line)]
    assert found == [], "TPU-runtime lines on stderr:\n" + "\n".join(found)


def _cli(*argv, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "twocircuit_jax.cli", *argv], env=env or _user_env(), capture_output=True, text=True
    )


def test_version_names_the_package_and_its_runtimes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"twocircuit {__version__} (jax {jax.__version__}, jaxlib "), out
    if importlib.util.find_spec("vllm") is not None:
        assert re.search(r", vllm(-cpu)? \d", out), out


@pytest.mark.tpu_compile
@pytest.mark.slow
def test_train_and_plan_write_no_tpu_runtime_lines(tmp_path):
    _no_tpu_here()
    if not HAS_LIBTPU:
        pytest.skip("libtpu is not installed (the test extras install it): nothing could write these lines")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(train={"steps": 1, "prompts_per_update": 4})))
    _clean(_cli("train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--no-progress"))
    plan = _cli("plan", "--config", str(cfg), "--topology", "tpu:v5e-4")
    _clean(plan)
    assert plan.stdout.startswith("plan for tpu:v5e-4: 4 devices"), plan.stdout  # libtpu's devices, its report only


@pytest.mark.slow
def test_with_a_jax_plugin_installed_the_tpu_probe_is_quiet_and_a_real_error_shows(tmp_path):
    """With a PJRT plugin installed (a GPU user's jax[cuda12], here one that registers nothing) the platforms are
    jax's to choose, TPU probe included: it fails without a word; asking for the TPU where there is none still
    raises jax's error."""
    _no_tpu_here()
    if not HAS_LIBTPU:
        pytest.skip("libtpu is not installed: no TPU backend to probe")
    (tmp_path / "jax_plugins").mkdir()
    (tmp_path / "jax_plugins" / "noop.py").write_text("def initialize():\n    pass\n")
    probe = (
        "import os, twocircuit_jax, jax\n"
        "print(os.environ.get('JAX_PLATFORMS'), jax.default_backend())\n"
        "try:\n    jax.devices('tpu')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    env = _user_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    _clean(proc)
    lines = proc.stdout.splitlines()
    assert lines[0] == "None cpu", proc.stdout  # no platform chosen for jax: it tried the TPU and took the CPU
    assert lines[1].startswith("refused:") and "tpu" in lines[1], proc.stdout


def test_jax_and_this_package_see_the_same_tpu_chips():
    from jax._src import hardware_utils

    assert platforms.GOOGLE_PCI_VENDOR == hardware_utils._GOOGLE_PCI_VENDOR_ID
    assert platforms.TPU_PCI_DEVICES == set(hardware_utils._TPU_PCI_DEVICE_IDS)


def _pci(root, *devices):
    for i, (vendor, device) in enumerate(devices):
        d = root / f"0000:00:0{i}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    return str(root)


def test_a_tpu_on_the_pci_bus_is_found_and_googles_other_devices_are_not(tmp_path):
    gvnic = ("0x1ae0", "0x0042")  # Google's virtual NIC on a GCE VM (a GPU VM has one): no TPU
    assert not platforms.tpu_on_pci(_pci(tmp_path / "gpu_vm", gvnic, ("0x10de", "0x2330")))
    assert platforms.tpu_on_pci(_pci(tmp_path / "v5e", gvnic, ("0x1ae0", "0x0063")))


@pytest.fixture
def no_tpu_no_jax(monkeypatch):
    """configure() as at the start of a process on a host without a TPU: jax not imported yet, no plugin."""
    monkeypatch.setattr(platforms, "tpu_attached", lambda: False)
    monkeypatch.setattr(platforms, "jax_plugins_installed", lambda environ: False)
    monkeypatch.delitem(sys.modules, "jax")


def test_without_a_tpu_the_cpu_is_chosen_and_the_runtime_told_it_is_one_host(no_tpu_no_jax):
    env = {}
    platforms.configure(env)
    assert env == {"JAX_PLATFORMS": "cpu", **platforms.RUNTIME_DEFAULTS}


@pytest.mark.parametrize("chosen", ["cpu", "tpu", ""])
def test_a_users_jax_platforms_wins(no_tpu_no_jax, chosen):
    env = {"JAX_PLATFORMS": chosen}
    platforms.configure(env)
    assert env == {"JAX_PLATFORMS": chosen, **platforms.RUNTIME_DEFAULTS}


def test_a_users_topology_and_a_plugin_are_left_to_them(no_tpu_no_jax, monkeypatch):
    env = {"TPU_ACCELERATOR_TYPE": "v5litepod-4"}
    platforms.configure(env)
    assert env == {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "JAX_PLATFORMS": "cpu"}
    monkeypatch.setattr(platforms, "jax_plugins_installed", lambda environ: True)
    env = {}
    platforms.configure(env)
    assert env == platforms.RUNTIME_DEFAULTS  # jax chooses among its plugins; its TPU probe is quiet


def test_a_tpu_here_or_forced_leaves_everything_alone(no_tpu_no_jax, monkeypatch):
    env = {"JAX_FORCE_TPU_INIT": "1"}
    platforms.configure(env)
    assert env == {"JAX_FORCE_TPU_INIT": "1"}
    monkeypatch.setattr(platforms, "tpu_attached", lambda: True)
    env = {}
    platforms.configure(env)
    assert env == {}


def test_jax_imported_first_keeps_its_platforms(monkeypatch):
    monkeypatch.setattr(platforms, "tpu_attached", lambda: False)
    env = {}
    platforms.configure(env)  # jax is imported in this process: its platforms were read already
    assert env == platforms.RUNTIME_DEFAULTS


def test_plugins_are_found_where_jax_finds_them():
    assert platforms.jax_plugins_installed({"PJRT_NAMES_AND_LIBRARY_PATHS": "my_chip:/opt/libmychip.so"})
