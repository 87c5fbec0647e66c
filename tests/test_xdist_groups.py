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
