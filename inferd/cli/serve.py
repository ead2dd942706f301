"""``inferd serve``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    pass
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
