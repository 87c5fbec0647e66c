"""pytest plugin loaded by scripts/run_tests.py (`-p pytest_trace`): writes the id of the test being started to
$TWOCIRCUIT_TEST_TRACE, so that a pytest process killed by a signal (an XLA abort loses the captured output and
pytest's own report) can still be named with the test it was running."""

import os


def pytest_runtest_logstart(nodeid, location):
    trace = os.environ.get("TWOCIRCUIT_TEST_TRACE")
    if trace:
        with open(trace, "w") as f:
            f.write(nodeid)
