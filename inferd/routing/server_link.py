"""A gateway's control channel to the controller (a Unix socket beside ``inferd serve``,
or TCP to ``inferd control`` on another host; both ways): routing tables, heartbeats and
``/metrics`` replies come down; reconcile requests, inference log rows, demands and
``/metrics`` queries go up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from inferd import transport
from inferd.errors import ModelNotReady
from inferd.shapes.control import (
    ConsoleAnswer,
    ConsoleQuery,
    ConsoleView,
    Demand,
    Heartbeat,
    LogRows,
    MetricsQuery,
    MetricsText,
    ReconcileRequest,
    RoutingTable,
    decode_table,
    encode_request,
)
from inferd.shapes.logs import LogRow

logger = logging.getLogger(__name__)


class ServerLink:
    def __init__(self) -> None:
        self.on_lost: Callable[[], None] | None = None
        """Called when the server goes away and the link does not reconnect (a local
        gateway then stops: its server process is gone)."""
        self.reconnect = False
        """Keep the last table and reconnect when the controller goes away (a gateway on
        another host than the controller: the data plane outlives the control plane)."""
        self.last_heard = time.monotonic()
        """When the controller last sent anything (a table, a heartbeat)."""
        self.address = ""
        """Where the controller is: a Unix socket, or ``host:port[,host:port…]`` (the
        first that answers: several controllers, one leading)."""
        self.connected_to = ""
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._answers: dict[int, asyncio.Future[Any]] = {}
        """Queries (``/metrics``, the console's figures) waiting for their answer, by id."""
        self._query_ids = 0

    async def connect(
        self, address: str | Path, on_table: Callable[[RoutingTable], Awaitable[None]]
    ) -> None:
        """Connect, and hand every table that comes to ``on_table``, in order."""
        self.address = address if isinstance(address, str) else f"unix:{address}"
        if self.reconnect:  # the controller may not be up yet: wait for it
            reader = await self._redial()
        else:
            reader, self._writer = await transport.open_stream(self.address, limit=2**26)
        self.last_heard = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._follow(reader, on_table))

    async def _follow(
        self,
        reader: asyncio.StreamReader,
        on_table: Callable[[RoutingTable], Awaitable[None]],
    ) -> None:
        while True:
            await self._read(reader, on_table)
            self._writer = None
            if not self.reconnect:
                logger.error("lost the controller; this gateway stops")
                if self.on_lost is not None:
                    self.on_lost()
                return
            logger.warning(
                "lost the controller at %s; serving with the last routing table, reconnecting",
                self.address,
            )
            reader = await self._redial()
            logger.info("reconnected to the controller at %s", self.connected_to)

    async def _redial(self) -> asyncio.StreamReader:
        backoff = 0.1
        while True:
            try:
                reader, self._writer, self.connected_to = await transport.open_any(
                    self.address, limit=2**26, timeout_s=2.0
                )
                return reader
            except transport.AuthError as exc:  # says so once per try, louder
                logger.error("the controller at %s refused this gateway: %s", self.address, exc)
                await asyncio.sleep(1.0)
            except (OSError, TimeoutError, ConnectionError) as exc:
                logger.debug("controller at %s not reachable: %s", self.address, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def _read(
        self,
        reader: asyncio.StreamReader,
        on_table: Callable[[RoutingTable], Awaitable[None]],
    ) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                message = decode_table(await reader.readexactly(size))
                self.last_heard = time.monotonic()
                if isinstance(message, Heartbeat):
                    continue
                if isinstance(message, MetricsText | ConsoleAnswer):
                    waiter = self._answers.pop(message.id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(message)
                    continue
                if isinstance(message, RoutingTable):
                    await on_table(message)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            return

    def silent_for(self) -> float:
        """Seconds since the controller was last heard from (0 while it talks)."""
        return time.monotonic() - self.last_heard

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def request_reconcile(self, model: str = "") -> None:
        """Ask the controller to reconcile now (the registry changed), instead of on its
        next periodic pass. A no-op when not connected."""
        if not self.connected:
            return
        assert self._writer is not None
        self._writer.write(encode_request(ReconcileRequest(model)))
        await self._writer.drain()

    def send_demand(self, model: str, version: str) -> None:
        """Tell the controller a request waits for ``model:version`` (scaled to zero)."""
        if self.connected:
            assert self._writer is not None
            self._writer.write(encode_request(Demand(model, version)))

    def send_log_rows(self, rows: list[LogRow], counters: dict[str, int]) -> bool:
        """Hand inference log rows (and counter deltas) to the server process; False when
        it is not there."""
        if not self.connected:
            return False
        assert self._writer is not None
        self._writer.write(encode_request(LogRows(rows, counters)))
        return True

    async def metrics(self, timeout_s: float = 10.0) -> str:
        """``/metrics`` as the server process renders it (every gateway and replica)."""
        answer: MetricsText = await self._ask(MetricsQuery, timeout_s)
        return answer.text

    async def console(
        self,
        what: ConsoleView,
        models: list[str] | None = None,
        since: float | None = None,
        window_s: float = 300.0,
        timeout_s: float = 10.0,
        version: str | None = None,
    ) -> bytes:
        """The console's figures from the server process, as JSON (see
        :class:`~inferd.shapes.control.ConsoleQuery`)."""
        answer: ConsoleAnswer = await self._ask(
            lambda query: ConsoleQuery(query, what, models, since, window_s, version), timeout_s
        )
        return answer.body

    async def _ask(self, make: Callable[[int], Any], timeout_s: float) -> Any:
        """Send the query ``make(id)`` and wait for the answer with that id."""
        if not self.connected:
            raise ModelNotReady("the server process is not reachable")
        self._query_ids += 1
        query = self._query_ids
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._answers[query] = waiter
        assert self._writer is not None
        self._writer.write(encode_request(make(query)))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._answers.pop(query, None)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._writer is not None:
            self._writer.close()
