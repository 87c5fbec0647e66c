"""Bounding user code in time (`task.reward_timeout_s`, `env.step_timeout_s`): calls run in a long-lived worker
process, which is killed when one call takes longer than the bound.

Why a process: a thread cannot be stopped (a hung reward function would keep its thread, and whatever it holds,
for the rest of the run), and `signal.alarm` works only on the main thread, while rollouts may be collected in a
background thread. Why fork: the worker needs the code exactly as the trainer holds it (functions loaded from a
file, objects handed to `GRPOTrainer`, their state), which fork copies without pickling it.

One worker per target (a task's scoring, a python task's reward functions, an environment family's steps): forked
lazily on the first bounded call, it then serves every later call of that target over a pipe. The arguments go
there pickled and the results come back pickled; both are the project's own objects (rows, completions,
environments, scores) and nothing read from disk is ever unpickled. A call past its bound gets the worker killed
(SIGKILL to its process group, so a subprocess the user code started goes too) and reaped; a worker that died
(os._exit, a crash in native code) is reaped too, that call failing; the next call forks a fresh one. A worker
killed between calls (a signal from outside: `pkill -f` matches the fork's command line, which is the trainer's)
fails nothing: the batch runs again on a fresh worker. Workers are closed (reaped, no
zombie) at exit, with `close_all()`, or when their owner object is collected; an orphaned worker (the trainer
killed) exits within a second. Its own process group also keeps a terminal's Ctrl-C, meant for the trainer, away.

JAX: the worker runs the user's plain Python and pickle, never JAX; JAX's threads do not exist in it (fork copies
only the calling thread), so the warning about forking a threaded process is silenced. Arguments and results must
not hold JAX arrays (unpickling one would start JAX in the worker).

State: the worker lives across calls, so what user code keeps at module level or in its objects (caches, counters,
a loaded model) persists from call to call inside the worker (never seen by the trainer's process), and starts
afresh from the fork-time copy after a timeout. Likewise the task and its reward functions are used as they were at
the fork: a change made to them in the trainer afterwards is not seen by the worker, except through the task's
`begin_step(gs)` hook, after which the trainer forks the task's workers again (`refresh`). Environments are the exception:
each travels to the worker with its call and back with the result, so its state stays the trainer's.

Memory: the fork shares the trainer's pages copy-on-write, and the worker keeps the fork-time copy of each page the
trainer later rewrites, so its own memory grows towards the trainer's host RSS at the fork (not beyond; a re-fork
after a timeout starts again from the trainer as it is then). On the demo: 181 MB private after ~10 steps of a
900 MB trainer. Accelerator memory is not involved.

Cost per bounded batch of calls: the arguments pickled in one message, the results pickled in one message per
FLUSH_S of work, no fork (a fork of the trainer, a few ms plus its page tables, happens once per target and after
each timeout). The trainer bounds each call by its start time, which the worker writes to shared memory, not by a
message per call. After a timeout, calls whose results were not sent yet (at most FLUSH_S of work) run again.
Measured on the demo (256 rows of chain_sum a step, 2-core machine): +0.9 ms of the trainer's CPU and 1.5 ms of the
worker's per step's scoring (<1% of a ~0.39 CPU-s step; fork per call, before, cost ~33 ms a step); an environment
call costs ~45 us of the trainer's CPU (the environment pickled both ways).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.util  # noqa: F401 - its exit hook registered before ours, so ours runs first
import os
import pickle
import signal
import threading
import time
import traceback
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Optional, Sequence

OK, ERROR, TIMEOUT = "ok", "error", "timeout"


class CallTimeout(TimeoutError):
    """A bounded call took longer than its bound; the worker running it was killed."""


_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()  # for close_all and for closing other workers' pipes in a fork
_LIVE_LOCK = threading.Lock()


def _watch_parent(ppid: int) -> None:
    while True:  # the trainer died (even by SIGKILL, mid-call): go too, rather than hang on as an orphan
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(0)


FLUSH_S = 0.02  # the worker sends its results at most this often (and at the end of a batch)


def _send(conn, results: list) -> None:
    """Sends a list of (kind, value) in one message; an unpicklable entry becomes an error (pickling comes before
    any writing, so a failed send leaves the pipe clean)."""
    try:
        conn.send(results)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError):
        conn.send([_sendable(r) for r in results])


def _sendable(r):
    try:
        ForkingPickler.dumps(r)
        return r
    except Exception as e:  # noqa: BLE001 - an unpicklable result or exception
        return (ERROR, RuntimeError(f"the result could not be sent back from the worker: {e!r}"))


def _portable(e: Exception) -> Exception:
    """The exception itself if it survives pickling both ways (an exception class with its own __init__ arguments
    may not rebuild from its args), else a RuntimeError with its text, so the chunk it travels in arrives."""
    try:
        pickle.loads(ForkingPickler.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}\n" + "\n".join(getattr(e, "__notes__", [])))


def _serve(target, conn, ppid: int, inherited, progress) -> None:
    """The worker: per message (a list of arguments) the (kind, value) of each, sent back in chunks. Before
    each call it writes (position in the batch, start time) to `progress`, shared memory the trainer reads to bound
    the call without a message per call (one message per call cost ~60 us of wake-ups per row, 15 ms a demo step)."""
    os.setpgrp()
    # The trainer's handlers came with the fork: a SIGTERM or SIGINT here would run the trainer's preemption logic
    # (its messages, its grace watchdog, its exit 143) inside the worker. The worker ends as a plain process does.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    for c in inherited:  # the trainer's ends of the other workers' pipes: held here, they would hide its exit
        try:
            c.close()
        except OSError:
            pass
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    while True:
        try:
            blobs = conn.recv()
        except EOFError:
            return
        if blobs is None:
            return
        done, sent = [], time.monotonic()
        for pos, item in enumerate(blobs):
            progress[1] = time.monotonic()  # the start first, then the position: see Worker._progress
            progress[0] = pos
            try:
                out = (OK, target(item))
            except Exception as e:  # noqa: BLE001 - handed back to the caller, which decides
                e.add_note("in the bounded worker process:\n" + "".join(traceback.format_exception(e)).rstrip())
                out = (ERROR, _portable(e))
            done.append(out)
            if pos == len(blobs) - 1 or time.monotonic() - sent > FLUSH_S:
                _send(conn, done)
                done, sent = [], time.monotonic()


class Worker:
    """A long-lived worker serving `target(item)` calls, each bounded in time (see the module docstring)."""

    def __init__(self, target: Callable[[object], object], name: str = "bounded"):
        self._target, self.name = target, name
        self._proc = self._conn = self._shared = None
        self._spare_restarts = 0  # per map: re-runs allowed after the worker died between calls
        self._lock = threading.Lock()  # one batch at a time (scoring may run in the rollout thread and in eval)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._finalizer = weakref.finalize(self, _stop_proc, self.__dict__)  # collected: reap its process

    @property
    def pid(self) -> Optional[int]:
        """The live worker's process id; None before the first call and after a timeout or close."""
        p = self._proc
        return p.pid if p is not None and p.is_alive() else None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("fork")
        mine, theirs = ctx.Pipe(duplex=True)
        progress = ctx.RawArray("d", 2)  # shared with the fork: (position of the call running, its start time)
        progress[0] = -1
        with _LIVE_LOCK:
            others = [w._conn for w in list(_LIVE) if w is not self and w._conn is not None]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "os.fork() was called ... multithreaded": see the module docstring
            proc = ctx.Process(
                target=_serve,
                args=(self._target, theirs, os.getpid(), others + [mine], progress),
                daemon=True,
                name=self.name,
            )
            proc.start()
        theirs.close()
        self._proc, self._conn, self._shared = proc, mine, progress

    def _progress(self) -> tuple[int, float]:
        """(position of the call the worker runs, its start time): read position, time, position again, so that a
        pair torn by the worker starting the next call is read again."""
        while True:
            pos, t = self._shared[0], self._shared[1]
            if self._shared[0] == pos:
                return int(pos), t

    def map(self, items: Sequence, timeout_s: float) -> list[tuple[str, object]]:
        """[(OK, target(item)) | (ERROR, exception) | (TIMEOUT, CallTimeout)] per item, in order; each call may take
        at most `timeout_s` seconds (> 0), counted from its start in the worker."""
        if not timeout_s > 0:
            raise ValueError(f"{self.name}: the bound must be > 0 s, got {timeout_s}")
        items = list(items)
        out: list = [None] * len(items)
        todo = list(enumerate(items))  # (index, argument)
        try:  # the whole batch pickled once (what `send` would write); per item only to find what cannot be sent
            msg = ForkingPickler.dumps(items)
        except Exception:  # noqa: BLE001
            msg, todo = None, []
            for i, item in enumerate(items):
                try:
                    ForkingPickler.dumps(item)
                    todo.append((i, item))
                except Exception as e:  # noqa: BLE001
                    out[i] = (ERROR, TypeError(f"{self.name}: an argument could not be sent to the worker: {e!r}"))
        with self._lock:
            self._spare_restarts = 1  # see _collect: a death between calls re-runs the batch once, failing nothing
            while todo:
                if self._proc is None or not self._proc.is_alive():
                    _stop_proc(self.__dict__)  # reap a worker that died while idle
                    self._start()
                if msg is None:  # a part of the batch: after a timeout, or without its unpicklable arguments
                    msg = ForkingPickler.dumps([x for _, x in todo])
                self._shared[0] = -1  # no call of this batch has started (the last batch's position is stale)
                try:
                    self._conn.send_bytes(msg)
                except OSError:  # it died between the check and the send: once more on a fresh one
                    _stop_proc(self.__dict__)
                    self._start()
                    self._conn.send_bytes(msg)
                todo, msg = self._collect(todo, out, timeout_s), None
        return out

    def _collect(self, todo, out, timeout_s):
        """Reads the results of `todo` into `out`; after a timeout or a dead worker, returns what is left to run
        again: the calls after the stopped one, and those before it whose results had not been sent yet (re-run from
        the same arguments: a scorer scores them again, an environment steps again from its state before)."""
        got = 0
        while got < len(todo):
            pos, started = self._progress()
            if not got <= pos < len(todo):  # the worker has not marked the next call yet: look again shortly
                pos, started = -1, time.monotonic()
            wait = started + timeout_s - time.monotonic()
            if pos >= 0 and wait <= 0:
                out[todo[pos][0]] = (TIMEOUT, CallTimeout(f"no result within {timeout_s:g} s; the call was stopped"))
                _stop_proc(self.__dict__, graceful=False)
                return todo[got:pos] + todo[pos + 1 :]
            if not self._conn.poll(wait if pos >= 0 else min(wait, 0.01)):
                continue
            try:
                chunk = self._conn.recv()
            except (EOFError, OSError):  # the worker died (ConnectionResetError: with part of the batch unread)
                pos = self._progress()[0]
                code = _stop_proc(self.__dict__, graceful=False)
                if pos < got and self._spare_restarts > 0:
                    # Between calls (a signal from outside, e.g. `pkill -f` matching the trainer's command line,
                    # which the fork shares): no call of this batch failed, so all that is left runs again on a
                    # fresh worker. Once per batch, so a worker that cannot start does not loop forever.
                    self._spare_restarts -= 1
                    return todo[got:]
                pos = max(pos, got)  # inside a call (os._exit, a crash in native code): that call fails
                out[todo[pos][0]] = (ERROR, RuntimeError(f"the worker process died (exit code {code})"))
                return todo[got:pos] + todo[pos + 1 :]
            for r in chunk:
                out[todo[got][0]] = r
                got += 1
        return []

    def call(self, item, timeout_s: float):
        """target(item) with its time bounded: its value, its exception re-raised, or CallTimeout."""
        ((kind, value),) = self.map([item], timeout_s)
        if kind == OK:
            return value
        raise value

    def close(self) -> None:
        """Ends the worker (it exits on its own; killed if busy) and reaps it. A later call forks a new one."""
        got = self._lock.acquire(timeout=1.0)  # a call hung in another thread: kill it anyway
        try:
            _stop_proc(self.__dict__)
        finally:
            if got:
                self._lock.release()


def _stop_proc(state: dict, graceful: bool = True) -> Optional[int]:
    """Stops and reaps the process of a Worker (its __dict__, so a finalizer holds no reference to the Worker)."""
    proc, conn = state.get("_proc"), state.get("_conn")
    state["_proc"] = state["_conn"] = None
    if proc is None:
        return None
    if graceful and proc.is_alive():
        try:
            conn.send(None)
            proc.join(2.0)
        except OSError:
            pass
    if proc.is_alive():
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # with whatever the user code started
        except OSError:  # not yet its own group (killed right after the fork) or gone already
            pass
        proc.kill()
    proc.join()
    if conn is not None:
        conn.close()
    return proc.exitcode


def close_all() -> None:
    """Closes every worker (at exit; tests)."""
    with _LIVE_LOCK:
        workers = list(_LIVE)
    for w in workers:
        w.close()


atexit.register(close_all)  # after multiprocessing's exit hook (imported above), so it runs first: our workers
# are reaped by us (with their process groups), not just sent SIGTERM by it

_OWNED: dict = {}  # (id(owner), key) -> (weak or strong reference to the owner, Worker)
_OWNED_LOCK = threading.Lock()


def _deref(ref):
    return ref() if isinstance(ref, weakref.ref) else ref


def _call_owned(ref, target, item):
    return target(_deref(ref), item)


def _forget(k, w) -> None:
    with _OWNED_LOCK:
        if k in _OWNED and _OWNED[k][1] is w:
            del _OWNED[k]
    w.close()


def worker_for(owner, key: str, target: Callable[[object, object], object]) -> Worker:
    """The worker serving `target(owner, item)` calls for `owner` (a task, an environment family), made on first
    use and closed when the owner is collected. The worker holds the owner weakly here (in its fork the owner is
    alive: the forking call holds it), so a run's or a test's tasks are not kept alive by their workers."""
    k = (id(owner), key)
    with _OWNED_LOCK:
        got = _OWNED.get(k)
        if got is not None and _deref(got[0]) is owner:
            return got[1]
        stale = got[1] if got is not None else None  # an earlier owner with the same id, collected
        try:
            ref = weakref.ref(owner)
        except TypeError:  # not weak-referenceable: held until exit
            ref = owner
        w = Worker(functools.partial(_call_owned, ref, target), name=f"bounded-{key}")
        _OWNED[k] = (ref, w)
        if isinstance(ref, weakref.ref):
            weakref.finalize(owner, _forget, k, w)
    if stale is not None:
        stale.close()
    return w


def refresh(owner) -> None:
    """Close the workers serving `owner`, so that its next bounded call forks a worker from the owner as it is now.
    For state the trainer changes between calls through the owner's own hooks (a task's `begin_step(gs)`: a
    curriculum, a reward that depends on the step), which a worker forked earlier would not see. Costs one fork
    (a few ms) per refresh; owners without such hooks keep their worker for the whole run."""
    with _OWNED_LOCK:
        gone = [(k, v[1]) for k, v in _OWNED.items() if k[0] == id(owner) and _deref(v[0]) is owner]
        for k, _ in gone:
            del _OWNED[k]
    for _, w in gone:
        w.close()
