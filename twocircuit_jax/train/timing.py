"""Where a GRPO step's time goes: wall seconds per phase (`time/<phase>_s`) and the seconds JAX spent compiling
(`time/compile_s`, only on steps that compiled, with `time/compile_cache_hits` and `time/compile_cache_misses`: programs
loaded from and missing in the persistent compilation cache, train.compile_cache).

Phases are host wall time around calls that end in a host sync (the loop blocks on each phase's result before
the clock stops), so they add up to the step and do not hide device work in the next phase. Compile time comes
from JAX's own monitoring events (tracing, lowering and the backend compile); it overlaps the phase that
triggered the compile.
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax

# rollout_wait: train.async_rollouts' wait for the next step's rollouts before publishing (train/rollout_ahead.py)
PHASES = ("generate", "score", "logprob", "update", "anchor", "rollout_wait", "export", "eval", "checkpoint")
_COMPILE_EVENTS = "/jax/core/compile/"
_lock = threading.Lock()
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": 1, "/jax/compilation_cache/cache_misses": 2}
_compile = [0.0, 0, 0]  # seconds, cache hits, cache misses; process-wide: JAX's listeners are process-wide too
_listening = [False]


def _on_duration(event: str, duration: float, **_) -> None:
    if event.startswith(_COMPILE_EVENTS):
        with _lock:
            _compile[0] += float(duration)


def _on_event(event: str, **_) -> None:
    if event in _CACHE_EVENTS:
        with _lock:
            _compile[_CACHE_EVENTS[event]] += 1


def _compile_counts() -> tuple:
    with _lock:
        return tuple(_compile)


class PhaseTimer:
    """`with timer("update"): ...` adds the block's wall time to `time/update_s`; `take()` returns the step's
    `time/*` metrics and starts the next step from zero."""

    def __init__(self):
        with _lock:
            if not _listening[0]:
                jax.monitoring.register_event_duration_secs_listener(_on_duration)
                jax.monitoring.register_event_listener(_on_event)
                _listening[0] = True
        self._s: dict = {}
        self._compile0 = _compile_counts()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if phase not in PHASES:
            raise ValueError(f"timing phase {phase!r}; allowed: {', '.join(PHASES)}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._s[phase] = self._s.get(phase, 0.0) + time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        """Time measured elsewhere (the rollout engine's own clock)."""
        self._s[phase] = self._s.get(phase, 0.0) + float(seconds)

    def take(self) -> dict:
        out = {f"time/{p}_s": s for p, s in self._s.items()}
        now = _compile_counts()
        if now[0] > self._compile0[0]:
            out["time/compile_s"] = now[0] - self._compile0[0]
            out["time/compile_cache_hits"] = now[1] - self._compile0[1]
            out["time/compile_cache_misses"] = now[2] - self._compile0[2]
        self._s, self._compile0 = {}, now
        return out
