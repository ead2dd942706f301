"""Pushes routing-table snapshots to gateway processes over a Unix socket."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from inferd.routing.table import RoutingTable, encode_table

logger = logging.getLogger(__name__)


class TablePublisher:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._frame: bytes | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._on_connect, str(self.path))

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self._frame is not None:
            writer.write(self._frame)
        try:
            await reader.read()  # gateways never send; EOF means they left
        finally:
            self._writers.discard(writer)
            writer.close()

    def publish(self, table: RoutingTable) -> None:
        self._frame = encode_table(table)
        for writer in list(self._writers):
            if writer.is_closing():
                self._writers.discard(writer)
            else:
                writer.write(self._frame)

    async def close(self) -> None:
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()
        self.path.unlink(missing_ok=True)
