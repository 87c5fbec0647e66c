"""No setting silently ignored: a knob either takes effect or is refused with an error that names it."""

import dataclasses

import jax
import pytest

from twocircuit_jax.config import ConfigError, load_config
from twocircuit_jax.config.sections import ModelConfig
from twocircuit_jax.model.tokenizer import load_tokenizer
from twocircuit_jax.train.setup import check_vocab, load_model


def test_defaults_load_with_no_codec_and_pp_size_is_checked_once_a_codec_is_on():
    cfg = load_config(data={})  # model: 4 layers, fast.pp_size: 8, no codec
    assert cfg.fast.pp_size > cfg.model.num_layers
    with pytest.raises(ConfigError, match="fast.pp_size"):
        load_config(data={"fast": {"codec": {"type": "prf_mask"}}})
    assert load_config(data={"fast": {"codec": {"type": "prf_mask"}, "pp_size": 4}}).fast.pp_size == 4


def test_powersgd_alone_builds_with_the_default_pp_size():
    from twocircuit_jax.fast.circuit import FastCircuit
    from twocircuit_jax.parallel.mesh import make_mesh

    cfg = load_config(data={"fast": {"grad_codec": {"type": "powersgd", "rank": 2}}})
    circuit = FastCircuit(cfg, cfg.model, make_mesh(cfg.mesh))
    assert circuit.boundaries == (0, 1, 2)  # capped at the model's 4 layers


@pytest.mark.parametrize("key,value", [("temperature", 0.7), ("top_p", 0.9), ("top_k", 5)])
def test_rollout_sampling_other_than_the_policy_is_refused(key, value):
    with pytest.raises(ConfigError, match=f"sampler.sampling.{key}: got {value}.*design §1"):
        load_config(data={"sampler": {"sampling": {key: value}}})


def test_eos_has_one_source_of_truth():
    tok = load_tokenizer("char")
    assert check_vocab(ModelConfig(vocab_size=100), tok).eos_token_id == tok.eos_id == 2
    with pytest.raises(ConfigError, match="model.eos_token_id: got 5; the tokenizer .* token 2"):
        check_vocab(ModelConfig(vocab_size=100, eos_token_id=5), tok)


def test_model_section_beside_a_checkpoint_must_match_it(tmp_path):
    from twocircuit_jax.model.hf_io import save_hf
    from twocircuit_jax.model.qwen2 import init_params

    mcfg = ModelConfig(vocab_size=100, hidden_size=32, num_layers=2, head_dim=16, intermediate_size=64)
    path = save_hf(mcfg, jax.device_get(init_params(mcfg, jax.random.key(0))), str(tmp_path / "base"))
    same = {f.name: getattr(mcfg, f.name) for f in dataclasses.fields(mcfg)}
    loaded, _ = load_model(load_config(data={"base_model": path, "model": same}), 0)
    assert loaded.hidden_size == 32
    assert (
        load_model(load_config(data={"base_model": path, "model": {"compute_dtype": "bfloat16"}}), 0)[0].compute_dtype
        == "bfloat16"
    )
    with pytest.raises(ConfigError, match="model.hidden_size: got 48; the checkpoint .* has 32"):
        load_model(load_config(data={"base_model": path, "model": {"hidden_size": 48, "head_dim": 24}}), 0)


def test_default_model_fits_the_default_tokenizer_and_the_python_task_refuses_answer_suffix():
    cfg = load_config(data={})
    assert check_vocab(cfg.model, load_tokenizer(cfg.tokenizer)) is cfg.model
    with pytest.raises(ConfigError, match="task.answer_suffix: got 'x'"):
        load_config(data={"task": {"type": "python", "answer_suffix": "x"}})
