"""The decoder's memory and compile-time knobs (model.remat, model.scan_layers, model.attention) against today's path
(unrolled layers, no remat, the `xla` attention with its [B, T, T] bias): values and gradients equal at the real
tokens, the hooks' aux equal, the staged pipeline equal, and the GPU/TPU kernels lowered for their platforms."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.sections import ModelConfig
from twocircuit_jax.model import attention as attn, qwen2

T = 16


def small_cfg(**kw):
    base = dict(vocab_size=50, hidden_size=32, num_layers=5, num_heads=4, num_kv_heads=2, head_dim=8)
    return ModelConfig(**{**base, "intermediate_size": 48, **kw})


def padded_mask():
    """Left-padded prompts and right-padded responses: one row of each, one with both, one full."""
    m = np.ones((4, T), np.int32)
    m[0, :4] = 0
    m[1, -5:] = 0
    m[2, :2] = 0
    m[2, -3:] = 0
    return jnp.asarray(m)


def loss_and_grads(cfg, params, tokens, mask, hook=None, hook_layers=()):
    """(loss, logits at real tokens, aux) and the parameter gradient, of a loss that reads only real tokens."""

    def loss(p):
        logits, aux = qwen2.forward_with_aux(cfg, p, tokens, mask, hook=hook, hook_layers=hook_layers)
        logits = jnp.where(mask[..., None] > 0, logits, 0.0)
        return jnp.sum(jnp.sin(logits)), (logits, aux)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def assert_close(got, want, tol):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.all(np.isfinite(x))
        assert float(np.linalg.norm(x - y)) <= tol * float(np.linalg.norm(y)) + 1e-6


# every pair of (dtype, q/k norm, block) values once: 4 cases instead of 8
@pytest.mark.parametrize(
    "compute,qk_norm,block",
    [("float32", False, 5), ("float32", True, 16), ("bfloat16", False, 16), ("bfloat16", True, 5)],
)
def test_blockwise_equals_xla(compute, qk_norm, block):
    """Grouped-query heads, q/k norm, padding on both sides, uneven and single blocks: the logits and every
    parameter gradient equal the xla path's (fp32: float order only; bf16: the same ops on bf16 operands)."""
    # 2 layers: the attention path is per layer, the second layer's input is the first's output, so the equality
    # holds at any depth; each layer more (they unroll) only adds compile time
    ref_cfg = small_cfg(qk_norm=qk_norm, compute_dtype=compute, attention="xla", num_layers=2)
    params = qwen2.init_params(ref_cfg, jax.random.key(0), std=0.1)
    mask = padded_mask()
    tokens = jax.random.randint(jax.random.key(1), mask.shape, 0, ref_cfg.vocab_size)
    want = loss_and_grads(ref_cfg, params, tokens, mask)
    got = loss_and_grads(
        dataclasses.replace(ref_cfg, attention="blockwise", attention_block=block), params, tokens, mask
    )
    assert_close(got, want, 1e-5 if compute == "float32" else 2e-2)


def kernel_inputs(T=128, nq=4, nkv=2, D=32):
    ks = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(ks[0], (4, T, nq, D))
    k, v = (jax.random.normal(key, (4, T, nkv, D)) for key in ks[1:])
    m = np.ones((4, T), np.int32)
    m[0, :10], m[1, -20:], m[2, :3], m[2, -7:] = 0, 0, 0, 0
    return q, k, v, jnp.asarray(m)


_BLOCKWISE: dict = {}  # blockwise's output and gradient on kernel_inputs(): the reference of both kernels' tests


def kernel_vs_blockwise(fn, tol):
    """fn(q, k, v, mask) against blockwise: outputs at real queries, gradients of a loss read at real queries, and
    every output (padding queries included) finite. The reference is computed once per process, jitted (op by op,
    its forward and gradient took seconds of dispatch in each test)."""
    q, k, v, m = kernel_inputs()
    real = m[:, :, None, None] > 0

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.where(real, f(q, k, v, m), 0.0) ** 2)

    ref = lambda q, k, v, m: attn.blockwise(q, k, v, m, block=48)  # noqa: E731
    if not _BLOCKWISE:
        _BLOCKWISE["out"] = jax.jit(ref)(q, k, v, m)
        _BLOCKWISE["grad"] = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    out, want = jax.jit(fn)(q, k, v, m), _BLOCKWISE["out"]
    assert bool(jnp.all(jnp.isfinite(out)))
    assert_close(jnp.where(real, out, 0.0), jnp.where(real, want, 0.0), tol)
    assert_close(jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v), _BLOCKWISE["grad"], tol)


def test_cudnn_row_rotation_equals_blockwise():
    """The cudnn path's padding (rows rotated so real tokens come first, lengths, rotated back) run through XLA's
    implementation of the same fused-attention call: equal to blockwise at the real queries."""
    kernel_vs_blockwise(lambda q, k, v, m: attn.cudnn(q, k, v, m, implementation="xla"), 1e-5)


def test_cudnn_lowers_for_cuda(monkeypatch):
    """The cudnn path's forward and backward export for CUDA from this CPU box as the cuDNN fused-attention custom
    calls. The CPU install has no cuDNN library to ask its version: the lowering is told 9.8 (what it reads the
    version for is which features to emit)."""
    from jax import export
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    cfg = small_cfg(compute_dtype="bfloat16", attention="cudnn", num_layers=2, head_dim=64)
    params = jax.eval_shape(lambda: qwen2.init_params(cfg, jax.random.key(0)))
    tok = jax.ShapeDtypeStruct((2, 128), jnp.int32)

    def grads(p, tokens, mask):
        return jax.grad(lambda p: jnp.sum(qwen2.forward(cfg, p, tokens, mask)))(p)

    targets = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets]
    text = export.export(jax.jit(grads), platforms=["cuda"], disabled_checks=checks)(params, tok, tok).mlir_module()
    calls = set(re.findall(r"custom_call @([\w$]+)", text))
    assert set(targets) <= calls
    assert "PADDING_CAUSAL" in text


def test_cudnn_needs_bf16():
    with pytest.raises(ConfigError, match="model.attention: got 'cudnn' with compute_dtype float32"):
        load_config(data={"model": {"attention": "cudnn"}})


def test_flash_tpu_in_interpret_mode_equals_blockwise():
    """The Pallas TPU flash kernel, run by the TPU interpreter on CPU: segment ids express the padding."""
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode():
        kernel_vs_blockwise(attn.flash_tpu, 1e-5)


@pytest.mark.tpu_compile
def test_flash_tpu_compiles_sharded_for_tpu_v5e(monkeypatch):
    """A forward and backward with flash_tpu over a 2 x 4 (data, fsdp) mesh of compile-only TPU v5e devices: the
    kernel runs in a shard_map over the batch axes (a Mosaic kernel is not partitioned by XLA) and compiles."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on this box may hold libtpu's lock
    devices = topologies.get_topology_desc(
        platform="tpu", topology_name="v5e:2x4", chips_per_host_bounds=(2, 4, 1), num_slices=1
    ).devices
    mesh = Mesh(np.asarray(devices).reshape(2, 4), ("data", "fsdp"))
    cfg = small_cfg(compute_dtype="bfloat16", attention="flash_tpu", num_layers=2, head_dim=128)
    params = jax.eval_shape(lambda: qwen2.init_params(cfg, jax.random.key(0)))
    tok = jax.ShapeDtypeStruct((8, 256), jnp.int32)

    def grads(p, tokens, mask):
        return jax.grad(lambda p: jnp.sum(qwen2.forward(cfg, p, tokens, mask)))(p)

    rows = NamedSharding(mesh, P(("data", "fsdp")))
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    with jax.set_mesh(mesh):
        compiled = jax.jit(grads, in_shardings=(replicated, rows, rows)).lower(params, tok, tok).compile()
    assert "tpu_custom_call" in compiled.as_text()


def make_hook(mask):
    """A codec stand-in: changes the hidden state and reports a statistic of it at the real tokens (a padding
    query's hidden state is path-dependent, see model/attention.py)."""

    def hook(layer, h):
        energy = jnp.sum(jnp.where(mask[..., None] > 0, h.astype(jnp.float32), 0.0) ** 2)
        return h * (1.0 + 0.1 * layer) + 0.01, {"energy": energy}

    return hook


_UNROLLED: dict = {}  # hook_layers -> the unrolled, un-rematerialised stack's (logits, aux, gradients)


SCANNED = [
    {"scan_layers": True},
    {"scan_layers": True, "remat": "full"},
    {"scan_layers": True, "remat": "dots", "attention": "blockwise", "attention_block": 6},
]
HOOK_SETS = [(), (1, 2), (0, 4)]
# The hooked layers decide where a scanned stack splits into runs (model/qwen2.py run_layers): one run of 5 layers,
# runs of 2, 1 and 2 (a middle layer hooked), runs of 1 and 4 (first and last hooked). The split is the same code
# whatever the remat policy and attention inside the scanned layer (which wraps each layer alone), and those are the
# same code whatever the split: each hook set once, each with another scanned case, covers both. The unrolled loop
# calls the hook between layers whatever the set, outside the rematerialised layer: the unrolled remat policies with
# the first and last layer hooked.
CASES = list(zip(SCANNED, HOOK_SETS)) + [({"remat": r}, (0, 4)) for r in ("full", "dots")]


@pytest.mark.parametrize("knobs,hook_layers", CASES)
def test_scan_and_remat_equal_the_unrolled_stack(knobs, hook_layers):
    """Scanned runs between hooked layers (first, middle, last layer hooked), each remat policy: the logits, the
    hooks' aux and the gradients equal the unrolled, un-rematerialised stack's."""
    cfg = small_cfg(attention="xla")
    params = qwen2.init_params(cfg, jax.random.key(0), std=0.1)
    mask = padded_mask()
    tokens = jax.random.randint(jax.random.key(1), mask.shape, 0, cfg.vocab_size)
    hook = make_hook(mask)
    if hook_layers not in _UNROLLED:  # the reference depends on the hooked layers only: once per hook set
        _UNROLLED[hook_layers] = loss_and_grads(cfg, params, tokens, mask, hook, hook_layers)
    want = _UNROLLED[hook_layers]
    got = loss_and_grads(dataclasses.replace(cfg, **knobs), params, tokens, mask, hook, hook_layers)
    assert sorted(got[0][1][1]) == sorted(hook_layers)
    assert_close(got, want, 1e-5)


def test_scanned_program_does_not_grow_with_depth():
    """With scan_layers the lowered program holds one layer body per run of layers: 4 and 12 layers give the same
    number of dot ops (unrolled: three times as many)."""

    def dots(layers, scan):
        cfg = small_cfg(num_layers=layers, scan_layers=scan, attention="xla")
        params = jax.eval_shape(lambda: qwen2.init_params(cfg, jax.random.key(0)))
        tok = jax.ShapeDtypeStruct((2, 8), jnp.int32)
        hook = make_hook(jnp.ones((2, 8), jnp.int32))
        fn = jax.jit(jax.grad(lambda p, t: jnp.sum(qwen2.forward(cfg, p, t, hook=hook, hook_layers=(1,)))))
        return fn.lower(params, tok).as_text().count("stablehlo.dot_general")

    assert dots(4, True) == dots(12, True)
    assert dots(12, False) > 2 * dots(4, False)


def test_pipeline_stages_use_the_layer_stack_knobs():
    """The staged forward (stage 2, two layers a stage) with scan, full remat and blockwise attention equals the
    one-program forward with today's path, value and gradient. (Two stages: what runs a stage's layers is the same
    at any stage count, which tests/test_pipeline.py varies; each unrolled layer of the reference only added
    compile time.)"""
    from twocircuit_jax.config.sections import MeshConfig
    from twocircuit_jax.parallel import mesh as pmesh, pipeline as pipe

    cfg = small_cfg(num_layers=4, attention="xla")
    fast = dataclasses.replace(cfg, scan_layers=True, remat="full", attention="blockwise", attention_block=5)
    params = qwen2.init_params(cfg, jax.random.key(0), std=0.1)
    mask = padded_mask()
    tokens = jax.random.randint(jax.random.key(1), mask.shape, 0, cfg.vocab_size)
    # logp[:, t] reads the logits at t - 1: only tokens whose predecessor is real (a padding query's output is
    # any finite value, path-dependent)
    real = (mask * jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))).astype(jnp.float32)

    def loss(c, pl, p):
        st, _ = pipe.forward(c, p, tokens, mask, pipeline=pl, entropy_grad=True)
        return jnp.sum((st.logp + 0.3 * st.entropy) * real)

    want = jax.jit(jax.value_and_grad(lambda p: loss(cfg, None, p)))(params)
    pl = pipe.Pipeline(fast, pmesh.make_mesh(MeshConfig(data=2, stage=2), jax.devices()[:4]), 2)
    got = jax.jit(jax.value_and_grad(lambda p: loss(fast, pl, p)))(params)
    assert_close(got, want, 1e-5)


def test_run_owned_forward_settings_win_over_the_checkpoint(tmp_path):
    """A native checkpoint saved with remat/scan/attention settings: the run's model section decides them (its
    defaults included), the checkpoint's shape stays."""
    from twocircuit_jax.sampler.export import export_weights
    from twocircuit_jax.train.setup import load_model

    saved = small_cfg(remat="full", scan_layers=True, attention="blockwise", attention_block=7)
    path = export_weights(jax.device_get(qwen2.init_params(saved, jax.random.key(0))), saved, str(tmp_path), 1)
    default = load_model(load_config(data={"base_model": path}), 0)[0]
    assert (default.remat, default.scan_layers, default.attention, default.attention_block) == (
        "none",
        False,
        "auto",
        512,
    )
    assert default.num_layers == 5
    run = {"remat": "dots", "scan_layers": True, "attention": "xla", "attention_block": 64}
    mine = load_model(load_config(data={"base_model": path, "model": run}), 0)[0]
    assert (mine.remat, mine.scan_layers, mine.attention, mine.attention_block) == ("dots", True, "xla", 64)


def test_auto_keeps_short_cpu_sequences_on_the_xla_path():
    cfg = small_cfg()
    assert jax.default_backend() == "cpu"
    assert attn.resolve(cfg, attn.AUTO_BLOCKWISE_FROM - 1) == "xla"
    assert attn.resolve(cfg, attn.AUTO_BLOCKWISE_FROM) == "blockwise"
    assert attn.resolve(dataclasses.replace(cfg, attention="cudnn", compute_dtype="bfloat16"), 8) == "cudnn"
