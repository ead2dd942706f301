"""A replica's health over plain HTTP, for an orchestrator's probes (Kubernetes' kubelet).

The replica protocol is binary frames behind the cluster token, which a kubelet cannot
speak; so a replica pod also answers two GETs on its own port:

- ``/health/live``: 200 while the process and its event loop run (a liveness probe that
  fails restarts the container: only a wedged replica should fail it, never a slow
  load);
- ``/health/ready``: 200 while it takes requests (loaded, not draining), else 503 with
  its state and why: a pod that is not ready leaves its Service's endpoints and
  inferd's routing tables alike.

The body is ``{"state": ..., "message": ...}``. Nothing here reads a request body or
keeps a connection: one short request line per connection, answered and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192


async def serve_health(address: str, state: Callable[[], tuple[str, str]]) -> asyncio.Server:
    """Listen on ``host:port``; ``state()`` is the replica's (state, message) now."""
    host, _, port = address.rpartition(":")

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            writer.close()
            return
        method, _, rest = head.decode("latin-1").partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        now, message = state()
        if method not in ("GET", "HEAD"):
            status, body = 405, {"error": f"{method} is not allowed; GET {path}"}
        elif path == "/health/live":
            status, body = 200, {"state": now, "message": message}
        elif path == "/health/ready":
            status = 200 if now == "ready" else 503
            body = {"state": now, "message": message}
        else:
            status, body = 404, {"error": f"no {path}; try /health/live or /health/ready"}
        payload = json.dumps(body).encode()
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Unavailable"}
        writer.write(
            f"HTTP/1.1 {status} {reason[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode()
            + (payload if method == "GET" else b"")
        )
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(
        answer, host or None, int(port), limit=MAX_REQUEST_BYTES, reuse_address=True
    )
    logger.info("health on http://%s/health/ready", address)
    return server
