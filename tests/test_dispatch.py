"""parallel/dispatch.jit: on the multi-device CPU backend no two multi-device programs are ever in flight at once.

With XLA:CPU's default device pool (as many threads as devices), independent programs with all-reduces dispatched
back to back deadlock the pool within a few rounds under plain `jax.jit`, and XLA aborts the process after 40 s.
The interleaving check runs in a subprocess with that default pool (the test session itself runs with a larger one,
see conftest.py).
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from twocircuit_jax.parallel import dispatch

INTERLEAVE = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from twocircuit_jax.parallel import dispatch

    assert dispatch.serial_dispatch()
    mesh = jax.make_mesh((8,), ("d",))

    def heavy(x):
        for _ in range(8):
            x = jax.lax.psum(jnp.tanh(x @ x.T @ x), "d") / 8
        return x

    f = dispatch.jit(jax.shard_map(heavy, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    g = dispatch.jit(jax.shard_map(lambda x: jax.lax.psum(jnp.sin(x), "d"), mesh=mesh, in_specs=P("d"),
                                   out_specs=P("d")))
    xs = [jax.device_put(jnp.full((8 * 32, 32), i / 100.0), NamedSharding(mesh, P("d"))) for i in range(8)]
    want = [np.asarray(f(x) if i % 2 else g(x)) for i, x in enumerate(xs)]
    for _ in range(60):
        outs = [f(x) if i % 2 else g(x) for i, x in enumerate(xs)]
    for o, w in zip(outs, want):
        np.testing.assert_array_equal(np.asarray(o), w)
    np.testing.assert_allclose(np.asarray(outs[2])[0, 0], 8 * np.sin(0.02), rtol=1e-6)  # psum of 8 shards
    print("interleaved ok")
""")


def test_interleaved_collective_programs_finish_on_the_default_pool():
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}  # the default pool: one thread per device
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run([sys.executable, "-c", INTERLEAVE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interleaved ok" in proc.stdout


def test_serial_on_the_fake_cpu_mesh_and_outputs_ready():
    assert dispatch.serial_dispatch()  # conftest: 8 CPU devices
    mesh = jax.make_mesh((8,), ("d",))
    g = dispatch.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    out = g(jax.device_put(jnp.ones((8 * 16, 16)), NamedSharding(mesh, P("d"))))
    assert out.is_ready()  # the call returned only after the program finished
    assert float(np.asarray(out)[0, 0]) == 8.0


def test_wrapper_keeps_the_jitted_api():
    f = dispatch.jit(lambda x, n: x * n, static_argnames="n")
    assert float(f(jnp.float32(2.0), n=3)) == 6.0
    f(jnp.float32(5.0), n=3)
    assert f._cache_size() == 1  # same shapes and statics: no recompile through the wrapper
    assert "mul" in f.lower(jnp.float32(1.0), n=3).as_text()

    @dispatch.jit(static_argnames=("k",))
    def h(x, k):
        return x + k

    assert float(h(jnp.float32(1.0), k=2)) == 3.0


def test_wrapper_binds_self_as_a_method_decorator():
    class Scale:
        def __init__(self, k):
            self.k = k

        @dispatch.jit(static_argnums=0)
        def apply(self, x):
            return x * self.k

    assert float(Scale(3.0).apply(jnp.float32(2.0))) == 6.0
    assert isinstance(Scale.__dict__["apply"], dispatch.Jitted)


def test_cpu_scheduler_flag_is_added_once_and_a_users_choice_kept():
    """The CLI (and conftest) add XLA:CPU's scheduler flag (parallel/distributed.py CPU_SCHEDULER_FLAG) to the
    flags already given, once, and leave a value the user set alone."""
    from twocircuit_jax.parallel.distributed import CPU_SCHEDULER_FLAG, cpu_xla_flags

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cpu_xla_flags(env)
    cpu_xla_flags(env)
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {CPU_SCHEDULER_FLAG}"
    env = {}
    cpu_xla_flags(env)
    assert env["XLA_FLAGS"] == CPU_SCHEDULER_FLAG
    mine = {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"}
    cpu_xla_flags(mine)
    assert mine["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    # the test session runs under it (conftest), so every staged program of the suite does
    import os

    assert CPU_SCHEDULER_FLAG in os.environ["XLA_FLAGS"]


def _opts(jitted, *args):
    return dict(jitted.lower(*args)._lowering._compiler_options_kvs)  # what compile() will pass to XLA


def test_cpu_programs_compile_at_llvm_level_1_unless_xla_flags_choose(monkeypatch):
    """Top-level calls on the CPU backend compile at dispatch.CPU_OPT_LEVEL; a level in XLA_FLAGS (the suite's 0)
    or the caller's own compiler_options win, and other backends get nothing. The options are chosen at the first
    call, so the environment is set before the wrapper is used."""
    level = dispatch.OPT_LEVEL_FLAG
    assert dispatch.cpu_compiler_options("", "cpu") == {level: dispatch.CPU_OPT_LEVEL}
    assert dispatch.cpu_compiler_options(f"--foo=1 --{level}=3", "cpu") is None
    assert dispatch.cpu_compiler_options("", "gpu") is None and dispatch.cpu_compiler_options("", "tpu") is None

    x = jnp.arange(4.0)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    f = dispatch.jit(lambda v: jnp.sin(v) * 2)
    assert _opts(f, x) == {level: dispatch.CPU_OPT_LEVEL}
    np.testing.assert_allclose(np.asarray(f(x)), np.sin(np.arange(4.0)) * 2, rtol=1e-6)
    assert _opts(f.wrapped, x) == {}  # the export path: a plain jit
    mine = dispatch.jit(lambda v: v + 1, compiler_options={level: 2})
    assert _opts(mine, x) == {level: 2}
    # called while another function is traced, the wrapper takes the plain jit: jax refuses compile options there
    outer = jax.jit(lambda v: f(v) + 1)
    np.testing.assert_allclose(np.asarray(outer(x)), np.sin(np.arange(4.0)) * 2 + 1, rtol=1e-6)

    monkeypatch.setenv("XLA_FLAGS", f"--{level}=0")
    assert _opts(dispatch.jit(lambda v: v * 3), x) == {}
