"""Every Pallas kernel COMPILES for TPU on this CPU host: libtpu's compile-only devices (an 8-chip v5e topology,
jax.experimental.topologies) run the real TPU compiler, Mosaic's own passes included (layouts, VMEM limits), which a
lowering (tests/test_platform_export.py) never reaches. Nothing runs. Each kernel is wrapped in jax.shard_map as in a
data-parallel step (pallas_kernels/sharding.py: row kernels per device on their own rows; PowerSGD's projection per
device on a whole gradient leaf), and the compiled program must hold the kernel's Mosaic custom call.
"""

import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.lowrank import lowrank_fused, project_reconstruct
from pallas_kernels.powersgd import ef_project
from pallas_kernels.prf_mask import MaskRows, prf_mask_kernel

pytestmark = pytest.mark.tpu_compile

S = jax.ShapeDtypeStruct
KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pallas_kernels")


@pytest.fixture(scope="module")
def mesh():
    from twocircuit_jax.plan.targets import devices, parse

    return Mesh(devices(parse("tpu:v5e-8")), ("data",))


def _rows(n):
    u = S((n, 1), jnp.uint32)
    return MaskRows(u, u, u, u, u, u, S((n, 1), jnp.float32))


def _mask(h, r):
    return prf_mask_kernel(h, r, platform="tpu")


def _mask_grad(h, r):
    return jax.grad(lambda h: jnp.sum(prf_mask_kernel(h, r, platform="tpu").astype(jnp.float32)))(h)


def _lowrank(m, q):
    return lowrank_fused(m, q, platform="tpu")


def _pr_grad(m, q):
    return jax.grad(lambda m, q: jnp.sum(project_reconstruct(m, q, platform="tpu").astype(jnp.float32)), (0, 1))(m, q)


def _ef(g, e, q):
    return ef_project(g, e, q, platform="tpu")


# (module, fn, global args, row args: split over `data`; the rest replicated). Rows: 8 devices x 64 (x 40 for the
# 1536-wide bf16 case, Qwen2.5-1.5B's hidden width with the lowrank rank 77 of configs/shapes).
CASES = {
    "prf_mask_f32": ("prf_mask", _mask, (S((512, 128), jnp.float32), _rows(512)), 2),
    "prf_mask_1536_bf16": ("prf_mask", _mask, (S((320, 1536), jnp.bfloat16), _rows(320)), 2),
    "prf_mask_grad_bf16": ("prf_mask", _mask_grad, (S((512, 256), jnp.bfloat16), _rows(512)), 2),
    "lowrank_f32_r8": ("lowrank", _lowrank, (S((512, 256), jnp.float32), S((256, 8), jnp.float32)), 1),
    "lowrank_1536_r77_bf16": ("lowrank", _lowrank, (S((320, 1536), jnp.bfloat16), S((1536, 77), jnp.float32)), 1),
    "lowrank_grad_bf16": ("lowrank", _pr_grad, (S((512, 256), jnp.bfloat16), S((256, 16), jnp.float32)), 1),
    "powersgd_f32": ("powersgd", _ef, (S((256, 512), jnp.float32), S((256, 512), jnp.float32), S((512, 4), jnp.float32)), 0),
    "powersgd_stacked_bf16": ("powersgd", _ef, (S((4, 64, 128), jnp.bfloat16), S((4, 64, 128), jnp.float32), S((4, 128, 2), jnp.float32)), 0),
}  # fmt: skip


def _compile(mesh, fn, args, n_rows):
    specs = tuple(jax.tree.map(lambda _: P("data"), a) for a in args[:n_rows])
    specs += tuple(jax.tree.map(lambda _: P(), a) for a in args[n_rows:])
    out_specs = P("data") if n_rows else P()
    body = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    return jax.jit(body, in_shardings=shardings).lower(*args).compile()


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_compiles_for_tpu(case, mesh):
    _, fn, args, n_rows = CASES[case]
    compiled = _compile(mesh, fn, args, n_rows)
    hlo = compiled.as_text()
    assert re.search(r'custom_call_target="tpu_custom_call"', hlo), "the kernel became plain XLA"
    # per device on its own rows (row kernels) or its own copy of the leaf (PowerSGD): no collective moves data
    assert not re.search(r"\b(all-gather|all-reduce|all-to-all|collective-permute)(-start)?\(", hlo)


def test_every_kernel_module_has_a_compile_case():
    """A new kernel module (a file that imports Pallas) fails here until it has a compile case above."""
    have = {m for m, *_ in CASES.values()}
    modules = set()
    for f in os.listdir(KERNEL_DIR):
        if f.endswith(".py") and f not in ("platform.py", "sharding.py", "__init__.py"):
            if "from jax.experimental import pallas" in open(os.path.join(KERNEL_DIR, f)).read():
                modules.add(f[: -len(".py")])
    assert modules == have, (modules, have)
