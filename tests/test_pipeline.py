"""Real pipeline stages (parallel/pipeline.py) on the 8-device fake mesh: the staged forward and train step equal the
one-program ones (no codec: the plain forward and gradient; each codec's step: its emulated path, same keys and
basis; PowerSGD nested around the pipeline), what crosses a boundary in the compiled program is the codec's packed payload, and the layer
stack is split over the stages."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_run import NARROW_MODEL, circuit_state, fast_section, narrow_batch

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.fast.circuit import FastCircuit
from twocircuit_jax.fast.hlo_bytes import staged_bytes
from twocircuit_jax.model.qwen2 import init_params
from twocircuit_jax.names import OLD
from twocircuit_jax.parallel import dispatch, mesh as pmesh, pipeline as pipe
from twocircuit_jax.step.grpo_step import make_grpo_loss
from twocircuit_jax.step.passes import make_logp_fn
from twocircuit_jax.step.programs import make_pipeline
from twocircuit_jax.step.train_step import build_train_step, init_state, state_shardings

NEW = 6
SGD = optax.sgd(0.5)


def run_cfg(mesh: dict, layers: int = 4, microbatches: int = 0, **fast):
    return load_config(
        data={
            "model": {**NARROW_MODEL, "num_layers": layers},
            "mesh": mesh,
            "grpo": {"kl_coef": 0.0},
            "sampler": {"n": 4},
            "fast": fast_section(**{"pp_size": 4, **fast}),
            "anchor": {"enabled": False},
            "train": {
                "prompts_per_step": 4,
                "prompts_per_update": 4,
                "max_prompt_len": 6,
                "pipeline_microbatches": microbatches,
            },
        }
    )


def one_step(cfg, params, batch):
    """(new params, metrics, old log-probs, compiled HLO text) of one tick of the run `cfg` describes, staged when
    its mesh has stages. The step runs through its ahead-of-time compiled executable, whose text is returned."""
    mesh = pmesh.make_mesh(cfg.mesh)
    on = cfg.fast.codec_type != "none" or cfg.fast.grad_codec_type != "none"
    circuit = FastCircuit(cfg, cfg.model, mesh) if on else None
    act = circuit if circuit and circuit.has_activation_codec else None
    pl = make_pipeline(cfg, cfg.model, mesh) if cfg.mesh.stage > 1 else None
    sh = state_shardings(init_state(params, SGD), mesh)
    step = build_train_step(
        make_grpo_loss(cfg.model, cfg.grpo, NEW, act, pl),
        SGD,
        sh,
        mesh,
        grad_fn=circuit.grad_fn(None) if circuit else None,
        absorb_aux=circuit.absorb_aux if circuit else None,
    )
    cs = circuit_state(circuit, params)
    b = jax.device_put(dict(batch), pmesh.batch_shardings(batch, mesh))
    b["old_logp"] = dispatch.jit(make_logp_fn(cfg.model, act, OLD, pl))(params, b, cs)[0]
    state = jax.device_put(init_state(jax.tree.map(jnp.copy, params), SGD), sh)
    compiled = step.lower(state, cs, b).compile()
    new, _, m = compiled(state, cs, b)
    return new.params, m, b["old_logp"], compiled.as_text()


def _exit_shapes(hlo: str) -> list[tuple[str, tuple]]:
    """(dtype, shape) of every array in the collectives of the pipeline's exit (the `stage_exit` named scope)."""
    out = []
    for line in hlo.splitlines():
        if "stage_exit" not in line or not re.search(r" all-reduce(?:-start)?\(", line):
            continue
        lhs = line.split(" all-reduce")[0]
        out += [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in re.findall(r"(\w+)\[([\d,]*)\]", lhs)]
    return out


def _permute_shapes(hlo: str) -> list[tuple[str, tuple]]:
    """(dtype, shape) of every stage-boundary collective-permute's result in compiled HLO text (the pipeline's named
    scope; PowerSGD's resharding of its packed buffers over `stage` adds permutes of its own)."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\]\S* collective-permute(?:-start)?\(", line)
        if m and "stage_boundary" in line:
            out.append((m.group(1), tuple(int(x) for x in m.group(2).split(",") if x)))
    return out


@pytest.fixture(scope="module")
def narrow():
    cfg = run_cfg({"data": 8})
    return init_params(cfg.model, jax.random.key(0), std=0.3), narrow_batch()[0]


def _close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.slow  # 8 compiled steps of the 8-device mesh: `make test` runs them
# No case of codec none without PowerSGD: its staged step is the lowrank case's (no gradient codec: XLA's implicit
# mean, the same pipeline and train step) without the boundary hooks, and its wire (H = 16 values a row and token) and
# stage-local ends are the PowerSGD case's (no activation codec); the plain staged forward and gradient are
# test_eight_stages_and_microbatch_counts_agree's.
@pytest.mark.parametrize(
    "codec,extra,width",
    [
        ("prf_mask", {"p": 0.75}, 4),
        ("lowrank", {}, 3),
        ("sr_quant", {"quant_bits": 4, "quant_block": 8, "subset_k": 6}, 3),  # 6 subset codes of 4 bits
        ("none", {"grad_codec": "powersgd", "grad_rank": 2, "start_after": 0}, 16),
    ],
)
def test_staged_step_equals_the_one_program_step(narrow, codec, extra, width):
    """data 2 x stage 4, 4 microbatches: loss, old log-probs and updated parameters of one tick equal the unstaged
    8-replica step's (an activation codec: its emulated path with the same PRF keys or basis; PowerSGD alone: the
    plain forward, the gradient codec nested around the pipeline). Every collective-permute of the compiled staged
    step (the forward messages and their transposes, the backward ones) carries the codec's payload: H = 16 values,
    k = 4 kept values (p = 0.75), r = 3 coefficients, or packed quantizer codes (with their block scales in a permute
    of their own)."""
    params, batch = narrow
    p0, m0, lp0, _ = one_step(run_cfg({"data": 8}, codec=codec, **extra), params, batch)
    p1, m1, lp1, hlo = one_step(run_cfg({"data": 2, "stage": 4}, codec=codec, **extra), params, batch)
    np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp0), rtol=1e-5, atol=1e-5)
    for k in ("loss", "grad/norm", "pg/loss"):
        if k in m0:
            np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-7)
    _close(p1, p0)
    shapes = _permute_shapes(hlo)
    # a microbatch of 16 / 4 rows split over 2 data replicas: 2 rows x 12 tokens x payload width per message
    if codec == "sr_quant":  # codes (u8) and block scales (f32), each direction
        assert sorted(shapes) == sorted([("f32", (2, 12, 2))] * 6 + [("u8", (2, 12, width))] * 6), shapes
    else:
        assert len(shapes) == 2 * 3, shapes  # 3 boundaries, forward and backward
        assert {s for _, s in shapes} == {(2, 12, width)}, shapes
    # The ends are stage-local: what leaves the last stage is two fp32 scalars per token (log-prob, entropy), in the
    # forward and in the backward, plus the codec's per-microbatch metrics; never hidden states [.., 12, 16] or
    # logits [.., 12, 100]. (XLA may fuse the end weights' gradient sum over `stage`, [100, 16], into the same
    # all-reduce.)
    exit_shapes = _exit_shapes(hlo)
    assert ("f32", (4, 2, 12)) in exit_shapes, exit_shapes
    assert not [s for _, s in exit_shapes if 12 in s and (16 in s or 100 in s)], exit_shapes
    if extra.get("grad_codec"):
        # PowerSGD reduces each stage's own layers over `data`: its packed buffers keep the layer stack's split over
        # `stage` ([L/S, Σ] per stage), so nothing is gathered or moved between stages outside the boundaries.
        # (One flat buffer of every leaf made XLA all-gather the whole layer stack's gradient over `stage`.)
        assert not re.search(r" all-gather(?:-start)?\(", hlo)
        assert not [ln for ln in hlo.splitlines() if " collective-permute" in ln and "stage_boundary" not in ln]
    exit_bytes = staged_bytes(hlo, 2)["stage_exit"]
    assert exit_bytes <= 4 * (16 * 12 * 4) + 4 * (100 * 16 + 16) + 1024, exit_bytes
    assert not any(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params))
        if a.size > 16
    )
    # each stage's devices hold their own layer: the leading layer axis is split 4 ways
    q = p1["layers"]["q_proj"]["kernel"]
    assert {s.data.shape[0] for s in q.addressable_shards} == {1}


@pytest.mark.slow
def test_eight_stages_and_microbatch_counts_agree(narrow):
    """stage 8 (one layer each) with 4 microbatches, and data 2 x stage 4 with 1 microbatch, both equal the
    unstaged forward and gradient of an 8-layer model."""
    _, batch = narrow
    cfg = run_cfg({"data": 8}, layers=8, codec="none")
    params = init_params(cfg.model, jax.random.key(1), std=0.3)

    def loss(pl, p):  # log-probs and an entropy bonus: both of the head's outputs carry a gradient
        st, _ = pipe.forward(cfg.model, p, batch["tokens"], batch["attention_mask"], pipeline=pl, entropy_grad=True)
        return jnp.sum((st.logp + 0.3 * st.entropy) * batch["response_mask"])

    v0, g0 = jax.jit(jax.value_and_grad(lambda p: loss(None, p)))(params)
    for mesh, m in (({"data": 1, "stage": 8}, 4), ({"data": 2, "stage": 4}, 1)):
        mc = run_cfg(mesh, layers=8, microbatches=m, codec="none")
        pl = make_pipeline(mc, mc.model, pmesh.make_mesh(mc.mesh))
        assert pl.bubble == pytest.approx((pl.stages - 1) / (m + pl.stages - 1))
        v, g = jax.jit(jax.value_and_grad(lambda p, pl=pl: loss(pl, p)))(params)
        np.testing.assert_allclose(float(v), float(v0), rtol=1e-5)
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):  # fp32 sums in another order: relative to the norm
            assert float(jnp.linalg.norm(x - y)) <= 1e-5 * float(jnp.linalg.norm(y)) + 1e-7


def test_stage_config_errors():
    with pytest.raises(ConfigError, match="mesh.stage"):
        run_cfg({"data": 1, "stage": 8}, layers=4, codec="none")
    with pytest.raises(ConfigError, match="fast.pp_size"):
        run_cfg({"data": 4, "stage": 2}, codec="prf_mask")  # boundaries (0, 1, 2) are not all stage boundaries
    with pytest.raises(ConfigError, match="train.pipeline_microbatches"):
        run_cfg({"data": 8}, microbatches=2, codec="none")
    cfg = run_cfg({"data": 2, "stage": 4}, microbatches=16, codec="none")
    with pytest.raises(ConfigError, match="train.pipeline_microbatches"):
        make_pipeline(cfg, cfg.model, pmesh.make_mesh(cfg.mesh))
    # what has no real-stage form is refused when the circuit is built, naming the field
    staged = {"data": 2, "stage": 4}
    for fast, field in (({"codec": "prf_mask", "exact_k": False}, "fast.codec"),):
        cfg = run_cfg(staged, **fast)
        with pytest.raises(ConfigError, match=field):
            FastCircuit(cfg, cfg.model, pmesh.make_mesh(cfg.mesh))


@pytest.mark.slow
def test_stages_with_fsdp_and_tensor_axes():
    """The stage axis composes with fsdp and tensor (layer kernels split over stage x fsdp x tensor): the staged
    forward and gradient equal the one-program ones."""
    from twocircuit_jax.config.sections import MeshConfig, ModelConfig

    cfg = ModelConfig(num_layers=4, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128)
    params = init_params(cfg, jax.random.key(0), std=0.1)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.vocab_size)
    mask = jnp.ones((8, 12), jnp.int32)

    def loss(pl, p):
        st, _ = pipe.forward(cfg, p, tokens, mask, pipeline=pl, entropy_grad=True)
        return jnp.sum(st.logp) + 0.3 * jnp.sum(st.entropy)

    v0, g0 = jax.jit(jax.value_and_grad(lambda p: loss(None, p)))(params)
    for mc in (MeshConfig(data=1, fsdp=2, stage=4), MeshConfig(data=1, fsdp=2, tensor=2, stage=2)):
        mesh = pmesh.make_mesh(mc)
        sharded = jax.device_put(params, pmesh.param_shardings(params, mesh))
        assert tuple(sharded["layers"]["q_proj"]["kernel"].sharding.spec) == ("stage", "fsdp", "tensor")
        pl = pipe.Pipeline(cfg, mesh, 2)
        v, g = jax.jit(jax.value_and_grad(lambda p, pl=pl: loss(pl, p)))(sharded)
        np.testing.assert_allclose(float(v), float(v0), rtol=1e-6)
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            assert float(jnp.linalg.norm(x - y)) <= 1e-5 * float(jnp.linalg.norm(y)) + 1e-7


def test_powersgd_state_is_split_over_stages(narrow):
    """data 2 x stage 4: each device holds its own stage's layers of PowerSGD's Q [L, m, r] and of its replica's
    error memory e [R·L, n, m] (one layer of four here), as it holds only those layers' parameters; the unstacked
    leaves keep today's placement."""
    params, _ = narrow
    cfg = run_cfg({"data": 2, "stage": 4}, codec="none", grad_codec="powersgd", grad_rank=2, start_after=0)
    circuit = FastCircuit(cfg, cfg.model, pmesh.make_mesh(cfg.mesh))
    g = circuit.init_grad_state(params)
    lay = [k for k in g.e if k.startswith("layers/")]
    assert lay and all(k.startswith("layers/") for k in g.Q)
    for k in lay:
        assert {s.data.shape[0] for s in g.e[k].addressable_shards} == {1}, k  # [2·4, n, m] over 8 devices
        assert {s.data.shape[0] for s in g.Q[k].addressable_shards} == {1}, k  # [4, m, r] over 4 stages
        # the two data replicas of one stage hold different rows of e (their own error memory)
        idx = {s.device.id: s.index[0] for s in g.e[k].addressable_shards}
        assert len(set(map(str, idx.values()))) == 8, idx
