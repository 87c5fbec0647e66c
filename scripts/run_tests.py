"""`make test`: the whole suite, in a few pytest processes rather than one, two at a time.

Each process holds every executable XLA compiled in it; hundreds of tiny end-to-end runs in a single process grow
it without bound (one CI run here ended with the pytest process aborting deep into the suite, on a test that passes
alone). Groups of files in separate processes bound that. Every test file is in exactly one group; the groups are
balanced by each file's measured time (WEIGHTS), and the files that start a vLLM engine share one group, so two
engines (several GiB and ~20 s to start each) never run at once.

A pytest process spends its time in XLA's compiles and tiny programs, on about one core: up to JOBS groups run at
once (default: two, or one on a one-core machine; env TWOCIRCUIT_TEST_JOBS overrides). Each group's output is
printed whole when it ends, never interleaved with another's. A group that fails (or runs no test) stops the run:
no further group starts, the running ones finish and are printed, and the exit code is that of the first group to
fail. Extra arguments are passed to every pytest call. All groups share one JAX persistent compilation cache, a
fresh folder per run (see cache_env), and compile at XLA's LLVM optimisation level 0 (see xla_env).
"""

from __future__ import annotations

import concurrent.futures as cf
import fnmatch
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

GROUPS = 8
TAPER = 0.7  # each pair of groups (one per process slot) 0.7 of the pair before it: see taper()
# Approximate seconds per test file, (all its tests, its tests outside `slow`), from the "heaviest test files" line a
# `make test` prints (its files' seconds with two groups at a time on the 2-core reference machine; the full list goes to
# $TWOCIRCUIT_TEST_TIMES_OUT when set). Only the balance of the groups depends on them (`-m "not slow"` plans with
# the second number); a file not listed counts DEFAULT_WEIGHT. Re-measure when a file's time changes a lot.
WEIGHTS = {
    "test_compile_matrix.py": (199, 13),
    "test_pipeline.py": (126, 12),
    "test_micro_batch.py": (98, 98),
    "test_preemption.py": (99, 0),
    "test_model_scale.py": (71, 65),
    "test_plan.py": (61, 0),
    "test_chaos.py": (91, 12),
    "test_pipeline_loop.py": (73, 0),
    "test_anchor_resume.py": (54, 0),
    "test_old_pass.py": (61, 5),
    "test_vllm_loop.py": (27, 0),
    "test_fsdp_state.py": (60, 60),
    "test_platform_export.py": (46, 27),
    "test_vllm_sampler.py": (48, 0),
    "test_multihost.py": (50, 1),
    "test_fast_invariants.py": (42, 0),
    "test_vllm_agentic.py": (44, 0),
    "test_vllm_resume.py": (55, 0),
    # measured on a machine loaded by others (load average ~6): test_vllm_loop.py took 43 s in the same run
    "test_vllm_multiprocess.py": (96, 0),
    "test_vllm_fleet.py": (71, 0),
    "test_programs.py": (47, 0),
    "test_fast_bootstrap.py": (34, 4),
    "test_guard.py": (35, 0),
    "test_agentic.py": (43, 0),
    "test_fast_e2e.py": (42, 0),
    "test_model_hf.py": (41, 23),
    "test_comm_bytes.py": (35, 0),
    "test_codec_fsdp_collectives.py": (30, 30),  # two compiles on data 2 x fsdp 4 (29.5 s at load ~8)
    "test_grpo_e2e.py": (37, 0),
    "test_chunked_head.py": (37, 37),
    "test_fast_mask.py": (36, 8),
    "test_kernel_prf_mask.py": (32, 18),
    "test_sampler_security.py": (3, 3),
    "test_sampler_placement.py": (22, 22),
    "test_async_rollouts.py": (27, 0),
    "test_trainer_api.py": (27, 0),
    "test_example.py": (24, 1),
    "test_vllm_client_faults.py": (10, 10),
    "test_probe.py": (19, 0),
    "test_fast_lowrank.py": (22, 12),
    "test_anchor_loop.py": (22, 0),
    "test_hf_math_run.py": (21, 0),
    "test_fidelity.py": (21, 10),
    "test_sweep.py": (42, 1),
    "test_user_code_timeouts.py": (35, 12),
    "test_device_check.py": (20, 20),
    "test_codec_registry.py": (19, 5),
    "test_anchor_circuit.py": (17, 17),
    "test_host_state.py": (20, 20),
    "test_anchor_owned_basis.py": (8, 0),
    "test_fast_powersgd.py": (16, 16),
    "test_grpo_loss.py": (15, 8),
    "test_fast_circuit.py": (15, 15),
    "test_anchor_nonfinite.py": (15, 10),
    "test_run_lock.py": (22, 8),
    "test_weight_sync.py": (14, 14),
    "test_sweep_seeds.py": (13, 5),
    "test_eval_suite.py": (29, 3),
    "test_fast_sr_quant.py": (12, 5),
    "test_anchor_swap.py": (11, 9),
    "test_jax_sampler.py": (11, 8),
    "test_train_step.py": (10, 10),
    "test_resume_config.py": (9, 2),
    "test_export_resume.py": (9, 9),
    "test_plot.py": (9, 3),
    "test_out_folders.py": (8, 5),
    "test_kernel_lowrank.py": (8, 8),
    "test_fast_bytes.py": (8, 8),
    "test_run_tests.py": (7, 7),
    "test_fast_prf.py": (7, 5),
    "test_mesh_context.py": (7, 7),
    "test_anchor_dense_view.py": (6, 6),
    "test_dispatch.py": (6, 3),
    "test_kernel_powersgd.py": (6, 5),
    "test_reference_copy.py": (6, 6),
    "test_python_task.py": (6, 2),
    "test_sft.py": (5, 5),
    "test_kernel_sharding.py": (5, 5),
    "test_config_fields.py": (5, 5),
    "test_checkpoint_safety.py": (4, 4),
    "test_checkpoint.py": (4, 3),
    "test_mismatch.py": (4, 4),
    "test_compare.py": (3, 3),
    "test_anchor_merger.py": (3, 3),
    "test_anchor_config.py": (2, 2),
    "test_grpo_tis.py": (2, 2),
    "test_tpu_kernel_compile.py": (2, 2),
    "test_sampler_export.py": (1, 1),
    "test_gauges.py": (1, 1),
    "test_grpo_advantages.py": (1, 1),
    "test_import_graph.py": (1, 0),
    "test_trainer_shape.py": (2, 2),
    "test_step_trace.py": (36, 1),
    "test_clean_console.py": (34, 1),
    "test_codec_plugin.py": (16, 0),
    "test_names.py": (1, 0),
    "test_tokenizer.py": (1, 0),
    "test_cli_repeats.py": (1, 1),
    "test_configs.py": (1, 0),
    "test_tasks.py": (1, 1),
    "test_knobs.py": (1, 1),
    "test_anchor_retention.py": (1, 0),
    "test_bench_step.py": (1, 1),
    "test_metrics_logger.py": (1, 0),
    "test_health.py": (1, 1),
    "test_prompt_length_check.py": (1, 1),
    "test_rewards.py": (1, 0),
    "test_anchor_projection.py": (1, 1),
    "test_envs.py": (1, 1),
    "test_plan_engines.py": (35, 1),
    "test_install_pins.py": (1, 1),
    "test_sampler_scale.py": (40, 40),
    "test_docs.py": (1, 1),
    "test_progress.py": (1, 1),
    "test_recipes.py": (58, 3),
    "test_slow_links.py": (25, 25),
    "test_plan_links.py": (30, 0),
}
DEFAULT_WEIGHT = 5.0
# Files whose tests start a vLLM engine (test_vllm_*.py, `twocircuit serve-sampler`): all in one group.
ENGINE = ("test_vllm_*.py", "test_sampler_security.py")
# Files that share a session fixture (tests/conftest.py), each tuple kept in one group so the fixture is built once:
# chain_sum_base, a 300-step SFT (~20 s of CPU), serves the guard's collapse runs and the suite's trained checkpoint
# (WEIGHTS count it once, in test_eval_suite.py: the file of the two that pytest runs first).
TOGETHER = (("test_guard.py", "test_eval_suite.py"),)


def taper(groups: int, jobs: int, ratio: float = TAPER) -> list[float]:
    """Each group's share of the work: the first `jobs` groups 1, the next `jobs` `ratio`, then `ratio`**2, ... The
    runner hands the next group to whichever process slot frees first, so when the groups come lighter towards the
    end, a file slower than its weight delays the run by a fraction of a light group, not of an average one (equal
    groups ended one measured run 130 s after the other slot went idle)."""
    return [ratio ** (k // max(1, jobs)) for k in range(groups)]


def plan(
    files: list[str],
    groups: int = GROUPS,
    weights: dict | None = None,
    fast: bool = False,
    shares: list[float] | None = None,
) -> list[list[str]]:
    """Split `files` into at most `groups` non-empty groups whose total weights follow `shares` (default: equal;
    longest first onto the group least full for its share); the ENGINE files travel together as one unit, and so do
    the files of each TOGETHER tuple. Heaviest group first, files sorted within. A weight is seconds, or (seconds, seconds outside `slow`), the second used
    when `fast`."""
    weights = WEIGHTS if weights is None else weights

    def weight(f):
        w = weights.get(os.path.basename(f), DEFAULT_WEIGHT)
        return w if not isinstance(w, tuple) else w[1] if fast else w[0]

    engine = [f for f in files if any(fnmatch.fnmatch(os.path.basename(f), p) for p in ENGINE)]
    tied = [u for u in ([f for f in files if os.path.basename(f) in t] for t in TOGETHER) if u]
    units = [[f] for f in files if f not in engine and not any(f in u for u in tied)] + ([engine] if engine else [])
    units += tied
    units.sort(key=lambda u: (-sum(map(weight, u)), u[0]))
    bins: list[list[str]] = [[] for _ in range(max(1, groups))]
    share = list(shares) if shares else [1.0] * len(bins)
    load = [0.0] * len(bins)
    for u in units:
        i = min(range(len(bins)), key=lambda k: (load[k] / share[k], k))
        bins[i] += u
        load[i] += sum(map(weight, u))
    order = sorted((i for i in range(len(bins)) if bins[i]), key=lambda i: (-load[i], i))
    return [sorted(bins[i]) for i in order]


def skips_slow(argv: list[str]) -> bool:
    """Whether a `-m` expression in the pytest arguments deselects the slow tests (`make test-fast`)."""
    exprs = [b for a, b in zip(argv, argv[1:]) if a == "-m"] + [a[2:] for a in argv if a.startswith("-m") and a != "-m"]
    return any(re.search(r"\bnot\s+slow\b", e) for e in exprs)


def default_jobs() -> int:
    env = os.environ.get("TWOCIRCUIT_TEST_JOBS")
    return max(1, int(env)) if env else min(2, os.cpu_count() or 1)


def cache_env(tmp: str) -> dict:
    """JAX's persistent compilation cache, shared by every group of one run (a fresh folder each run, unless
    JAX_COMPILATION_CACHE_DIR is set). Dozens of tests build trainers of the same tiny models, and each build
    jit-compiles the same programs again; the cache turns the repeats into a file read (measured here on three
    end-to-end test files: 155 s -> 97 s). Every entry, however small or quick to compile, is kept."""
    return {
        "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(tmp, "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": os.environ.get("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0"),
    }


# XLA's CPU backend flag for the LLVM optimisation level of the code it generates (HLO passes are not affected)
OPT_FLAG = "--xla_backend_optimization_level"


def xla_env(flags: str) -> dict:
    """XLA_FLAGS for the test processes: 8 simulated CPU devices (tests/conftest.py sets the same when run alone)
    and LLVM optimisation level 0, unless `flags` (the caller's XLA_FLAGS) sets either already. The suite is
    dominated by compiles of small programs that run a few times: on the 2-core machine the suite took 889-929 s of
    pytest at level 0 against 1183-1192 s at the default level, every test passing at both (the same HLO, so the
    same programs; only LLVM's machine-code optimisation differs). Benchmarks, demos and runs compile their
    programs at level 1 on CPU (parallel/dispatch.py), unless their XLA_FLAGS set a level."""
    extra = []
    if "--xla_force_host_platform_device_count" not in flags:
        extra.append("--xla_force_host_platform_device_count=8")
    if OPT_FLAG not in flags:
        extra.append(f"{OPT_FLAG}=0")
    return {"XLA_FLAGS": " ".join([flags, *extra]).strip()}


def _run_group(argv, group, root, here, trace):
    env = {
        **os.environ,
        **cache_env(os.path.dirname(trace)),
        **xla_env(os.environ.get("XLA_FLAGS", "")),
        "TWOCIRCUIT_TEST_TRACE": trace,
        "TWOCIRCUIT_TEST_TIMES": trace + ".times.json",
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
    }
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "pytest_trace", *argv, *group],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with proc.stdout:
        out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # its CPU seconds too: on a shared machine wall time alone misleads
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out, time.monotonic() - start, usage.ru_utime + usage.ru_stime


def file_times(tmp: str, groups: int, top: int = 20) -> str:
    """One line of the heaviest test files' seconds in this run (each file's tests, setup to teardown), from the
    groups' pytest_trace reports: what WEIGHTS is re-measured from when a file's time changes."""
    import json

    secs: dict[str, float] = {}
    for n in range(1, groups + 1):
        path = os.path.join(tmp, f"current-{n}.times.json")
        if os.path.exists(path):
            secs.update(json.load(open(path)))
    out = os.environ.get("TWOCIRCUIT_TEST_TIMES_OUT")  # every file's seconds, kept past the run's temporary folder
    if out:
        with open(out, "w") as f:
            json.dump(dict(sorted(secs.items(), key=lambda kv: -kv[1])), f, indent=0)
        tests: dict[str, float] = {}  # and every test's, in OUT.tests
        for n in range(1, groups + 1):
            path = os.path.join(tmp, f"current-{n}.times.json.tests")
            if os.path.exists(path):
                tests.update(json.load(open(path)))
        with open(out + ".tests", "w") as f:
            json.dump(dict(sorted(tests.items(), key=lambda kv: -kv[1])), f, indent=0)
    heavy = sorted(secs.items(), key=lambda kv: -kv[1])[:top]
    return "heaviest test files (s): " + ", ".join(f"{k} {v:.0f}" for k, v in heavy)


def main(argv: list[str], root: str | None = None, jobs: int | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))  # scripts/: holds the pytest_trace plugin
    root = root or os.path.dirname(here)
    files = sorted(glob.glob(os.path.join(root, "tests", "test_*.py")))
    if not files:
        print("no test files under tests/", file=sys.stderr)
        return 5
    jobs = jobs or default_jobs()
    fast = skips_slow(argv)
    # test-fast holds unit tests only (no end-to-end runs whose executables pile up in a process): one group per
    # job, so no process starts more than needed and the two cores finish together.
    groups = plan(files, groups=jobs, fast=True) if fast else plan(files, GROUPS, shares=taper(GROUPS, jobs))
    totals = {"passed": 0, "failed": 0, "skipped": 0, "deselected": 0}
    first_failure = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="twocircuit-tests-") as tmp, cf.ThreadPoolExecutor(jobs) as pool:
        pending = list(enumerate(groups, 1))
        running: dict[cf.Future, tuple[int, list[str], str]] = {}
        while pending or running:
            while pending and len(running) < jobs and not first_failure:
                n, group = pending.pop(0)
                trace = os.path.join(tmp, f"current-{n}")  # the running test's id, per group
                print(f"--- pytest group {n} started: {len(group)} files", flush=True)
                running[pool.submit(_run_group, argv, group, root, here, trace)] = (n, group, trace)
            if not running:
                break
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: running[f][0]):
                n, group, trace = running.pop(fut)
                rc, out, secs, cpu = fut.result()
                sys.stdout.write(f"--- pytest group {n}: {len(group)} files, {secs:.0f} s ({cpu:.0f} s CPU)\n{out}")
                sys.stdout.flush()
                tail = out.strip().splitlines()[-1] if out.strip() else ""
                for k, what in re.findall(r"(\d+) (passed|failed|skipped|deselected)", tail):
                    totals[what] += int(k)
                if rc == 5 and "deselected" in tail:  # every test of this group filtered out by -m/-k
                    continue
                if rc < 0:  # killed by a signal: name the test it was in (the abort loses pytest's report)
                    running_test = open(trace).read() if os.path.exists(trace) else "(before the first test)"
                    print(
                        f"pytest group {n} died of {signal.Signals(-rc).name} while running {running_test}",
                        file=sys.stderr,
                    )
                if rc != 0:
                    print(f"pytest group {n} exited with {rc}", file=sys.stderr, flush=True)
                    first_failure = first_failure or (rc if rc > 0 else 1)
        print(file_times(tmp, len(groups)))
    print(
        f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
        f" ({len(groups)} groups, {jobs} at a time, {time.monotonic() - start:.0f} s)"
    )
    if first_failure:
        if pending:
            print(f"not run after the failure: groups {', '.join(str(n) for n, _ in pending)}", file=sys.stderr)
        return first_failure
    return 0 if totals["passed"] > 0 else 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
