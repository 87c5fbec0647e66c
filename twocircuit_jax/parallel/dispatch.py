"""`jit`: `jax.jit` that never leaves two multi-device programs in flight on XLA:CPU, and compiles there at LLVM level 1.

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

On a CPU backend the wrapper also compiles at LLVM optimisation level 1 (`xla_backend_optimization_level`; XLA's
default is 3). The HLO passes are the same; only the machine code LLVM emits for fused loops differs, while dots
and convolutions are library calls the level does not touch. On the peers' tiny GRPO setting
(scripts/bench_step.py), measured on the 2-core machine:
  - the model's forward+backward alone compiled in 1.2 s against 1.6-1.8 s, and ran in the same time (medians of
    15 calls: 0.095-0.100 s at both levels);
  - in the trainer, the train step compiled in 2.2 s against 2.5-2.6 s and generation in 1.1 s against 1.35-1.45 s;
    the first GRPO step took 4.5-4.6 s against 5.1 s.
A level set in XLA_FLAGS wins (the test suite's 0, or 3 for XLA's default); other backends are left alone. The
option applies to top-level calls only: a wrapped function called while another is traced runs through the plain
jit, because jax refuses compile options on a nested jit.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
from jax._src import core as _core

OPT_LEVEL_FLAG = "xla_backend_optimization_level"
CPU_OPT_LEVEL = 1


def cpu_compiler_options(xla_flags: str, backend: str) -> dict | None:
    """The compile options the wrapper adds: {OPT_LEVEL_FLAG: CPU_OPT_LEVEL} on a CPU backend whose XLA_FLAGS
    (`xla_flags`) do not set a level; None else."""
    if backend != "cpu" or f"--{OPT_LEVEL_FLAG}" in xla_flags:
        return None
    return {OPT_LEVEL_FLAG: CPU_OPT_LEVEL}


@functools.cache
def serial_dispatch() -> bool:
    """True where a multi-device program must finish before the next is dispatched (XLA:CPU, >1 device). The
    global count, so that processes of one CPU device each, whose programs meet at cross-process (gloo)
    rendezvous, are serialised too: not seen to hang here, but the same hazard, for a host sync per call."""
    return jax.default_backend() == "cpu" and jax.device_count() > 1


class Jitted:
    """A jitted function whose calls are serialised on multi-device XLA:CPU (see the module docstring)."""

    def __init__(self, fun: Callable, jit_kwargs: dict):
        self._jitted = jax.jit(fun, **jit_kwargs)
        self._fun, self._kwargs, self._top = fun, jit_kwargs, None
        functools.update_wrapper(self, self._jitted)

    def _top_level(self):
        """The jit that top-level calls go through: with the CPU compile options where they apply (decided at the
        first call, when the backend is known; a caller's own `compiler_options` are kept)."""
        if self._top is None:
            opts = None
            if "compiler_options" not in self._kwargs:
                opts = cpu_compiler_options(os.environ.get("XLA_FLAGS", ""), jax.default_backend())
            self._top = jax.jit(self._fun, **self._kwargs, compiler_options=opts) if opts else self._jitted
        return self._top

    def __call__(self, *args, **kwargs) -> Any:
        fn = self._top_level() if _core.trace_state_clean() else self._jitted
        out = fn(*args, **kwargs)
        if serial_dispatch():
            jax.block_until_ready(out)  # host sync, CPU backend only
        return out

    @property
    def wrapped(self):
        """The plain `jax.jit` object, without the CPU compile options (jax.export accepts nothing else)."""
        return self._jitted

    def __get__(self, obj, objtype=None):  # as a method decorator: bind `self` like a function would
        return self if obj is None else functools.partial(self.__call__, obj)

    def __getattr__(self, name: str):
        if name in ("_jitted", "_fun", "_kwargs", "_top"):  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self._top_level(), name)  # lower, trace, _cache_size, ...: what a top-level call compiles


def jit(fun: Callable | None = None, **jit_kwargs) -> Jitted | Callable[[Callable], Jitted]:
    """`jax.jit(fun, **jit_kwargs)`, serialised on multi-device XLA:CPU. Also usable as `@jit(static_argnames=...)`."""
    if fun is None:
        return lambda f: Jitted(f, jit_kwargs)
    return Jitted(fun, jit_kwargs)
