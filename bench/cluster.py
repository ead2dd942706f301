"""inferd across hosts vs on one host, and how fast it heals (needs root: network
namespaces, as tests/test_cluster_hosts.py; PostgreSQL for the failover part).

    .venv/bin/python bench/cluster.py [--rounds 2] [--seconds 8] [--connections 32]

1. **Throughput and p99 of a predict**, closed loop (``inferd bench -c N``) against one
   gateway process and one replica of a trivial Python model (so the path is what is
   measured): ``one host``, ``inferd serve`` (gateway to replica over a Unix socket),
   vs ``two hosts``, ``inferd control`` + ``inferd gateway`` here and ``inferd
   replica`` in another network namespace behind a veth pair and a bridge (TCP, the
   cluster token's handshake once per connection). Rounds alternate; medians.
2. **A dead host leaves routing**: the seconds from killing every inferd process on the
   replica's host (its connection closes), and from cutting its link (its beats stop;
   ``cluster.replica_timeout_s`` 3 s), to the gateway's table having no replica there;
   each ``--rounds`` times with another host serving meanwhile.
3. **Controller failover** (PostgreSQL): two ``inferd control``, the leader killed with
   SIGKILL; the seconds until the follower leads and until the joined replica has
   joined it; ``--rounds`` times, the killed one restarted as the next follower.

Writes bench/results/cluster.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import create_engine, make_url, text  # noqa: E402

from tests import netns  # noqa: E402
from tests.conftest import POSTGRES_URL, InferdServer, free_port, push_source  # noqa: E402
from tests.roles import Role, gateway_role, replica_role, wait  # noqa: E402
from tests.test_cluster_hosts import HOSTNAME_MODEL, _ready, _replicas  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def closed_loop(url: str, out: Path, connections: int, seconds: int) -> dict[str, Any]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "inferd",
            "bench",
            url,
            "--target",
            "predict",
            "--model",
            "where",
            "-c",
            str(connections),
            "--duration",
            f"{seconds}s",
            "--warmup",
            "1s",
            "--body",
            '{"inputs": [{"x": 1}]}',
            "--json",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=seconds + 120,
    )
    (level,) = json.loads(out.read_text())["levels"]
    return {
        "rps": level["rps"],
        "p50_ms": level["latency"]["p50"],
        "p99_ms": level["latency"]["p99"],
        "errors": level["errors"],
        "requests": level["requests"],
    }


def one_host(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    push_source(work, "where", HOSTNAME_MODEL)
    server = InferdServer(work, workers=1)
    try:
        server.wait_ready()
        return closed_loop(server.url, work / "bench.json", args.connections, args.seconds)
    finally:
        server.stop()


def two_hosts(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    push_source(work, "where", HOSTNAME_MODEL)
    with netns.Network() as net:
        b = net.add("b")
        listen, http = f"{net.gateway_address}:{free_port()}", free_port()
        url = f"http://127.0.0.1:{http}"
        roles = [
            Role(work, "control", "control", "--listen", listen, "--no-local-replicas"),
            gateway_role(work, listen, http),
            replica_role(work, "replica", listen, "where", f"{b.address}:9100", netns=b.netns),
        ]
        try:
            wait(lambda: len(_ready(url)) == 1, "the replica on host B", *roles)
            return closed_loop(url, work / "bench.json", args.connections, args.seconds)
        finally:
            for role in reversed(roles):
                role.stop()


def leave_times(work: Path, rounds: int) -> dict[str, list[float]]:
    push_source(work, "where", HOSTNAME_MODEL)
    times: dict[str, list[float]] = {"killed": [], "cut": []}
    with netns.Network() as net:
        b, c = net.add("b"), net.add("c")
        listen, http = f"{net.gateway_address}:{free_port()}", free_port()
        url = f"http://127.0.0.1:{http}"
        roles = [
            Role(work, "control", "control", "--listen", listen, "--no-local-replicas"),
            gateway_role(work, listen, http),
            replica_role(work, "replica-c", listen, "where", f"{c.address}:9100", netns=c.netns),
        ]

        def on_b(name: str) -> Role:
            role = replica_role(work, name, listen, "where", f"{b.address}:9100", netns=b.netns)
            roles.append(role)
            return role

        def gone_after(since: float) -> float:
            """Seconds until only C's replica is routed to."""
            while len(_ready(url)) > 1:
                if time.monotonic() - since > 30:
                    raise RuntimeError(f"host B was still routed to 30 s later: {_replicas(url)}")
                time.sleep(0.02)
            return time.monotonic() - since

        try:
            for i in range(rounds):
                on_b(f"replica-b-k{i}")
                wait(lambda: len(_ready(url)) == 2, "both replicas", *roles)
                killed = time.monotonic()
                b.kill_all()
                times["killed"].append(gone_after(killed))
                on_b(f"replica-b-c{i}")
                wait(lambda: len(_ready(url)) == 2, "both replicas", *roles)
                time.sleep(1.5)  # somewhere between two beats
                cut = time.monotonic()
                b.cut()
                times["cut"].append(gone_after(cut))
                b.restore()
                b.kill_all()
        finally:
            for role in reversed(roles):
                role.stop()
    return times


def failover_times(work: Path, rounds: int) -> dict[str, list[float]]:
    admin = create_engine(POSTGRES_URL)
    schema = f"inferd_bench_{uuid.uuid4().hex}"
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url_db = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    database_url = url_db.render_as_string(hide_password=False)
    env = {"INFERD_DATABASE_URL": database_url, "INFERD_LOG_LEVEL": "INFO"}  # its log lines
    from tests.test_cluster_leader import _register

    _register(work, database_url)
    ports = [free_port(), free_port()]
    controls = ",".join(f"127.0.0.1:{p}" for p in ports)
    times: dict[str, list[float]] = {"leads": [], "replica_joined": []}

    def control(i: int, n: int) -> Role:
        return Role(
            work,
            f"control-{i}-{n}",
            "control",
            "--listen",
            f"127.0.0.1:{ports[i]}",
            "--no-local-replicas",
            env=env,
        )

    leader, follower = control(0, 0), None
    roles = [leader]
    try:
        wait(lambda: "control plane" in leader.log(), "a leader", leader)
        replica = replica_role(
            work, "replica", controls, "where", f"127.0.0.1:{free_port()}", env=env
        )
        roles.append(replica)
        wait(lambda: "joined" in replica.log(), "the replica", replica)
        index = 0
        for n in range(rounds):
            follower = control(1 - index, n + 1)
            roles.append(follower)
            wait(lambda f=follower: "following" in f.log(), "a follower", follower)
            joins = replica.log().count("joined")
            killed = time.monotonic()
            leader.process.kill()
            wait(lambda f=follower: "leads now" in f.log(), "the takeover", follower)
            times["leads"].append(time.monotonic() - killed)
            wait(lambda j=joins: replica.log().count("joined") > j, "the rejoin", replica)
            times["replica_joined"].append(time.monotonic() - killed)
            leader.stop()
            leader, index = follower, 1 - index
    finally:
        for role in reversed(roles):
            role.stop()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "cluster.json")
    args = parser.parse_args()
    if why := netns.available():
        raise SystemExit(f"bench/cluster.py: {why}")
    os.environ.setdefault("INFERD_LOG_LEVEL", "WARNING")
    work = Path(tempfile.mkdtemp(prefix="inferd-cluster-"))
    runs: list[dict[str, Any]] = []
    for n in range(args.rounds):
        for name, run in (("one host", one_host), ("two hosts", two_hosts)):
            result = run(work / f"{name.replace(' ', '-')}-{n}", args)
            runs.append({"round": n, "layout": name, **result})
            print(
                f"round {n} {name:>9}: {result['rps']:8,.0f} req/s  p50 {result['p50_ms']:.2f} ms"
                f"  p99 {result['p99_ms']:.2f} ms  errors {result['errors']}",
                flush=True,
            )
    summary = {}
    for name in ("one host", "two hosts"):
        mine = [r for r in runs if r["layout"] == name]
        summary[name] = {
            k: statistics.median(r[k] for r in mine) for k in ("rps", "p50_ms", "p99_ms")
        }
    summary["two hosts vs one"] = {
        "rps": summary["two hosts"]["rps"] / summary["one host"]["rps"],
        "p99": summary["two hosts"]["p99_ms"] / summary["one host"]["p99_ms"],
    }
    leave = leave_times(work / "leave", args.rounds)
    print(f"left routing after a kill: {leave['killed']}, after a cut: {leave['cut']}", flush=True)
    failover = failover_times(work / "failover", args.rounds)
    print(f"failover: {failover}", flush=True)
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "runs": runs,
        "summary": summary,
        "leave_routing_s": leave,
        "failover_s": failover,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
