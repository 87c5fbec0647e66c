"""scripts/comm_bytes.py in-process on configs/tiny.yaml: the final line, ratio = 1 for codec none and < 1 for a
codec; PowerSGD's measured HLO gradient bytes against the §3.6 formula.

Every check compiles on 2 of conftest's 8 fake devices (dp=2). The bytes are per replica, so the data-parallel
degree changes no asserted quantity (the gradient all-reduce's operands are the same leaves at dp 2 or 8), and
dp=2 still has a real cross-device reduction in the HLO. At dp 4 or 8, XLA:CPU's compile of configs/tiny.yaml's
train step stalls on the 2-core test machine (`scripts/comm_bytes.py --devices 4`: no result in 150 s; at 8 none in
240 s); at dp=2 each compile takes seconds."""

import os
import re

import pytest
from scripts_module import load_script

pytestmark = pytest.mark.slow  # end-to-end runs: `make test-fast` skips them, `make test` (CI) runs them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.fixture(scope="module")
def comm_bytes():
    return load_script("comm_bytes")


# tiny at 2 layers (pp_size 2: one boundary): every asserted quantity is per leaf or per boundary, and the layers
# unroll, so each one more only adds compile time to both programs (the config's and its dense twin)
TWO_LAYERS = ("model.num_layers=2", "fast.pp_size=2")


def final(mod, capsys, *sets, devices=2):
    args = ["--config", TINY, "--devices", str(devices)]
    for s in TWO_LAYERS + sets:
        args += ["--set", s]
    assert mod.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    m = re.fullmatch(r"dense_bytes=(\d+) compressed_bytes=(\d+) ratio=([0-9.]+)", out[-1])
    assert m, out[-1]
    return int(m.group(1)), int(m.group(2)), float(m.group(3)), out


def test_none_is_ratio_one_and_mask_below(comm_bytes, capsys):
    d0, c0, r0, _ = final(comm_bytes, capsys, "fast.codec=none")
    assert c0 == d0 and r0 == 1.0
    d1, c1, r1, _ = final(comm_bytes, capsys, "fast.codec=prf_mask")
    assert d1 == d0 and c1 < d1 and r1 < 1.0


def test_powersgd_hlo_bytes_match_formula(comm_bytes, capsys):
    import jax

    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.fast.bytes import grad_allreduce_bytes
    from twocircuit_jax.model.qwen2 import init_params

    sets = ["fast.codec=none", "fast.grad_codec={type: powersgd, rank: 2, start_after: 0}"]
    d, c, r, out = final(comm_bytes, capsys, *sets)
    assert r < 0.5
    cfg = load_config(TINY, list(TWO_LAYERS) + sets)
    params = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
    formula = grad_allreduce_bytes(params, cfg.fast.grad_codec)
    hlo = {k: float(v) for k, v in re.findall(r"(\w+): .*hlo_collective_bytes=(\d+)", "\n".join(out))}
    # the HLO also carries the loss's few scalar reductions (same on both sides): allow 1 KiB of slack. One tick per
    # step, so the train forward is the ℓ_old pass (step/programs.py fuses_old_pass): under PowerSGD its diagnostics
    # gather their inputs over the replicas, five fp32 [rows, T] arrays and the bool `truncated` per replica.
    rows, T = (
        cfg.train.prompts_per_update * cfg.sampler.n // 2,
        cfg.train.max_prompt_len + cfg.sampler.sampling.max_new_tokens,
    )
    diag = 5 * rows * T * 4 + rows
    assert abs(hlo["config"] - formula["comm/bytes_compressed"] - diag) < 1024, (hlo, formula, diag)
    # XLA's implicit mean reduces the tied embedding's two gradient parts (lookup, LM head) separately before
    # adding them, so the dense program sends the embedding once more than the formula's one copy per leaf
    embed = params["embed"].size * 4
    assert 0 <= hlo["dense"] - formula["comm/bytes_dense"] <= embed + 1024, (hlo, formula)


def test_anchor_fires_count_on_the_config_side(comm_bytes, capsys):
    """With the anchor on, each fire's dense gradient mean is compiled and counted at one fire per `cadence` ticks;
    the dense twin has no anchor. One fire's reduction is the dense step's gradient reduction."""
    sets = (
        "fast.codec=none",
        "anchor.enabled=true",
        "anchor.cadence=2",
        "anchor.delay=2",
        "anchor.projection.enabled=false",
    )
    d, c, r, out = final(comm_bytes, capsys, *sets)
    rows = {
        name: (int(t), float(h), float(b), float(a))
        for name, t, h, b, a in re.findall(
            r"(\w+): .*ticks/step=(\d+) hlo_collective_bytes=(\d+) .*boundary_bytes=(\d+) .*anchor_bytes=(\d+)",
            "\n".join(out),
        )
    }
    ticks, hlo_d, _, anchor_d = rows["dense"]
    _, hlo_c, bound_c, anchor_c = rows["config"]
    assert anchor_d == 0 and anchor_c > 0
    fire = anchor_c * 2 / ticks  # cadence 2
    assert abs(fire - hlo_d / ticks) / (hlo_d / ticks) < 0.05, (fire, hlo_d / ticks)
    assert c == round(hlo_c + bound_c + anchor_c) and c > d


def test_staged_powersgd_counts_its_steady_state(comm_bytes, capsys, tmp_path):
    """mesh data 2 x stage 2 with PowerSGD (default warm-up, start_after 100): the count is of the compressed
    reduction alone (the train step's steady program, and the output says so), the boundaries carry the dense
    activation on both sides, and the gradient reduction is smaller than the dense twin's: each stage reduces its own
    layers' P and Q over `data`, and nothing of the layer stack is gathered over `stage`."""
    import yaml
    from tiny_run import NARROW_MODEL

    # 2 layers, one a stage: the counts are per leaf and per stage, and each more layer adds only compile time
    cfg = {
        "model": {**NARROW_MODEL, "num_layers": 2},
        "mesh": {"data": 2, "stage": 2},
        "sampler": {"n": 4},
        "fast": {"pp_size": 2, "grad_codec": {"type": "powersgd", "rank": 2}},
        "anchor": {"enabled": False},
        "train": {"prompts_per_step": 4, "prompts_per_update": 4, "max_prompt_len": 6},
    }
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert comm_bytes.main(["--config", str(path), "--devices", "4"]) == 0
    out = capsys.readouterr().out
    assert "steady state (the train step's steady program); its first 100 reductions run the warm-up" in out
    assert re.search(r"boundary_ratio=1\.00x", out), out
    dense, comp = (float(x) for x in re.search(r"grad_reduce_dense_bytes=(\d+) grad_reduce_bytes=(\d+)", out).groups())
    # per stage: the embedding and final norm (1,616 values, reduced whole) plus its layer's P and Q (576 values
    # with its bias-free vectors); the dense twin sends the same ends plus each stage's layer whole (2,592 values):
    # 2,192 against 4,208
    assert comp < 0.6 * dense, out
