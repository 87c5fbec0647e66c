"""`twocircuit plan` per link on a multi-slice TPU target: tpu:2xv5e-8 is two v5e-8 slices of libtpu's compile-only
devices (num_slices=2) joined by DCN; a dcn_data=2 mesh puts the gradient reduction (PowerSGD's) across them. The TPU compiler
sends that part through the Megascale runtime: its bytes are the slow link's. configs/tiny.yaml at 2 layers, with
the dense twin, keeps both compiles to seconds."""

import io
import json
import os
from contextlib import redirect_stdout

import pytest

from twocircuit_jax import cli
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.plan import links, targets
from twocircuit_jax.plan.roofline import gbps_bytes

pytestmark = [pytest.mark.slow, pytest.mark.tpu_compile]  # compiles for TPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SETS = ["mesh.dcn_data=2", "model.num_layers=2", "fast.pp_size=2"]
# what crosses the slow link, compressed; a warm-up of one reduce, so the plan compiles its program too
SETS += ["fast.grad_codec={type: powersgd, rank: 2, start_after: 1}"]


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    args = ["plan", "--config", TINY, "--topology", "tpu:2xv5e-8", "--json", str(path)]
    args += ["--dcn-gbps", "100,25,1", "--dense-twin"] + [x for s in SETS for x in ("--set", s)]
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(args)
    return rc, buf.getvalue(), json.loads(path.read_text())


def test_multi_slice_target():
    t = targets.parse("tpu:2xv5e-8")
    assert t.count == 16 and t.slices == 2
    assert sorted({d.slice_index for d in targets.devices(t)}) == [0, 1]
    with pytest.raises(ConfigError):
        targets.parse("tpu:2xv5e-9")


def test_slow_link_bytes_and_times(two_slices):
    rc, out, p = two_slices
    assert rc == 0 and p["islands"] == 2 and p["mesh"]["data"] == 16
    assert "2 islands over the slow link" in out and "DCN Gb/s" in out and "speedup" in out
    s, lk = p["step"], p["links"]
    assert 0 < s["slow_bytes"] < s["collective_bytes"]  # the gradient reduction crosses; the in-slice part does not
    assert s["fast_bytes"] + s["slow_bytes"] == pytest.approx(s["collective_bytes"])
    train = p["programs"]["train_step"]
    # every loop's trip count is read from the TPU text (fast/hlo_bytes.py with_derived_trips): no count is a bound
    assert {n: r["note"] for n, r in p["programs"].items() if r["note"]} == {}
    assert train["slow_bytes"] > 0 and train["roofline"]["dcn_s"] == pytest.approx(
        train["slow_bytes"] / gbps_bytes(100)
    )
    rows = lk["rows"]
    assert [r["gbps"] for r in rows] == [100, 25, 1]
    for r in rows:  # the slow link's time scales with 1 / bandwidth
        assert r["slow_s"] == pytest.approx(s["slow_bytes"] / gbps_bytes(r["gbps"]))
        assert r["step_s"] >= lk["step_s_fast_only"] and r["step_s"] >= r["slow_s"]
        assert r["speedup"] == pytest.approx(r["dense_step_s"] / r["step_s"])
    assert rows[0]["slow_s"] * 100 == pytest.approx(rows[2]["slow_s"])
    assert rows[0]["step_s"] <= rows[1]["step_s"] <= rows[2]["step_s"]
    # below B* the slow link alone takes longer than the rest of the step's bound
    b_star = lk["slow_bound_below_gbps"]
    assert s["slow_bytes"] / gbps_bytes(b_star) == pytest.approx(lk["step_s_fast_only"])
    assert rows[2]["gbps"] < b_star  # at 1 Gb/s tiny's step is bound by the slow link
    assert links.step_at(p, gbps_bytes(1)) == pytest.approx(rows[2]["step_s"])
    assert 0 < s["slow_bytes"] < lk["dense_slow_bytes"]  # PowerSGD's factors against the dense gradient
    assert rows[2]["speedup"] > 1  # at 1 Gb/s the compressed step is the faster


def test_the_warm_up_is_a_program_that_must_fit_but_does_not_count_in_a_step(two_slices):
    """PowerSGD's warm-up (its plain mean) is a train-step program of its own (step/programs.py PhasedTrainStep): the
    plan compiles it and counts it in the peak, not in the steady step's time or bytes; its slow-link bytes are the
    dense gradient's, far above the compressed step's."""
    rc, out, p = two_slices
    warm, train = p["programs"]["train_step_warmup"], p["programs"]["train_step"]
    assert warm["runs_per_step"] == 0 and train["runs_per_step"] > 0
    assert warm["peak"] > 0 and p["peak"]["bytes"] >= warm["peak"]
    assert warm["slow_bytes"] > 2 * train["slow_bytes"]
    assert p["step"]["slow_bytes"] == pytest.approx(
        sum(r["runs_per_step"] * r["slow_bytes"] for r in p["programs"].values())
    )


def test_bad_dcn_gbps_is_refused():
    with pytest.raises(ConfigError) as e:
        links.parse_gbps("100,-1")
    assert e.value.path == "--dcn-gbps"
