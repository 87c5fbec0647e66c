"""`make test`: the whole suite, in a few pytest processes rather than one.

Each process holds every executable XLA compiled in it; hundreds of tiny end-to-end runs in a single process grow
it without bound (one CI run here ended with the pytest process aborting deep into the suite, on a test that passes
alone). Groups of files in separate processes bound that. Every test file is in exactly one group; a group that
fails (or runs no test) stops the run with its exit code. Extra arguments are passed to every pytest call.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import tempfile

GROUPS = 5


def main(argv: list[str], root: str | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))  # scripts/: holds the pytest_trace plugin
    root = root or os.path.dirname(here)
    files = sorted(glob.glob(os.path.join(root, "tests", "test_*.py")))
    if not files:
        print("no test files under tests/", file=sys.stderr)
        return 5
    size = -(-len(files) // GROUPS)
    totals = {"passed": 0, "failed": 0, "skipped": 0, "deselected": 0}
    with tempfile.TemporaryDirectory(prefix="twocircuit-tests-") as tmp:  # the running test's id, per group
        for i in range(0, len(files), size):
            group = files[i : i + size]
            print(f"--- pytest group {i // size + 1}: {len(group)} files", flush=True)
            trace = os.path.join(tmp, "current")
            if os.path.exists(trace):
                os.remove(trace)
            env = {
                **os.environ,
                "TWOCIRCUIT_TEST_TRACE": trace,
                "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
            }
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "pytest_trace", *argv, *group],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            sys.stdout.write(proc.stdout)
            sys.stdout.flush()
            tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            for n, what in re.findall(r"(\d+) (passed|failed|skipped|deselected)", tail):
                totals[what] += int(n)
            if proc.returncode == 5 and "deselected" in tail:  # every test of this group filtered out by -m/-k
                continue
            if proc.returncode < 0:  # killed by a signal: name the test it was in (the abort loses pytest's report)
                running = open(trace).read() if os.path.exists(trace) else "(before the first test)"
                print(
                    f"pytest group {i // size + 1} died of {signal.Signals(-proc.returncode).name} while running {running}",
                    file=sys.stderr,
                )
            if proc.returncode != 0:
                print(f"pytest group {i // size + 1} exited with {proc.returncode}", file=sys.stderr)
                return proc.returncode if proc.returncode > 0 else 1
    print(f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 0 if totals["passed"] > 0 else 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
