"""Codecs behind one interface: an activation codec and a gradient codec registered from this file (one class, one
config section each) are chosen by `fast.codec.type` / `fast.grad_codec.type`, parsed with their own fields, and run
a train step; the flat shorthand keys land in the sections."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from tiny_run import NARROW_MODEL, circuit_state, narrow_batch

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError, require
from twocircuit_jax.config.sections import ActivationCodecConfig, GradCodecConfig
from twocircuit_jax.fast.circuit import FastCircuit
from twocircuit_jax.fast.codecs import (
    ActivationCodec,
    GradCodec,
    activation_codecs,
    grad_codecs,
    register_activation,
    register_grad,
)
from twocircuit_jax.fast.codecs.base import wire_result
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.names import OLD
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.step.grpo_step import make_grpo_loss
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.step.train_step import build_train_step, init_state, state_shardings


@dataclass(frozen=True)
class ScaleConfig(ActivationCodecConfig):
    """A toy codec: every boundary message is multiplied by `scale`."""

    scale: float = 0.5

    def check(self):
        require(0 < self.scale <= 1, "scale", f"got {self.scale}; allowed (0, 1]")


@register_activation("toy_scale")
class ScaleCodec(ActivationCodec):
    config = ScaleConfig

    def hook(self, state, layer, h, path):
        self.check_layer(layer)
        return h * jnp.asarray(self.cfg.scale, h.dtype), {"mask_ratio": jnp.float32(0.0)}

    def wire_bytes(self, tokens, hidden, boundaries, act_bytes=2):
        el = len(boundaries) * tokens * hidden
        return wire_result(el * act_bytes, el * act_bytes, el, el)


B, T, NEW = 16, 12, 6


def _cfg(**fast):  # the narrow run of tiny_run, with kl off (no reference pass here)
    return load_config(
        data={
            "model": NARROW_MODEL,
            "mesh": {"data": 2},  # a data-parallel step on 2 of the 8 devices: the codec needs no more
            "sampler": {"n": 4},
            "grpo": {"kl_coef": 0.0},
            "fast": {"pp_size": 4, **fast},
            "train": {"prompts_per_step": 4, "prompts_per_update": 4, "max_prompt_len": T - NEW},
        }
    )


def test_a_registered_codec_parses_and_runs_a_step():
    assert "toy_scale" in activation_codecs()
    cfg = _cfg(codec={"type": "toy_scale", "scale": 0.5})
    assert isinstance(cfg.fast.codec, ScaleConfig) and cfg.fast.codec_type == "toy_scale"
    with pytest.raises(ConfigError) as e:
        _cfg(codec={"type": "toy_scale", "scale": 2.0})
    assert e.value.path == "fast.codec.scale"
    with pytest.raises(ConfigError, match="toy_scale"):  # the allowed types name the new one
        _cfg(codec={"type": "nope"})

    mesh = pmesh.make_mesh(cfg.mesh, jax.devices()[:2])
    params = init_params(cfg.model, jax.random.key(0), std=0.3)
    circuit = FastCircuit(cfg, cfg.model, mesh)
    assert circuit.boundaries == (0, 1, 2) and circuit.applies("train")
    batch, _ = narrow_batch()
    batch = jax.device_put(batch, pmesh.batch_shardings(batch, mesh))
    cs = circuit_state(circuit, params)
    batch["old_logp"] = dispatch.jit(make_logp_fn(cfg.model, circuit, OLD))(params, batch, cs)[0]
    opt = optax.sgd(0.1)
    state = init_state(jax.tree.map(jnp.copy, params), opt)
    sh = state_shardings(state, mesh)
    step = build_train_step(
        make_grpo_loss(cfg.model, cfg.grpo, NEW, circuit), opt, sh, mesh, absorb_aux=circuit.absorb_aux
    )
    new, _, m = step(jax.device_put(state, sh), cs, batch)
    # the codec acted in the train forward at every boundary: |h - h/2| / |h| is exactly 1/2
    for b in (0, 1, 2):
        assert float(m[f"codec/recon_rel_err/{b}"]) == pytest.approx(0.5, rel=1e-6)
    assert np.isfinite(float(m["loss"])) and int(new.tick) == 1
    assert all(np.ndim(v) == 0 for v in m.values())  # metrics leave the step as scalars only


def test_flat_keys_of_older_configs_are_refused_with_the_key_to_write():
    # a section's name alone is that type with its defaults
    assert _cfg(codec="prf_mask") == _cfg(codec={"type": "prf_mask"})
    for flat, path, new in (
        ({"codec": "prf_mask", "p": 0.5}, "fast.p", "fast.codec.p"),
        ({"grad_codec": "powersgd", "grad_rank": 2}, "fast.grad_rank", "fast.grad_codec.rank"),
        ({"grad_codec": "powersgd", "start_after": 0}, "fast.start_after", "fast.grad_codec.start_after"),
    ):
        with pytest.raises(ConfigError) as e:
            _cfg(**flat)
        assert e.value.path == path and f"write {new} instead" in e.value.message, str(e.value)
    with pytest.raises(ConfigError, match="allowed keys here"):
        _cfg(codec="prf_mask", colour=3)  # a key no older config had is plainly unknown


def test_a_base_config_section_of_another_type_is_replaced(tmp_path):
    (tmp_path / "base.yaml").write_text("fast: {codec: {type: prf_mask, p: 0.5}, pp_size: 4}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nfast: {codec: {type: lowrank, rank: 3}}\n")
    (tmp_path / "tweak.yaml").write_text("base: base.yaml\nfast: {codec: {p: 0.75}}\n")
    child = load_config(str(tmp_path / "child.yaml"))
    assert child.fast.codec_type == "lowrank" and child.fast.codec.rank == 3 and child.fast.pp_size == 4
    assert load_config(str(tmp_path / "tweak.yaml")).fast.codec.p == 0.75  # same type: merged key by key


def test_a_codec_that_is_neither_a_name_nor_a_section_is_an_error():
    with pytest.raises(ConfigError) as e:
        _cfg(codec=5)
    assert e.value.path == "fast.codec" and "expected a type name" in e.value.message


def test_layers_and_overrides_of_the_sections(tmp_path):
    (tmp_path / "short.yaml").write_text("fast: {codec: lowrank, pp_size: 4}\n")  # a type by its name alone
    (tmp_path / "child.yaml").write_text("base: short.yaml\nfast: {codec: {rank: 8}}\n")
    assert load_config(str(tmp_path / "child.yaml")).fast.codec.rank == 8  # the later file's knob, the base's type
    assert load_config(str(tmp_path / "short.yaml"), ["fast.codec.rank=5"]).fast.codec.rank == 5
    # --set of another type replaces the section: the old type's fields would not fit
    (tmp_path / "mask.yaml").write_text("fast: {codec: {type: prf_mask, p: 0.5}, pp_size: 4}\n")
    cfg = load_config(str(tmp_path / "mask.yaml"), ["fast.codec.type=lowrank", "fast.codec.rank=3"])
    assert cfg.fast.codec_type == "lowrank" and cfg.fast.codec.rank == 3
    assert load_config(str(tmp_path / "mask.yaml"), ["fast.codec.type=prf_mask"]).fast.codec.p == 0.5  # same type


# --- a gradient codec registered from this file -----------------------------------------------------------------
@dataclass(frozen=True)
class HalfMeanConfig(GradCodecConfig):
    """A toy gradient codec: each replica sends its gradient in bfloat16; the state counts the reductions."""


@register_grad("toy_half_mean")
class HalfMeanCodec(GradCodec):
    config = HalfMeanConfig

    def init(self, params_like, n_replicas=1):
        return jnp.zeros((), jnp.int32)  # [] int32 reductions done

    def state_specs(self, state, axes):
        return P()

    def reduce(self, grads, state, axes):
        mean = jax.tree.map(lambda g: jax.lax.pmean(g.astype(jnp.bfloat16), axes).astype(g.dtype), grads)
        return mean, state + 1, {"toy/reduced": jnp.float32(1.0)}

    def wire_bytes(self, params_like, state=None):
        el = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params_like))
        return wire_result(2 * el, 4 * el, el, el)


def test_a_registered_gradient_codec_parses_and_runs_a_step():
    assert "toy_half_mean" in grad_codecs()
    cfg = _cfg(grad_codec={"type": "toy_half_mean"})
    assert cfg.fast.grad_codec_type == "toy_half_mean"
    mesh = pmesh.make_mesh(cfg.mesh, jax.devices()[:2])
    params = init_params(cfg.model, jax.random.key(0), std=0.3)
    circuit = FastCircuit(cfg, cfg.model, mesh)
    batch, _ = narrow_batch()
    batch = jax.device_put(batch, pmesh.batch_shardings(batch, mesh))
    batch["old_logp"] = dispatch.jit(make_logp_fn(cfg.model, circuit, OLD))(params, batch, None)[0]
    opt = optax.sgd(0.1)
    sh = state_shardings(init_state(params, opt), mesh)
    loss = make_grpo_loss(cfg.model, cfg.grpo, NEW, circuit)

    def run(grad_fn):
        cs = circuit_state(circuit, params)
        step = build_train_step(loss, opt, sh, mesh, grad_fn=grad_fn)
        return step(jax.device_put(init_state(jax.tree.map(jnp.copy, params), opt), sh), cs, batch)

    new, cs, m = run(circuit.grad_fn(None))
    assert int(cs.grad) == 1 and float(m["toy/reduced"]) == 1.0  # the codec's state and metrics came back
    dense, _, _ = run(None)
    diff = jax.tree.map(lambda a, b, p: float(jnp.max(jnp.abs(a - b))), new.params, dense.params, params)
    assert max(jax.tree.leaves(diff)) > 0  # the bfloat16 wire changed the update ...
    for a, b, p in zip(jax.tree.leaves(new.params), jax.tree.leaves(dense.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(a - p, b - p, atol=1e-3, rtol=2e-2)  # ... to within bfloat16's rounding
    # the byte accounting asks the codec
    assert circuit.step_bytes(cs.grad)["comm/bytes_ratio"] < 1.0
