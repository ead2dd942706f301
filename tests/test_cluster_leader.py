"""Two ``inferd control`` processes on one PostgreSQL registry: one leads (an advisory
lock), the other follows and writes nothing; killing the leader under load hands
over to the follower with no failed request (the gateway and the joined replica move to
it), and deployments change again through the new leader. With SQLite a second
controller is refused with the reason."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from inferd.registry import Registry
from inferd.runtimes import inspect_artifact
from tests.conftest import free_port
from tests.roles import Role, gateway_role, replica_role, wait
from tests.test_cluster_hosts import HOSTNAME_MODEL, Load

pytestmark = pytest.mark.slow


def _register(data: Path, database_url: str) -> None:
    src = data / "src"
    src.mkdir(parents=True)
    (src / "model.py").write_text(HOSTNAME_MODEL)
    framework, signature = inspect_artifact(src, None, {}, None)
    with Registry(database_url, data / "artifacts") as registry:
        registry.push("where", src, "v1", framework=framework, signature=signature)


@pytest.mark.postgres
def test_the_follower_takes_over_when_the_leader_dies_and_nothing_fails(
    tmp_path: Path, postgres_url: str
):
    _register(tmp_path, postgres_url)
    env = {"INFERD_DATABASE_URL": postgres_url}
    first, second, http, rport = free_port(), free_port(), free_port(), free_port()
    controls = f"127.0.0.1:{first},127.0.0.1:{second}"
    url = f"http://127.0.0.1:{http}"
    leader = Role(
        tmp_path, "control-1", "control", "--listen", f"127.0.0.1:{first}",
        "--no-local-replicas", env=env,
    )  # fmt: skip
    roles = [leader]
    try:
        wait(lambda: "control plane" in leader.log(), "the first controller leading", leader)
        follower = Role(
            tmp_path, "control-2", "control", "--listen", f"127.0.0.1:{second}",
            "--no-local-replicas", env=env,
        )  # fmt: skip
        roles.append(follower)
        wait(lambda: "following" in follower.log(), "the second one following", follower)
        gateway = gateway_role(tmp_path, controls, http, env=env)
        replica = replica_role(
            tmp_path, "replica", controls, "where", f"127.0.0.1:{rport}", env={"HOST_TAG": "r"}
        )
        roles += [gateway, replica]
        body = {"model": "where", "input": {"x": 1.0}}
        wait(
            lambda: httpx.post(f"{url}/api/v1/predict", json=body).status_code == 200,
            "a prediction",
            *roles,
        )
        assert "deploying" not in follower.log()  # a follower reconciles nothing

        load = Load(url, tmp_path / "failover.json", rate=40, seconds=10)
        load.under_way(*roles)
        killed = time.monotonic()
        leader.process.send_signal(signal.SIGKILL)
        wait(lambda: "leads now" in follower.log(), "the takeover", follower, timeout_s=15)
        took_over = time.monotonic() - killed
        wait(lambda: "joined 127.0.0.1" in replica.log().split("lost the controller")[-1],
             "the replica joining the new leader", replica, timeout_s=15)  # fmt: skip
        rejoined = time.monotonic() - killed
        run = load.report()
        assert run["errors"] == 0 and run["requests"] >= 300, run
        assert took_over <= 10, took_over

        # the new leader applies deployment changes
        changed = httpx.post(
            f"{url}/api/v1/deployments",
            json={"model_name": "where", "version": "v1", "resources": {"replicas": 2}},
        )
        assert changed.status_code == 201, changed.text

        def desired() -> int:
            shown = httpx.get(f"{url}/api/v1/deployments/where").json()
            return shown["versions"][0]["replicas_desired"]

        wait(lambda: desired() == 2, "the new leader's routing table", *roles)
        print(f"\nthe follower led {took_over:.2f}s after the leader's kill -9; "
              f"the replica had joined it {rejoined:.2f}s after")  # fmt: skip
    finally:
        for role in reversed(roles):
            role.stop()


def test_a_second_controller_on_a_sqlite_registry_is_refused(tmp_path: Path):
    first = Role(tmp_path, "control-1", "control", "--listen", f"127.0.0.1:{free_port()}")
    try:
        wait(lambda: "control plane" in first.log(), "the first controller", first)
        second = Role(tmp_path, "control-2", "control", "--listen", f"127.0.0.1:{free_port()}")
        assert second.process.wait(60) != 0
        second.stop()
        assert "another controller" in second.log()
        assert "needs a PostgreSQL registry" in second.log()
    finally:
        first.stop()
