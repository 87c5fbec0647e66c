"""Every Pallas kernel against its jnp reference on the accelerator, compiled (not interpret mode): values and
gradients, at configs/tiny.yaml's widths, Qwen2.5-0.5B's (H 896, MLP 4864) and 1.5B's (H 1536, MLP 8960), with
ragged row counts.

    python scripts/kernel_check.py            # on a GPU/TPU host; exit 0 all PASS, 1 any FAIL, 2 no accelerator
    python scripts/kernel_check.py --cpu-smoke  # small shapes, CUDA tiling in interpret mode (checks the script)

Tolerances: the mask is exact (integer hash, one fp32 multiply); the products differ from XLA's only in fp32
summation order (the references run at `highest` matmul precision, so no TF32 rounding on either side): relative
Frobenius error 1e-5 in fp32, 2e-2 where the inputs are bfloat16.
"""

from __future__ import annotations

import argparse
import sys
import time

FULL = {
    "mask": [(160, 64, "float32"), (1000, 896, "bfloat16"), (4096, 1536, "bfloat16")],
    "lowrank": [(160, 64, 3, "float32"), (1000, 896, 64, "bfloat16"), (4096, 1536, 77, "bfloat16")],
    "ef": [((4, 64, 128), 2, "float32"), ((896, 4864), 8, "float32"), ((1536, 8960), 8, "float32"), ((100, 37), 2, "bfloat16")],
}  # fmt: skip
SMOKE = {
    "mask": [(45, 96, "float32")],
    "lowrank": [(37, 100, 3, "bfloat16")],
    "ef": [((2, 40, 64), 2, "float32")],
}


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _mask_rows(N, key):
    import jax.numpy as jnp

    from pallas_kernels import prf
    from pallas_kernels.prf_mask import MaskRows

    rk = prf.row_key(prf.prefix_key(7, 3, jnp.int32(5)), jnp.arange(N, dtype=jnp.int32), jnp.zeros((N, 1), jnp.int32))
    thr = prf.const64(int(0.9 * 2**53))  # Bernoulli, p = 0.9
    col = lambda x, d=jnp.uint32: jnp.broadcast_to(jnp.asarray(x, d).reshape(-1, 1), (N, 1))  # noqa: E731
    return MaskRows(col(rk.hi), col(rk.lo), col(thr.hi), col(thr.lo), col(0xFFFFFFFF), col(0), col(10.0, jnp.float32))


def run(shapes, kw) -> list[tuple[str, bool, str]]:
    """(case, ok, detail) for every kernel case; `kw` is the kernels' interpret/platform arguments."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.lowrank import lowrank_fused, lowrank_reference, project_reconstruct
    from pallas_kernels.powersgd import ef_project, ef_project_reference
    from pallas_kernels.prf_mask import prf_mask_kernel, prf_mask_reference

    out = []
    key = jax.random.PRNGKey(0)
    hi = lambda f: jax.default_matmul_precision("highest")(f)  # noqa: E731
    for N, H, dt in shapes["mask"]:
        h, w = jax.random.normal(key, (N, H)).astype(dt), jax.random.normal(key, (N, H)).astype(dt)
        rows = _mask_rows(N, key)
        got, vjp = jax.vjp(jax.jit(lambda x: prf_mask_kernel(x, rows, **kw)), h)
        want, vjp_r = jax.vjp(lambda x: prf_mask_reference(x, rows), h)
        ok = bool(jnp.all(got == want)) and bool(jnp.all(vjp(w)[0] == vjp_r(w)[0]))
        out.append((f"prf_mask N={N} H={H} {dt}", ok, "exact" if ok else f"rel_err={_rel(got, want):.2e}"))
    for N, H, r, dt in shapes["lowrank"]:
        k1, k2 = jax.random.split(key)
        M, W = jax.random.normal(k1, (N, H)).astype(dt), jax.random.normal(k2, (N, H))
        Q = jnp.linalg.qr(jax.random.normal(k2, (H, r)))[0]
        Y, Mh = jax.jit(lambda m, q: lowrank_fused(m, q, **kw))(M, Q)
        Yr, Mhr = hi(jax.jit(lowrank_reference))(M, Q)
        loss = lambda f: lambda m, q: jnp.sum(f(m, q).astype(jnp.float32) * W)  # noqa: E731
        g = jax.jit(jax.grad(loss(lambda m, q: project_reconstruct(m, q, **kw)), (0, 1)))(M, Q)
        gr = hi(jax.jit(jax.grad(loss(lambda m, q: lowrank_reference(m, q)[1]), (0, 1))))(M, Q)
        errs = [_rel(Y, Yr), _rel(Mh, Mhr), _rel(g[0], gr[0]), _rel(g[1], gr[1])]
        tol = 1e-5 if dt == "float32" else 2e-2
        out.append(
            (f"lowrank N={N} H={H} r={r} {dt}", max(errs) < tol, "rel_err=" + ",".join(f"{e:.1e}" for e in errs))
        )
    for shape, r, dt in shapes["ef"]:
        k1, k2, k3 = jax.random.split(key, 3)
        G, E = jax.random.normal(k1, shape).astype(dt), jax.random.normal(k2, shape)
        Q = jax.random.normal(k3, shape[:-2] + (shape[-1], r))
        P = jax.jit(lambda g, e, q: ef_project(g, e, q, **kw))(G, E, Q)
        err = _rel(P, hi(jax.jit(ef_project_reference))(G, E, Q))
        tol = 1e-5 if dt == "float32" else 2e-2
        out.append((f"ef_project {shape} r={r} {dt}", err < tol, f"rel_err={err:.1e}"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="small shapes, CUDA tiling in interpret mode")
    args = ap.parse_args(argv)
    import jax

    if args.cpu_smoke:
        shapes, kw = SMOKE, {"interpret": True, "platform": "cuda"}
    elif jax.default_backend() == "cpu":
        print("kernel_check: FAIL no accelerator (backend cpu); --cpu-smoke checks the script only", file=sys.stderr)
        return 2
    else:
        shapes, kw = FULL, {}
    t0 = time.perf_counter()
    results = run(shapes, kw)
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    bad = sum(not ok for _, ok, _ in results)
    mode = "cpu-smoke (interpret)" if args.cpu_smoke else jax.devices()[0].device_kind
    print(f"kernel_check: {'FAIL' if bad else 'PASS'} {len(results) - bad}/{len(results)} on {mode} in "
          f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
