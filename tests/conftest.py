"""Test-session setup, the same under plain pytest and under `make test` (pytest-xdist, `-n 2 --dist loadgroup`).

Set here, once, before jax is imported anywhere, and inherited by xdist's workers and by every child process a test
starts: 8 simulated CPU devices, XLA's LLVM optimisation level 0 and its older CPU fusion emitters, and one JAX
persistent compilation cache per run (the garbage collector's thresholds are this process's and its workers').
The groups of pytest_collection_modifyitems decide which tests share a worker."""

import gc
import os
import shutil
import tempfile

# Python's cyclic garbage collector, at its default thresholds (700, 10, 10), runs thousands of times in a test module
# that traces and compiles programs (JAX builds millions of small objects): 3.5 s of tests/test_micro_batch.py's 53 s.
# At (10000, 10, 10) it runs a tenth as often, 0.8 s; reference counting frees nearly everything anyway, and the
# module fixture below collects in full before dropping a big worker's caches.
gc.set_threshold(10_000, 10, 10)

# 8 fake devices, and two settings that make XLA:CPU compile faster, each unless XLA_FLAGS sets it: the suite is
# dominated by compiles of small programs that run a few times, so compiling faster beats running faster.
# - LLVM optimisation level 0 (on the 2-core machine 889-929 s of pytest at level 0 against 1183-1192 s at the default
#   level: the same HLO, only LLVM's machine-code optimisation differs).
# - XLA:CPU's older fusion emitters (`--xla_cpu_use_fusion_emitters=false`): XLA compiles each fused loop straight to
#   LLVM instead of through its MLIR fusion emitters: about half the compile time (two tests of
#   tests/test_micro_batch.py, side by side: 19.8 s of backend compiles against 10.8 s, 34 s of CPU against 22 s;
#   the whole suite: docs/speed.md). The programs compute the same functions; a fused loop's float rounding may differ
#   by a few ulp, which matters only to checks of two different programs' bit equality (tests/test_anchor_circuit.py).
# Benchmarks, demos and runs compile with XLA's defaults and level 1 on CPU (parallel/dispatch.py).
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
if "--xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags.strip()
# JAX's persistent compilation cache: dozens of tests build trainers of the same tiny models, and each build
# jit-compiles the same programs again; the cache turns the repeats into a file read (three end-to-end files: 155 s
# -> 97 s). The first process to import this file (pytest's controller under xdist) makes a fresh folder; the workers
# and child processes inherit it through the environment, so one run shares one cache. Every entry is kept, however
# small or quick to compile. A JAX_COMPILATION_CACHE_DIR set by the caller is used as is and never removed.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="twocircuit-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
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


# --- which tests share an xdist worker (`make test`: `--dist loadgroup`) ---
# A whole module is one unit, so its module-scoped fixtures are built once. The modules whose tests start a vLLM
# engine (marked `vllm`) are one unit: two engines at once would take several GiB and both cores. The users of the
# session fixture chain_sum_base are one unit, so the base is trained once. xdist hands the units out, those with the
# most tests first, to whichever worker is nearly idle.
VLLM_GROUP = "vllm"
BASE_GROUP = "chain_sum_base"


def module_groups(items) -> dict[str, str]:
    """{module path: its xdist group} for the collected `items`."""
    groups: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        if item.get_closest_marker("vllm"):
            groups[path] = VLLM_GROUP
        elif BASE_GROUP in getattr(item, "fixturenames", ()) and groups.get(path) != VLLM_GROUP:
            groups[path] = BASE_GROUP
        else:
            groups.setdefault(path, path)
    return groups


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which appends the group to each test's id
def pytest_collection_modifyitems(config, items):
    groups = module_groups(items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid.split("::")[0]]))


def pytest_xdist_node_collection_finished(node, ids):
    """xdist's scheduler reads each test's group back from the `@group` its worker appended to the test's id. pytest
    9.2 stopped that append from taking effect (pytest-xdist issue 1386): every test then is a unit of its own, one
    module's tests run on both workers with a module fixture each, and two engines start at once. The test extras
    pin pytest below 9.2; a run whose ids carry no group stops here, before any test runs."""
    if node.config.getoption("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        import xdist

        pytest.exit(
            f"--dist loadgroup would not group the tests: pytest {pytest.__version__} with pytest-xdist "
            f"{xdist.__version__} drops the group from each test's id ({ids[0]}). Install the test extras' "
            "pytest: pip install -e '.[test]' (pyproject.toml pins it below 9.2)",
            returncode=4,
        )


# A worker's resident size past which the compiled programs are dropped after a module (bytes).
RSS_LIMIT = float(os.environ.get("TWOCIRCUIT_TEST_RSS_GB", "4")) * 2**30


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True, scope="module")
def _bound_the_worker_memory():
    """A worker runs dozens of modules, and JAX's in-memory caches keep every program compiled in it: a process
    holding all of them grows without bound (one run aborted deep into the suite on a test that passes alone).
    After a module, if the worker holds more than TWOCIRCUIT_TEST_RSS_GB (4 GiB), they are dropped; below it they are
    kept, since the next module often builds the same programs (clearing after every module: 126 s against 117 s on
    six end-to-end files), and a repeat compile after a drop is a read from the persistent cache."""
    yield
    if os.path.exists("/proc/self/statm") and _rss() > RSS_LIMIT:
        import gc

        jax.clear_caches()
        gc.collect()


def pytest_unconfigure(config):
    """The run's compilation cache is removed by the process that made it (the controller under xdist)."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
