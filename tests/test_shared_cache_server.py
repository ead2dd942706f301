"""The machine's shared result cache with the real server: ``inferd serve`` with two
gateway processes and the cache on. An answer one gateway process kept is a hit in the
other (the test finds which process accepted each connection), a version's TTL expires,
the machine-wide size bound evicts, a second server with another data folder shares
nothing with the first, and a store broken under the running server fails no request."""

from __future__ import annotations

import http.client
import json
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from inferd.config import Settings
from inferd.routing.cache import ENTRY_OVERHEAD, shared_file
from tests.conftest import InferdServer, arithmetic_model, push_source

pytestmark = pytest.mark.slow

BOUND = 16 * 1024
"""cache.max_bytes: about eleven answers of ``WIDE`` rows."""
WIDE = 300
TTL_S = 2


def _push(data: Path, model: str, *meta: str) -> None:
    extra = [a for m in meta for a in ("--meta", m)] + ["--deploy"]
    push_source(data, model, arithmetic_model("x + 1.0"), *extra)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("shared-cache")
    _push(data, "plus")
    _push(data, "short", f"cache_ttl_s={TTL_S}")
    return data


@pytest.fixture(scope="module")
def server(data: Path) -> Iterator[InferdServer]:
    env = {"INFERD_CACHE__ENABLED": "true", "INFERD_CACHE__MAX_BYTES": str(BOUND)}
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready()
        # Both gateway processes listen (they start one after the other).
        wait(lambda: "serving on" in server.log(), "the server's start message", 60)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert not _shared_path(data).exists(), "the server removes its file when it stops"


def _shared_path(data: Path) -> Path:
    """Where the server keeps the file: this user's folder on /dev/shm, else the data
    folder's (the server's choice, by the room there)."""
    shm = Path(f"/dev/shm/inferd-{os.getuid()}")
    for folder in (shm, data / "cache"):
        path = shared_file(Settings(data_dir=data, cache={"dir": folder}))
        if path.exists():
            return path
    return shared_file(Settings(data_dir=data, cache={"dir": shm}))


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, gateway: int):
        self.status, self.headers, self.gateway = status, headers, gateway
        self.json = json.loads(body)


def predict(server: InferdServer, model: str, xs: list[float]) -> Reply:
    """One request on a new connection (the kernel picks the gateway process), and the
    pid of the gateway process that answered it."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        body = json.dumps({"inputs": [{"x": x} for x in xs]})
        conn.request("POST", f"/api/v1/models/{model}/predict", body)
        response = conn.getresponse()
        content = response.read()
        gateway = _gateway_of(server, conn.sock.getsockname()[1])
        headers = {k.lower(): v for k, v in response.getheaders()}
        reply = Reply(response.status, headers, content, gateway)
    finally:
        conn.close()
    assert reply.status == 200, content
    assert reply.json["outputs"] == [{"y": x + 1.0} for x in xs]
    return reply


def _gateway_of(server: InferdServer, client_port: int) -> int:
    """The gateway process holding the server's end of the connection from
    ``client_port`` (its socket's inode in /proc/net/tcp, among the processes' fds)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, inode_ = (line.split()[i] for i in (1, 2, 9))
        if int(local.split(":")[1], 16) == server.port and int(remote.split(":")[1], 16) == (
            client_port
        ):
            inode = inode_
    assert inode is not None, "the connection is not in /proc/net/tcp"
    for pid in _gateways(server):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError("no gateway process holds the connection")


def _gateways(server: InferdServer) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rpartition(")")[2].split()[1]) != server.process.pid:
                continue
            if b"inferd.api.worker" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    assert len(pids) == 2, pids
    return pids


def in_file(data: Path, xs: list[float]) -> bool:
    """Whether the answer to ``xs`` (its y = x + 1 as float32 bytes) is in the machine's
    file: each process's writer thread writes a moment after the reply."""
    answer = np.asarray([x + 1.0 for x in xs], dtype=np.float32).tobytes()
    db = sqlite3.connect(_shared_path(data), timeout=5)
    try:
        ((n,),) = db.execute("SELECT count(*) FROM entries WHERE instr(value, ?)", (answer,))
    finally:
        db.close()
    return n > 0


def wait(predicate: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def fresh() -> float:
    """An input no earlier request (or run) sent."""
    return float(random.randrange(1, 1 << 20))


def test_an_answer_one_gateway_kept_is_a_hit_in_the_other(server: InferdServer, data: Path):
    x = fresh()
    first = predict(server, "plus", [x])
    assert first.headers["x-cache"] == "miss"
    wait(lambda: in_file(data, [x]), "the answer in the file")
    for _ in range(60):
        reply = predict(server, "plus", [x])
        assert reply.headers["x-cache"] == "hit"
        if reply.gateway != first.gateway:
            break
    else:
        pytest.fail("60 new connections all reached the same gateway process")
    # The other process logged its answer as a hit.
    rid = reply.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while not (
        rows := server.client.get("/api/v1/logs", params={"request_id": rid}).json()["logs"]
    ):
        assert time.monotonic() < deadline, "the hit's log row never came"
        time.sleep(0.1)
    assert [row["cache_hit"] for row in rows] == [True]


def test_a_versions_ttl_expires(server: InferdServer, data: Path):
    x = fresh()
    start = time.monotonic()
    assert predict(server, "short", [x]).headers["x-cache"] == "miss"
    wait(lambda: in_file(data, [x]), "the answer in the file")
    assert predict(server, "short", [x]).headers["x-cache"] == "hit"
    assert time.monotonic() - start < TTL_S, "too slow a machine for this test's TTL"
    time.sleep(TTL_S + 0.2 - (time.monotonic() - start))
    assert predict(server, "short", [x]).headers["x-cache"] == "miss"


def test_the_size_bound_evicts_the_least_recently_used(server: InferdServer, data: Path):
    one = 4 * WIDE + ENTRY_OVERHEAD  # (and a few bytes of encoding)
    assert one < BOUND // 8 < 2 * one
    firsts = [fresh() + i for i in range(WIDE)]
    assert predict(server, "plus", firsts).headers["x-cache"] == "miss"
    wait(lambda: in_file(data, firsts), "the first answer in the file")
    assert predict(server, "plus", firsts).headers["x-cache"] == "hit"
    for _ in range(2 * BOUND // one):  # twice what fits, through both processes
        lasts = [fresh() for _ in range(WIDE)]
        assert predict(server, "plus", lasts).headers["x-cache"] == "miss"
    wait(lambda: not in_file(data, firsts), "the first answer evicted")
    wait(lambda: in_file(data, lasts), "the last answer in the file")
    assert predict(server, "plus", firsts).headers["x-cache"] == "miss"
    assert predict(server, "plus", lasts).headers["x-cache"] == "hit"
    db = sqlite3.connect(_shared_path(data), timeout=5)
    ((total, stored),) = db.execute("SELECT bytes, (SELECT sum(size) FROM entries) FROM total")
    db.close()
    assert total == stored <= BOUND  # for the two processes together


def test_another_server_shares_nothing(server: InferdServer, data: Path, tmp_path: Path):
    """A second server on this machine (its own data folder, the same model and so the
    same keys) misses what the first kept."""
    x = fresh()
    assert predict(server, "plus", [x]).headers["x-cache"] == "miss"
    wait(lambda: in_file(data, [x]), "the answer in the first server's file")
    _push(tmp_path, "plus")
    other = InferdServer(tmp_path, workers=1, env={"INFERD_CACHE__ENABLED": "true"})
    try:
        other.wait_ready()
        version = "/api/v1/models/plus/versions/v1"
        same = [s.client.get(version).json()["sha256"] for s in (server, other)]
        assert same[0] == same[1]  # one artifact: one key, were the file shared
        seen = [other.client.post("/api/v1/models/plus/predict", json={"inputs": [{"x": x}]})
                for _ in range(2)]  # fmt: skip
        assert [r.headers["x-cache"] for r in seen] == ["miss", "hit"]
        assert predict(server, "plus", [x]).headers["x-cache"] == "hit"
        assert _shared_path(tmp_path) != _shared_path(data)
    finally:
        assert other.stop() == 0, other.log()[-3000:]


def test_a_broken_store_fails_no_request(server: InferdServer, data: Path):
    """Last in this module: the file is garbage from here on."""
    cached = fresh()
    assert predict(server, "plus", [cached]).headers["x-cache"] == "miss"
    path = _shared_path(data)
    for part in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        with part.open("r+b") as f:  # in place, under the gateway processes
            f.write(b"\xff" * part.stat().st_size)
    x = fresh()
    seen = [predict(server, "plus", [x]).headers["x-cache"] for _ in range(6)]
    assert seen == ["miss"] * 6  # every answer right, none kept
    predict(server, "plus", [cached])  # right, whether or not a process still had it
    assert "result cache: " in server.log()  # said so (at most once a minute each)
