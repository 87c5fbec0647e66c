"""FastCircuit wiring (design §2, §3.1, §3.6): boundaries, tags, bad configs, kernel refusal, mask identity across
paths, the low-rank basis life cycle, per-step byte metrics against fast/bytes.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import FOUR_BLOCK_MODEL, fast_section

from twocircuit_jax.boundaries import boundary_layers
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.run import load_config
from twocircuit_jax.fast import bytes as fbytes
from twocircuit_jax.fast.circuit import DENSE, OLD, REF, TRAIN, FastCircuit
from twocircuit_jax.model.qwen2 import default_positions, init_params
from twocircuit_jax.parallel.mesh import make_mesh

TINY = {
    "model": dict(FOUR_BLOCK_MODEL),
    "sampler": {"n": 4, "sampling": {"max_new_tokens": 4}},
    "fast": {"codec": "prf_mask", "pp_size": 4},
    "train": {"prompts_per_step": 4, "prompts_per_update": 2, "max_prompt_len": 12},
}


def cfg_with(**fast):
    """TINY with a fast section: the keyword form of tiny_run.fast_section (prf_mask by default; lowrank's rank 3 is
    below the 32-wide model's hidden size), or the sections themselves (`codec={...}`)."""
    if isinstance(fast.get("codec", ""), dict) or isinstance(fast.get("grad_codec", ""), dict):
        section = {"pp_size": 4, **fast}
    else:
        section = fast_section(**{"codec": "prf_mask", "pp_size": 4, **fast})
    return load_config(data=dict(TINY, fast=section))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(load_config(data=TINY).mesh)


def circuit(mesh, **fast):
    cfg = cfg_with(**fast)
    return FastCircuit(cfg, cfg.model, mesh)


def test_boundaries():
    assert boundary_layers(28, 8) == (3, 7, 11, 15, 18, 21, 24)
    assert boundary_layers(16, 8) == (1, 3, 5, 7, 9, 11, 13)
    assert boundary_layers(4, 4) == (0, 1, 2) and boundary_layers(4, 1) == ()
    with pytest.raises(ValueError, match="fast.pp_size"):
        boundary_layers(4, 5)


@pytest.mark.parametrize(
    "override,field",
    [
        ({"p": 1.0}, "fast.codec.p"),
        ({"p": -0.1}, "fast.codec.p"),
        ({"codec": {"type": "prf_mask"}, "p": 0.5}, "fast.p"),  # a flat key of older configs: refused
        ({"codec": {"type": "prf_mask", "p": 1.0}}, "fast.codec.p"),
        ({"codec": "lowrank", "rank": 32}, "fast.codec.rank"),
        ({"codec": {"type": "lowrank", "rank": 3, "p": 0.5}}, "fast.codec.p"),
        ({"pp_size": 5}, "fast.pp_size"),
        ({"codec": "foo"}, "fast.codec.type"),
        ({"grad_codec": "bar"}, "fast.grad_codec.type"),
        ({"grad_codec": {"type": "powersgd", "rank": 0}}, "fast.grad_codec.rank"),
    ],
)
def test_bad_config_names_field(override, field):
    with pytest.raises(ConfigError) as e:
        cfg_with(**override)
    assert e.value.path == field, str(e.value)
    if field == "fast.p":
        assert "write fast.codec.p instead" in e.value.message


def test_kernel_on_cpu_without_interpret_is_an_error(mesh):
    with pytest.raises(ConfigError) as e:
        circuit(mesh, use_kernel=True)
    assert e.value.path == "fast.codec.use_kernel" and "no silent fallback" in str(e.value)
    with pytest.raises(ConfigError, match="unknown key") as e:  # the section itself: sr_quant has no such knob
        circuit(mesh, codec={"type": "sr_quant", "use_kernel": True})
    assert e.value.path == "fast.codec.use_kernel"
    assert circuit(mesh, use_kernel=True, kernel_interpret=True).interpret  # explicit interpret mode is allowed


def test_tags(mesh):
    c = circuit(mesh, codec_reference=False)
    assert c.boundaries == (0, 1, 2) and c.has_activation_codec
    assert c.applies(TRAIN) and c.applies(OLD) and not c.applies(REF) and not c.applies(DENSE)
    ids, pos, am = jnp.arange(2), jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), jnp.int32)
    for tag in (DENSE, REF):
        with pytest.raises(ValueError, match="no codec may act"):
            c.hook(c.init_codec_state(), tag, 0, ids, pos, am)
    off = circuit(mesh, codec="none")
    assert not off.has_activation_codec and not off.applies(TRAIN) and off.grad_fn(None) is None


def _batch(B=4, T=10, pad=3):
    am = np.ones((B, T), np.int32)
    am[1, :pad] = 0
    return jnp.arange(B, dtype=jnp.int32) + 5, jnp.asarray(am)


@pytest.mark.parametrize("codec", ["prf_mask", "sr_quant", "lowrank"])
def test_same_bits_on_every_path(mesh, codec):
    """The old-log-prob, train and reference hooks are the same function of (gs, sample_id, position)."""
    c = circuit(mesh, codec=codec)
    ids, am = _batch()
    pos = default_positions(am)
    h = jax.random.normal(jax.random.PRNGKey(1), (4, 10, 32))
    st = c.init_codec_state()
    outs = []
    for tag in (OLD, TRAIN, REF):
        fn, layers = jax.jit(lambda s, i, p, a, x, tag=tag: c.hook(s, tag, 7, i, p, a)[0](1, x))(st, ids, pos, am, h)
        outs.append(np.asarray(fn))
    assert outs[0].tobytes() == outs[1].tobytes() == outs[2].tobytes()
    assert not np.array_equal(outs[0], np.asarray(h))  # the codec did act
    # another step key changes the prf bits (lowrank is key-free)
    other = np.asarray(c.hook(st, TRAIN, 8, ids, pos, am)[0](1, h)[0])
    assert np.array_equal(other, outs[0]) == (codec == "lowrank")


def test_summarize_keys(mesh):
    c = circuit(mesh)
    aux = {b: {"mask_ratio": jnp.float32(0.9), "recon_rel_err": jnp.float32(b)} for b in c.boundaries}
    m = c.summarize(aux)
    assert float(m["codec/mask_ratio"]) == pytest.approx(0.9)
    assert float(m["codec/recon_rel_err"]) == pytest.approx(1.0)
    assert float(m["codec/recon_rel_err/2"]) == 2.0 and "codec/mask_ratio/0" in m
    assert all(jnp.ndim(v) == 0 for v in m.values())


def test_lowrank_basis_never_changes_mid_step(mesh):
    c = circuit(mesh, codec="lowrank")
    assert c.owns_basis
    st = c.init_codec_state()
    Q0 = {b: np.asarray(q) for b, q in st.Q.items()}
    ids, am = _batch()
    h = jax.random.normal(jax.random.PRNGKey(2), (4, 10, 32))
    fn, layers = c.hook(st, TRAIN, 1, ids, default_positions(am), am)
    aux = {b: fn(b, h)[1] for b in layers}
    for _ in range(2):  # two ticks: sketches accumulate (the step's absorb_aux), Q untouched
        st = c.absorb_aux(st, aux)
        c.tick_done()
        assert all(np.array_equal(np.asarray(st.Q[b]), Q0[b]) for b in layers)
    assert c.applications[TRAIN] == 2 and float(st.sketch_tokens) == 2 * float(np.sum(am))
    staged = c.stage_basis(st, {b: -q for b, q in st.Q.items()})
    with pytest.raises(RuntimeError, match="only after the step's last mini-batch"):
        c.activate_basis(staged)
    st, m = c.end_step(st, 1)
    assert m["codec/q_updates"] == 1 and m["codec/q_activations"] == 1 and m["codec/steps"] == 1
    assert not all(np.array_equal(np.asarray(st.Q[b]), Q0[b]) for b in layers)
    assert m["codec/basis_cond"] == pytest.approx(1.0, abs=1e-4) and "codec/basis_cond/1" in m
    st, m = c.end_step(st, 2)  # a step without sketches stages nothing: counters advance once per step at most
    assert m["codec/q_updates"] == 1 and m["codec/q_activations"] == 1 and m["codec/steps"] == 2


@pytest.mark.parametrize(
    "fast",
    [
        {"codec": "prf_mask"},
        {"codec": "lowrank"},
        {"codec": "sr_quant"},
        {"codec": "none", "grad_codec": "powersgd", "start_after": 0},
        {"codec": "prf_mask", "p": 0.5, "exact_k": False},
    ],
)
def test_step_bytes_match_formulas(mesh, fast):
    c = circuit(mesh, **fast)
    model = c.model_cfg
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    st, grad = c.init_codec_state(), c.init_grad_state(params)
    if grad is not None:
        grad = grad._replace(step=jnp.asarray(5, jnp.int32))
    _, m = c.end_step(st, 1, grad)
    ticks = 2  # prompts_per_step 4 / prompts_per_update 2
    tokens = 2 * 4 * (12 + 4) // 8  # per replica: a replica's share of the mini-batch
    act = fbytes.activation_bytes(c.fcfg.codec, tokens=tokens, hidden=32, boundaries=(0, 1, 2))
    grad = fbytes.grad_allreduce_bytes(params, c.fcfg.grad_codec)
    comp = ticks * (act["comm/bytes_compressed"] + grad["comm/bytes_compressed"])
    dense = ticks * (act["comm/bytes_dense"] + grad["comm/bytes_dense"])
    assert m["comm/bytes_compressed"] == pytest.approx(comp)
    assert m["comm/bytes_dense"] == pytest.approx(dense)
    assert m["comm/bytes_ratio"] == pytest.approx(comp / dense) and m["comm/bytes_ratio"] < 1


def test_external_dense_sketch_stages_one_power_iteration(mesh):
    """The anchor-owned path without the anchor: `basis_sketcher` sketches a dense pass (activations unchanged, no
    codec error computed) and `absorb_sketch` stages orth(MᵀM·Q_start) per boundary; the active basis stays."""
    c = circuit(mesh, codec="lowrank")
    st = c.init_codec_state()
    ids, am = _batch()
    h = jax.random.normal(jax.random.PRNGKey(3), (4, 10, 32))
    fn, layers = c.basis_sketcher(st, am)
    outs = {b: fn(b, h) for b in layers}
    assert all(np.array_equal(np.asarray(o[0]), np.asarray(h)) for o in outs.values())  # dense: h passes unchanged
    assert all(set(o[1]) == {"sketch", "tokens"} for o in outs.values())
    new = c.absorb_sketch(st, {b: o[1] for b, o in outs.items()})
    M = np.asarray(h).reshape(-1, 32) * np.asarray(am, np.float32).reshape(-1, 1)
    for b in layers:
        assert np.array_equal(np.asarray(new.Q[b]), np.asarray(st.Q[b]))  # active basis untouched
        want, _ = np.linalg.qr(M.T @ (M @ np.asarray(st.Q_start[b])))
        got = np.asarray(new.Q_next[b])
        np.testing.assert_allclose(np.abs(got.T @ want), np.eye(want.shape[1]), atol=1e-4)  # same columns up to sign
    assert bool(new.staged)


def test_rel_err_weighs_tokens_and_sums_channels_first():
    """The codec error metric over real tokens only (padding rows and columns excluded), equal to the one-pass
    formula it replaces: ‖(h̃ − h) w‖ / ‖h w‖ over [B, T, H]."""
    from twocircuit_jax.fast.circuit import _rel_err
    from twocircuit_jax.fast.codecs.base import row_sum

    rng = np.random.default_rng(0)
    h, out = rng.normal(size=(3, 5, 8)).astype(np.float32), rng.normal(size=(3, 5, 8)).astype(np.float32)
    mask = np.ones((3, 5), np.int32)
    mask[0, :2] = 0
    mask[2, 4] = 0
    out[0, :2] = 1e6  # padding: must not count
    w = mask[..., None].astype(np.float64)
    want = np.sqrt(np.sum((out - h) ** 2 * w) / np.sum(h.astype(np.float64) ** 2 * w))
    np.testing.assert_allclose(float(_rel_err(jnp.asarray(h), jnp.asarray(out), jnp.asarray(mask))), want, rtol=1e-5)
    wt = rng.uniform(size=(3, 5)).astype(np.float32)
    np.testing.assert_allclose(float(row_sum(jnp.asarray(h), jnp.asarray(wt))), np.sum(h * wt[..., None]), rtol=1e-5)
