"""pytest plugin loaded by scripts/run_tests.py (`-p pytest_trace`): writes the id of the test being started to
$TWOCIRCUIT_TEST_TRACE, so that a pytest process killed by a signal (an XLA abort loses the captured output and
pytest's own report) can still be named with the test it was running; and, when $TWOCIRCUIT_TEST_TIMES names a file, each test
file's seconds (setup + call + teardown of its tests) as JSON at the end, from which run_tests.py prints the
heaviest files (the numbers its WEIGHTS are re-measured from); each test's seconds go to the same path + ".tests"
(what to trim when the suite runs over its budget)."""

import json
import os

_SECONDS: dict[str, float] = {}
_TESTS: dict[str, float] = {}


def pytest_runtest_logstart(nodeid, location):
    trace = os.environ.get("TWOCIRCUIT_TEST_TRACE")
    if trace:
        with open(trace, "w") as f:
            f.write(nodeid)


def pytest_runtest_logreport(report):
    name = os.path.basename(report.nodeid.split("::")[0])
    _SECONDS[name] = _SECONDS.get(name, 0.0) + report.duration
    _TESTS[report.nodeid] = _TESTS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("TWOCIRCUIT_TEST_TIMES")
    if path:
        with open(path, "w") as f:
            json.dump(_SECONDS, f)
        with open(path + ".tests", "w") as f:
            json.dump(_TESTS, f)
