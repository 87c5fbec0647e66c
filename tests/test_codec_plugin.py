"""A codec registered from outside the package, here from this test file, is a first-class codec: a toy codec with a
learned basis runs the anchor-owned-basis path (its section declares `learns_basis`; nothing compares a `type:`
name), and `twocircuit plot` lists it with the strength its section declares."""

import json
from dataclasses import dataclass

import pytest
import yaml
from test_plot import _run
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.config import ConfigError, base as config_base, load_config
from twocircuit_jax.config.sections import ActivationCodecConfig
from twocircuit_jax.fast.codecs import base as codec_base, register_activation
from twocircuit_jax.fast.codecs.base import ActivationCodec
from twocircuit_jax.fast.codecs.lowrank import LowRankCodec, LowRankConfig

NAME = "toy_basis"


@pytest.fixture
def toy():
    """Register the toy for one test and remove it again, so other test files in the same process (the config
    reference, the registry listings) never see it."""

    @dataclass(frozen=True)
    class ToyConfig(LowRankConfig):
        """A low-rank projector under another name: the learned-basis capability comes from the section alone."""

        strength = ("rank", "k")  # its own plot label, so the plot shows it read the section

    @register_activation(NAME)
    class ToyCodec(LowRankCodec):
        config = ToyConfig

    yield ToyCodec
    codec_base._ACTIVATION.classes.pop(NAME)
    config_base._REGISTRY[ActivationCodecConfig].pop(NAME)


CFG = tiny_config(
    optim={"lr": 3e-3},
    fast={"codec": {"type": NAME, "rank": 3}},  # the tiny 2-block model, pp_size 2: one boundary carries the basis
    anchor={"enabled": True, "cadence": 4, "delay": 4, "projection": {"window": 2}},
    train={"steps": 4},
)


def test_a_toy_codec_with_a_learned_basis_runs_the_anchor_owned_path_and_is_plotted(toy, tmp_path, monkeypatch):
    from twocircuit_jax.train import loop

    assert load_config(data=CFG).anchor_owns_q  # auto: the anchor owns a basis the codec learns
    seen = {}
    real = loop.GRPOTrainer.run

    def keep(self):
        seen["t"] = self
        return real(self)

    monkeypatch.setattr(loop.GRPOTrainer, "run", keep)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(CFG))
    run = tmp_path / "sweep" / "toy"
    assert main(["train", "--config", str(tmp_path / "cfg.yaml"), "--out", str(run), "--no-progress"]) == 0
    assert type(seen["t"].built.fast.codec) is toy and seen["t"].built.fast.owns_basis is False
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")][1:]
    assert [int(r["anchor/fire"]) for r in rows] == [0, 1, 0, 1]  # cadence 4 ticks, 2 ticks per step
    # the bootstrap publishes Q1; then one new basis per fire, active from the next step on: only fires refresh it
    assert [int(r["codec/q_updates"]) for r in rows] == [1, 2, 2, 3]
    assert all(abs(r["codec/basis_cond"] - 1.0) < 1e-4 for r in rows)

    _run(tmp_path / "sweep" / "dense", codec="none", final_acc=0.5)  # the fidelity map's dense reference
    out = tmp_path / "plots"
    assert main(["plot", str(run), str(tmp_path / "sweep" / "dense"), "--out", str(out)]) == 0
    cells = json.loads((out / "map.json").read_text())
    cells = cells["cells"] if isinstance(cells, dict) else cells
    assert [(c["codec"], c["strength"], c["anchor"]) for c in cells] == [(NAME, 3, True)]
    assert f"{NAME} k=3" in (out / "index.html").read_text()


def test_the_checks_name_the_codecs_that_learn_a_basis(toy):
    with pytest.raises(ConfigError, match=f"anchor.owns_q.*learns a basis .type: lowrank, {NAME}."):
        load_config(data=CFG, overrides=["fast.codec=prf_mask", "anchor.owns_q=true"])


def test_a_learned_basis_without_its_life_cycle_is_refused():
    @dataclass(frozen=True)
    class HalfConfig(ActivationCodecConfig):
        learns_basis = True

    with pytest.raises(TypeError, match="learns_basis.*sketcher"):

        @register_activation("half_basis")
        class Half(ActivationCodec):
            config = HalfConfig

    assert "half_basis" not in codec_base.activation_codecs()
    assert "half_basis" not in config_base.registered(ActivationCodecConfig)
