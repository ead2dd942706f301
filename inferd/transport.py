"""Where inferd's processes listen and connect, and who may connect over a network.

Addresses: ``unix:/path`` (one machine: the socket file's permissions guard it),
``tcp:host:port`` (across hosts), ``inproc:name`` (one process; see
:mod:`inferd.serving.inprocess`, handled by its callers).

Over TCP nothing is read from a peer before it proved it is one of ours:

- **cluster token** (``cluster.token``): a challenge-response both ways. The listener
  sends ``INFD1`` and a 16-byte nonce; the connecting side answers its own nonce and
  ``HMAC-SHA256(token, "client" | listener nonce | its nonce)``; the listener checks it
  (constant time) and answers ``HMAC-SHA256(token, "server" | its nonce | listener
  nonce)``, which the connecting side checks in turn. The token never crosses the wire,
  a recorded exchange cannot be replayed (fresh nonces), and neither side talks to a
  peer without it. A failed proof closes the connection before any frame is read.
- **mutual TLS** (``cluster.tls_cert``/``tls_key``/``tls_ca``): both sides present a
  certificate signed by the cluster CA and check the other's; with a token too, the
  token exchange runs inside TLS.

A TCP listener or connection without either is refused with an error naming the
settings. Each process sets its credentials once (:func:`use`), from its settings; the
connections it opens and the listeners it starts take them from there.

A gateway's own ports (HTTP, gRPC) are bound by :func:`bind_socket`, shared by every
gateway process.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"INFD1"
NONCE = 16
MAC = 32
HANDSHAKE_TIMEOUT_S = 5.0


class AuthError(ConnectionError):
    """The peer did not prove it holds the cluster's credentials."""


@dataclass(frozen=True, slots=True)
class Credentials:
    token: bytes | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None

    @classmethod
    def from_settings(cls, cluster: Any) -> Credentials:
        """From a ``ClusterConfig`` (``settings.cluster``)."""

        def path(value: str | None) -> Path | None:
            return Path(value) if value else None

        token = cluster.token.encode() if cluster.token else None
        return cls(token, path(cluster.tls_cert), path(cluster.tls_key), path(cluster.tls_ca))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Credentials:
        """From ``INFERD_CLUSTER__TOKEN`` and ``INFERD_CLUSTER__TLS_*`` (a replica process
        has no settings of its own but its environment)."""
        env = os.environ if environ is None else environ

        def path(name: str) -> Path | None:
            value = env.get(f"INFERD_CLUSTER__{name}")
            return Path(value) if value else None

        token = env.get("INFERD_CLUSTER__TOKEN")
        return cls(
            token.encode() if token else None, path("TLS_CERT"), path("TLS_KEY"), path("TLS_CA")
        )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def check(self) -> None:
        """ValueError naming what is missing for TCP."""
        if self.token is None and not self.tls:
            raise ValueError(
                "a TCP address needs the cluster's credentials: set cluster.token "
                "(INFERD_CLUSTER__TOKEN) and/or cluster.tls_cert, tls_key and tls_ca"
            )
        if self.tls and (self.tls_key is None or self.tls_ca is None):
            raise ValueError("mutual TLS needs cluster.tls_cert, tls_key and tls_ca together")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("cluster.token must be at least 16 characters")

    def server_ssl(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.tls_ca)
        context.load_cert_chain(self.tls_cert, self.tls_key)  # type: ignore[arg-type]
        context.verify_mode = ssl.CERT_REQUIRED  # mutual: the client shows a certificate
        return context

    def client_ssl(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        context.load_cert_chain(self.tls_cert, self.tls_key)  # type: ignore[arg-type]
        context.check_hostname = False  # peers are addressed by IP; the CA vouches for them
        return context


_credentials = Credentials()


def use(credentials: Credentials) -> None:
    """This process's credentials for every TCP connection and listener from now on."""
    global _credentials
    _credentials = credentials


def split(address: str) -> tuple[str, str]:
    """``("unix", "/path")``, ``("tcp", "host:port")`` or ``("inproc", "name")``; a bare
    ``host:port`` is TCP."""
    kind, sep, where = address.partition(":")
    if sep and kind in ("unix", "tcp", "inproc"):
        return kind, where
    return "tcp", address


def host_port(where: str) -> tuple[str, int]:
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a TCP address is host:port, not {where!r}")
    return host.strip("[]"), int(port)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, not listening yet, that the other gateway
    processes bind too (SO_REUSEPORT, where the system has it: the kernel spreads the
    connections across them), inheritable: a gateway's HTTP and gRPC ports."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _mac(token: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(token, label + b"".join(nonces), hashlib.sha256).digest()


class _Guard(asyncio.Protocol):
    """Runs the token exchange on a fresh connection, then hands the connection (and
    any bytes past the exchange) to the real protocol; until then nothing reaches it."""

    def __init__(self, inner: Callable[[], asyncio.BaseProtocol], token: bytes) -> None:
        self._factory = inner
        self._token = token
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._inner: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        """The inner protocol once proven (a connector awaits it; a listener does not)."""
        self.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(HANDSHAKE_TIMEOUT_S, self._fail, "no proof in time")
        self._started()

    def _started(self) -> None: ...

    def _step(self) -> bool:
        """Consume the buffer; True once the exchange is complete."""
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)
            return
        self._buffer += data
        try:
            finished = self._step()
        except AuthError as exc:
            self._fail(str(exc))
            return
        if finished:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        rest, self._buffer = self._buffer, b""
        self._inner = self._factory()
        self._inner.connection_made(self._transport)
        if not self.done.done():
            self.done.set_result(self._inner)
        if rest:
            self._inner.data_received(rest)

    def _fail(self, why: str) -> None:
        if self._inner is not None:
            return
        peer = self._transport.get_extra_info("peername") if self._transport else None
        logger.warning("refused a connection from %s: %s", peer, why)
        if not self.done.done():
            self.done.set_exception(AuthError(f"cluster handshake failed: {why}"))
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._inner is not None:
            self._inner.connection_lost(exc)
        elif not self.done.done():
            self.done.set_exception(self._hung_up())

    def _hung_up(self) -> Exception:
        return AuthError("cluster handshake failed: the peer hung up (does it hold the token?)")

    def eof_received(self) -> bool | None:
        if self._inner is not None and hasattr(self._inner, "eof_received"):
            return bool(self._inner.eof_received())
        return None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class _ListenerGuard(_Guard):
    def _started(self) -> None:
        self._nonce = os.urandom(NONCE)
        assert self._transport is not None
        self._transport.write(MAGIC + self._nonce)

    def _step(self) -> bool:
        if len(self._buffer) < NONCE + MAC:
            return False
        theirs, proof = self._buffer[:NONCE], self._buffer[NONCE : NONCE + MAC]
        self._buffer = self._buffer[NONCE + MAC :]
        if not hmac.compare_digest(proof, _mac(self._token, b"client", self._nonce, theirs)):
            raise AuthError("wrong cluster token")
        assert self._transport is not None
        self._transport.write(_mac(self._token, b"server", theirs, self._nonce))
        return True


class _ConnectorGuard(_Guard):
    _ours: bytes | None = None

    def _hung_up(self) -> Exception:
        if self._ours is None:  # before the listener's hello: it went away, it did not refuse
            return ConnectionResetError("the listener closed the connection before its hello")
        return super()._hung_up()

    def _step(self) -> bool:
        assert self._transport is not None
        if self._ours is None:
            if len(self._buffer) < len(MAGIC) + NONCE:
                return False
            if not self._buffer.startswith(MAGIC):
                raise AuthError("the peer is not an inferd cluster listener")
            self._theirs = self._buffer[len(MAGIC) : len(MAGIC) + NONCE]
            self._buffer = self._buffer[len(MAGIC) + NONCE :]
            self._ours = os.urandom(NONCE)
            self._transport.write(
                self._ours + _mac(self._token, b"client", self._theirs, self._ours)
            )
        if len(self._buffer) < MAC:
            return False
        proof, self._buffer = self._buffer[:MAC], self._buffer[MAC:]
        if not hmac.compare_digest(proof, _mac(self._token, b"server", self._ours, self._theirs)):
            raise AuthError("the listener does not hold the cluster token")
        return True


async def listen(
    where: str,
    factory: Callable[[], asyncio.BaseProtocol],
    creds: Credentials | None = None,
    *,
    reuse_port: bool = False,
) -> asyncio.Server:
    """A TCP listener on ``host:port`` whose connections reach ``factory``'s protocol
    only once they proved themselves."""
    creds = creds or _credentials
    creds.check()
    host, port = host_port(where)
    token = creds.token
    wrapped: Callable[[], asyncio.BaseProtocol] = (
        factory if token is None else (lambda: _ListenerGuard(factory, token))
    )
    return await asyncio.get_running_loop().create_server(
        wrapped, host, port, ssl=creds.server_ssl(), reuse_port=reuse_port or None
    )


async def connect(
    where: str,
    factory: Callable[[], asyncio.BaseProtocol],
    creds: Credentials | None = None,
    timeout_s: float = 5.0,
) -> tuple[asyncio.Transport, Any]:
    """A TCP connection to ``host:port``, proven both ways: (transport, the protocol
    ``factory`` made). AuthError when the exchange fails."""
    creds = creds or _credentials
    creds.check()
    host, port = host_port(where)
    loop = asyncio.get_running_loop()
    token = creds.token
    if token is None:
        coro = loop.create_connection(factory, host, port, ssl=creds.client_ssl())
        transport, protocol = await asyncio.wait_for(coro, timeout_s)
        return transport, protocol  # type: ignore[return-value]
    guard: _ConnectorGuard | None = None

    def guarded() -> _ConnectorGuard:
        nonlocal guard
        guard = _ConnectorGuard(factory, token)
        return guard

    async def dial() -> tuple[asyncio.Transport, Any]:
        transport, _ = await loop.create_connection(guarded, host, port, ssl=creds.client_ssl())
        assert guard is not None
        try:
            inner = await guard.done
        except BaseException:
            transport.abort()
            raise
        return transport, inner  # type: ignore[return-value]

    return await asyncio.wait_for(dial(), timeout_s)


async def open_stream(
    address: str, limit: int = 2**16, timeout_s: float = 5.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``asyncio.open_connection`` for any inferd address (unix or guarded TCP)."""
    kind, where = split(address)
    if kind == "unix":
        return await asyncio.wait_for(asyncio.open_unix_connection(where, limit=limit), timeout_s)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await connect(where, lambda: protocol, timeout_s=timeout_s)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def open_any(
    addresses: str, limit: int = 2**16, timeout_s: float = 5.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """:func:`open_stream` to the first of ``a:1,b:2`` that answers (several controllers,
    one leading: the others do not listen); the last failure when none does."""
    failure: Exception = OSError(f"no address in {addresses!r}")
    for address in (a.strip() for a in addresses.split(",") if a.strip()):
        try:
            reader, writer = await open_stream(address, limit, timeout_s)
        except AuthError:
            raise
        except (OSError, TimeoutError) as exc:
            failure = exc
            continue
        return reader, writer, address
    raise failure


async def start_stream_server(
    callback: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any],
    address: str,
    limit: int = 2**16,
) -> asyncio.Server:
    """``asyncio.start_server`` for any inferd address (unix or guarded TCP)."""
    kind, where = split(address)
    if kind == "unix":
        Path(where).unlink(missing_ok=True)
        return await asyncio.start_unix_server(callback, where, limit=limit)
    loop = asyncio.get_running_loop()

    def factory() -> asyncio.StreamReaderProtocol:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        return asyncio.StreamReaderProtocol(reader, callback, loop=loop)

    return await listen(where, factory)
