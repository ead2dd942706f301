"""A gateway process: follows the routing table and serves HTTP on the shared port.

Started by ``inferd serve`` (``python -m inferd.api.worker SETTINGS_JSON CONTROL_SOCKET``).
Several gateway processes bind the same port with SO_REUSEPORT, so the kernel spreads
connections evenly across them. A gateway prints ``LISTENING`` on stdout once it accepts
connections, and exits when it loses the controller.

The registry's database (and SQLAlchemy with it, ~20 MiB a process) is opened on first
use (:func:`on_first_use`): the predict path never reads it (routing tables say what
runs), so a gateway that only serves predictions never loads the database layer. Routes
that read the registry, jobs, API keys (``auth.enabled``: opened at start) and pinned
versions not yet in a table open it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import uvicorn

from inferd import transport
from inferd.access.limits import rate_limits_for
from inferd.api.app import create_app
from inferd.config import Settings, TLSConfig
from inferd.control.gateways import SETTINGS_VAR
from inferd.errors import ModelNotFound
from inferd.jobs import Jobs
from inferd.jobs.queue import queue_for
from inferd.process import die_with_parent, freeze_heap
from inferd.routing.cache import cache_for
from inferd.routing.dataplane import DataPlane
from inferd.routing.prefix import BYTES_PER_TOKEN
from inferd.routing.router import Router
from inferd.telemetry import tracing
from inferd.telemetry.log_rows import LogShipper
from inferd.telemetry.logging import configure_logging

if TYPE_CHECKING:
    from inferd.jobs.store import JobStore
    from inferd.registry import Registry

T = TypeVar("T")


@dataclass
class Gateway:
    """One gateway's app and what it holds: built the same way by a gateway process and
    by the in-process test tier."""

    app: Any
    router: Router
    registry: Registry
    inference_log: LogShipper
    cache: Any
    limits: Any
    jobs: Jobs
    plane: DataPlane

    async def close(self) -> None:
        self.router.close()
        self.inference_log.close()  # what is left, to the server
        if self.cache is not None:
            await self.cache.close()
        if self.limits is not None:
            await self.limits.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.jobs.queue.close(), 5.0)
        self.registry.close()


async def build_gateway(settings: Settings, control: str | Path) -> Gateway:
    """Follow the controller's routing tables and build the app; returns once the first
    table arrived. ``control``: the server's Unix socket (a path), or ``host:port`` of
    ``inferd control`` on another host (then the gateway outlives losing it)."""
    transport.use(transport.Credentials.from_settings(settings.cluster))
    llm = settings.llm
    router = Router(
        settings.hold_timeout_s,
        settings.hold_max_requests,
        prefix_block_bytes=BYTES_PER_TOKEN * llm.block_size if llm.prefix_routing else 0,
        prefix_margin=llm.prefix_routing_margin,
        prefix_move_tokens=llm.prefix_routing_move_tokens,
    )
    address = control if isinstance(control, Path) else _address(control)
    router.server.reconnect = isinstance(address, str) and transport.split(address)[0] == "tcp"
    await router.follow(address)
    registry = on_first_use(lambda: _open_registry(settings))

    def deployed(model: str, version: str | None) -> bool:  # called in a worker thread
        if version is not None:
            return registry.deployments.runs(model, version)
        try:
            registry.latest_version(model)  # registered: the next table lists it
        except ModelNotFound:
            return False
        return True

    router.holds.deployed = deployed
    # Rows go to the server even with the log off: /metrics counts requests from them.
    cfg = settings.inference_log
    inference_log = LogShipper(
        router.server.send_log_rows, cfg.flush_interval_s, cfg.max_buffer_rows, cfg.enabled
    )
    payloads = settings.payload_log
    if payloads.sinks and payloads.payloads:  # bodies ride with sampled rows to the sinks
        inference_log.payload_rate = payloads.sample_rate
        inference_log.max_payload_bytes = payloads.max_payload_bytes
        inference_log.max_payload_buffer_bytes = int(payloads.max_buffer_mb * 1024 * 1024)
    inference_log.start()
    cache = cache_for(settings) if settings.cache.enabled else None
    limits = rate_limits_for(settings)  # one per process: HTTP and gRPC share the budgets
    store = on_first_use(lambda: _job_store(registry))
    jobs = Jobs(settings, store, queue_for(settings.resolved_queue_url))
    # One data plane per process, for its HTTP routes and its gRPC service alike.
    plane = DataPlane(router, settings.request_timeout_s, cache, settings.cache.ttl_s)
    app = create_app(settings, router, registry, inference_log, cache, limits, jobs, plane)
    return Gateway(app, router, registry, inference_log, cache, limits, jobs, plane)


def _open_registry(settings: Settings) -> Registry:
    from inferd.registry import Registry

    return Registry.from_settings(settings, migrate=False)


def _job_store(registry: Registry) -> JobStore:
    from inferd.jobs.store import JobStore

    return JobStore(registry.engine)


class _OnFirstUse:
    """Stands for the object ``build`` returns, built when an attribute is first read
    (once, under a lock: routes read it from worker threads too). ``close`` closes it
    only if it was built."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._target: Any = None

    def __getattr__(self, name: str) -> Any:
        target = self._target
        if target is None:
            with self._lock:
                if self._target is None:
                    self._target = self._build()
                target = self._target
        return getattr(target, name)

    def close(self) -> None:
        if self._target is not None:
            self._target.close()


def on_first_use(build: Callable[[], T]) -> T:
    """What ``build`` returns, built on first use (see :class:`_OnFirstUse`)."""
    return cast(T, _OnFirstUse(build))


def _address(control: str) -> str | Path:
    return Path(control) if control.startswith("/") else control


async def run_gateway(settings: Settings, control: str | Path) -> None:
    from inferd.api.http_protocol import HttpBounds, HttpProtocol, sweep_forever

    gateway = await build_gateway(settings, control)
    freeze_heap()
    limits = settings.connections
    bounds = HttpBounds(
        limits.max_per_process, limits.header_timeout_s, limits.body_timeout_s,
        limits.max_header_bytes,
    )  # fmt: skip
    config = uvicorn.Config(
        gateway.app,
        loop="none",
        http=HttpProtocol.bounded(bounds),
        lifespan="off",
        access_log=False,
        log_config=None,
        backlog=4096,
        proxy_headers=False,
        timeout_keep_alive=limits.idle_s,  # type: ignore[arg-type]  # a float works
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        **_tls_options(settings.tls),
    )
    server = uvicorn.Server(config)

    def stop_serving() -> None:
        server.should_exit = True

    gateway.router.server.on_lost = stop_serving
    sock = transport.bind_socket(settings.host, settings.port)
    sock.listen(config.backlog)
    grpc_server = None
    if settings.grpc_port >= 0:
        from inferd.grpc.service import start_server

        g = gateway
        grpc_server = await start_server(
            g.router, g.registry, settings, g.plane, g.inference_log, g.limits
        )
    loop = asyncio.get_running_loop()
    sweeper = loop.create_task(sweep_forever(server.server_state.connections, bounds))
    loop.call_soon(_listening)
    stopping = None
    if grpc_server is not None:
        stopping = loop.create_task(_stop_grpc_with(server, grpc_server, settings))
    try:
        await server.serve(sockets=[sock])
    finally:
        sweeper.cancel()
        if stopping is not None:
            await stopping
        await gateway.close()


def _tls_options(tls: TLSConfig) -> dict[str, Any]:
    """uvicorn's TLS options for ``settings.tls`` (none: plain HTTP). Each gateway process
    wraps its own connections; the shared port (SO_REUSEPORT) is unchanged."""
    if tls.cert_file is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.client_ca_file is not None:
        options.update(ssl_cert_reqs=ssl.CERT_REQUIRED, ssl_ca_certs=str(tls.client_ca_file))
    return options


def _listening() -> None:
    """Tell the server this gateway accepts connections (its one line of stdout), then
    point stdout at stderr: nobody reads the pipe after that line, and anything else
    printed (a console trace exporter, a library) would fill it and block the process."""
    print("LISTENING", flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


async def _stop_grpc_with(server: uvicorn.Server, grpc_server: Any, settings: Settings) -> None:
    """When the HTTP server starts its graceful shutdown, gRPC does too: new calls are
    refused, running ones get the same grace, then are cancelled."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    await grpc_server.stop(settings.shutdown_grace_s)


def main() -> None:
    # The settings come in the environment (readable by this user only), not on the
    # command line: they may hold the cluster token.
    settings = Settings.model_validate_json(os.environ.pop(SETTINGS_VAR))
    control = sys.argv[1]
    configure_logging(settings.log_level, settings.log_json, "gateway")
    die_with_parent()
    tracing.configure("gateway")
    import uvloop

    try:
        uvloop.run(run_gateway(settings, control))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
