"""The trivial server of the load-generator comparison: a raw ASGI hello world.

    python bench/hello_app.py --port 8080 [--workers 2]

Each worker is a uvicorn server (httptools + uvloop) with its own listening socket on
the same port (SO_REUSEPORT), so the kernel spreads connections over the workers by
hash. Why not ``uvicorn --workers 2``: its workers share one socket and the first to
wake accepts a whole burst, so 64 connections opened at once often all land on one
worker -- and which way a run goes decides its req/s more than the load generator does.
"""

from __future__ import annotations

import argparse

from servers import serve_reuseport

BODY = b'{"hello":"world"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"17")]


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    more = True
    while more:  # read (and drop) the request body
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    serve_reuseport(app, args.port, args.workers)


if __name__ == "__main__":
    main()
