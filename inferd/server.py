"""The composition root: ``inferd serve`` in one function.

The server process owns the registry, the control plane (:mod:`inferd.control.plane`:
the controller and its replicas, the table publisher, the inference log, ``/metrics``)
and the gateway processes, and handles signals. SIGTERM/SIGINT
shut down in dependency order: gateways stop accepting and finish in-flight requests,
then replicas drain, then the process exits.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path

import inferd
from inferd import tls, transport
from inferd.config import Settings
from inferd.control.gateways import GatewayPool
from inferd.control.leader import Leadership
from inferd.control.plane import ControlPlane
from inferd.jobs.service import JobService
from inferd.registry import Registry, schema
from inferd.routing.cache import prepare_shared, remove_shared

logger = logging.getLogger(__name__)


def _reserve_port(host: str, port: int) -> socket.socket:
    """Fail early on a taken port; for port 0, reserve a free one for all gateways."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        if port:
            # Without SO_REUSEPORT this bind fails if anything holds the port, even
            # another inferd: fail with a clear message instead of sharing its traffic.
            with socket.socket(sock.family) as probe:
                probe.bind((host, port))
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return sock  # held (bound, not listening) until the gateways listen


def _resolve_ports(settings: Settings) -> list[socket.socket]:
    """Check their TLS files, reserve the HTTP port and the gRPC port (unless disabled);
    0 becomes a real port."""
    tls.check(settings.tls)
    http = _reserve_port(settings.host, settings.port)
    settings.port = http.getsockname()[1]
    if settings.grpc_port < 0:
        return [http]
    try:
        grpc = _reserve_port(settings.host, settings.grpc_port)
    except SystemExit:
        http.close()
        raise
    settings.grpc_port = grpc.getsockname()[1]
    return [http, grpc]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _cluster(settings: Settings, tcp: bool) -> None:
    """This process's credentials for TCP (checked when it will use TCP)."""
    creds = transport.Credentials.from_settings(settings.cluster)
    if tcp:
        try:
            creds.check()
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    transport.use(creds)


def _listening_on(settings: Settings) -> str:
    """``http(s)://host:port, gRPC on host:port`` for the start message."""
    secure = settings.tls.cert_file is not None
    where = _http_url(settings)
    if settings.grpc_port >= 0:
        where += f", gRPC{' (TLS)' if secure else ''} on {settings.host}:{settings.grpc_port}"
    if settings.tls.client_ca_file is not None:
        where += ", client certificates required"
    return where


def _http_url(settings: Settings) -> str:
    scheme = "https" if settings.tls.cert_file is not None else "http"
    return f"{scheme}://{settings.host}:{settings.port}"


def _console_at(settings: Settings) -> str:
    """``; console at http(s)://host:port/ui/`` for the start message (when it is on)."""
    return f"; console at {_http_url(settings)}/ui/" if settings.console.enabled else ""


def _own_gateways_tls(settings: Settings, run_dir: Path) -> ssl.SSLContext | None:
    """How the job runner reaches this server's gateways over TLS (None: plain HTTP);
    with client certificates required, the gateways also trust the runner's own."""
    if settings.tls.cert_file is None:
        return None
    context, client_cas = tls.own_gateways_client(settings.tls, run_dir)
    settings.tls.client_ca_file = client_cas or settings.tls.client_ca_file
    return context


def _internal_token(settings: Settings) -> str:
    """The job runner's credential with the gateways: derived from the cluster token
    when there is one (gateways on other hosts derive the same), else random."""
    if settings.cluster.token:
        return hmac.new(settings.cluster.token.encode(), b"jobs", hashlib.sha256).hexdigest()
    return secrets.token_urlsafe(32)


async def serve(
    settings: Settings,
    demo: bool = False,
    progress: Callable[[str], None] = print,
    *,
    gateways: bool = True,
) -> None:
    """``inferd serve`` (``gateways``) or ``inferd control`` (the registry, controller and
    replicas, and the control channel for gateways on other hosts; no gateway here)."""
    # Replicas on other hosts (joined, or Kubernetes pods) are reached over TCP.
    tcp = settings.cluster.control_listen is not None or settings.replica_backend != "local"
    _cluster(settings, tcp=tcp)
    registry = await asyncio.to_thread(Registry.from_settings, settings, False)
    try:
        # The schema, when behind, is upgraded in a child: the server keeps no Alembic.
        url = settings.resolved_database_url
        await asyncio.to_thread(schema.upgrade_isolated, registry.engine, url)
        # One controller writes desired state; others wait (PostgreSQL) or are refused.
        leadership = await Leadership.acquire(registry.engine, settings, progress)
    except BaseException:
        registry.close()
        raise
    if demo:
        from inferd.demo.install import install_demo_isolated

        await install_demo_isolated(settings, progress)
    if gateways and not settings.auth.enabled and not _loopback(settings.host):
        warning = (
            f"WARNING: serving on {settings.host} WITHOUT AUTHENTICATION: anyone who can "
            "reach this port can run, deploy and delete models. Turn it on with "
            "INFERD_AUTH__ENABLED=true and create a key with `inferd keys create`."
        )
        logger.warning(warning)
        progress(warning)
    reserved = _resolve_ports(settings) if gateways else []
    # The job runner's credential with the gateways (they get it in their settings).
    settings.auth.internal_token = _internal_token(settings)
    run_dir = settings.run_dir or Path(tempfile.mkdtemp(prefix="inferd-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    own_tls = _own_gateways_tls(settings, run_dir) if gateways else None
    shared_cache = prepare_shared(settings) if gateways else None  # before the gateways
    plane = ControlPlane(settings, registry, run_dir)
    plane.console.role = "serve" if gateways else "control"
    plane.console.leader = {
        "host": socket.gethostname(), "pid": os.getpid(), "lock": leadership.how,
        "since": leadership.since,
    }  # fmt: skip
    pool = GatewayPool(settings, plane.control_socket)
    plane.gateway_pids = lambda: [p.pid for p in pool.processes]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    abdicate = loop.create_task(leadership.lost.wait())
    abdicate.add_done_callback(lambda _: stop.set())
    try:
        await plane.start()
        models = ", ".join(sorted(plane.controller.models)) or "none yet"
        if gateways:
            await pool.start()
            for sock in reserved:
                sock.close()
        if settings.jobs.runner and (gateways or settings.jobs.gateway_url):
            plane.jobs = JobService(settings, registry, own_tls)
            await plane.jobs.start()
        if gateways:
            progress(
                f"inferd {inferd.__version__} serving on {_listening_on(settings)} "
                f"({settings.gateway_workers} gateway process(es)); models: {models}"
                + _console_at(settings)
            )
        else:
            progress(
                f"inferd {inferd.__version__} control plane: gateways and replicas connect to "
                f"{settings.cluster.control_listen}; models: {models}"
            )
        await stop.wait()
        progress("shutting down: draining gateways, then replicas")
    finally:
        if plane.jobs is not None:
            await plane.jobs.stop()  # what runs comes back from the queue after its lease
        abdicate.cancel()
        await pool.stop()
        remove_shared(shared_cache)
        await plane.stop()
        await leadership.release()
        registry.close()
        if settings.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    if leadership.lost.is_set():
        raise SystemExit(f"stopped leading: {leadership.why}")
    logger.info("stopped")


async def serve_gateways(
    settings: Settings, control: str, progress: Callable[[str], None] = print
) -> None:
    """``inferd gateway``: gateway processes on this host following the controller at
    ``control`` (``host:port`` of ``inferd control``); they keep serving their last
    routing table while it is unreachable, and reconnect."""
    _cluster(settings, tcp=True)
    reserved = _resolve_ports(settings)
    settings.auth.internal_token = _internal_token(settings)
    shared_cache = prepare_shared(settings)
    pool = GatewayPool(settings, control)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        # A gateway starts once the controller answers: stopping meanwhile is allowed.
        starting = asyncio.create_task(pool.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return
        stopping.cancel()
        starting.result()
        for sock in reserved:
            sock.close()
        progress(
            f"inferd {inferd.__version__} gateway on {_listening_on(settings)} "
            f"({settings.gateway_workers} process(es)), following the controller at {control}"
        )
        await stop.wait()
        progress("shutting down: draining gateways")
    finally:
        await pool.stop()
        remove_shared(shared_cache)
