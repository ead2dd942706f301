"""Pushes routing-table snapshots (and a heartbeat every second) to gateway processes
over a Unix socket, and over TCP to gateways on other hosts when ``cluster.control_listen``
is set (connections proving the cluster's credentials, :mod:`inferd.transport`); hands
the requests gateways send back on the same connection to the controller."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from inferd import transport
from inferd.control.joined import JoinedReplica
from inferd.shapes.control import (
    Beat,
    ConsoleAnswer,
    ConsoleQuery,
    Demand,
    Heartbeat,
    Join,
    Joined,
    LogRows,
    MetricsQuery,
    MetricsText,
    ReconcileRequest,
    Refused,
    RoutingTable,
    decode_request,
    encode_down,
    encode_table,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


HEARTBEAT_S = 1.0


class TablePublisher:
    def __init__(self, path: Path, listen: str | None = None) -> None:
        self.path = path
        self.listen = listen
        """Also a TCP address (``host:port``) for gateways on other hosts."""
        self.on_reconcile: Callable[[], Awaitable[None]] | None = None
        """Called for each :class:`ReconcileRequest` a gateway sends (the controller's
        ``reconcile``); one gateway's requests are handled one at a time."""
        self.on_log_rows: Callable[[LogRows], None] | None = None
        """Called with the inference log rows (and counters) a gateway sends."""
        self.on_metrics: Callable[[], Awaitable[str]] | None = None
        """Renders ``/metrics`` for a gateway that asks."""
        self.on_console: Callable[[ConsoleQuery], Awaitable[bytes]] | None = None
        """Answers the web console's queries for figures (JSON)."""
        self.on_demand: Callable[[str, str], Awaitable[None]] | None = None
        """Called when a gateway holds a request for a version scaled to zero."""
        self.on_join: (
            Callable[[Join, asyncio.StreamWriter], Awaitable[JoinedReplica | str]] | None
        ) = None
        """A replica on another host asks to join: its joined self, or why not."""
        self._frame: bytes | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._servers: list[asyncio.Server] = []
        self._beat: asyncio.Task[None] | None = None
        self._generation = 0

    async def start(self) -> None:
        self._servers.append(
            await transport.start_stream_server(self._on_connect, f"unix:{self.path}")
        )
        if self.listen:
            self._servers.append(await transport.start_stream_server(self._on_connect, self.listen))
            logger.info("listening for gateways and replicas on %s", self.listen)
        self._beat = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            frame = encode_down(Heartbeat(self._generation))
            for writer in list(self._writers):
                if not writer.is_closing():
                    writer.write(frame)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self._frame is not None:
            writer.write(self._frame)
        try:
            await self._serve_requests(reader, writer)  # returns at EOF: the gateway left
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _serve_requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        joined: JoinedReplica | None = None
        try:
            while True:
                try:
                    size = int.from_bytes(await reader.readexactly(4), "little")
                    request = decode_request(await reader.readexactly(size))
                except (asyncio.IncompleteReadError, ConnectionError, OSError):
                    return
                except msgspec.DecodeError as exc:
                    logger.error("dropping a peer that sent a bad control frame: %s", exc)
                    return
                if isinstance(request, Beat):
                    if joined is not None:
                        joined.beat(request.state, request.message)
                elif isinstance(request, Join):
                    self._writers.discard(writer)  # a replica: no routing tables
                    joined = await self._join(request, writer)
                    if joined is None:
                        return
                else:
                    await self._serve_gateway(request, writer)
        finally:
            if joined is not None:
                joined.lost("its connection to the controller closed")

    async def _join(self, request: Join, writer: asyncio.StreamWriter) -> JoinedReplica | None:
        if self.on_join is None:
            answer: JoinedReplica | str = "this controller takes no joining replicas"
        else:
            answer = await self.on_join(request, writer)
        if isinstance(answer, str):
            logger.warning(
                "refused %s:%s from %s: %s", request.model, request.version, request.host, answer
            )
            writer.write(encode_down(Refused(answer)))
            await writer.drain()
            return None
        writer.write(encode_down(Joined(answer.id, answer.spec.to_json())))
        return answer

    async def _serve_gateway(
        self,
        request: ReconcileRequest | Demand | LogRows | MetricsQuery | ConsoleQuery,
        writer: asyncio.StreamWriter,
    ) -> None:
        if isinstance(request, LogRows):
            if self.on_log_rows is not None:
                self.on_log_rows(request)
        elif isinstance(request, MetricsQuery):
            text = await self._guarded(self.on_metrics, "rendering /metrics") or ""
            if not writer.is_closing():
                writer.write(encode_down(MetricsText(request.id, text)))
        elif isinstance(request, ConsoleQuery):
            query = functools.partial(self.on_console, request) if self.on_console else None
            body = await self._guarded(query, "answering the console") or b"{}"
            if not writer.is_closing():
                writer.write(encode_down(ConsoleAnswer(request.id, body)))
        elif isinstance(request, Demand):
            if self.on_demand is not None:
                what = f"starting {request.model}:{request.version} on demand"
                demand = functools.partial(self.on_demand, request.model, request.version)
                await self._guarded(demand, what)
        else:
            logger.debug("gateway asks to reconcile (model %s)", request.model or "-")
            await self._guarded(self.on_reconcile, "reconcile requested by a gateway")

    @staticmethod
    async def _guarded(call: Callable[[], Awaitable[T]] | None, what: str) -> T | None:
        """``call()``, its failure logged (a gateway's request never breaks the channel)."""
        if call is None:
            return None
        try:
            return await call()
        except Exception:
            logger.exception("%s failed", what)
            return None

    def gateways(self) -> list[str]:
        """Where the gateways following this controller connect from: ``local`` (this
        host's Unix socket) or ``host:port`` over TCP."""
        out = []
        for writer in self._writers:
            if writer.is_closing():
                continue
            peer = writer.get_extra_info("peername")
            out.append(f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "local")
        return sorted(out)

    def publish(self, table: RoutingTable) -> None:
        self._frame = encode_table(table)
        self._generation = table.generation
        for writer in list(self._writers):
            if writer.is_closing():
                self._writers.discard(writer)
            else:
                writer.write(self._frame)

    async def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        for writer in list(self._writers):
            writer.close()
        for server in self._servers:
            server.close()
        self.path.unlink(missing_ok=True)
