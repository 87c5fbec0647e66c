"""The GRPO loop on real pipeline stages (mesh data 4 x stage 2, 2 microbatches, the low-rank codec at the stage
boundary, the anchor owning the basis, the fidelity probe on): every pass compiles once, a resumed run continues
exactly, and a weight export of the stage-split parameters holds the full arrays."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.config import load_config
from twocircuit_jax.sampler.export import export_weights, load_export
from twocircuit_jax.train.checkpoint import committed_steps
from twocircuit_jax.train.loop import GRPOTrainer

pytestmark = pytest.mark.slow  # end-to-end runs: `make test-fast` skips them, `make test` (CI) runs them

CFG = tiny_config(
    name="pipeline_loop",
    mesh={"data": 4, "stage": 2},
    task={"train_size": 32},
    fast={"pp_size": 2, "codec": {"type": "lowrank", "rank": 3}},
    anchor={"enabled": True, "cadence": 1, "delay": 1, "projection": {"window": 2, "min_snapshots": 2}},
    train={"steps": 3, "checkpoint_every": 2, "probe_every": 1, "pipeline_microbatches": 2},
)


def _rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _same(a: dict, b: dict):
    keys = {k for k in a if not k.startswith("time/")} | {k for k in b if not k.startswith("time/")}
    assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pipe") / "straight")
    trainer = GRPOTrainer(load_config(data=CFG), out, show_progress=False)
    trainer.run()
    return trainer, out


def test_staged_loop_compiles_each_pass_once_and_exports_whole_arrays(straight, tmp_path):
    """The straight run's passes compiled once each, its traffic, its stage-split layer stack, and a weight export
    of that stack holding the full arrays. (One test reads the run for all of these: under `make test` a test of the
    module run apart from the others could have its worker build the run again.)"""
    trainer, out = straight
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["pipeline/bubble_fraction"] == pytest.approx(1 / 3)  # (S - 1) / (M + S - 1), S = M = 2
    assert rows[-1]["anchor/fires"] == 6 and "fidelity/grad_cos" in rows[-1]  # a fire every tick, 2 ticks a step
    for name in ("train_step", "logp_old", "logp_ref", "logp_dense", "logp_anchor_ref", "fidelity"):
        assert getattr(trainer.built.programs, name)._cache_size() == 1, name  # comm/hlo/* compiled it ahead: once
    # comm/hlo/*: the train step's traffic from its compiled program, per data replica per step. The boundary
    # carries r = 3 fp32 coefficients per token of a replica's microbatch, forward and back, at each of the
    # M + S - 1 = 3 ticks (bubble ticks send too), for each of the step's mini-batches.
    cfg = trainer.built.cfg
    mb_rows = cfg.train.prompts_per_update * cfg.sampler.n // 2 // 4  # M = 2 microbatches over 4 data replicas
    tokens = mb_rows * (cfg.train.max_prompt_len + cfg.sampler.sampling.max_new_tokens)
    want = 3 * tokens * 3 * 4 * cfg.ticks_per_step
    assert rows[-1]["comm/hlo/boundary_fwd"] == rows[-1]["comm/hlo/boundary_bwd"] == want, (rows[-1], want)
    assert rows[-1]["comm/hlo/grad_reduce"] > 0 and rows[-1]["comm/hlo/stage_exit"] > 0
    # the layer stack lives split over the stages: one of the 2 layers per device
    q = trainer.state.params["layers"]["q_proj"]["kernel"]
    assert q.shape[0] == 2 and {s.data.shape[0] for s in q.addressable_shards} == {1}
    # the export gathers the stage-split parameters: every leaf whole, equal to the trained one
    params = trainer.state.params
    version = export_weights(params, trainer.built.model_cfg, str(tmp_path / "export"), 1)
    _, loaded = load_export(version)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_staged_resume_is_exact(straight, tmp_path):
    """A copy of the straight run cut back to its step-2 checkpoint (a run that died after it), resumed through the
    CLI, ends on the straight run's last line. (The copy spares a second 2-step run: its compiles and rollouts.)"""
    _, out = straight
    part = str(tmp_path / "part")
    shutil.copytree(out, part)
    ckpts = os.path.join(part, "checkpoints")
    shutil.rmtree(os.path.join(ckpts, "step_00000003"))
    assert committed_steps(ckpts) == [2]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CFG))
    assert main(["train", "--config", str(path), "--out", part, "--no-progress", "--resume"]) == 0
    assert [r["step"] for r in _rows(part)] == [0, 1, 2, 3]
    _same(_rows(part)[-1], _rows(out)[-1])
