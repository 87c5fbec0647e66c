"""Accelerator readiness on a CPU host: every Pallas kernel, and the train step with kernels on, lowered for CUDA and
for TPU with jax.export (interpret=False), and the lowered module checked for the kernel's own custom call.

The check reads the exported StableHLO: a Pallas Triton kernel is a `stablehlo.custom_call @__gpu$xla.gpu.triton`
carrying `name = "<kernel>"`, a Mosaic TPU kernel a `@tpu_custom_call` carrying `kernel_name = "<kernel>"`. Counting
(target, kernel) pairs fails the test if a kernel silently became plain XLA, or lowered for the wrong backend.
What this cannot see: the backend compilers' own checks (ptxas, Mosaic's layout passes, VMEM limits), which run
only on the device (scripts/device_check.sh). The CUDA tiling is also run here in interpret mode against the jnp
references, since it differs from the default one (power-of-two chunks, padded rank).
"""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import platform as plat
from pallas_kernels.lowrank import lowrank_fused, lowrank_reference, project_reconstruct
from pallas_kernels.powersgd import ef_project, ef_project_reference
from pallas_kernels.prf_mask import MaskRows, prf_mask_kernel, prf_mask_reference

S = jax.ShapeDtypeStruct
CALL = {"cuda": plat.TRITON_CUSTOM_CALL, "tpu": plat.TPU_CUSTOM_CALL}


def export_for(fn, platform, *args):
    # A Triton custom call has no serialization-compatibility guarantee across jax versions, so jax.export refuses
    # it unless told; here the artifact is only inspected, never stored.
    checks = [export.DisabledSafetyCheck.custom_call(plat.TRITON_CUSTOM_CALL)] if platform == "cuda" else []
    return export.export(fn, platforms=[platform], disabled_checks=checks)(*args)


def kernel_calls(exp) -> Counter:
    """(custom-call target, kernel name) of every custom call in the exported module."""
    out = Counter()
    for line in exp.mlir_module().splitlines():
        m = re.search(r"stablehlo\.custom_call @([\w$.]+)\(", line)
        if m:
            names = re.findall(r'(?:kernel_)?name = "([\w.]+)"', line)  # the last one: after the encoded body
            out[(m.group(1), names[-1] if names else None)] += 1
    return out


def _rows(n):
    u = S((n, 1), jnp.uint32)
    return MaskRows(u, u, u, u, u, u, S((n, 1), jnp.float32))


# value and gradient: the forward kernel and the custom-VJP backward (the same kernel on the cotangent)
def _mask_grad(platform):
    return jax.value_and_grad(lambda h, r: jnp.sum(prf_mask_kernel(h, r, platform=platform).astype(jnp.float32)))


def _pr_grad(platform):
    return jax.value_and_grad(
        lambda m, q: jnp.sum(project_reconstruct(m, q, platform=platform).astype(jnp.float32)), (0, 1)
    )


# (kernel name, fn(platform) -> callable, args, calls): Qwen2.5-1.5B-like widths (H 1536, MLP 8960, lowrank r 77),
# 0.5B (H 896), and configs/tiny.yaml's per-device rows (160 tokens of H 64) and leaves
KERNELS = {
    "mask_1536_bf16": ("prf_mask", lambda p: lambda h, r: prf_mask_kernel(h, r, platform=p), (S((512, 1536), jnp.bfloat16), _rows(512)), 1),
    "mask_tiny": ("prf_mask", lambda p: lambda h, r: prf_mask_kernel(h, r, platform=p), (S((160, 64), jnp.float32), _rows(160)), 1),
    "mask_grad_896": ("prf_mask", _mask_grad, (S((300, 896), jnp.bfloat16), _rows(300)), 2),
    "lowrank_1536_r77": ("lowrank_project_reconstruct", lambda p: lambda m, q: lowrank_fused(m, q, platform=p), (S((512, 1536), jnp.bfloat16), S((1536, 77), jnp.float32)), 1),
    "lowrank_tiny": ("lowrank_project_reconstruct", lambda p: lambda m, q: lowrank_fused(m, q, platform=p), (S((160, 64), jnp.float32), S((64, 3), jnp.float32)), 1),
    "lowrank_grad_896": ("lowrank_project_reconstruct", _pr_grad, (S((300, 896), jnp.bfloat16), S((896, 64), jnp.float32)), 2),
    "ef_1536x8960": ("powersgd_ef_project", lambda p: lambda g, e, q: ef_project(g, e, q, platform=p), (S((1536, 8960), jnp.float32), S((1536, 8960), jnp.float32), S((8960, 8), jnp.float32)), 1),
    "ef_stacked_tiny": ("powersgd_ef_project", lambda p: lambda g, e, q: ef_project(g, e, q, platform=p), (S((4, 64, 128), jnp.float32), S((4, 64, 128), jnp.float32), S((4, 128, 2), jnp.float32)), 1),
    "ef_ragged_bf16": ("powersgd_ef_project", lambda p: lambda g, e, q: ef_project(g, e, q, platform=p), (S((100, 37), jnp.bfloat16), S((100, 37), jnp.float32), S((37, 2), jnp.float32)), 1),
}  # fmt: skip


@pytest.mark.parametrize("platform", plat.PLATFORMS)
@pytest.mark.parametrize("case", sorted(KERNELS))
def test_kernel_lowers_to_its_custom_call(case, platform):
    name, fn, args, calls = KERNELS[case]
    exp = export_for(jax.jit(fn(platform)), platform, *args)
    assert exp.platforms == (platform,)
    assert kernel_calls(exp) == Counter({(CALL[platform], name): calls})


# (config overrides, kernel name, calls per train step): the train forward's kernel at the boundary of tiny at 2 layers
# (pp_size 2: one boundary, after layer 0; each boundary lowers the same, more layers only add tracing time) and its
# custom-VJP backward (the same kernel on the cotangent); PowerSGD's projection once per compressed leaf
TWO_LAYERS = ["model.num_layers=2", "fast.pp_size=2"]
STEPS = {
    "prf_mask": (TWO_LAYERS + ["fast.codec={type: prf_mask, p: 0.95, use_kernel: true}"], "prf_mask", 2),
    "lowrank": (
        TWO_LAYERS + ["fast.codec={type: lowrank, rank: 3, use_kernel: true}"],
        "lowrank_project_reconstruct",
        2,
    ),
    "powersgd": (
        TWO_LAYERS + ["fast.codec=none", "fast.grad_codec={type: powersgd, rank: 2, start_after: 0, use_kernel: true}"],
        "powersgd_ef_project",
        None,  # one per compressed leaf: counted from the codec's own leaf plan
    ),
}


@pytest.mark.parametrize("platform", plat.PLATFORMS)
@pytest.mark.parametrize("codec", sorted(STEPS))
def test_train_step_lowers_with_kernels(codec, platform, tiny_config):
    from twocircuit_jax.fast.leaf_plan import plan_leaves
    from twocircuit_jax.step.abstract_step import abstract_train_step

    sets, name, calls = STEPS[codec]
    cfg = tiny_config(sets)
    # dp=2 of conftest's 8 devices: the kernels run under the per-device shard_map, as in a data-parallel run
    step = abstract_train_step(cfg, jax.devices()[:2], lowering_platform=platform)
    assert step.circuit.lowering_platform == platform
    if calls is None:
        calls = sum(p.compress for p in plan_leaves(cfg.fast.grad_codec, step.params))
        assert calls > 0
    exp = export_for(step.jitted.wrapped, platform, *step.args)
    assert exp.nr_devices == 2
    assert kernel_calls(exp) == Counter({(CALL[platform], name): calls})


@pytest.fixture
def tiny_config():
    import os

    from twocircuit_jax.config.run import load_config

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
    return lambda sets: load_config(path, sets)


def test_lowering_platform_is_lowering_only(tiny_config):
    """A kernel built for CUDA is refused by the CPU compiler (jax's pallas_call has no CPU lowering), and the
    circuit's knob rejects an unknown platform and interpret mode (which runs on the host, not the device)."""
    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.fast.circuit import FastCircuit
    from twocircuit_jax.parallel.mesh import make_mesh

    h = jnp.ones((16, 128), jnp.float32)
    rows = MaskRows(*(jnp.zeros((16, 1), jnp.uint32),) * 6, jnp.ones((16, 1), jnp.float32))
    with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
        jax.jit(lambda h: prf_mask_kernel(h, rows, platform="cuda")).lower(h)
    with pytest.raises(RuntimeError, match="platform='cuda'/'tpu' to lower it for export only"):
        prf_mask_kernel(h, rows)
    with pytest.raises(ValueError, match="platform 'rocm' is not supported"):
        ef_project(h, h, jnp.ones((128, 2)), platform="rocm")
    cfg = tiny_config(["fast.codec={type: prf_mask, use_kernel: true}"])
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    with pytest.raises(ValueError, match="lowering_platform"):
        FastCircuit(cfg, cfg.model, mesh, lowering_platform="gpu")
    icfg = tiny_config(["fast.codec={type: prf_mask, use_kernel: true}", "fast.kernel_interpret=true"])
    with pytest.raises(ConfigError, match="cannot be lowered for an accelerator"):
        FastCircuit(icfg, icfg.model, mesh, lowering_platform="tpu")


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize(
    "N,H,r,dtype", [(37, 256, 5, jnp.float32), (50, 100, 3, jnp.bfloat16), (16, 64, 20, jnp.float32)]
)
def test_cuda_tiling_matches_reference_in_interpret_mode(N, H, r, dtype):
    """The CUDA tiling (H in power-of-two chunks, r padded, H=100 zero-padded to 112) against the jnp references:
    only the fp32 summation order differs."""
    k = jax.random.split(jax.random.PRNGKey(N), 4)
    M = jax.random.normal(k[0], (N, H)).astype(dtype)
    Q = jnp.linalg.qr(jax.random.normal(k[1], (H, r)))[0]
    Y, Mh = jax.jit(lambda M, Q: lowrank_fused(M, Q, interpret=True, platform="cuda"))(M, Q)
    Yr, Mhr = lowrank_reference(M, Q)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    _close(Y, Yr, tol)
    _close(Mh, Mhr, tol)
    G, E = jax.random.normal(k[2], (3, N, H)), jax.random.normal(k[3], (3, N, H))
    Qg = jax.random.normal(k[1], (3, H, 2))
    P = jax.jit(lambda G, E, Q: ef_project(G.astype(dtype), E, Q, interpret=True, platform="cuda"))(G, E, Qg)
    _close(P, ef_project_reference(G.astype(dtype), E, Qg), 1e-6)


def test_cuda_mask_tiling_is_exact_in_interpret_mode():
    from pallas_kernels import prf

    N, H = 45, 96  # ragged on both axes for the [16, 32] blocks the CUDA tiling picks at H=96
    rk = prf.row_key(prf.prefix_key(0, 1, jnp.int32(3)), jnp.arange(N, dtype=jnp.int32), jnp.zeros((N, 1), jnp.int32))
    col = lambda x, d=jnp.uint32: jnp.broadcast_to(jnp.asarray(x, d).reshape(-1, 1), (N, 1))  # noqa: E731
    thr = prf.const64(1 << 52)  # keep about half
    rows = MaskRows(col(rk.hi), col(rk.lo), col(thr.hi), col(thr.lo), col(0xFFFFFFFF), col(0), col(2.0, jnp.float32))
    h = jax.random.normal(jax.random.PRNGKey(1), (N, H))
    out = jax.jit(lambda h: prf_mask_kernel(h, rows, interpret=True, platform="cuda"))(h)
    ref = prf_mask_reference(h, rows)
    assert bool(jnp.all(out == ref)) and 0.3 < float(jnp.mean(ref != 0)) < 0.7


@pytest.mark.parametrize("platform", plat.PLATFORMS)
def test_staged_train_step_lowers(platform, tiny_config):
    """The train step on real stages (data 2 x stage 4, the PRF mask's packed payload at the 3 boundaries) lowers
    for the accelerator: 8 devices, one collective-permute per boundary and direction."""
    from twocircuit_jax.step.abstract_step import abstract_train_step

    cfg = tiny_config(["mesh.data=2", "mesh.stage=4"])
    step = abstract_train_step(cfg, jax.devices())
    exp = export_for(step.jitted.wrapped, platform, *step.args)
    assert exp.nr_devices == 8
    assert exp.mlir_module().count("stablehlo.collective_permute") == 2 * 3
