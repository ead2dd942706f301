"""A shared replica process: many small versions in one OS process, each served as a
replica of its own (its own core, batcher, executor thread, socket and status), so
gateways, routing, deployments and ``/metrics`` see them exactly as separate replicas.

    python -m inferd.serving.host FD GRACE_S BUDGET_S [LOG_LEVEL]

The server's shared backend (:mod:`inferd.control.backends.shared`) holds the other end
of a socket pair (``FD``) and sends length-prefixed msgpack frames:

- :class:`Start`: serve this replica spec (listen at once, fetch, load and warm up in the
  background, as :func:`~inferd.serving.replica_server.serve` does in a process of its own);
- :class:`Stop`: drain it (or, without ``drain``, stop it at once).

The host answers :class:`Gone` when a replica ended (its exit code, or why it was cut
off), sends a :class:`Beat` every ``WATCH_EVERY_S``, and exits when the server's end
closes. Isolation between neighbours: each replica computes on its own thread, and no
model code runs on the event loop they share (:mod:`inferd.serving.compute`), so one's
slow or hung batch does not stall another's; an exception is its own requests' (the
batcher's rule); a batch running past ``budget_s`` (``models.predict_budget_s``) cuts
its replica off (:data:`CUT_OFF`): its requests fail, its thread is left behind, and the
backend starts it again in a process of its own. The budget is kept by a thread
(:class:`Watchdog`), not a task of the loop it protects. Where the loop itself stops
(a model holding the interpreter lock in C code stops every thread), the beats stop,
and the server kills the process (``SILENT_GRACE_S`` in
:mod:`inferd.control.backends.shared`). A model that crashes the whole process takes
its neighbours' replicas with it; they are restarted, and the backend moves a version
present at two such crashes to a process of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from inferd.errors import ModelError
from inferd.process import die_with_parent
from inferd.serving.core import Core
from inferd.shapes.replica import HEADER
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)

CUT_OFF = 75
"""The code a replica ends with when its batch ran past its time budget."""
WATCH_EVERY_S = 0.25
"""How often the watchdog looks at the hosted replicas' batches, and the host beats: a
hung batch fails at most this long after its budget."""


class Start(msgspec.Struct, tag="start", array_like=True):
    spec: str
    """The replica's spec as JSON."""


class Stop(msgspec.Struct, tag="stop", array_like=True):
    replica_id: str
    drain: bool = True


class Gone(msgspec.Struct, tag="gone", array_like=True):
    replica_id: str
    code: int
    reason: str


class Beat(msgspec.Struct, tag="beat", array_like=True):
    """The host's event loop runs (sent from it, every ``WATCH_EVERY_S``)."""


Frame = Start | Stop | Gone | Beat
_decoder = msgspec.msgpack.Decoder(Frame)
_encoder = msgspec.msgpack.Encoder()


def encode(frame: Frame) -> bytes:
    """Framed as every other inferd frame (:data:`~inferd.shapes.replica.HEADER`)."""
    body = _encoder.encode(frame)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Frame | None:
    """The next frame, or None at the end of the stream."""
    try:
        head = await reader.readexactly(HEADER.size)
        return _decoder.decode(await reader.readexactly(HEADER.unpack(head)[0]))
    except asyncio.IncompleteReadError:
        return None


class Hosted:
    """One replica served by this host."""

    def __init__(self, spec: ReplicaSpec, grace_s: float, loading: asyncio.Lock) -> None:
        from inferd.serving.replica_server import serve

        self.spec = spec
        self.drain = asyncio.Event()
        self.kill = asyncio.Event()
        self.core: Core | None = None
        self.cut_off = ""
        self.cutting = False
        """The watchdog asked the loop to cut it off."""
        self.task = asyncio.get_running_loop().create_task(
            serve(spec, self.drain, grace_s, self.kill, on_core=self._got, loading=loading)
        )

    def _got(self, core: Core) -> None:
        self.core = core

    def busy_since(self) -> float | None:
        """When its running batch started (``time.monotonic()``; None: none runs)."""
        batcher = getattr(self.core, "batcher", None)
        return getattr(batcher, "busy_since", None)

    def overdue(self, budget_s: float, now: float) -> float:
        """Seconds its running batch is past ``budget_s`` (0: none is)."""
        started = self.busy_since()
        if started is None:
            return 0.0
        return max(0.0, now - started - budget_s)


async def run_host(fd: int, grace_s: float, budget_s: float) -> None:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_connection(sock=sock)
    hosted: dict[str, Hosted] = {}
    loading = asyncio.Lock()  # one load at a time: each measures its own memory

    def ended(replica: Hosted, task: asyncio.Task[int]) -> None:
        hosted.pop(replica.spec.replica_id, None)
        if replica.cut_off:
            code, reason = CUT_OFF, replica.cut_off
        elif task.cancelled():
            code, reason = 1, "cancelled"
        elif (exc := task.exception()) is not None:
            code, reason = 1, f"failed: {type(exc).__name__}: {exc}"
        else:
            code, reason = task.result(), f"exited with code {task.result()}"
        if not writer.is_closing():
            writer.write(encode(Gone(replica.spec.replica_id, code, reason)))

    def beat() -> None:
        if not writer.is_closing():
            writer.write(encode(Beat()))

    watchdog = Watchdog(asyncio.get_running_loop(), hosted, budget_s, beat)
    try:
        while (frame := await read_frame(reader)) is not None:
            if isinstance(frame, Start):
                spec = ReplicaSpec.from_json(frame.spec)
                started = Hosted(spec, grace_s, loading)
                hosted[spec.replica_id] = started
                started.task.add_done_callback(functools.partial(ended, started))
                logger.info("hosting %s (%s:%s)", spec.replica_id, spec.model, spec.version)
            elif isinstance(frame, Stop) and (stopping := hosted.get(frame.replica_id)):
                if not frame.drain:
                    stopping.kill.set()
                stopping.drain.set()
    finally:
        watchdog.stop()
        writer.close()


class Watchdog:
    """The time budget, kept from a daemon thread of its own, so that it never waits for
    the loop it protects to be free: every ``WATCH_EVERY_S`` it reads each hosted
    replica's ``busy_since`` and, for a batch past ``budget_s``, has the loop cut that
    replica off (``call_soon_threadsafe``: its requests fail at once, its neighbours go
    on); and it has the loop send a :class:`Beat`. Beats that stop coming tell the
    server the loop no longer runs what it is given, which no thread here can mend."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        hosted: dict[str, Hosted],
        budget_s: float,
        beat: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._hosted = hosted
        self._budget_s = budget_s
        self._beat = beat
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(WATCH_EVERY_S):
            now = time.monotonic()
            # list() copies the dict the loop changes in one step: no Python code runs
            for replica in list(self._hosted.values()):
                if replica.overdue(self._budget_s, now) > 0 and not replica.cutting:
                    replica.cutting = True
                    self._call(self._cut_off, replica)
            self._call(self._beat)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed: the host is ending
            self._stopped.set()

    def _cut_off(self, replica: Hosted) -> None:
        """On the loop: end ``replica``, whose batch ran past its time budget."""
        if replica.cut_off or replica.spec.replica_id not in self._hosted:
            return
        if replica.overdue(self._budget_s, time.monotonic()) <= 0:
            replica.cutting = False  # its batch ended meanwhile
            return
        spec = replica.spec
        replica.cut_off = (
            f"cut off: a batch of {spec.model}:{spec.version} ran past its time "
            f"budget of {self._budget_s:g}s (models.predict_budget_s)"
        )
        logger.error("%s", replica.cut_off)
        batcher = getattr(replica.core, "batcher", None)
        if batcher is not None:  # its requests fail now, not at their deadlines
            batcher.abandon(ModelError(replica.cut_off))
        replica.kill.set()
        replica.drain.set()


def main(argv: list[str] | None = None) -> None:
    from inferd.telemetry.logging import configure_logging

    args = sys.argv[1:] if argv is None else argv
    fd, grace_s, budget_s = int(args[0]), float(args[1]), float(args[2])
    configure_logging(args[3] if len(args) > 3 else "INFO", False, f"shared {os.getpid()}")
    die_with_parent()
    try:
        import uvloop
    except ImportError:
        asyncio.run(run_host(fd, grace_s, budget_s))
    else:
        uvloop.run(run_host(fd, grace_s, budget_s))
    # As a replica process: a batch past its budget may still run in its thread.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
