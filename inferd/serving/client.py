"""Gateway side of the replica protocol: one multiplexed connection per replica.

``infer`` sends one frame and awaits the reply matched by id; if the connection drops,
every pending call fails at once with :class:`ReplicaGone` (a 503), so a dead replica
costs its in-flight requests a fast error or a retry elsewhere, never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from inferd import transport as transport_
from inferd.errors import (
    BadRequest,
    InferdError,
    InvalidInput,
    ModelError,
    ModelNotReady,
    Overloaded,
    PayloadTooLarge,
    PromptTooLong,
    RequestTimeout,
)
from inferd.serving import inprocess
from inferd.shapes import replica as p
from inferd.telemetry import tracing

logger = logging.getLogger(__name__)

_ERRORS: dict[str, type[InferdError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        InvalidInput,
        ModelError,
        ModelNotReady,
        Overloaded,
        PayloadTooLarge,
        PromptTooLong,
        RequestTimeout,
    )
}


MIN_TIMEOUT_S = 0.001
"""A request whose deadline passed while the gateway looked it up (the cache, a retry)
still goes out with this much time, so that it ends as a timeout like any other."""


class ReplicaGone(ModelNotReady):
    code = "replica_unavailable"


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, client: ReplicaClient) -> None:
        self.client = client
        self.frames = p.FrameBuffer()

    def data_received(self, data: bytes) -> None:
        pending = self.client._pending
        streams = self.client._streams
        for message in self.frames.feed(data):
            if type(message) is p.Load:
                self.client.engine, self.client.sent_since_load = message, 0
                if message.prefix and self.client.on_prefix is not None:
                    self.client.on_prefix(message.prefix, self.client.replica_id)
                continue
            stream = streams.get(message.id)  # type: ignore[union-attr]
            if stream is not None:
                stream.put_nowait(message)
                continue
            future = pending.pop(message.id, None)  # type: ignore[union-attr]
            if future is not None and not future.done():
                future.set_result(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._lost(exc)


class ReplicaClient:
    def __init__(self, address: str, replica_id: str = "") -> None:
        self.address = address
        self.replica_id = replica_id or address
        self._transport: asyncio.Transport | None = None
        self._writer: p.TurnWriter | None = None  # the frames of a turn in one write
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._ids = itertools.count(1)
        self.outstanding = 0
        self.engine: p.Load | None = None
        """A generation replica's last reported engine state (None: none yet)."""
        self.sent_since_load = 0
        """Generations this gateway sent it since that report (not counted in it yet)."""
        self.on_prefix: Callable[[list[int], str], None] | None = None
        """Told the prompt keys a report says gateways sent it, and its id."""
        self._adapters_sent: dict[str, float] = {}
        """LoRA adapters this gateway sent it requests for, and when (monotonic)."""
        self.closed = True

    ADAPTER_NEWS_S = 2.0
    """How long a request this gateway sent for an adapter counts as the adapter being
    loaded there, before the replica's report says so."""

    def sent_adapter(self, adapter: str) -> None:
        now = time.monotonic()
        sent = self._adapters_sent
        if len(sent) > 256:
            for name, when in list(sent.items()):
                if now - when > self.ADAPTER_NEWS_S:
                    del sent[name]
        sent[adapter] = now

    def has_adapter(self, adapter: str) -> bool:
        """Its engine reported ``adapter`` loaded, or this gateway sent it a request for
        it a moment ago."""
        report = self.engine
        if report is not None and adapter in report.adapters:
            return True
        when = self._adapters_sent.get(adapter)
        return when is not None and time.monotonic() - when < self.ADAPTER_NEWS_S

    async def connect(self, timeout_s: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        kind, _, where = self.address.partition(":")
        if kind == "inproc":
            self._transport = inprocess.connect(where, lambda: _ClientProtocol(self))
            self._writer = p.TurnWriter(self._transport)
            self.closed = False
            return
        if kind == "unix":
            coro = loop.create_unix_connection(lambda: _ClientProtocol(self), where)
        else:  # tcp: proven both ways before the first frame (inferd.transport)
            coro = transport_.connect(where, lambda: _ClientProtocol(self), timeout_s=timeout_s)
        transport, _ = await asyncio.wait_for(coro, timeout_s)
        self._transport = transport  # type: ignore[assignment]
        self._writer = p.TurnWriter(transport)
        self.closed = False

    def _lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._transport = self._writer = None
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ReplicaGone(f"replica {self.replica_id} went away"))
        for stream in self._streams.values():
            stream.put_nowait(ReplicaGone(f"replica {self.replica_id} went away"))

    async def _call(self, message: Any, timeout_s: float) -> Any:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ReplicaGone(f"replica {self.replica_id} is not connected")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[message.id] = future
        self._writer.write(p.encode(message))  # type: ignore[union-attr]
        timer = loop.call_later(timeout_s, _expire, future, timeout_s)
        try:
            return await future
        except (RequestTimeout, asyncio.CancelledError):
            # Deadline passed or the caller went away (client disconnected): tell the
            # replica to drop the request instead of computing it for nobody.
            self._pending.pop(message.id, None)
            if self._writer is not None:
                self._writer.write(p.encode(p.Cancel(message.id)))
            raise
        finally:
            timer.cancel()

    async def infer(
        self,
        inputs: dict[str, p.Tensor],
        rows: int,
        request: p.InferRequest,
        reference: dict[str, p.Tensor] | None = None,
        tolerance: float = 0.0,
    ) -> p.Answer:
        """One predict within what is left of the request's deadline; with ``reference``
        (a live answer) a shadow request, answered with no outputs (the replica compares
        and counts)."""
        timeout_s = max(request.left_s(), MIN_TIMEOUT_S)
        message = p.Infer(
            next(self._ids), inputs, rows, timeout_s * 1000, request.request_id,
            request.priority, reference, tolerance,
        )  # fmt: skip
        if tracing.tracer is not None and tracing.recording():
            return await self._traced_infer(tracing.tracer, message, timeout_s)
        return await self._send_infer(message, timeout_s)

    async def explain(
        self, inputs: dict[str, p.Tensor], rows: int, request: p.InferRequest
    ) -> p.Explained:
        """Attributions of one request's predictions, within its deadline."""
        timeout_s = max(request.left_s(), MIN_TIMEOUT_S)
        message = p.Explain(next(self._ids), inputs, rows, timeout_s * 1000, request.request_id)
        self.outstanding += 1
        try:
            reply = await self._call(message, timeout_s)
        finally:
            self.outstanding -= 1
        if isinstance(reply, p.Explained):
            return reply
        raise _as_error(reply)

    async def _send_infer(self, message: p.Infer, timeout_s: float) -> p.Answer:
        self.outstanding += 1
        sent = time.perf_counter()
        try:
            reply = await self._call(message, timeout_s)
        finally:
            self.outstanding -= 1
        if isinstance(reply, p.InferResult):
            return p.Answer(
                {name: p.from_tensor(t) for name, t in reply.outputs.items()},
                (time.perf_counter() - sent) * 1000, reply.queue_ms, reply.compute_ms,
                reply.batch_rows,
            )  # fmt: skip
        raise _as_error(reply)

    async def _traced_infer(self, tracer: Any, message: p.Infer, timeout_s: float) -> p.Answer:
        """:meth:`infer` inside a CLIENT span whose context travels in the frame."""
        from opentelemetry.trace import SpanKind

        name = "inferd.replica shadow" if message.reference is not None else "inferd.replica infer"
        attributes = {"inferd.replica": self.replica_id, "inferd.rows": message.rows}
        with tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes):
            message.trace = tracing.carrier()
            return await self._send_infer(message, timeout_s)

    async def generate(
        self, request: p.GenerateRequest, prefix: list[int] | None = None
    ) -> AsyncGenerator[p.TokenChunk, None]:
        """Token chunks as the replica makes them. Closing the iterator early (the client
        went away) cancels the generation in the replica, freeing its KV blocks.

        The first chunk may take ``request.first_timeout_s`` (a request can wait in the
        replica's queue; the replica itself ends a wait that is too long); after it, each
        chunk must come within ``request.idle_timeout_s``."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ReplicaGone(f"replica {self.replica_id} is not connected")
        mid = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[mid] = queue
        self.outstanding += 1
        self.sent_since_load += 1
        finished = False
        r = request
        message = p.Generate(
            mid, r.prompt, r.params, r.adapter, r.request_id, r.arrived_at, prefix=prefix,
            resume=r.resume,
        )  # fmt: skip
        span = None
        if tracing.tracer is not None and tracing.recording():
            span = tracing.client_span("inferd.replica generate", self.replica_id)
            message.trace = tracing.carrier(span)
        self._writer.write(p.encode(message))  # type: ignore[union-attr]
        idle_timeout_s = request.idle_timeout_s
        wait_s = idle_timeout_s if r.first_timeout_s is None else r.first_timeout_s
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(queue.get(), wait_s)
                except TimeoutError:
                    raise RequestTimeout(f"no token from the model for {wait_s:.0f}s") from None
                wait_s = idle_timeout_s
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, p.Error):
                    finished = True
                    raise _as_error(item)
                finished = item.finished
                yield item
        finally:
            self.outstanding -= 1
            self._streams.pop(mid, None)
            if not finished and self._writer is not None:
                self._writer.write(p.encode(p.Cancel(mid)))
            if span is not None:
                span.end()

    async def adapter(self, name: str, path: str | None, timeout_s: float = 60.0) -> p.Status:
        reply = await self._call(p.Adapter(next(self._ids), name, path), timeout_s)
        if not isinstance(reply, p.Status):
            raise _as_error(reply)
        return reply

    async def status(self, timeout_s: float = 5.0) -> p.Status:
        reply = await self._call(p.StatusQuery(next(self._ids)), timeout_s)
        if not isinstance(reply, p.Status):
            raise _as_error(reply)
        return reply

    async def drift(self, query: p.DriftQuery, timeout_s: float = 5.0) -> p.DriftCounts:
        """The replica's input counts (see :class:`~inferd.shapes.replica.DriftQuery`)."""
        query.id = next(self._ids)
        reply = await self._call(query, timeout_s)
        if not isinstance(reply, p.DriftCounts):
            raise _as_error(reply)
        return reply

    async def drain(self, timeout_s: float = 5.0) -> p.Status:
        return await self._call(p.Drain(next(self._ids)), timeout_s)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def status_of(address: str, replica_id: str, timeout_s: float = 1.0) -> p.Status | None:
    """One status frame over a connection of its own, closed after; None when the
    replica does not answer within ``timeout_s`` (starting, draining, gone)."""
    client = ReplicaClient(address, replica_id)
    try:
        await client.connect()
        return await client.status(timeout_s=timeout_s)
    except Exception:  # not measurable now
        return None
    finally:
        client.close()


def _expire(future: asyncio.Future[Any], timeout_s: float) -> None:
    if not future.done():
        took = f"{timeout_s * 1000:.0f} ms" if timeout_s < 1 else f"{timeout_s:.1f} s"
        future.set_exception(RequestTimeout(f"no reply from the model within {took}"))


def _as_error(reply: Any) -> InferdError:
    if isinstance(reply, p.Error):
        cls = _ERRORS.get(reply.code, InferdError)
        if issubclass(cls, ModelNotReady):
            err: InferdError = cls(reply.message, retry_after_s=reply.retry_after_s or 1)
        else:
            err = cls(reply.message)
        err.status_code = reply.status
        err.code = reply.code
        return err
    return InferdError(f"unexpected reply {type(reply).__name__}")
