"""`twocircuit plan`: a config's step compiled for a target from shapes alone, in-process through the CLI.

tpu:v5e-8 runs the real TPU compiler on libtpu's compile-only devices (nothing runs); cpu:8 uses conftest's 8 fake
host devices. configs/tiny.yaml (4 layers, H 64) keeps each compile to seconds. The fitting plan's numbers are
checked against what they are made of: the compiled programs' own memory analysis, the chip table, and the
roofline arithmetic by hand.
"""

import json
import math
import os

import jax
import pytest
from scripts_module import load_script

from twocircuit_jax import cli
from twocircuit_jax.plan import chips, roofline

pytestmark = pytest.mark.slow  # compiles (TPU and CPU): `make test-fast` skips them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def plan(capsys, topology, *sets, json_path="", chip=""):
    args = ["plan", "--config", TINY, "--topology", topology] + (["--sampler-chip", chip] if chip else [])
    for s in sets:
        args += ["--set", s]
    if json_path:
        args += ["--json", str(json_path)]
    rc = cli.main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def tiny_tpu(tmp_path_factory):
    """One plan of tiny (2 layers) on tpu:v5e-8 with the anchor on (every program kind but logp_old), shared by the checks."""
    import io
    from contextlib import redirect_stdout

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    sets = ["anchor.enabled=true", "anchor.cadence=2", "anchor.delay=2", "anchor.projection.enabled=false"]
    sets += ["model.num_layers=2", "fast.pp_size=2"]  # what is checked holds at any depth; layers add compile time
    args = ["plan", "--config", TINY, "--topology", "tpu:v5e-8", "--json", str(path)]
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(args + [x for s in sets for x in ("--set", s)])
    return rc, buf.getvalue(), json.loads(path.read_text()), sets


@pytest.mark.tpu_compile
def test_tiny_fits_on_v5e_8(tiny_tpu):
    rc, out, p, _ = tiny_tpu
    assert rc == 0
    assert "fits" in out and "DOES NOT FIT" not in out
    assert p["target"] == "tpu:v5e-8" and p["devices"] == 8 and p["mesh"]["data"] == 8
    assert p["chip"]["hbm_bytes"] == chips.CHIPS["v5e"].hbm_bytes
    # one tick per step: ℓ_old from the train forward; the mask acts on the reference pass: the anchor runs its own
    # and the embedded sampler's rollout call (tiny evaluates only at the ends: no generate_eval per step)
    assert set(p["programs"]) == {"train_step", "logp_ref", "anchor_fire", "logp_anchor_ref", "generate"}
    for name, r in p["programs"].items():
        for key in ("argument", "output", "temp", "alias"):
            assert r["memory"][key] >= 0
        assert r["oom"] == "" and r["cost"]["flops"] > 0 and r["cost"]["bytes_accessed"] > 0
        keys = {"compute_s", "hbm_s", "collective_s", "bound_s", "limit"}
        assert set(r["roofline"]) == (keys | {"decode_step_s"} if name == "generate" else keys)
        assert r["largest"] and r["largest"][0]["bytes"] >= r["largest"][-1]["bytes"]
    # every gradient program reduces over data: the dp mean of the float32 gradients at least
    params = p["step"]["params"]
    assert p["programs"]["train_step"]["collectives"]["grad_reduce"] >= 4 * params
    assert p["programs"]["anchor_fire"]["collectives"]["grad_reduce"] >= 4 * params
    assert p["host"]["anchor_batches"] == 2 and p["host"]["anchor_snapshots"] == 3  # delay//cadence+1, +current


@pytest.mark.tpu_compile
def test_peak_is_resident_plus_the_largest_transient(tiny_tpu):
    from twocircuit_jax.plan.report import RESIDENT_ARGS

    _, _, p, _ = tiny_tpu
    res = p["resident"]
    assert res["total"] == pytest.approx(sum(v for k, v in res.items() if k != "total"))
    for name, r in p["programs"].items():
        m = r["memory"]
        assert r["transient"] == pytest.approx(r["own_arguments"] + m["output"] - m["alias"] + m["temp"])
        assert r["peak"] == pytest.approx(res["total"] + r["transient"])
        assert name in RESIDENT_ARGS
    assert p["peak"]["bytes"] == max(r["peak"] for r in p["programs"].values())
    # the train step donates its state: the new state is aliased to the old one
    t = p["programs"]["train_step"]
    assert t["memory"]["alias"] >= res["train_state"] - 64
    # float32 params and two Adam moments, replicated (dp only): 3 x 4 bytes per parameter per device
    assert res["train_state"] == pytest.approx(12 * p["step"]["params"], abs=64)
    assert res["reference_params"] == pytest.approx(4 * p["step"]["params"], abs=64)


@pytest.mark.tpu_compile
def test_roofline_matches_hand_arithmetic(tiny_tpu):
    _, _, p, sets = tiny_tpu
    chip = chips.CHIPS["v5e"]
    step_s, flops = 0.0, 0.0
    T = 16 + 4  # tiny: max_prompt_len + max_new_tokens
    gen_s = 0.0
    for name, r in p["programs"].items():
        c = r["cost"]
        if name == "generate":
            # the decode loop from shapes: 4 prompts x n 4 = 16 rows over 8 devices (2 each), every prompt prefilled
            # on each device (fewer prompts than devices); float32 weights (tiny's compute dtype), whole on each
            N, kv = p["step"]["params"], 2 * 2 * 1 * 32 * 4  # 2 layers, k and v, 1 KV head of 32, float32
            assert r["rows"] == 16 and r["generation"] == {"prompts": 4, "n": 4, "prompt_len": 16, "max_new": 4,
                                                           "greedy": False, "rows_per_call": "auto"}  # fmt: skip
            prefill = max(2 * N * 1 * 16 / 197e12, 4 * N / 819e9)
            step = max(2 * N * 2 / 197e12, (4 * N + 2 * 20 * kv) / 819e9)
            want = prefill + 4 * step + r["collective_bytes"] / 400e9
            gen_s += want
        else:
            # the compute term: XLA's flops, or the model's per device when larger (a loop's body is counted once)
            compute = max(c["flops"], r["model_flops"] / 8)
            want = max(compute / 197e12, c["bytes_accessed"] / 819e9, r["collective_bytes"] / 400e9)
        assert r["roofline"]["bound_s"] == pytest.approx(want, rel=1e-12)
        step_s += r["runs_per_step"] * want
        per_token = 6 if name in ("train_step", "anchor_fire") else 2
        assert r["model_flops"] == per_token * p["step"]["params"] * r["rows"] * T
        flops += r["runs_per_step"] * r["model_flops"]
    # tiny: 4 prompts x n=4 rows, one tick; the anchor fires every 2nd tick
    assert p["programs"]["train_step"]["rows"] == 16 and p["programs"]["anchor_fire"]["runs_per_step"] == 0.5
    assert p["step"]["step_bound_s"] == pytest.approx(step_s, rel=1e-12)
    assert p["step"]["generation_bound_s"] == pytest.approx(gen_s, rel=1e-12)
    assert p["step"]["train_bound_s"] == pytest.approx(step_s - gen_s, rel=1e-12)
    assert p["step"]["mfu_bound"] == pytest.approx(flops / (8 * chip.peak_bf16_flops * step_s), rel=1e-12)


def test_roofline_hand_numbers():
    chip = chips.Chip("x", 16 * 2**30, 100e12, 1e12, 0.5e12, "")
    b = roofline.program_bound(200e12, 1e12, 0.25e12, chip)  # 2 s compute, 1 s HBM, 0.5 s links
    assert (b["compute_s"], b["hbm_s"], b["collective_s"], b["bound_s"], b["limit"]) == (2.0, 1.0, 0.5, 2.0, "compute")
    assert roofline.program_bound(1e12, 3e12, 0.0, chip)["limit"] == "hbm"
    # 1.5e9 params, 4096 tokens trained: 6 * 1.5e9 * 4096 = 3.6864e13 flops; on 8 such chips for 0.1 s: 46.08%
    f = roofline.model_flops(1_500_000_000, 4096, True)
    assert f == 3.6864e13 and roofline.model_flops(10, 3, False) == 60
    assert roofline.mfu(f, 8, chip, 0.1) == pytest.approx(0.4608)


@pytest.mark.tpu_compile
def test_huge_vocab_does_not_fit_and_names_the_largest_buffer(capsys, tmp_path):
    # a 9M-token vocabulary over 32 rows per device of 20 tokens: float32 logits of 32 x 19 x 9M (20 GiB) alone are
    # past a v5e's 16 GiB, so the TPU compiler refuses the step; the plan names that buffer. (A long sequence does
    # the same through the attention scores, but its compiles take minutes on a shared CPU; this one is short.)
    # One layer: the logits are the buffer that does not fit, whatever the depth; each layer only adds compile time.
    # Rollouts from vLLM engines (sized by --sampler-chip, no program here): the embedded sampler's call over a 9M
    # vocabulary would only add a long compile to a check of the train step.
    V = 9_000_000
    rc, out, err = plan(
        capsys, "tpu:v5e-8", f"model.vocab_size={V}", "train.prompts_per_step=64", "train.prompts_per_update=64",
        "fast.codec=none", "model.num_layers=1", "sampler.backend=vllm", json_path=tmp_path / "p.json",
        chip="h100-80gb",
    )  # fmt: skip
    assert rc == 1, err
    assert "DOES NOT FIT" in out and "largest buffers of train_step" in out
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["peak"]["fits"] is False and p["peak"]["bytes"] > chips.CHIPS["v5e"].hbm_bytes
    worst = p["programs"]["train_step"]
    assert worst["oom"].startswith("RESOURCE_EXHAUSTED") and worst["memory"]["temp"] > chips.CHIPS["v5e"].hbm_bytes
    big = worst["largest"][0]
    assert str(V) in big["shape"] and big["bytes"] > 16 * 2**30
    assert f"{big['op']} {big['shape']}" in out


@pytest.mark.tpu_compile
def test_a_generation_that_cannot_fit_does_not_fit_and_names_its_buffer(capsys, tmp_path):
    """The rollouts' call is a program of the plan: 16,384 rows of 16 + 512 positions in one call (2,048 rows a
    device, 16 KV heads of 128 in one float32 layer: 8.7 MB of cache a row, 17.7 GB a device) are past a v5e's 16 GiB
    while the train step, one row a device at a time, fits. The plan says so, exit 1, naming the generation
    program and its largest buffer. (Many short rows rather than fewer long ones: the same cache, and the train
    step at 528 positions compiles in a third of the time it takes at 2,064.)"""
    rc, out, err = plan(
        capsys, "tpu:v5e-8", "model.num_layers=1", "fast.pp_size=1", "fast.codec=none", "grpo.kl_coef=0",
        "model.num_heads=16", "model.num_kv_heads=16", "model.head_dim=128", "sampler.sampling.max_new_tokens=512",
        "train.prompts_per_step=4096", "train.prompts_per_update=4096", "train.micro_batch_per_device=1", "sampler.max_rows_per_call=16384",
        json_path=tmp_path / "p.json",
    )  # fmt: skip
    assert rc == 1, err
    assert "DOES NOT FIT" in out and "largest buffers of generate" in out
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["peak"]["program"] == "generate" and p["peak"]["fits"] is False
    assert p["programs"]["train_step"]["oom"] == "" and p["programs"]["generate"]["oom"].startswith("RESOURCE_EXH")
    assert p["programs"]["generate"]["rows"] == 16384
    big = p["programs"]["generate"]["largest"][0]
    assert f"{big['op']} {big['shape']}" in out


@pytest.mark.parametrize(
    "topology,sets,needle",
    [
        ("tpu:v9-8", [], "--topology: got 'tpu:v9-8'; allowed: tpu:v5e-4"),
        ("gpu:h100-8", [], "GPU programs cannot be compiled on this host"),
        ("cpu:0", [], "--topology: got 'cpu:0'"),
        ("tpu:v5e-8", ["mesh.data=3"], "but there are 8 devices"),
        ("tpu:v5p-8", ["mesh.data=8"], "target tpu:v5p-8 has 4 devices"),
    ],
)
def test_bad_target_or_mesh_is_bad_input(capsys, topology, sets, needle):
    rc, out, err = plan(capsys, topology, *sets)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("twocircuit plan: error: ")
    assert needle in err


def test_cpu_8_plans_on_fake_host_devices(capsys, tmp_path):
    """conftest's 8 host devices: the CPU compiler's memory, no chip to fit (exit 0, no roofline)."""
    rc, out, err = plan(capsys, "cpu:8", "fast.codec=none", json_path=tmp_path / "p.json")
    assert rc == 0, err
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["chip"] is None and p["peak"]["fits"] is None and "roofline" not in p["programs"]["train_step"]
    assert "no chip memory to fit into" in out
    # the same step compiled directly on the same devices: the plan reports its memory analysis as is
    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.step.abstract_step import abstract_train_step

    step = abstract_train_step(load_config(TINY, ["fast.codec=none"]), jax.devices()[:8])
    m = step.jitted.lower(*step.args).compile().memory_analysis()
    got = p["programs"]["train_step"]["memory"]
    assert (got["argument"], got["temp"]) == (m.argument_size_in_bytes, m.temp_size_in_bytes)
    assert math.isclose(p["resident"]["train_state"], 12 * p["step"]["params"], abs_tol=64)


def test_comm_bytes_memory_is_the_plans_report(capsys):
    """scripts/comm_bytes.py --memory prints the plan of the same devices: its train step's memory line and table."""
    import re

    mod = load_script("comm_bytes")
    assert mod.main(["--config", TINY, "--devices", "2", "--memory", "--set", "fast.codec=none"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"memory unstaged \(mesh -?\d+x1x1x1\), per device: argument=([\d.]+)MiB .*temp=([\d.]+)MiB", out)
    assert m, out
    assert "plan for cpu:2: 2 devices" in out and "train_step" in out and "logp_ref" in out
    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.step.abstract_step import abstract_train_step

    step = abstract_train_step(load_config(TINY, ["fast.codec=none"]), jax.devices()[:2])
    ma = step.jitted.lower(*step.args).compile().memory_analysis()
    assert m.group(1) == f"{ma.argument_size_in_bytes / 2**20:.1f}"
    assert m.group(2) == f"{ma.temp_size_in_bytes / 2**20:.1f}"


@pytest.mark.tpu_compile
def test_plan_with_the_mask_kernel_compiles_for_tpu(capsys, tmp_path):
    """The Pallas mask kernel inside the train step and the reference pass (built for TPU, under the circuit's
    shard_map) goes through the TPU compiler too: the plan fits, and the kernel's program differs from the jnp one."""
    # 2 layers, one boundary (after layer 0): the kernel lowers the same at each boundary; more only adds compile time
    two = ("model.num_layers=2", "fast.pp_size=2")
    kernel = "fast.codec={type: prf_mask, p: 0.95, use_kernel: true}"
    on = plan(capsys, "tpu:v5e-8", kernel, *two, json_path=tmp_path / "k")
    off = plan(capsys, "tpu:v5e-8", *two, json_path=tmp_path / "j")
    assert on[0] == 0 and off[0] == 0, (on[2], off[2])
    k, j = (json.loads((tmp_path / n).read_text())["programs"]["train_step"] for n in ("k", "j"))
    assert k["cost"] != j["cost"]
