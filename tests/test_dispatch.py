"""parallel/dispatch.jit: on the 8-device CPU backend no two multi-device programs are ever in flight at once.

Two independent programs with all-reduces, dispatched back to back many times, deadlock XLA:CPU's shared device
pool with plain `jax.jit` (the process aborts after 40 s); through `dispatch.jit` they finish, with correct values.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from twocircuit_jax.parallel import dispatch


def _programs():
    mesh = jax.make_mesh((8,), ("d",))

    def heavy(x):
        for _ in range(4):
            x = jnp.tanh(x @ x.T @ x)
            x = jax.lax.psum(x, "d") / 8
        return x

    f = dispatch.jit(jax.shard_map(heavy, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    g = dispatch.jit(jax.shard_map(lambda x: jax.lax.psum(jnp.sin(x), "d"), mesh=mesh, in_specs=P("d"),
                                   out_specs=P("d")))
    return mesh, f, g


def test_serial_on_the_fake_cpu_mesh_and_outputs_ready():
    assert dispatch.serial_dispatch()  # conftest: 8 CPU devices
    mesh, f, g = _programs()
    x = jax.device_put(jnp.ones((8 * 16, 16)) * 0.01, NamedSharding(mesh, P("d")))
    out = g(x)
    assert out.is_ready()  # the call returned only after the program finished


def test_interleaved_collective_programs_finish_with_correct_values():
    mesh, f, g = _programs()
    sh = NamedSharding(mesh, P("d"))
    xs = [jax.device_put(jnp.full((8 * 16, 16), i / 100.0), sh) for i in range(6)]
    want = {i: np.asarray(f(x) if i % 2 else g(x)) for i, x in enumerate(xs)}
    for _ in range(40):  # with plain jax.jit this interleaving deadlocks within a few rounds here
        outs = [f(x) if i % 2 else g(x) for i, x in enumerate(xs)]
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(np.asarray(o), want[i])
    # g sums sin(x) over the 8 shards: every row equals 8 * sin(i / 100)
    np.testing.assert_allclose(np.asarray(outs[2])[0, 0], 8 * np.sin(0.02), rtol=1e-6)


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
