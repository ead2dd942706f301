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
import multiprocessing
import os
import signal
import socket

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


def _worker(port: int) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(
        app, http="httptools", loop="uvloop", access_log=False, log_level="warning"
    )
    uvicorn.Server(config).run(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    workers = [
        multiprocessing.Process(target=_worker, args=(args.port,)) for _ in range(args.workers)
    ]
    for worker in workers:
        worker.start()

    def stop(*_: object) -> None:
        for worker in workers:
            if worker.pid is not None:
                os.kill(worker.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main()
