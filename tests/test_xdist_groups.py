"""The units of work `make test` hands to its pytest-xdist workers (tests/conftest.py): each module whole, the vLLM
engine modules together, the users of the shared SFT base together. Read from a real collection of real test files,
in a child pytest (collection imports the modules; nothing runs)."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Collects the given files and prints {node id: its xdist_group names} as one JSON line.
REPORT = """
import json, sys, pytest
class Report:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        out = {i.nodeid: [m.args[0] for m in i.iter_markers("xdist_group")] for i in items}
        print("GROUPS " + json.dumps(out))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Report()]))
"""

FILES = {  # file: the group its tests must be in
    "tests/test_vllm_loop.py": "vllm",
    "tests/test_vllm_resume.py": "vllm",
    "tests/test_vllm_client_faults.py": "tests/test_vllm_client_faults.py",  # a fake engine: no vllm marker
    "tests/test_guard.py": "chain_sum_base",
    "tests/test_eval_suite.py": "chain_sum_base",
    "tests/test_grpo_tis.py": "tests/test_grpo_tis.py",
}


def test_each_module_is_one_unit_and_engines_and_the_shared_base_share_one():
    proc = subprocess.run([sys.executable, "-c", REPORT, *FILES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("GROUPS ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    groups = json.loads(line[0][len("GROUPS ") :])
    seen = {f: set() for f in FILES}
    for nodeid, names in groups.items():
        path = nodeid.split("::")[0]
        assert len(names) == 1, (nodeid, names)  # exactly one group per test, or xdist joins the names
        seen[path].add(names[0])
    assert seen == {f: {g} for f, g in FILES.items()}


def test_make_test_distributes_by_those_groups():
    """Without --dist loadgroup xdist ignores the groups: two engines could start at once."""
    make = open(os.path.join(ROOT, "Makefile")).read()
    pytest_line = re.search(r"^PYTEST := (.*)$", make, re.M).group(1)
    assert "-n $(TEST_JOBS)" in pytest_line and "--dist loadgroup" in pytest_line
    for target in ("test", "test-fast"):
        body = re.search(rf"^{target}: lint\n\t(.*)$", make, re.M).group(1)
        assert body.startswith("$(PYTEST)"), body


PROBE = """
import os, pytest
{mark}

@pytest.mark.parametrize("i", range(3))
def test_where(i):
    with open(os.path.join(os.path.dirname(__file__), "ran.txt"), "a") as fh:
        fh.write(f"{{__name__}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
"""


def test_a_run_under_xdist_keeps_each_group_on_one_worker(tmp_path):
    """The distribution itself, not only the marks: a child `pytest -n 2 --dist loadgroup` of three small modules
    under this suite's conftest, two of them engine modules. Each module runs on one worker and both engine modules on
    the same one (a pytest whose ids lose xdist's group suffix hands the tests out one by one, or the conftest stops
    the run)."""
    with open(os.path.join(ROOT, "tests", "conftest.py")) as src:
        (tmp_path / "conftest.py").write_text(src.read())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: an engine module\n")
    for name, mark in (
        ("test_engine_a", "pytestmark = pytest.mark.vllm"),
        ("test_engine_b", "pytestmark = pytest.mark.vllm"),
        ("test_plain", ""),
    ):
        (tmp_path / f"{name}.py").write_text(PROBE.format(mark=mark))
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "."]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set] = {}
    for line in (tmp_path / "ran.txt").read_text().splitlines():
        module, worker = line.split()
        workers.setdefault(module, set()).add(worker)
    assert sorted(workers) == ["test_engine_a", "test_engine_b", "test_plain"]
    assert all(len(w) == 1 for w in workers.values()), workers
    assert workers["test_engine_a"] == workers["test_engine_b"], workers
