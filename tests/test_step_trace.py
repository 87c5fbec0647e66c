"""docs/architecture.md's step trace is what a real run gives (scripts/step_trace.py --check, in its own process),
with at most 10 wiring modules; and the wiring rule itself on a hand-made trace."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import step_trace  # noqa: E402


def test_wiring_is_a_module_that_calls_into_two_other_parts():
    tr = step_trace.Tracer()
    tr.order = ["twocircuit_jax.train.loop", "twocircuit_jax.fast.powersgd", "twocircuit_jax.fast.orth"]
    tr.edges = {
        ("twocircuit_jax.train.loop", "twocircuit_jax.fast.powersgd"),
        ("twocircuit_jax.train.loop", "twocircuit_jax.sampler.base"),
        ("twocircuit_jax.train.loop", "twocircuit_jax.train.guard"),  # its own part: not counted
        ("twocircuit_jax.fast.powersgd", "twocircuit_jax.fast.orth"),  # within fast
        ("twocircuit_jax.fast.powersgd", "pallas_kernels.powersgd"),  # one other part: still a leaf
    }
    imports = {  # what each module imports (read from the source in a real trace)
        "twocircuit_jax.train.loop": {"twocircuit_jax.fast.powersgd", "twocircuit_jax.sampler.base"},
        "twocircuit_jax.fast.powersgd": {"twocircuit_jax.fast.orth", "pallas_kernels.powersgd"},
        "twocircuit_jax.fast.orth": set(),
    }
    assert step_trace.wiring(tr, dict(imports)) == ["twocircuit_jax.train.loop"]
    # a call into a module it does not import is a callback (a function handed over), not wiring
    imports["twocircuit_jax.train.loop"] = {"twocircuit_jax.fast.powersgd"}
    assert step_trace.wiring(tr, dict(imports)) == []
    # calls into the utilities every layer uses do not count
    tr.edges.add(("twocircuit_jax.fast.powersgd", "twocircuit_jax.names"))
    imports["twocircuit_jax.fast.powersgd"].add("twocircuit_jax.names")
    assert step_trace.wiring(tr, dict(imports)) == []
    assert step_trace.part_of("twocircuit_jax.names") == "names"
    assert step_trace.part_of("pallas_kernels.prf") == "pallas_kernels"
    with pytest.raises(SystemExit, match="markers"):
        step_trace.replace_section("no markers here", "x")


@pytest.mark.slow  # a 3-step run under a profile hook, in its own process
def test_the_documented_trace_is_what_a_run_gives():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "step_trace.py"), "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    section = open(step_trace.DOC).read().split(step_trace.BEGIN)[1].split(step_trace.END)[0]
    assert "**Wiring:" in section and "`train/loop.py`" in section
