"""Test-session setup. The fake device count is set here, once, before jax is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's device pool has max(cores, devices) threads; two multi-device programs with collectives in flight at once
# can fill it with threads waiting at each other's rendezvous (an abort after 40 s). The project's own programs never
# overlap (twocircuit_jax/parallel/dispatch.py), but eager ops on sharded arrays and orbax's background saves are
# not serialised: a larger pool (idle threads cost nothing) leaves room for them.
os.environ.setdefault("PJRT_NPROC", "64")
# ... and one program's own collectives, run concurrently by XLA:CPU, can do the same (twocircuit_jax/parallel/
# distributed.py CPU_SCHEDULER_FLAG): the scheduler flag the CLI adds, added here for the in-process runs.
from twocircuit_jax.parallel.distributed import cpu_xla_flags  # noqa: E402

cpu_xla_flags()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 simulated devices, got {jax.device_count()}"


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def chain_sum_base(tmp_path_factory):
    """(folder, SFT result) of tests/shared_bases.py's base, trained once per process; read-only for its users
    (test_guard.py, test_eval_suite.py)."""
    import shared_bases

    out = str(tmp_path_factory.mktemp("chain_sum_base") / "base")
    return out, shared_bases.build(out)
