"""Model parity with transformers' PyTorch Qwen2/Qwen3, HF round trip, checkpoint errors."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import make_hf_model, torch_logits

from twocircuit_jax.model import CheckpointError, forward, load_hf, save_hf


@pytest.fixture(
    scope="module",
    params=[("qwen2", False), ("qwen2", True), ("qwen3", True)],
    ids=["qwen2-untied", "qwen2-tied", "qwen3-tied"],
)
def hf_pair(request, tmp_path_factory):
    kind, tie = request.param
    d = str(tmp_path_factory.mktemp(f"{kind}{tie}"))
    model = make_hf_model(kind, d, tie=tie)
    cfg, params = load_hf(d)
    return model, cfg, params, d


def _masks(B, T):
    none = np.ones((B, T), np.int64)
    left = none.copy()
    left[1, :4] = 0
    left[2, :2] = 0
    right = none.copy()
    right[1, 7:] = 0
    right[2, 9:] = 0
    return {"none": none, "left": left, "right": right}


# the new forward paths too (tests/test_model_scale.py): scanned layers, full remat, blockwise attention
SCALED = {"scan_layers": True, "remat": "full", "attention": "blockwise", "attention_block": 4}


@pytest.mark.parametrize("knobs", [{}, SCALED], ids=["default", "scaled"])
@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_logits_match_transformers(hf_pair, pad, knobs):
    model, cfg, params, _ = hf_pair
    cfg = dataclasses.replace(cfg, **knobs)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (3, 11))
    mask = _masks(3, 11)[pad]
    ref = torch_logits(model, tokens, mask)
    out = np.asarray(forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.isfinite(out).all()
    err = np.abs(out - ref) * mask[..., None]  # padded positions are not defined by either side
    assert err.max() < 1e-4, err.max()


def test_left_padding_does_not_change_a_row(hf_pair):
    _, cfg, params, _ = hf_pair
    rng = np.random.default_rng(2)
    row = rng.integers(3, cfg.vocab_size, (1, 6))
    padded = np.concatenate([np.zeros((1, 3), np.int64), row], 1)
    mask = np.concatenate([np.zeros((1, 3)), np.ones((1, 6))], 1).astype(np.int32)
    a = np.asarray(forward(cfg, params, jnp.asarray(row)))
    b = np.asarray(forward(cfg, params, jnp.asarray(padded), jnp.asarray(mask)))[:, 3:]
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_save_load_round_trip_is_bit_exact(hf_pair, tmp_path):
    _, cfg, params, _ = hf_pair
    for shard in (0, 20_000):
        out = save_hf(cfg, params, str(tmp_path / f"rt{shard}"), shard_bytes=shard)
        if shard:
            assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
        cfg2, params2 = load_hf(out)
        assert cfg2 == cfg
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_saved_dir_loads_in_transformers(hf_pair, tmp_path):
    import transformers

    model, cfg, params, _ = hf_pair
    out = save_hf(cfg, params, str(tmp_path / "export"))
    m2 = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9))
    mask = np.ones_like(tokens)
    np.testing.assert_allclose(torch_logits(m2, tokens, mask), torch_logits(model, tokens, mask), atol=1e-6)


def test_bf16_forward_close_to_fp32(hf_pair):
    import dataclasses

    _, cfg, params, _ = hf_pair
    cfg16 = dataclasses.replace(cfg, param_dtype="bfloat16", compute_dtype="bfloat16")
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 8)))
    a = forward(cfg, params, tokens)
    b = forward(cfg16, p16, tokens)
    assert b.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(a - b))) < 0.1


def test_missing_and_malformed_checkpoints(tmp_path, hf_pair):
    with pytest.raises(CheckpointError, match="not found"):
        load_hf(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf(str(empty))
    (empty / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_hf(str(empty))
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type"):
        load_hf(str(empty))
    _, cfg, params, src = hf_pair
    bad = tmp_path / "trunc"
    save_hf(cfg, params, str(bad))
    (bad / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf(str(bad))
    cfgd = json.loads((bad / "config.json").read_text())
    del cfgd["hidden_size"]
    (bad / "config.json").write_text(json.dumps(cfgd))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_hf(str(bad))


def test_train_program_takes_each_rope_transcendental_once():
    """The rotary tables are one cos and one sin pass in the compiled forward+backward, whatever the layer count:
    XLA used to fuse them into every q and k rotation of every layer, forward and backward (40 passes a step for
    the peers' 4-layer model). Values are checked against transformers above; this guards the cost."""
    from twocircuit_jax.config.sections import ModelConfig
    from twocircuit_jax.model import init_params

    cfg = ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=32
    )
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    mask = jnp.ones((2, 8), jnp.int32).at[0, :3].set(0)

    def loss(p):
        return jnp.mean(jax.nn.log_softmax(forward(cfg, p, tokens, mask))[..., 0])

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    assert hlo.count(" sine(") == 1 and hlo.count(" cosine(") == 1, (hlo.count(" sine("), hlo.count(" cosine("))
