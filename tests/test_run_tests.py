"""scripts/run_tests.py (the `make test` runner): a pytest process killed by a signal fails the run and is named
with the test it was running; clean groups pass with their totals summed; two groups run at once and each one's
output is printed whole; the first group to fail gives the exit code and no further group starts; the groups are
balanced by weight and the vLLM-engine files stay in one group."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runner():
    spec = importlib.util.spec_from_file_location("run_tests", os.path.join(ROOT, "scripts", "run_tests.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _project(tmp_path, body: str):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_fine():\n    assert 1 + 1 == 2\n")
    (tmp_path / "tests" / "test_b.py").write_text(body)
    return str(tmp_path)


def test_signal_death_names_the_running_test(tmp_path, capsys):
    root = _project(tmp_path, "import os\n\ndef test_ok():\n    pass\n\ndef test_dies():\n    os.abort()\n")
    rc = _runner().main(["-p", "no:faulthandler"], root=root)
    err = capsys.readouterr().err
    assert rc == 1
    assert "died of SIGABRT while running tests/test_b.py::test_dies" in err


def test_clean_groups_pass(tmp_path, capsys):
    root = _project(tmp_path, "def test_ok():\n    pass\n")
    assert _runner().main([], root=root) == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out
    # each file's seconds, from the groups' pytest_trace reports: both files named, heaviest first
    line = next(x for x in out.splitlines() if x.startswith("heaviest test files (s): "))
    assert sorted(x.split()[0] for x in line.split(": ", 1)[1].split(", ")) == ["test_a.py", "test_b.py"]


BARRIER = """import os, time

def test_{me}():
    print("{me}-begin")
    open(os.path.join({dir!r}, "{me}"), "w").close()
    deadline = time.time() + 60
    while not os.path.exists(os.path.join({dir!r}, "{other}")):  # the other group must be running too
        assert time.time() < deadline, "the two groups did not run at once"
        time.sleep(0.05)
    time.sleep(0.5)
    print("{me}-end")
"""


def test_two_groups_run_at_once_and_each_prints_whole(tmp_path, capsys):
    flags = tmp_path / "flags"
    flags.mkdir()
    (tmp_path / "tests").mkdir()
    for me, other in (("a", "b"), ("b", "a")):
        body = BARRIER.format(me=me, other=other, dir=str(flags))
        (tmp_path / "tests" / f"test_{me}.py").write_text(body)
    assert _runner().main(["-s"], root=str(tmp_path), jobs=2) == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out
    for me, other in (("a", "b"), ("b", "a")):
        block = out[out.index(f"{me}-begin") : out.index(f"{me}-end")]
        assert f"{other}-begin" not in block and f"{other}-end" not in block, out


def test_first_failing_group_gives_the_exit_code_and_no_new_group_starts(tmp_path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("import pytest\n\ndef test_stop():\n    pytest.exit('x', 3)\n")
    slow_fail = "import time\n\ndef test_late():\n    time.sleep(3)\n    assert False\n"
    (tmp_path / "tests" / "test_b.py").write_text(slow_fail)
    (tmp_path / "tests" / "test_c.py").write_text("def test_fine():\n    pass\n")
    assert _runner().main([], root=str(tmp_path), jobs=2) == 3
    cap = capsys.readouterr()
    assert "1 failed" in cap.out  # the running group b finished and was printed
    assert "test_c.py" not in cap.out and "not run after the failure: groups 3" in cap.err
    assert "0 passed, 1 failed" in cap.out  # the totals still add up the groups that ran


def test_plan_balances_by_weight_and_keeps_engines_together():
    run = _runner()
    files = [f"tests/test_{n}.py" for n in ("a", "b", "c", "d", "vllm_x", "vllm_y")]
    weights = {"test_a.py": 100, "test_b.py": 60, "test_c.py": 40, "test_d.py": 1, "test_vllm_x.py": 30}
    groups = run.plan(files, groups=3, weights={**weights, "test_vllm_y.py": 30})
    # longest first onto the lightest group; the two engine files are one unit of 60; heaviest group first
    assert groups == [
        ["tests/test_a.py"],
        ["tests/test_b.py", "tests/test_c.py"],
        ["tests/test_d.py", "tests/test_vllm_x.py", "tests/test_vllm_y.py"],
    ]
    # with weight 1 each, splitting the engine files would balance better: they stay together anyway
    assert ["tests/test_vllm_x.py", "tests/test_vllm_y.py"] in run.plan(files[4:], groups=2, weights={})
    assert run.plan(files[:2], groups=5, weights={}) == [["tests/test_a.py"], ["tests/test_b.py"]]


def test_plan_keeps_the_files_of_a_together_tuple_in_one_group():
    run = _runner()
    a, b = run.TOGETHER[0][:2]  # the shipped tuple: its files share a session fixture
    files = [f"tests/{a}", "tests/test_x.py", "tests/test_y.py", f"tests/{b}"]
    weights = {a: 50, b: 50, "test_x.py": 50, "test_y.py": 50}
    # alone each would take a group of its own: the tuple is one unit of 100, heaviest, the first group
    assert run.plan(files, groups=4, weights=weights) == [
        sorted([f"tests/{a}", f"tests/{b}"]),
        ["tests/test_x.py"],
        ["tests/test_y.py"],
    ]
    assert run.plan(files[:1], groups=2, weights=weights) == [[f"tests/{a}"]]  # one file of a tuple: a unit alone


def test_test_fast_plans_with_the_weights_outside_slow():
    run = _runner()
    assert run.skips_slow(["-m", "not slow"]) and run.skips_slow(["-mnot slow and not vllm"])
    assert not run.skips_slow(["-m", "slow"]) and not run.skips_slow(["-k", "not slow"])
    files = ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"]
    weights = {"test_a.py": (100, 0), "test_b.py": (50, 50), "test_c.py": (50, 50)}
    assert run.plan(files, groups=2, weights=weights) == [["tests/test_a.py"], ["tests/test_b.py", "tests/test_c.py"]]
    assert run.plan(files, groups=2, weights=weights, fast=True) == [
        ["tests/test_a.py", "tests/test_b.py"],
        ["tests/test_c.py"],
    ]


def test_groups_compile_at_level_0_on_8_devices_unless_the_caller_says_otherwise():
    env = _runner().xla_env
    assert env("") == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
    # the caller's own flags are kept, and a level or device count it sets wins
    got = env("--xla_backend_optimization_level=2 --xla_dump_to=/tmp/x")["XLA_FLAGS"].split()
    assert got == [
        "--xla_backend_optimization_level=2",
        "--xla_dump_to=/tmp/x",
        "--xla_force_host_platform_device_count=8",
    ]
    got = env("--xla_force_host_platform_device_count=4")["XLA_FLAGS"].split()
    assert got == ["--xla_force_host_platform_device_count=4", "--xla_backend_optimization_level=0"]


def test_a_group_sees_the_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    root = _project(
        tmp_path, "import os\n\ndef test_flags():\n    assert 'optimization_level=0' in os.environ['XLA_FLAGS']\n"
    )
    assert _runner().main([], root=root) == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out
    # each file's seconds, from the groups' pytest_trace reports: both files named, heaviest first
    line = next(x for x in out.splitlines() if x.startswith("heaviest test files (s): "))
    assert sorted(x.split()[0] for x in line.split(": ", 1)[1].split(", ")) == ["test_a.py", "test_b.py"]


def test_tapered_groups_come_lighter_towards_the_end():
    """make test's plan: per pair of groups (one per slot) 0.7 of the work of the pair before, so a file slower than
    its weight late in the run costs a fraction of a light group."""
    run = _runner()
    assert run.taper(6, 2, 0.5) == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    files = [f"tests/test_{i:02d}.py" for i in range(40)]
    weights = {f"test_{i:02d}.py": 10 for i in range(40)}  # 400 s of equal files
    groups = run.plan(files, groups=6, weights=weights, shares=run.taper(6, 2, 0.5))
    loads = [10 * len(g) for g in groups]
    assert sorted(f for g in groups for f in g) == files  # every file once
    assert loads == sorted(loads, reverse=True) and loads[0] >= 3 * loads[-1], loads
    assert abs(loads[0] - 400 / 3.5) <= 10 and abs(loads[-1] - 400 / 14) <= 10, loads
