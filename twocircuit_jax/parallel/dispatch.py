"""`jit`: `jax.jit` that never leaves two multi-device programs in flight on XLA:CPU.

Why: XLA:CPU runs the per-device parts of every program on one shared thread pool with exactly as many threads as
devices. Two programs with collectives in flight at once (async dispatch of independent calls: the old- and
reference-log-prob forwards, the probe, the anchor fire) can each hold part of the pool while waiting at a
rendezvous for devices whose threads the other program holds. Nothing progresses; after 40 s XLA aborts the process
("Expected 8 threads to join the rendezvous, but only 6 of them arrived"). On 8 simulated devices two interleaved
`psum` programs reach this within a few dozen calls. GPUs and TPUs run each device's programs in order on its own
stream and do not have this.

So on a CPU backend with more than one device, each call waits for its outputs before returning (a host sync per
call; there the host and the "devices" share the same cores, so little overlap is lost). Elsewhere the wrapper adds
nothing to the call and dispatch stays asynchronous. Every attribute of the underlying jitted function (`lower`,
`trace`, `_cache_size`, ...) is reachable through the wrapper.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax


@functools.cache
def serial_dispatch() -> bool:
    """True where a multi-device program must finish before the next is dispatched (XLA:CPU, >1 device). The
    global count, so that processes of one CPU device each, whose programs meet at cross-process (gloo)
    rendezvous, are serialised too: not seen to hang here, but the same hazard, for a host sync per call."""
    return jax.default_backend() == "cpu" and jax.device_count() > 1


class Jitted:
    """A jitted function whose calls are serialised on multi-device XLA:CPU (see the module docstring)."""

    def __init__(self, jitted: Callable):
        self._jitted = jitted
        functools.update_wrapper(self, jitted)

    def __call__(self, *args, **kwargs) -> Any:
        out = self._jitted(*args, **kwargs)
        if serial_dispatch():
            jax.block_until_ready(out)  # host sync, CPU backend only
        return out

    @property
    def wrapped(self):
        """The plain `jax.jit` object (jax.export accepts nothing else)."""
        return self._jitted

    def __get__(self, obj, objtype=None):  # as a method decorator: bind `self` like a function would
        return self if obj is None else functools.partial(self.__call__, obj)

    def __getattr__(self, name: str):
        if name == "_jitted":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self._jitted, name)


def jit(fun: Callable | None = None, **jit_kwargs) -> Jitted | Callable[[Callable], Jitted]:
    """`jax.jit(fun, **jit_kwargs)`, serialised on multi-device XLA:CPU. Also usable as `@jit(static_argnames=...)`."""
    if fun is None:
        return lambda f: Jitted(jax.jit(f, **jit_kwargs))
    return Jitted(jax.jit(fun, **jit_kwargs))
