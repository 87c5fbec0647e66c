"""The frozen reference policy is kept in the compute dtype (step/train_step.py reference_copy): the forward casts every
weight to the compute dtype before use, so its log-probs and entropies are the same bits as from the full-precision
weights, at half the memory under bf16 compute; under fp32 compute it is a plain copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.config.sections import ModelConfig
from twocircuit_jax.model import qwen2
from twocircuit_jax.parallel import pipeline as pipe
from twocircuit_jax.step.train_step import reference_copy


@pytest.mark.parametrize("tie,qk_norm", [(True, False), (False, True)])
def test_bf16_reference_gives_the_same_log_prob_bits(tie, qk_norm):
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
        compute_dtype="bfloat16", tie_embeddings=tie, qk_norm=qk_norm, logits_chunk=4,
    )  # fmt: skip
    params = qwen2.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda a: a + 0.01 * jax.random.normal(jax.random.key(1), a.shape), params)  # no zeros
    ref = reference_copy(params, cfg.compute_dtype)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(ref))
    tokens = jax.random.randint(jax.random.key(2), (3, 10), 0, 64)
    mask = jnp.ones((3, 10), jnp.int32).at[0, :2].set(0)
    full = jax.jit(lambda p: pipe.forward(cfg, p, tokens, mask)[0])(params)
    half = jax.jit(lambda p: pipe.forward(cfg, p, tokens, mask)[0])(ref)
    np.testing.assert_array_equal(half.logp, full.logp)
    np.testing.assert_array_equal(half.entropy, full.entropy)
    bytes_ = lambda t: sum(a.nbytes for a in jax.tree.leaves(t))  # noqa: E731
    assert bytes_(ref) * 2 == bytes_(params)


def test_fp32_compute_keeps_a_distinct_fp32_copy():
    params = {"w": jnp.ones((3, 2)), "n": jnp.arange(3)}
    ref = reference_copy(params, "float32")
    assert ref["w"].dtype == jnp.float32 and ref["n"].dtype == params["n"].dtype
    assert ref["w"].unsafe_buffer_pointer() != params["w"].unsafe_buffer_pointer()  # the train state is donated
    shapes = reference_copy(jax.eval_shape(lambda: params), "bfloat16")
    assert shapes["w"].dtype == jnp.bfloat16 and shapes["n"].dtype == params["n"].dtype
