"""``inferd serve``, and its roles on their own: ``inferd control``, ``inferd gateway``."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Annotated, Any

import typer

from inferd.cli.common import ConfigOpt, DataDirOpt, _progress, _settings, app

HostOpt = Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")]
PortOpt = Annotated[int | None, typer.Option(help="HTTP port (default 8000).")]
GrpcPortOpt = Annotated[int | None, typer.Option(help="gRPC port (default 8001; -1: no gRPC).")]
WorkersOpt = Annotated[int | None, typer.Option(help="Gateway processes.")]
ControlOpt = Annotated[
    str | None,
    typer.Option(help="host:port[,host:port] of `inferd control` (cluster.control)."),
]


@app.command()
def serve(
    demo: Annotated[bool, typer.Option(help="Build, register and serve the demo models.")] = False,
    host: HostOpt = None,
    port: PortOpt = None,
    grpc_port: GrpcPortOpt = None,
    workers: WorkersOpt = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Start the server: gateway processes on HOST:PORT (HTTP) and HOST:GRPC_PORT (the
    Open Inference Protocol's gRPC service), and one replica per model."""
    from inferd.server import serve as run_server
    from inferd.telemetry.logging import configure_logging

    settings = _settings(
        config,
        host=host,
        port=port,
        grpc_port=grpc_port,
        gateway_workers=workers,
        data_dir=data_dir,
    )
    configure_logging(settings.log_level, settings.log_json, "server")
    _run(run_server(settings, demo=demo, progress=_progress))


@app.command()
def control(
    listen: Annotated[
        str | None,
        typer.Option(
            help="host:port where gateways and replicas on other hosts connect "
            "(cluster.control_listen; default 0.0.0.0:7070)."
        ),
    ] = None,
    local_replicas: Annotated[
        bool | None,
        typer.Option(
            "--local-replicas/--no-local-replicas",
            help="Start replicas on this host too (cluster.local_replicas; default on).",
        ),
    ] = None,
    jobs_gateway: Annotated[
        str | None,
        typer.Option(
            help="Run the batch job runner here, sending its requests to this gateway "
            "(http://host:port; jobs.gateway_url). Without it no job runs here."
        ),
    ] = None,
    demo: Annotated[
        bool, typer.Option(help="Build and register the demo models (as `serve --demo`).")
    ] = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Run the control plane alone: registry, controller, autoscaler and the replicas it
    starts here; gateways (`inferd gateway --control`) connect from any host. TCP
    connections must prove cluster.token (INFERD_CLUSTER__TOKEN) and/or mutual TLS."""
    from inferd.server import serve as run_server
    from inferd.telemetry.logging import configure_logging

    settings = _settings(config, data_dir=data_dir)
    settings.cluster.control_listen = listen or settings.cluster.control_listen or "0.0.0.0:7070"
    if local_replicas is not None:
        settings.cluster.local_replicas = local_replicas
    if jobs_gateway:
        settings.jobs.gateway_url = jobs_gateway
    configure_logging(settings.log_level, settings.log_json, "control")
    _run(run_server(settings, demo=demo, progress=_progress, gateways=False))


@app.command()
def gateway(
    control: ControlOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    grpc_port: GrpcPortOpt = None,
    workers: WorkersOpt = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Run gateways only (HTTP and gRPC), following `inferd control` on another host:
    stateless, as many as you like; they keep serving with the last routing table while
    the controller is unreachable, and reconnect."""
    from inferd.server import serve_gateways
    from inferd.telemetry.logging import configure_logging

    settings = _settings(
        config, host=host, port=port, grpc_port=grpc_port, gateway_workers=workers,
        data_dir=data_dir,
    )  # fmt: skip
    address = control or settings.cluster.control
    if not address:
        raise typer.BadParameter("give --control HOST:PORT (or cluster.control)")
    configure_logging(settings.log_level, settings.log_json, "gateway")
    _run(serve_gateways(settings, address, progress=_progress))


def _run(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        import asyncio

        asyncio.run(main)


@app.command()
def replica(
    model: Annotated[str | None, typer.Option(help="The model to serve.")] = None,
    version: Annotated[
        str | None, typer.Option(help="Its version (deployed on the controller).")
    ] = None,
    control: ControlOpt = None,
    listen: Annotated[
        str, typer.Option(help="host:port this replica listens on for gateways.")
    ] = "0.0.0.0:9100",
    advertise: Annotated[
        str | None,
        typer.Option(help="host:port gateways reach it at (default: --listen, unless 0.0.0.0)."),
    ] = None,
    spec_env: Annotated[
        str | None,
        typer.Option(
            help="Serve the replica spec (JSON) in this environment variable instead of "
            "joining a controller (Kubernetes pods: the controller finds them through the API)."
        ),
    ] = None,
    health_listen: Annotated[
        str | None,
        typer.Option(help="host:port answering GET /health/live and /health/ready (probes)."),
    ] = None,
    replica_id: Annotated[
        str | None, typer.Option(help="With --spec-env: its id (default: the host name).")
    ] = None,
    fetch_only: Annotated[
        bool,
        typer.Option(
            help="With --spec-env: fetch and check the version's files into the artifact "
            "cache (a cached entry hashed again), then exit (a pod's fetch step)."
        ),
    ] = False,
    read_only_cache: Annotated[
        bool,
        typer.Option(
            help="With --spec-env: the artifact cache is a node's, read-only here, filled "
            "by the pod's fetch step; an entry gone since is fetched into the data folder."
        ),
    ] = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Serve one replica of MODEL:VERSION on this host and join the controller: it is
    routed to, health-checked and drained like one the controller started. The files
    come from the S3 artifact store into this host's data folder. With --spec-env it
    joins nothing: it serves the spec it was handed (a Kubernetes replica pod)."""
    import os
    import socket
    import sys

    from inferd import transport
    from inferd.telemetry.logging import configure_logging

    settings = _settings(config, data_dir=data_dir)
    creds = transport.Credentials.from_settings(settings.cluster)
    try:
        creds.check()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    code: list[int] = []
    if spec_env is not None:
        from inferd.serving import pod as pods

        try:
            spec = pods.spec_of(os.environ.get(spec_env) or "")
        except ValueError as exc:
            raise typer.BadParameter(f"${spec_env}: {exc}") from None
        transport.use(creds)
        configure_logging(
            settings.log_level, settings.log_json, f"replica {spec.model}:{spec.version}"
        )
        cache = (settings.artifact_cache_dir, settings.artifact_cache_max_bytes)
        if fetch_only:
            sys.exit(pods.fetch_only(spec, cache))
        own = None
        if read_only_cache:
            own = ((settings.data_dir / "artifact-cache").resolve(), cache[1])

        async def pod() -> None:
            health = health_listen or f"0.0.0.0:{settings.kubernetes.health_port}"
            rid = replica_id or socket.gethostname()
            grace = settings.shutdown_grace_s
            code.append(await pods.run_pod(spec, rid, listen, health, cache, grace, own))

        _run(pod())
        sys.exit(code[0] if code else 1)
    from inferd.serving.joiner import run_joined

    if not model or not version:
        raise typer.BadParameter("give --model and --version (or --spec-env)")
    address = control or settings.cluster.control
    if not address:
        raise typer.BadParameter("give --control HOST:PORT (or cluster.control)")
    host, _, _ = listen.rpartition(":")
    if advertise is None:
        if host in ("0.0.0.0", "::", ""):
            raise typer.BadParameter("--listen binds every address: give --advertise HOST:PORT")
        advertise = listen
    transport.use(creds)
    configure_logging(settings.log_level, settings.log_json, f"replica {model}:{version}")

    async def main() -> None:
        joined = run_joined(
            address, model, version, listen, f"tcp:{advertise}",
            (settings.artifact_cache_dir, settings.artifact_cache_max_bytes),
            settings.shutdown_grace_s,
        )  # fmt: skip
        code.append(await joined)

    _run(main())
    sys.exit(code[0] if code else 1)
