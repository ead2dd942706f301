"""A tiny raw-asyncio HTTP/1.1 server for load-generator tests: ``python trivial.py PORT``.

Paths: ``/ok`` (200 JSON), ``/status/503``, ``/slow/<ms>``, ``/sse/<n>/<gap_ms>`` (n token
events, chunked, then [DONE]), ``/sse-bad`` (an unterminated event), ``/close`` (hangs up
without answering), ``/flaky`` (every third request 500), ``/seen`` (how many requests
each first path segment got so far, as JSON).
"""

from __future__ import annotations

import asyncio
import json
import sys

COUNT = {"flaky": 0}
SEEN: dict[str, int] = {}


def _response(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            length = 0
            for line in head.lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length)
            if path == "/seen":
                writer.write(_response(200, json.dumps(SEEN).encode()))
            elif not await route(path, writer, body):
                return
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _openai_stream(chat: bool, n: int) -> bytes:
    chunks = []
    for i in range(n):
        choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
        chunks.append(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
    chunks.append(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    return b"".join(_chunk(c) for c in chunks) + b"0\r\n\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def route(path: str, writer: asyncio.StreamWriter, body: bytes = b"{}") -> bool:
    parts = path.strip("/").split("/")
    request = json.loads(body or b"{}")
    SEEN[parts[0]] = SEEN.get(parts[0], 0) + 1
    if path in ("/v1/completions", "/v1/chat/completions"):
        writer.write(SSE_HEAD + _openai_stream("chat" in path, request.get("max_tokens", 4)))
    elif path.startswith("/api/v1/models/") and path.endswith("/generate"):
        n = request.get("max_tokens", 4)
        events = [b'data: {"token": "t%d"}\n\n' % i for i in range(n)]
        events.append(
            b'data: {"finish_reason": "length", "usage": {"completion_tokens": %d}}\n\n' % n
        )
        writer.write(SSE_HEAD + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n")
    elif path in ("/api/v1/embed", "/v1/embeddings") or path.startswith("/v2/models/"):
        writer.write(_response(200, json.dumps({"echo": request}).encode()))
    elif parts[0] == "ok":
        writer.write(_response(200, b'{"ok":true}'))
    elif parts[0] == "status":
        writer.write(_response(int(parts[1]), b'{"error":"as asked"}'))
    elif parts[0] == "slow":
        await asyncio.sleep(int(parts[1]) / 1000)
        writer.write(_response(200, b'{"slow":true}'))
    elif parts[0] == "flaky":
        COUNT["flaky"] += 1
        writer.write(_response(500 if COUNT["flaky"] % 3 == 0 else 200, b"{}"))
    elif parts[0] == "sse":
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for i in range(int(parts[1])):
            await asyncio.sleep(int(parts[2]) / 1000)
            writer.write(_chunk(b'data: {"token": "t%d"}\n\n' % i))
            await writer.drain()
        writer.write(
            _chunk(
                b'data: {"finish_reason": "length", "usage": {"completion_tokens": '
                b"%d}}\n\ndata: [DONE]\n\n" % int(parts[1])
            )
            + b"0\r\n\r\n"
        )
    elif parts[0] == "sse-bad":
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        writer.write(_chunk(b'data: {"token": "half') + b"0\r\n\r\n")
    elif parts[0] == "close":
        return False
    else:
        writer.write(_response(404, b"{}"))
    return True


async def main(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print("LISTENING", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
