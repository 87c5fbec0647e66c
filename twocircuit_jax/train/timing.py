"""Where a GRPO step's time goes: wall seconds per phase (`time/<phase>_s`) and the seconds JAX spent compiling
(`time/compile_s`, only on steps that compiled).

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

PHASES = ("generate", "score", "logprob", "update", "anchor", "export", "eval", "checkpoint")
_COMPILE_EVENTS = "/jax/core/compile/"
_lock = threading.Lock()
_compile_s = [0.0]  # process-wide: JAX's listeners are process-wide too
_listening = [False]


def _on_duration(event: str, duration: float, **_) -> None:
    if event.startswith(_COMPILE_EVENTS):
        with _lock:
            _compile_s[0] += float(duration)


def compile_seconds() -> float:
    """Seconds JAX has spent compiling in this process since the first `PhaseTimer` was made."""
    with _lock:
        return _compile_s[0]


class PhaseTimer:
    """`with timer("update"): ...` adds the block's wall time to `time/update_s`; `take()` returns the step's
    `time/*` metrics and starts the next step from zero."""

    def __init__(self):
        with _lock:
            if not _listening[0]:
                jax.monitoring.register_event_duration_secs_listener(_on_duration)
                _listening[0] = True
        self._s: dict = {}
        self._compile0 = compile_seconds()

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
        now = compile_seconds()
        if now > self._compile0:
            out["time/compile_s"] = now - self._compile0
        self._s, self._compile0 = {}, now
        return out
