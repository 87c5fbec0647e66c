"""Pallas kernels against their jnp references on an accelerator (design §3.6 "Kernels"): time and bandwidth.

    python scripts/bench_kernels.py [--tokens 16384] [--hidden 1536] [--rank 77] [--iters 50] [--dtype bfloat16]
    python scripts/bench_kernels.py --cpu-smoke   # tiny shapes, CUDA tiling in interpret mode: checks the script

Times, forward only, jitted, median of `--iters`: the PRF mask (h [N, H] -> h*m*g), the low-rank project /
reconstruct (M [N, H], Q [H, r] -> M·Q·Qᵀ) and PowerSGD's error-feedback projection ((G + E)·Q on a [H, F] leaf).
Achieved bandwidth = bytes the op must move (inputs read once + output written once) / time, reported against
the device's measured copy bandwidth (a jitted x -> x + 1 over a 1 GiB buffer: read + write), one table row per
kernel. Last line `bench_kernels: PASS` when every timing is a positive finite number (a slow kernel is reported,
not failed: the table is the result). On CPU the kernels cannot be compiled; the script says so and exits 2 (it never
silently times the interpreter or the reference), unless --cpu-smoke asks for exactly that, at toy sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _timed(fn, *args, iters):
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth(iters: int, mib: int = 1024) -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((mib, 256, 1024), jnp.float32)  # `mib` MiB
    t = _timed(jax.jit(lambda a: a + 1.0), x, iters=iters)
    return 2 * x.size * 4 / t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--rank", type=int, default=77)
    ap.add_argument("--mlp", type=int, default=8960)
    ap.add_argument("--grad-rank", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes in interpret mode (CUDA tiling)")
    args = ap.parse_args(argv)
    import math

    import jax
    import jax.numpy as jnp

    kw, copy_mib = {}, 1024
    if args.cpu_smoke:
        args.tokens, args.hidden, args.rank, args.mlp, args.grad_rank, args.iters = 64, 96, 3, 64, 2, 2
        kw, copy_mib = {"interpret": True, "platform": "cuda"}, 8
    elif jax.default_backend() == "cpu":
        print(
            "bench_kernels: no accelerator (backend cpu); the Pallas kernels cannot be compiled here and the "
            "interpreter would time nothing useful. Run on a GPU/TPU host.",
            file=sys.stderr,
        )
        return 2
    from pallas_kernels import prf
    from pallas_kernels.lowrank import lowrank_reference, project_reconstruct
    from pallas_kernels.powersgd import ef_project, ef_project_reference
    from pallas_kernels.prf_mask import MaskRows, prf_mask_kernel, prf_mask_reference
    from twocircuit_jax.fast.codecs import prf_mask as mask_lib

    N, H, r, F = args.tokens, args.hidden, args.rank, args.mlp
    dt = jnp.dtype(args.dtype)
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    h = jax.random.normal(k[0], (N, H), dt)
    rk = prf.row_key(
        prf.prefix_key(0, 3, jnp.int32(1)),
        jnp.arange(N // 128 or 1, dtype=jnp.int32),
        jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (N // 128 or 1, 128)),
    )
    thr = prf.const64(mask_lib.bernoulli_threshold(0.95))
    col = lambda x, d=jnp.uint32: jnp.broadcast_to(jnp.asarray(x, d).reshape(-1, 1)[:N], (N, 1))  # noqa: E731
    rows = MaskRows(
        col(rk.hi),
        col(rk.lo),
        col(thr.hi),
        col(thr.lo),
        col(0xFFFFFFFF),
        col(0),
        col(mask_lib.constant_gain(0.95), jnp.float32),
    )
    Q = jnp.linalg.qr(jax.random.normal(k[1], (H, r), jnp.float32))[0]
    G = jax.random.normal(k[2], (H, F), jnp.float32)
    E = jax.random.normal(k[3], (H, F), jnp.float32)
    Qg = jax.random.normal(k[4], (F, args.grad_rank), jnp.float32)
    item = dt.itemsize
    cases = [
        (
            "prf_mask",
            lambda x, rw: prf_mask_kernel(x, rw, **kw),
            lambda x, rw: prf_mask_reference(x, rw),
            (h, rows),
            2 * N * H * item + N * 7 * 4,
        ),
        (
            "lowrank",
            lambda m, q: project_reconstruct(m, q, **kw),
            lambda m, q: lowrank_reference(m, q)[1],
            (h, Q),
            2 * N * H * item + H * r * 4,
        ),
        (
            "powersgd_ef_project",
            lambda g, e, q: ef_project(g, e, q, **kw),
            ef_project_reference,
            (G, E, Qg),
            2 * H * F * 4 + F * args.grad_rank * 4 + H * args.grad_rank * 4,
        ),
    ]
    bw = copy_bandwidth(args.iters, copy_mib)
    print(
        f"device={jax.devices()[0].device_kind} copy_bandwidth={bw / 1e9:.1f} GB/s dtype={args.dtype} "
        f"tokens={N} hidden={H} rank={r}"
    )
    head = ("kernel", "kernel_ms", "ref_ms", "speedup", "kernel_GB/s", "of_copy", "ref_GB/s", "ref_of_copy")
    print(f"{head[0]:<22}" + "".join(f"{h:>12}" for h in head[1:]))
    ok = True
    for name, kern, ref, xs, nbytes in cases:
        tk = _timed(jax.jit(kern), *xs, iters=args.iters)
        tr = _timed(jax.jit(ref), *xs, iters=args.iters)
        ok &= all(math.isfinite(t) and t > 0 for t in (tk, tr))
        cells = (tk * 1e3, tr * 1e3, tr / tk, nbytes / tk / 1e9, nbytes / tk / bw, nbytes / tr / 1e9, nbytes / tr / bw)
        fmt = ("{:.3f}", "{:.3f}", "{:.2f}", "{:.1f}", "{:.0%}", "{:.1f}", "{:.0%}")
        print(f"{name:<22}" + "".join(f"{f.format(c):>12}" for f, c in zip(fmt, cells)))
    print(
        f"bench_kernels: {'PASS' if ok else 'FAIL'}{' (cpu-smoke: interpreter timings, meaningless)' * args.cpu_smoke}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
