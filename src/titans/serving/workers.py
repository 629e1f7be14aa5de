"""Model work in worker processes: each holds its own copy of the model and its own store connections, so
requests of different sessions run on separate cores (threads of one process share one interpreter lock,
and a small model's forward is mostly Python between short torch ops: on 2 threads it ran no faster than
on 1).

    pool = ProcessPool(2, build, payload)    # build(payload) -> the object whose methods the jobs call
    await pool.start()                       # every process started and built (warmed up), or an error
    result = await pool.call("read", sid, owner, text)  # target.read(sid, owner, text) in a process
    pool.close()

The caller decides what runs when (locks, fairness): `call` only hands a job to a free process, so at
most `n` jobs should be in flight. Arguments, results and exceptions cross as pickles; an exception
raised by the job is raised by `call`. A process that dies (killed, out of memory) fails the jobs it
held with `WorkerDied`, and the pool is rebuilt for the next job (not once `close` was called; `renew`
gives the new processes a new payload). The processes ignore SIGINT and SIGTERM (a signal to the whole
process group stops the server, which then finishes its jobs and closes the pool) and end with this one,
even when it is killed with SIGKILL (Linux: the parent-death signal).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

_TARGET: Any = None  # in a worker process: what `build` made


class WorkerDied(RuntimeError):
    """A worker process ended while it held a job (the job may or may not have been applied)."""


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a server killed with SIGKILL must not leave
    workers behind that still write to the store after a new server started)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


# glibc's mallopt parameters, and the values `reuse_freed_memory` sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest
TRIM_THRESHOLD = 128 << 20


def reuse_freed_memory() -> bool:
    """Linux (glibc): buffers up to 32 MiB come from the heap, and up to 128 MiB of freed heap is kept for
    the next request, instead of each large buffer being mapped fresh from the OS and unmapped when freed.
    A request of the server allocates and frees megabytes (a session's bytes, their parts, a state's
    tensors): by default every one of them is a new mapping whose pages fault in one by one (2,000-2,500
    page faults per read of the tiny model with 8 snapshots, a few ms of CPU). Returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(mapped) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


_BUILD: tuple[Callable[[Any], Any], Any] | None = None  # in a worker process: build and its payload


def _init(build: Callable[[Any], Any], payload: Any) -> None:
    global _BUILD
    _die_with_parent()
    # Ctrl-C, or a SIGTERM sent to the whole process group (systemd's default KillMode, a shell's job
    # control), stops the server, which finishes the requests in flight on its workers, then stops them
    # (or the parent-death signal does, if it is killed)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _BUILD = (build, payload)


def _target() -> Any:
    """What `build` makes, built on the first job (and again after a failed build: a store that was
    unreachable may be back). Building in a job rather than in the pool's initializer sends a failure back
    to the caller as the job's exception, where the server redacts and answers it; an initializer's
    failure would be printed as a traceback (store URL and all) and break the pool."""
    global _TARGET
    if _TARGET is None:
        build, payload = _BUILD
        _TARGET = build(payload)
    return _TARGET


def _run(name: str, args: tuple) -> Any:
    return getattr(_target(), name)(*args)


def _ready() -> int:
    """Build the target; this process's id. It takes a moment, so that `start`'s jobs at once spread over
    the processes rather than all going to the first one up."""
    _target()
    time.sleep(0.05)
    return os.getpid()


class ProcessPool:
    """`n` worker processes (spawned: a fresh interpreter each), each running build(payload) once at start;
    `build` and `payload` must pickle (a module-level function, plain data or picklable objects).
    `renew`: called for each set of processes (the first, and each one that replaces a pool a process of
    which died), its value their payload instead of `payload` (objects shared with them, such as locks,
    made new: a process killed while it held a lock never gives it back)."""

    def __init__(
        self,
        n: int,
        build: Callable[[Any], Any],
        payload: Any,
        *,
        renew: Callable[[], Any] | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"ProcessPool: n must be >= 1, got {n}")
        self.n, self._build, self._payload, self._renew = n, build, payload, renew
        self._lock = threading.Lock()
        self._closed = False
        self._executor = self._new()

    def _new(self) -> concurrent.futures.ProcessPoolExecutor:
        payload = self._renew() if self._renew is not None else self._payload
        return concurrent.futures.ProcessPoolExecutor(
            self.n,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init,
            initargs=(self._build, payload),
        )

    async def start(self) -> None:
        """Start every process and wait until each has built its target (and so ignores SIGINT / SIGTERM):
        rounds of n jobs at once until every process has run one (a process slow to start under load would
        otherwise leave its jobs to the others)."""
        seen: set[int] = set()
        while len(seen) < self.n:
            seen.update(await asyncio.gather(*(self._submit(_ready) for _ in range(self.n))))

    async def call(self, name: str, *args: Any) -> Any:
        """target.name(*args) in a free process."""
        return await self._submit(_run, name, args)

    async def _submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            executor = self._executor
        try:
            return await asyncio.wrap_future(executor.submit(fn, *args))
        except BrokenProcessPool as e:
            with self._lock:
                if self._executor is executor:  # the first job to see it ends the pool's other workers
                    # the executor ends them with SIGTERM, which they ignore (`_init`): SIGKILL instead
                    others = list((executor._processes or {}).values())
                    executor.shutdown(wait=False, cancel_futures=True)
                    for process in others:
                        process.kill()
                    if not self._closed:  # and rebuilds the pool, unless the server is shutting down
                        self._executor = self._new()
            raise WorkerDied("a worker process of the server ended while it served this request") from e

    def close(self) -> None:
        """Stop the pool for good: queued jobs are cancelled and the processes ended with SIGKILL. The
        server closes it once its graceful-shutdown time is over, when a job still running has been
        answered 503 (it may or may not be applied); left to finish, it kept the command alive, and wrote
        to the store, for as long as it ran."""
        with self._lock:
            self._closed = True
            running = list((self._executor._processes or {}).values())
            self._executor.shutdown(wait=False, cancel_futures=True)
        for process in running:
            process.kill()


__all__ = ["ProcessPool", "WorkerDied", "reuse_freed_memory"]
