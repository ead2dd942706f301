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
    from inferd.observability.logging import configure_logging
    from inferd.server import serve as run_server

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
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Run the control plane alone: registry, controller, autoscaler and the replicas it
    starts here; gateways (`inferd gateway --control`) connect from any host. TCP
    connections must prove cluster.token (INFERD_CLUSTER__TOKEN) and/or mutual TLS."""
    from inferd.observability.logging import configure_logging
    from inferd.server import serve as run_server

    settings = _settings(config, data_dir=data_dir)
    settings.cluster.control_listen = listen or settings.cluster.control_listen or "0.0.0.0:7070"
    if local_replicas is not None:
        settings.cluster.local_replicas = local_replicas
    if jobs_gateway:
        settings.jobs.gateway_url = jobs_gateway
    configure_logging(settings.log_level, settings.log_json, "control")
    _run(run_server(settings, progress=_progress, gateways=False))


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
    from inferd.observability.logging import configure_logging
    from inferd.server import serve_gateways

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
    model: Annotated[str, typer.Option(help="The model to serve.")],
    version: Annotated[str, typer.Option(help="Its version (deployed on the controller).")],
    control: ControlOpt = None,
    listen: Annotated[
        str, typer.Option(help="host:port this replica listens on for gateways.")
    ] = "0.0.0.0:9100",
    advertise: Annotated[
        str | None,
        typer.Option(help="host:port gateways reach it at (default: --listen, unless 0.0.0.0)."),
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Serve one replica of MODEL:VERSION on this host and join the controller: it is
    routed to, health-checked and drained like one the controller started. The files
    come from the S3 artifact store into this host's data folder."""
    import sys

    from inferd import transport
    from inferd.observability.logging import configure_logging
    from inferd.serving.joiner import run_joined

    settings = _settings(config, data_dir=data_dir)
    address = control or settings.cluster.control
    if not address:
        raise typer.BadParameter("give --control HOST:PORT (or cluster.control)")
    host, _, _ = listen.rpartition(":")
    if advertise is None:
        if host in ("0.0.0.0", "::", ""):
            raise typer.BadParameter("--listen binds every address: give --advertise HOST:PORT")
        advertise = listen
    creds = transport.Credentials.from_settings(settings.cluster)
    try:
        creds.check()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    transport.use(creds)
    configure_logging(settings.log_level, settings.log_json, f"replica {model}:{version}")
    code: list[int] = []

    async def main() -> None:
        joined = run_joined(
            address, model, version, listen, f"tcp:{advertise}", settings.data_dir,
            settings.shutdown_grace_s,
        )  # fmt: skip
        code.append(await joined)

    _run(main())
    sys.exit(code[0] if code else 1)
