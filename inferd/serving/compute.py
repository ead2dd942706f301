"""A replica's compute thread: the one thread its model code runs on.

Design rule: user model code never runs on an event loop. The loop of a replica (in a
shared process, the loop of all its neighbours and of their time budget's checks) only
moves bytes; everything that calls into the runtime — its load, warm-up rows,
``predict_batch``, a Python model's explanations, its unload — goes to this thread, so
a model that computes for long, blocks or hangs stalls its own requests only.

It is an :class:`~concurrent.futures.Executor` (``run_in_executor`` and
:func:`~inferd.serving.core.load_off_loop` take it) with one fast path for batches,
:meth:`ComputeThread.post`: a light model's batch (a tree ensemble: ~100 µs) costs about
what ``run_in_executor``'s machinery does (a concurrent future, the asyncio future
wrapping it, the task it wakes), so a batch is one ``SimpleQueue.put`` from the loop and
one ``call_soon_threadsafe`` back, its outputs handed to a callback on the loop.

In a shared process each compute thread also keeps a :class:`BusyMark`: when what it
runs now began, in a file the server reads should the process stop answering. A model
holding the interpreter lock in C code stops every thread of its process, so nothing
there can report it; what was written before it began says which replica it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Delivery = Callable[[Any, BaseException | None], None]
"""Receives, on the loop, a posted call's result (None on failure) and its error."""


@dataclass(slots=True)
class _Call:
    """A submitted call (the Executor interface): its outcome goes on ``future``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: Future[Any]

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)

    def cancel(self) -> None:
        self.future.cancel()


@dataclass(slots=True)
class _Posted:
    """A posted call: its outcome goes to ``deliver`` on ``loop``."""

    fn: Callable[[Any], Any]
    arg: Any
    loop: asyncio.AbstractEventLoop
    deliver: Delivery

    def run(self) -> None:
        try:
            result, error = self.fn(self.arg), None
        except BaseException as exc:  # a model calling sys.exit() fails its batch only
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self.loop.call_soon_threadsafe(self.deliver, result, error)

    def cancel(self) -> None:
        pass


_STARTED = struct.Struct("d")


class BusyMark:
    """When the call a compute thread runs now began (``time.monotonic()``, the same
    clock in every process of the machine; 0.0: it runs nothing), in an 8-byte file
    mapped in memory: a store per call, readable by another process at any time, even
    after this one was killed (:func:`busy_since`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _STARTED.size)
            self._map = mmap.mmap(fd, _STARTED.size)
        finally:
            os.close(fd)

    def set(self, started: float) -> None:
        _STARTED.pack_into(self._map, 0, started)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def busy_since(path: Path) -> float | None:
    """What a :class:`BusyMark` at ``path`` says: when its thread's call began (None:
    nothing runs, or no such mark)."""
    try:
        started = _STARTED.unpack(path.read_bytes()[: _STARTED.size])[0]
    except (OSError, struct.error):
        return None
    return started or None


class ComputeThread(Executor):
    """One long-lived daemon thread running what is submitted or posted, in order. A
    daemon: a call that never returns (a hung model, cut off by its time budget) must
    not keep its process from exiting. ``mark``: where it says when each call began."""

    def __init__(self, name: str = "predict", mark: BusyMark | None = None) -> None:
        self.name = name
        self.mark = mark
        self._jobs: queue.SimpleQueue[_Call | _Posted | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError(f"compute thread {self.name} is shut down")
        future: Future[T] = Future()
        self._jobs.put(_Call(fn, args, kwargs, future))
        return future

    def post(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any], arg: Any, deliver: Delivery
    ) -> None:
        """``fn(arg)`` on the thread, then ``deliver(result, error)`` on ``loop``; after
        :meth:`shutdown`, nothing (and ``deliver`` is never called)."""
        if not self._closed:
            self._jobs.put(_Posted(fn, arg, loop, deliver))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; ``cancel_futures``: drop the queued ones (the call running now,
        if any, cannot be stopped); ``wait``: until the thread ended."""
        if self._closed:
            return
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.cancel()
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _serve(self) -> None:
        mark = self.mark
        while (job := self._jobs.get()) is not None:
            if mark is None:
                job.run()
                continue
            mark.set(time.monotonic())
            job.run()
            mark.set(0.0)
