"""The replica protocol over in-memory pipes: a replica core served in this process,
reached by the same :class:`~inferd.serving.client.ReplicaClient` as a replica process.

An ``inproc:NAME`` address works wherever a ``unix:`` or ``tcp:`` one does: a replica
listens on it (:func:`listen`, from
:func:`inferd.serving.replica_server.start_listening`) and clients connect to it
(:func:`connect`). Frames are encoded and decoded exactly as on a socket; only the
bytes move through the event loop instead of the kernel. Both ends must run on the same
event loop. The ``inprocess`` replica backend uses it (one process serving models
without child processes: tests, notebooks, embedding inferd in an application).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

_LISTENERS: dict[str, Listener] = {}


class PipeEnd(asyncio.Transport):
    """One end of an in-memory connection: what it writes, the peer's protocol receives
    on a later turn of the loop, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self._loop = loop
        self._protocol = protocol
        self._closing = False
        self.peer: PipeEnd | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:  # type: ignore[override]
        if not self._closing and self.peer is not None:
            self._loop.call_soon(self.peer._deliver, bytes(data))

    def _deliver(self, data: bytes) -> None:
        if not self._closing:
            self._protocol.data_received(data)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.call_soon(self._protocol.connection_lost, None)
        if self.peer is not None:
            self.peer.close()

    def abort(self) -> None:
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0


class Listener:
    """What :func:`listen` returns: closing it refuses new connections (like
    ``asyncio.Server.close``); :meth:`disconnect` then closes the open ones, as the end
    of a replica process closes its sockets."""

    def __init__(self, name: str, factory: Callable[[], asyncio.Protocol]) -> None:
        self.name = name
        self.factory = factory
        self.connections: set[PipeEnd] = set()

    def close(self) -> None:
        if _LISTENERS.get(self.name) is self:
            del _LISTENERS[self.name]

    def disconnect(self) -> None:
        for end in list(self.connections):
            end.close()
        self.connections.clear()


def listen(name: str, factory: Callable[[], asyncio.Protocol]) -> Listener:
    if name in _LISTENERS:
        raise OSError(f"inproc:{name} is already listening")
    listener = _LISTENERS[name] = Listener(name, factory)
    return listener


def connect(name: str, factory: Callable[[], asyncio.Protocol]) -> PipeEnd:
    """A client end connected to the replica listening on ``inproc:NAME``."""
    listener = _LISTENERS.get(name)
    if listener is None:
        raise ConnectionRefusedError(f"nothing listens on inproc:{name}")
    loop = asyncio.get_running_loop()
    client_protocol, server_protocol = factory(), listener.factory()
    client, server = PipeEnd(loop, client_protocol), PipeEnd(loop, server_protocol)
    client.peer, server.peer = server, client
    listener.connections.add(server)
    server_protocol.connection_made(server)
    client_protocol.connection_made(client)
    return client
