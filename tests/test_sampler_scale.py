"""The embedded sampler at scale: a step's rows split into calls and over devices give the same rows for the same
seed as one call on one device, sampled and greedy; a call ends when its rows have finished; the plan's sizing of a
call."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.config import MeshConfig, ModelConfig, SamplingConfig
from twocircuit_jax.model import init_params
from twocircuit_jax.parallel import mesh as pmesh
from twocircuit_jax.sampler import jax_sampler as js
from twocircuit_jax.sampler.jax_sampler import JaxSampler

# H 32 over 4-way FSDP and a vocabulary of 64 over 2: the parameters really are split, as the trainer's are
CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    eos_token_id=2,
    pad_token_id=0,
)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20], [3, 4], [8, 8, 9], [30, 31], [40], [7, 50, 51]]
SAMPLE = SamplingConfig(temperature=1.0, max_new_tokens=10)
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(4), std=0.4)  # peaky: some rows end with EOS before the cap


def _sharded(params):
    mesh = pmesh.make_mesh(MeshConfig(data=2, fsdp=4, tensor=1), jax.devices()[:8])
    return jax.device_put(params, pmesh.param_shardings(params, mesh))


def _same(a, b):
    assert a.tokens == b.tokens and a.truncated == b.truncated
    np.testing.assert_allclose(np.concatenate(a.logprobs), np.concatenate(b.logprobs), atol=2e-5)


@pytest.mark.parametrize("sampling", [SAMPLE, GREEDY], ids=["sampled", "greedy"])
def test_calls_and_devices_do_not_change_the_rows(params, sampling):
    """One call on one device, four calls on one device, and two calls of rows split over 8 devices (weights
    FSDP-sharded as the trainer holds them): the same tokens, flags and log-probs for the same seed."""
    one_dev = jax.device_put(params, jax.devices()[0])
    n = 4 if sampling.temperature else 1
    whole = JaxSampler(CFG, one_dev, prompt_bucket=8, max_rows_per_call=len(PROMPTS) * n).generate(
        PROMPTS, n, sampling, seed=3
    )
    four = JaxSampler(CFG, one_dev, prompt_bucket=8, max_rows_per_call=2 * n)
    assert four.prompts_per_call(len(PROMPTS), n, 8, 10) == 2
    _same(whole, four.generate(PROMPTS, n, sampling, seed=3))
    spread = JaxSampler(CFG, _sharded(params), prompt_bucket=8, max_rows_per_call=4 * n)
    assert spread.mesh is not None and spread.mesh.size == 8
    _same(whole, spread.generate(PROMPTS, n, sampling, seed=3))
    if sampling.temperature:  # both cases exercised; rows of one prompt differ; another seed, other rows
        assert any(whole.truncated) and not all(whole.truncated)
        assert len({tuple(t) for t in whole.tokens[:n]}) > 1
        assert JaxSampler(CFG, one_dev, prompt_bucket=8).generate(PROMPTS, n, sampling, seed=4).tokens != whole.tokens


def test_rows_are_split_over_the_devices_and_weights_gathered_once(params):
    """In the sharded call the KV cache is split by rows over the 8 devices (each holds 1/8 of the rows' cache) and
    the weights are gathered before the decode loop, not inside it (no all-gather in the loop body)."""
    p = _sharded(params)
    mesh = JaxSampler(CFG, p).mesh
    args = (jnp.zeros((8, 8), jnp.int32), jnp.ones((8, 8), jnp.int32), jax.random.key(0), jnp.float32(1.0))
    args += (jnp.int32(0), jnp.float32(1.0), jnp.int32(0))
    hlo = js.generate_tokens.lower(CFG, p, *args, max_new_tokens=10, n=2, mesh=mesh).compile().as_text()
    # the cache of one layer: [16 rows, 2 kv heads, 18 slots, 8] in float32, a device holding 2 rows of it
    assert "f32[2,2,18,8]" in hlo and "f32[16,2,18,8]" not in hlo
    comps = {c.split(" ", 1)[0].lstrip("%"): c for c in hlo.split("\n\n")}
    loop = next(line for line in hlo.splitlines() if " while(" in line and "f32[2,2,18,8]" in line)
    body, cond = (comps[re.search(rf"{k}=%?([\w.\-]+)", loop).group(1)] for k in ("body", "condition"))
    assert "all-reduce(" in cond  # the loop's one collective: are all rows done?
    assert "all-gather(" not in body + cond and "all-gather(" in hlo  # the weights: gathered once, before the loop


def test_a_call_ends_when_its_rows_have_finished(params):
    """With `stop_early` the loop runs as many decode steps as the longest row (EOS well before the cap here),
    and its rows are those of the loop run to the cap."""
    p = jax.device_put(params, jax.devices()[0])
    tok = jnp.asarray([[0, 0, 5, 6], [0, 9, 10, 11]], jnp.int32)
    args = (p, tok, (tok > 0).astype(jnp.int32), jax.random.key(1), jnp.float32(1.0), jnp.int32(0))
    args += (jnp.float32(1.0), jnp.int32(0))
    cfg = CFG.__class__(**{**CFG.__dict__, "eos_token_id": 5})  # a likely token: rows end early
    early = js.generate_tokens(cfg, *args, max_new_tokens=64, n=8)
    full = js.generate_tokens(cfg, *args, max_new_tokens=64, n=8, stop_early=False)
    lengths = np.asarray(early[2])
    assert int(full[4]) == 64 and int(early[4]) == lengths.max() < 64 and not np.asarray(early[3]).any()
    for a, b in zip(early[:4], full[:4]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rows_that_fit_sizes_whole_groups_from_memory():
    # Qwen2.5-1.5B shapes, 1,024 + 3,072 positions: 28,672 B of KV cache a token, 117 MB a row; the rest of a row
    # (its share of the prefill, the vocabulary-long vectors) about a quarter more
    q = ModelConfig(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                    intermediate_size=8960, compute_dtype="bfloat16")  # fmt: skip
    rows = js.rows_that_fit(q, 8 * 2**30, 1024, 3072, 8, 8)
    assert rows % 8 == 0
    kv_row = 28 * 2 * 2 * 128 * 2 * 4096
    weights = 1.54e9 * 2
    assert (0.9 * 8 * 2**30 - weights) / kv_row * 8 * 0.7 < rows < (0.9 * 8 * 2**30 - weights) / kv_row * 8
    assert js.rows_that_fit(q, 16 * 2**30, 1024, 3072, 8, 8) > 2 * rows  # the weights are fixed: more than double
    assert js.rows_that_fit(q, 1 * 2**30, 1024, 3072, 8, 8) == 8  # never less than one group
    s = JaxSampler(q, max_rows_per_call=100)
    s.params = {"x": jnp.zeros(2)}  # one device: no mesh
    assert s.prompts_per_call(512, 8, 1024, 3072) == 12 and s.prompts_per_call(5, 8, 1024, 3072) == 5
