"""Bounding user code in time (`task.reward_timeout_s`, `env.step_timeout_s`): calls run in a forked worker process
that is killed when one call takes longer than the bound.

Why a process: a thread cannot be stopped (a hung reward function would keep its thread, and whatever it holds,
for the rest of the run), and `signal.alarm` works only on the main thread, while the rollouts of
`train.async_rollouts` are collected in a background thread. Why fork: the worker needs the task or the
environments exactly as the trainer holds them (functions loaded from a file, objects handed to `GRPOTrainer`,
their state), which fork copies without pickling them; only the results travel back, pickled. The worker runs
plain Python (the user's code) and never touches JAX, whose threads do not exist in it; the warning JAX and
CPython print about forking a threaded process is silenced for that reason.

Cost, only with a bound set (0 = none = the calls run in the trainer's process as before): one fork per batch of
calls (a step's scoring, a turn's environment steps), a few ms plus the page-table copy of the trainer's process;
the results pickled back; state the code keeps between calls (caches, counters) is made in the worker and lost with
it, except an environment's, which travels back with each step's result. After a timeout the worker is killed
(SIGKILL) and a fresh one continues with the next call.
"""

from __future__ import annotations

import multiprocessing
import warnings
from typing import Callable, Sequence

OK, ERROR, TIMEOUT = "ok", "error", "timeout"


class CallTimeout(TimeoutError):
    """A bounded call took longer than its bound; the worker running it was killed."""


def _worker(fn, items, conn) -> None:
    for i, item in enumerate(items):
        try:
            out = (OK, fn(item))
        except Exception as e:  # noqa: BLE001 - handed back to the caller, which decides
            out = (ERROR, e)
        try:
            conn.send((i, out))
        except Exception as e:  # noqa: BLE001 - an unpicklable result or exception
            conn.send((i, (ERROR, RuntimeError(f"the result could not be sent back from the worker: {e!r}"))))
    conn.close()


def bounded_map(fn: Callable, items: Sequence, timeout_s: float) -> list[tuple[str, object]]:
    """[(OK, fn(item)) | (ERROR, exception) | (TIMEOUT, CallTimeout)] per item, in order. Each call may take at
    most `timeout_s` seconds (counted from the end of the previous one); `timeout_s` <= 0 runs them here."""
    items = list(items)
    if timeout_s <= 0:
        out = []
        for item in items:
            try:
                out.append((OK, fn(item)))
            except Exception as e:  # noqa: BLE001
                out.append((ERROR, e))
        return out
    ctx = multiprocessing.get_context("fork")
    results: list = []
    while len(results) < len(items):
        start = len(results)
        recv, send = ctx.Pipe(duplex=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "os.fork() was called ... multithreaded": see the module docstring
            proc = ctx.Process(target=_worker, args=(fn, items[start:], send), daemon=True)
            proc.start()
        send.close()
        try:
            while len(results) < len(items):
                if not recv.poll(timeout_s):
                    results.append((TIMEOUT, CallTimeout(f"no result within {timeout_s:g} s; the call was stopped")))
                    break
                try:
                    _, out = recv.recv()
                except EOFError:  # the worker died inside a call (os._exit, a crash in native code)
                    results.append((ERROR, RuntimeError(f"the worker process died (exit code {proc.exitcode})")))
                    break
                results.append(out)
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join()
            recv.close()
    return results


def bounded_call(fn: Callable[[], object], timeout_s: float):
    """fn() with its time bounded: its value, its exception re-raised, or CallTimeout."""
    ((kind, value),) = bounded_map(lambda _: fn(), [None], timeout_s)
    if kind == OK:
        return value
    raise value
