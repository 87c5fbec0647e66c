"""The accelerator runtimes a process may start, settled before jax is imported (twocircuit_jax/__init__.py calls
configure() first, so every entry point does: the CLI, the demos, the vLLM sampler process, a user's own script).

With JAX_PLATFORMS unset jax tries every backend it knows, TPU included. Where libtpu is installed (the `plan` and
`test` extras) on a host without a TPU, the TPU runtime starts, finds no TPU metadata (jax tells it not to ask) and
writes five lines to stderr, an INVALID_ARGUMENT error among them, before jax takes the CPU: the first thing
`make demo` printed was an error that is none. On a host without a TPU (and only there):

- the TPU runtime is told what it fails to find out: one host, this one (TPU_WORKER_HOSTNAMES, TPU_HOST_BOUNDS).
  It then starts without a word wherever it starts: `twocircuit plan --topology tpu:*` (compile-only devices of a
  named slice; the slice's own shape is passed explicitly), and jax's TPU probe where other plugins are installed;
- where jax has no PJRT plugin installed, its platforms are cpu and tpu, so JAX_PLATFORMS=cpu hides nothing: libtpu
  is then not loaded at all (~200 MB of memory, and its machine-wide lock file) unless `plan` asks for it.

Left alone: a host with a TPU attached, JAX_FORCE_TPU_INIT (jax's own override of its TPU check), a JAX_PLATFORMS
the user set (any value, '' included: the user's choice wins), TPU topology variables the user set, and a jax
imported before this package (its platform is read when jax is imported). A real error still shows: asking for
the TPU backend where there is none raises jax's "Unable to initialize backend 'tpu'".
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import MutableMapping

# jax's own TPU check (jax/_src/hardware_utils.py: num_available_tpu_chips_and_device_id): a PCI device of Google's
# vendor id with one of these device ids. tests/test_clean_console.py checks the copy against jax's.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
# The device files libtpu opens: /dev/accelN (TPU v2 to v4), VFIO groups /dev/vfio/N (v5e and later).
TPU_DEVICE_FILES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
PCI_DEVICES = "/sys/bus/pci/devices"

# What the TPU runtime reports it "could not determine" without a TPU VM's metadata: this host, alone.
RUNTIME_DEFAULTS = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}
# Any one of these set by the user means the user describes the topology: none of ours is added to it.
TOPOLOGY_VARS = (
    "TPU_ACCELERATOR_TYPE",
    "TPU_WORKER_HOSTNAMES",
    "TPU_WORKER_ID",
    "TPU_HOST_BOUNDS",
    "TPU_CHIPS_PER_HOST_BOUNDS",
    "TPU_PROCESS_BOUNDS",
)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def tpu_on_pci(pci_devices: str = PCI_DEVICES) -> bool:
    """A TPU chip among the host's PCI devices, as jax checks it."""
    for vendor in glob.glob(os.path.join(pci_devices, "*", "vendor")):
        if _read(vendor) == GOOGLE_PCI_VENDOR and _read(os.path.join(os.path.dirname(vendor), "device")) in (
            TPU_PCI_DEVICES
        ):
            return True
    return False


def tpu_attached() -> bool:
    """A TPU chip on this host: on the PCI bus, or a device file libtpu drives (a container may show the files
    without /sys). Either counts: a wrong 'yes' only leaves the runtime's warnings, a wrong 'no' could hide a chip."""
    return tpu_on_pci() or any(glob.glob(pattern) for pattern in TPU_DEVICE_FILES)


def jax_plugins_installed(environ: MutableMapping[str, str] = os.environ) -> bool:
    """A PJRT plugin (CUDA, ROCm, ...) that jax would load besides its built-in CPU and TPU backends, found the ways
    jax finds one (jax/_src/xla_bridge.py: the `jax_plugins` namespace package, the `jax_plugins` entry points,
    PJRT_NAMES_AND_LIBRARY_PATHS)."""
    import importlib.util
    from importlib.metadata import entry_points

    if environ.get("PJRT_NAMES_AND_LIBRARY_PATHS"):
        return True
    if importlib.util.find_spec("jax_plugins") is not None:
        return True
    return len(entry_points(group="jax_plugins")) > 0


def quiet_tpu_runtime(environ: MutableMapping[str, str] = os.environ) -> None:
    """Tell a TPU runtime on a host without a TPU that it is one host, this one (see the module docstring); a
    topology the user gave is left whole."""
    if not any(v in environ for v in TOPOLOGY_VARS):
        environ.update(RUNTIME_DEFAULTS)


def configure(environ: MutableMapping[str, str] = os.environ) -> None:
    """Settle the runtimes before jax starts (the module docstring says what, and what is left alone)."""
    if "JAX_FORCE_TPU_INIT" in environ or tpu_attached():
        return  # a TPU here, or the user says there is: jax and libtpu as they are
    quiet_tpu_runtime(environ)
    if "JAX_PLATFORMS" in environ or "jax" in sys.modules:
        return  # the user's choice, or jax has read its platforms already
    if not jax_plugins_installed(environ):
        environ["JAX_PLATFORMS"] = "cpu"  # the platforms other than tpu: jax knows no others here
