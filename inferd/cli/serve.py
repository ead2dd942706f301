"""``inferd serve``, and its roles on their own: ``inferd control``, ``inferd gateway``."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Annotated, Any

import typer

from inferd.cli.common import ConfigOpt, DataDirOpt, _progress, _settings, app


@app.command()
def serve(
    demo: Annotated[bool, typer.Option(help="Build, register and serve the demo models.")] = False,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).")] = None,
    grpc_port: Annotated[
        int | None, typer.Option(help="gRPC port (default 8001; -1: no gRPC).")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Gateway processes.")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Start the server: gateway processes on HOST:PORT (HTTP) and HOST:GRPC_PORT (the
    Open Inference Protocol's gRPC service), and one replica per model."""
    import asyncio

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
    try:
        import uvloop

        uvloop.run(run_server(settings, demo=demo, progress=_progress))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(run_server(settings, demo=demo, progress=_progress))


@app.command()
def control(
    listen: Annotated[
        str | None,
        typer.Option(
            help="host:port where gateways and replicas on other hosts connect "
            "(cluster.control_listen; default 0.0.0.0:7070)."
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
    settings.jobs.runner = False  # it calls a gateway: run it with `inferd serve` for now
    configure_logging(settings.log_level, settings.log_json, "control")
    _run(run_server(settings, progress=_progress, gateways=False))


@app.command()
def gateway(
    control: Annotated[
        str | None,
        typer.Option(
            help="host:port of `inferd control` (cluster.control; INFERD_CLUSTER__CONTROL)."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).")] = None,
    grpc_port: Annotated[
        int | None, typer.Option(help="gRPC port (default 8001; -1: no gRPC).")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Gateway processes.")] = None,
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
