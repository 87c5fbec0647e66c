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
(os._exit, a crash in native code) is reaped too; the next call forks a fresh one. Workers are closed (reaped, no
zombie) at exit, with `close_all()`, or when their owner object is collected; an orphaned worker (the trainer
killed) exits within a second. Its own process group also keeps a terminal's Ctrl-C, meant for the trainer, away.

JAX: the worker runs the user's plain Python and pickle, never JAX; JAX's threads do not exist in it (fork copies
only the calling thread), so the warning about forking a threaded process is silenced. Arguments and results must
not hold JAX arrays (unpickling one would start JAX in the worker).

State: the worker lives across calls, so what user code keeps at module level or in its objects (caches, counters,
a loaded model) persists from call to call inside the worker (never seen by the trainer's process), and starts
afresh from the fork-time copy after a timeout. Environments are the exception: each travels to the worker with its
call and back with the result, so its state stays the trainer's.

Cost per bounded batch of calls: one message each way per call (pickled arguments and result), no fork (a fork of
the trainer, a few ms plus its page tables, happens once per target and after each timeout).
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


def _watch_parent(ppid: int) -> None:
    while True:  # the trainer died (even by SIGKILL, mid-call): go too, rather than hang on as an orphan
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(0)


def _serve(target, conn, ppid: int, inherited) -> None:
    """The worker: per message (a list of pickled arguments) one (kind, value) message back per argument."""
    os.setpgrp()
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
        for blob in blobs:
            try:
                out = (OK, target(pickle.loads(blob)))
            except Exception as e:  # noqa: BLE001 - handed back to the caller, which decides
                e.add_note("in the bounded worker process:\n" + "".join(traceback.format_exception(e)).rstrip())
                out = (ERROR, e)
            try:
                conn.send(out)
            except Exception as e:  # noqa: BLE001 - an unpicklable result or exception
                conn.send((ERROR, RuntimeError(f"the result could not be sent back from the worker: {e!r}")))


class Worker:
    """A long-lived worker serving `target(item)` calls, each bounded in time (see the module docstring)."""

    def __init__(self, target: Callable[[object], object], name: str = "bounded"):
        self._target, self.name = target, name
        self._proc = self._conn = None
        self._lock = threading.Lock()  # one batch at a time (scoring may run in the rollout thread and in eval)
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
        others = [w._conn for w in list(_LIVE) if w is not self and w._conn is not None]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "os.fork() was called ... multithreaded": see the module docstring
            proc = ctx.Process(
                target=_serve, args=(self._target, theirs, os.getpid(), others + [mine]), daemon=True, name=self.name
            )
            proc.start()
        theirs.close()
        self._proc, self._conn = proc, mine

    def map(self, items: Sequence, timeout_s: float) -> list[tuple[str, object]]:
        """[(OK, target(item)) | (ERROR, exception) | (TIMEOUT, CallTimeout)] per item, in order; each call may take
        at most `timeout_s` seconds (> 0), counted from the end of the previous one."""
        if not timeout_s > 0:
            raise ValueError(f"{self.name}: the bound must be > 0 s, got {timeout_s}")
        items = list(items)
        out: list = [None] * len(items)
        todo = []  # (index, pickled argument): pickled here, so an unpicklable one fails alone, before any sending
        for i, item in enumerate(items):
            try:
                todo.append((i, bytes(ForkingPickler.dumps(item))))
            except Exception as e:  # noqa: BLE001
                out[i] = (ERROR, TypeError(f"{self.name}: an argument could not be sent to the worker: {e!r}"))
        with self._lock:
            while todo:
                if self._proc is None or not self._proc.is_alive():
                    _stop_proc(self.__dict__)  # reap a worker that died while idle
                    self._start()
                try:
                    self._conn.send([b for _, b in todo])
                except OSError:  # it died between the check and the send: once more on a fresh one
                    _stop_proc(self.__dict__)
                    self._start()
                    self._conn.send([b for _, b in todo])
                todo = self._collect(todo, out, timeout_s)
        return out

    def _collect(self, todo, out, timeout_s):
        """Reads the results of `todo` into `out`; returns what is left after a timeout or a dead worker."""
        for k, (i, _) in enumerate(todo):
            if not self._conn.poll(timeout_s):
                out[i] = (TIMEOUT, CallTimeout(f"no result within {timeout_s:g} s; the call was stopped"))
                _stop_proc(self.__dict__, graceful=False)
                return todo[k + 1 :]
            try:
                out[i] = self._conn.recv()
            except EOFError:  # the worker died inside the call (os._exit, a crash in native code)
                code = _stop_proc(self.__dict__, graceful=False)
                out[i] = (ERROR, RuntimeError(f"the worker process died (exit code {code})"))
                return todo[k + 1 :]
            except Exception as e:  # noqa: BLE001 - a result that cannot be rebuilt here (odd exception class)
                out[i] = (ERROR, RuntimeError(f"the result of the worker could not be read: {e!r}"))
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
    for w in list(_LIVE):
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


def _apply(fn, item):
    return fn(item)


def bounded_map(fn: Callable, items: Sequence, timeout_s: float) -> list[tuple[str, object]]:
    """[(OK, fn(item)) | (ERROR, exception) | (TIMEOUT, CallTimeout)] per item, in order, in `fn`'s worker (one per
    function object: pass the same function to reuse it). `timeout_s` <= 0 runs the calls here."""
    items = list(items)
    if timeout_s > 0:
        return worker_for(fn, "map", _apply).map(items, timeout_s)
    out = []
    for item in items:
        try:
            out.append((OK, fn(item)))
        except Exception as e:  # noqa: BLE001
            out.append((ERROR, e))
    return out
