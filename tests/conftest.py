"""Test-session setup. The fake device count is set here, once, before jax is imported anywhere."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

# One program at a time on the 8 fake CPU devices: with asynchronous dispatch, two programs whose all-reduces are
# in flight together can deadlock XLA's in-process CPU collectives (one device thread waits in the other program's
# rendezvous until XLA aborts the process after 40 s). Real accelerators order their streams; the fake mesh does not.
jax.config.update("jax_cpu_enable_async_dispatch", False)

assert jax.device_count() == 8, f"expected 8 simulated devices, got {jax.device_count()}"
