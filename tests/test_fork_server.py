"""Replica processes forked from the fork server (``models.fork_server``), on the real
server: who their parent is, what they start with, how they end and restart, and what
happens when the fork server itself dies."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import InferdServer, push_source

pytestmark = pytest.mark.slow

# At load: a draw from numpy's global generator (a fork copies its state: each replica
# must draw its own), the count of BLAS threads (the replica's ``threads``, set after
# the fork for the pools loaded before it) and whether sklearn was imported before the
# model loaded (the fork server imported it: the replica did not pay for it).
PROBE = """
import os, sys
import numpy as np

# Whether the fork server had imported colorsys (a module only this model uses) before
# forking this replica: it learns it from the first replica's report. And a mark that this
# model's own code ran in this process (never in the fork server's).
LEARNED = "colorsys" in sys.modules
import colorsys
if "PROBE_MARKS" in os.environ:  # not at push time, in the test's own process
    open(os.path.join(os.environ["PROBE_MARKS"], str(os.getpid())), "w").close()

class Probe:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP64", "shape": [-1, 5]}],
    }

    def __init__(self):
        from threadpoolctl import threadpool_info
        self.draw = float(np.random.random())
        self.blas = max((p["num_threads"] for p in threadpool_info()), default=-1)

    def predict(self, batch):
        row = [self.draw, os.getpid(), os.getppid(), self.blas, float(LEARNED)]
        return {"y": np.asarray([row] * len(batch["x"]), dtype=np.float64)}
"""


def _ask(client: httpx.Client, model: str = "probe") -> list[float]:
    reply = client.post(f"/api/v1/models/{model}/predict", json={"inputs": [1.0]})
    assert reply.status_code == 200, reply.text
    return reply.json()["outputs"][0]["y"]


def _replicas(server: InferdServer, model: str = "probe") -> list[dict]:
    detail = server.client.get(f"/api/v1/models/{model}").json()
    version = next(v for v in detail["versions"] if v["version"] == detail["serving_version"])
    return version["replicas"]


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _sockets(pid: int) -> set[str]:
    links = (os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
    return {link for link in links if link.startswith("socket:")}


def _ready(server: InferdServer, count: int) -> bool:
    replicas = _replicas(server)
    return len(replicas) == count and all(r["state"] == "ready" for r in replicas)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("forks")
    push_source(data, "probe", PROBE, "--batching", '{"replicas": 2}')
    marks = data / "marks"
    marks.mkdir()
    srv = InferdServer(data, env={"INFERD_LOAD_TIMEOUT_S": "30", "PROBE_MARKS": str(marks)})
    try:
        srv.wait_ready(path="/health/live")
        srv.wait_for(lambda: _ready(srv, 2), timeout_s=90, what="two probe replicas")
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def _answers(server: InferdServer, n: int = 40) -> dict[int, list[float]]:
    """Each replica's answer, by its pid (concurrent requests: both replicas answer)."""
    with ThreadPoolExecutor(8) as pool:
        rows = list(pool.map(lambda _: _ask(server.client), range(n)))
    return {int(row[1]): row for row in rows}


def _forked(server: InferdServer, answers: dict[int, list[float]]) -> dict[int, list[float]]:
    return {pid: row for pid, row in answers.items() if int(row[2]) != server.process.pid}


def test_a_frameworks_first_replica_starts_from_scratch_and_the_next_is_forked(
    server: InferdServer,
):
    server.wait_for(lambda: len(_answers(server)) == 2, what="both replicas answering")
    answers = _answers(server)
    assert {r["pid"] for r in _replicas(server)} == set(answers)
    (scratch,) = set(answers) - set(_forked(server, answers))
    assert "inferd.serving.replica_server" in _command(scratch)
    ((forked, row),) = _forked(server, answers).items()
    zygote = int(row[2])
    assert "inferd.serving.zygote" in _command(zygote)
    assert zygote in _children(server.process.pid)
    assert not _sockets(zygote) & _sockets(forked)  # the fork server's socket is its own
    assert {row[3] for row in answers.values()} == {1.0}  # threads: 1, after the fork too


def _restart(server: InferdServer, victim: int) -> int:
    """Kill ``victim``; the pid of the replica that replaced it, once both serve."""
    before = {r["pid"] for r in _replicas(server)}
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        pids = {r["pid"] for r in _replicas(server)}
        return _ready(server, 2) and victim not in pids

    server.wait_for(replaced, timeout_s=60, what="the replica restarted")
    server.wait_for(lambda: len(_answers(server)) == 2, what="both replicas answering")
    (restarted,) = {r["pid"] for r in _replicas(server)} - before
    return restarted


def test_restarts_are_forked_with_their_own_seeds_and_what_the_first_reported(
    server: InferdServer,
):
    server.wait_for(lambda: len(_answers(server)) == 2, what="both replicas answering")
    (scratch,) = set(_answers(server)) - set(_forked(server, _answers(server)))
    restarted = _restart(server, scratch)
    answers = _answers(server)
    assert set(_forked(server, answers)) == set(answers)  # both forked now
    (zygote,) = {int(row[2]) for row in answers.values()}  # by one fork server
    draws = {row[0] for row in answers.values()}
    assert len(draws) == 2, "both replicas drew the same number: the fork copied the seed"
    # forked after the first forked replica reported what it imported: colorsys was
    # loaded already; the model's own code ran in its replicas only, never in the fork
    # server
    assert answers[restarted][4] == 1.0
    marks = {int(p.name) for p in (server.data_dir / "marks").iterdir()}
    assert zygote not in marks and set(answers) <= marks
    # a forked replica killed says how it ended, and is forked again
    again = _restart(server, restarted)
    assert server.log().count("exited with code -9") == 2
    assert int(_answers(server)[again][2]) == zygote


def test_a_dead_fork_server_takes_its_replicas_and_the_next_start_forks_anew(
    server: InferdServer,
):
    server.wait_for(lambda: len(_answers(server)) == 2, what="both replicas answering")
    (zygote,) = {int(row[2]) for row in _answers(server).values()}
    before = {r["pid"] for r in _replicas(server)}
    os.kill(zygote, signal.SIGKILL)

    def anew() -> bool:
        pids = {r["pid"] for r in _replicas(server)}
        return _ready(server, 2) and not pids & before

    server.wait_for(anew, timeout_s=90, what="both replicas restarted")
    parents = {int(row[2]) for row in _answers(server).values()}
    assert len(parents) == 1 and zygote not in parents
    assert "inferd.serving.zygote" in _command(parents.pop())
    assert "the replicas' fork server is gone" in server.log()


def test_with_the_fork_server_off_replicas_are_the_servers_children(tmp_path: Path):
    push_source(tmp_path, "probe", PROBE)
    srv = InferdServer(tmp_path, env={"INFERD_MODELS__FORK_SERVER": "false"})
    try:
        srv.wait_ready()
        row = _ask(srv.client)
        assert int(row[2]) == srv.process.pid
        assert "inferd.serving.replica_server" in _command(int(row[1]))
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
