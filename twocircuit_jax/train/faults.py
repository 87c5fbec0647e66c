"""Crash safety primitives: durable writes (fsync) and fault-injection points for the crash tests.

Durability. A rename commits a file or a folder only once what it names is on disk: without an fsync, a power loss
or a kernel crash after the rename can leave the new name pointing at empty or partial files (ext4's delayed
allocation, XFS). `fsync_tree` flushes every file and folder under a path (one fsync each) before the caller renames
it; `fsync_dir` flushes the folder holding the new name after the rename, so the rename itself survives.

Fault injection. `point(name)` is called at the places a crash hurts most (inside checkpoint commits, best updates,
retention, metrics writes, the sampler's weight exports). With `TWOCIRCUIT_CHAOS_POINT=name:count` in the environment, the
process SIGKILLs itself the count-th time it reaches `name` (scripts/chaos.py, tests/test_chaos.py): a real kill at
a chosen instant, nothing cleaned up (`name:count:TERM` sends SIGTERM instead: tests/test_preemption.py). Unset (always, outside those tests), a point costs one comparison.
"""

from __future__ import annotations

import os
import signal

ENV = "TWOCIRCUIT_CHAOS_POINT"

# The named points, for scripts/chaos.py; `point()` accepts only these so a typo in a test cannot pass silently.
POINTS = (
    "ckpt/before_commit",  # state, meta and blobs written and fsynced, the COMMITTED marker not yet renamed in
    "ckpt/after_commit",  # the step folder renamed into place, retention not yet applied
    "ckpt/retention",  # between deleting old step folders
    "best/before_commit",
    "best/swapped_out",  # the old best moved aside, the new one not yet renamed in
    "metrics/before_line",  # a step's checkpoint committed, its metrics line not yet written
    "metrics/after_line",  # the step's line written: every write of the step done
    # the vLLM sampler's weight exports (sampler/export.py), reached once per published version
    "export/before_commit",  # a version's arrays and meta.json written in its .tmp-* folder, not yet renamed in
    "export/after_commit",  # the version renamed in and older ones pruned; the server not yet told to load it
)


def _parse(spec: str | None):
    if not spec:
        return None
    parts = spec.split(":")
    sig = parts.pop() if len(parts) == 3 else "KILL"
    ok = len(parts) == 2 and parts[0] in POINTS and parts[1].isdigit() and int(parts[1]) >= 1
    if not ok or sig not in ("KILL", "TERM", "INT"):
        raise ValueError(
            f"{ENV}={spec!r}: expected NAME:COUNT[:KILL|TERM|INT] with NAME one of {', '.join(POINTS)}, COUNT >= 1"
        )
    return parts[0], int(parts[1]), getattr(signal, f"SIG{sig}")


_TARGET = _parse(os.environ.get(ENV))
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """A fault-injection point: SIGKILL this process here when the environment asks for it (module doc); with
    `:TERM` or `:INT` after the count, that signal instead (a preemption at an exact instant)."""
    if _TARGET is None:
        return
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}")
    _seen[name] = _seen.get(name, 0) + 1
    if name == _TARGET[0] and _seen[name] == _TARGET[1]:
        os.kill(os.getpid(), _TARGET[2])


def fsync_path(path) -> None:
    """fsync one file or folder (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root) -> None:
    """fsync every file and folder under `root` (and `root`), deepest first: one fsync each."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        fsync_path(root)
        return
    for d, dirs, files in os.walk(root, topdown=False):
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                fsync_path(p)
        fsync_path(d)


def fsync_dir(path) -> None:
    """fsync the folder holding `path`, after a rename into it."""
    fsync_path(os.path.dirname(os.path.abspath(os.fspath(path))))


# ----- the run folder's lock ------------------------------------------------------------------------------------------
LOCK_FILE = "trainer.lock"
_held: dict[str, list] = {}  # real path -> [open file, holders in this process]


def _drop_held_in_child() -> None:
    """In a forked child (the scoring and environment workers of tasks/bounded.py): close this process's copies of
    the lock files, without unlocking. A flock belongs to the open file, which the fork shares; a worker that kept
    its copy would hold the folder after its trainer died (a SIGKILLed trainer's worker lives until it notices),
    and the resume started at once would be refused. Closing a copy leaves the trainer's hold as it was."""
    for fh, _ in _held.values():
        try:
            fh.close()  # the child's descriptor only; no LOCK_UN, which would release the trainer's hold too
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_drop_held_in_child)


def lock_run_folder(run_dir: str) -> str:
    """Hold `run_dir/trainer.lock` (fcntl.flock, exclusive) for this process: a second trainer on the folder, in
    another process, gets a ConfigError naming the folder and the holder's pid (the CLI's exit 2). The kernel drops
    the lock when the holder's process ends, however it ends (SIGKILL too), so a dead run never blocks its resume.
    Several trainers of one process on one folder share the hold (a test, a retry after an error). Returns the key
    `unlock_run_folder` takes."""
    import fcntl

    from twocircuit_jax.config.base import ConfigError

    key = os.path.realpath(run_dir)
    if key in _held:
        _held[key][1] += 1
        return key
    path = os.path.join(key, LOCK_FILE)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise ConfigError(
            "--out", f"{run_dir} is in use by another trainer (pid {holder}, holding {path}); wait for it or stop it"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    _held[key] = [fh, 1]
    return key


def unlock_run_folder(key: str) -> None:
    """One holder of this process lets go; the lock is released when the last one does."""
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[key]
        entry[0].close()  # closing the file releases the flock


# ----- preemption -----------------------------------------------------------------------------------------------------
class StopSignals:
    """SIGTERM and SIGINT set `requested` (the signal's name) instead of ending the process, so the loop can save a
    checkpoint at the next step boundary and exit 0. A second SIGINT raises KeyboardInterrupt as usual (a user who
    presses Ctrl-C twice wants out now). Installed only from the main thread (Python's rule); `restore()` puts the
    previous handlers back.

    `grace_s` > 0 (train.preempt_grace_s): the first signal also starts a watchdog thread. If the loop has not called
    `disarm()` (its boundary checkpoint written) within `grace_s` seconds, the watchdog saves nothing (a half-done
    step is no consistent state), prints where to resume (`last_checkpoint()`, the newest committed step) and ends
    the process with 143 (128 + SIGTERM): the preemptor sees a prompt exit instead of having to SIGKILL."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    EXPIRED_RC = 128 + signal.SIGTERM

    def __init__(self, grace_s: float = 0.0, last_checkpoint=None):
        import threading

        self.requested: str | None = None
        self.grace_s, self.last_checkpoint = float(grace_s), last_checkpoint
        self._watchdog = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = self.requested is None
        self.requested = signal.Signals(signum).name
        # os.write, not print: a handler that prints while the main thread is printing raises (reentrant call)
        os.write(2, f"twocircuit: {self.requested} received; stopping at the end of this step\n".encode())
        if first and self.grace_s > 0:
            import threading

            self._watchdog = threading.Timer(self.grace_s, self._expire)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _expire(self) -> None:
        try:
            step = self.last_checkpoint() if self.last_checkpoint is not None else None
        except Exception as e:  # the message must still go out: the exit is what the preemptor waits for
            step = f"unknown ({type(e).__name__}: {e})"
        where = "no checkpoint yet: a --resume starts again" if step is None else f"resume from checkpoint step {step}"
        os.write(
            2,
            f"twocircuit: grace period expired (train.preempt_grace_s={self.grace_s:g} s) before the step boundary; "
            f"nothing saved; {where}\n".encode(),
        )
        os._exit(self.EXPIRED_RC)  # no cleanup: the run folder's lock and the sampler server go with the process

    def disarm(self) -> None:
        """The boundary checkpoint is written: the watchdog (if any) has nothing left to guard."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def restore(self) -> None:
        self.disarm()
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def agreed(self) -> bool:
        """Whether a stop signal arrived here or at another process of the run: several processes agree first (one
        tiny all-gather a step, multi-process runs only), so a checkpoint is written by all of them or by none."""
        import jax

        asked = self.requested is not None
        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils

            if bool(np.any(multihost_utils.process_allgather(np.int32(asked)))) and not asked:
                self.requested, asked = "a signal to another process", True
        return asked
