"""The composition root: ``inferd serve`` in one function.

The server process owns the registry, the controller (which starts and watches
replica processes) and the gateway processes, and handles signals. SIGTERM/SIGINT
shut down in dependency order: gateways stop accepting and finish in-flight requests,
then replicas drain, then the process exits.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import inferd
from inferd.config import Settings
from inferd.control.controller import Controller
from inferd.control.gateways import GatewayPool
from inferd.control.publisher import TablePublisher
from inferd.jobs.service import JobService
from inferd.observability import feedback
from inferd.observability.exposition import (
    RequestMetrics,
    Text,
    replica_statuses,
    write_accuracy,
    write_gpus,
    write_processes,
    write_replicas,
    write_requests,
)
from inferd.observability.inference_log import InferenceLog, log_engine, maintain
from inferd.registry import Registry
from inferd.routing.table import LogRows

logger = logging.getLogger(__name__)
UPKEEP_INTERVAL_S = 3600.0
"""How often old inference log rows go and new partitions are made."""


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
    """Reserve the HTTP port and the gRPC port (unless disabled); 0 becomes a real port."""
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


def _log_upkeep(registry: Registry, settings: Settings) -> None:
    """Inference log partitions ahead (PostgreSQL) and retention."""
    cfg = settings.inference_log
    done = maintain(registry.write_engine, cfg.retention_days, cfg.partitions_ahead_days)
    if done.created or done.dropped or done.deleted_rows:
        logger.info(
            "inference log: created %s, dropped %s, deleted %d old row(s)",
            done.created or "no partition", done.dropped or "no partition", done.deleted_rows,
        )  # fmt: skip


async def _log_upkeep_forever(registry: Registry, settings: Settings) -> None:
    while True:
        await asyncio.sleep(UPKEEP_INTERVAL_S)
        try:
            await asyncio.to_thread(_log_upkeep, registry, settings)
        except Exception:
            logger.exception("inference log upkeep failed; retrying in an hour")


def _take_rows(
    settings: Settings, publisher: TablePublisher, requests: RequestMetrics
) -> InferenceLog | None:
    """What gateways ship: request rows and counters feed ``requests`` (``/metrics``)
    and, when the inference log is on, the returned writer."""
    writer = None
    if settings.inference_log.enabled:
        cfg = settings.inference_log
        engine = log_engine(settings.resolved_database_url)
        writer = InferenceLog(engine, cfg.flush_interval_s, cfg.max_buffer_rows)
        writer.start()

    def on_log_rows(message: LogRows) -> None:
        requests.observe(message.rows)
        if message.counters:
            requests.add_counters(message.counters)
        if writer is not None:
            writer.extend(message.rows)

    publisher.on_log_rows = on_log_rows
    return writer


async def render_metrics(
    requests: RequestMetrics,
    controller: Controller,
    gateways: GatewayPool,
    writer: InferenceLog | None = None,
    registry: Registry | None = None,
    jobs: JobService | None = None,
) -> str:
    """``/metrics``: requests from every gateway, then every replica and process, then
    accuracy from feedback."""
    out = Text()
    write_requests(out, requests, 0 if writer is None else writer.dropped)
    states, reachable = [], []
    processes = [({"process": "server", "id": "server"}, os.getpid())]
    for i, process in enumerate(gateways.processes):
        processes.append(({"process": "gateway", "id": str(i)}, process.pid))
    for name, model in controller.models.items():
        for version, vset in model.versions.items():
            for replica in vset.replicas:
                labels = {"model": name, "version": version, "replica": replica.id}
                states.append((labels, replica.state.value, replica.restarts))
                if replica.state in ("ready", "draining"):
                    reachable.append((labels, replica.address))
                if replica.pid:
                    processes.append(({"process": "replica", "id": replica.id}, replica.pid))
    write_replicas(out, states, await replica_statuses(reachable))
    write_processes(out, processes)
    write_gpus(out)
    if registry is not None and writer is not None:  # feedback needs the inference log
        await _write_accuracy(out, controller, registry)
    if jobs is not None:
        await jobs.write_metrics(out)
    return out.render()


async def _write_accuracy(out: Text, controller: Controller, registry: Registry) -> None:
    thresholds = []
    for name, model in controller.models.items():
        for version, vset in model.versions.items():
            value = vset.record.metadata.get("accuracy_threshold")
            if isinstance(value, int | float) and not isinstance(value, bool):
                thresholds.append(({"model": name, "version": version}, float(value)))
    try:
        rows = await asyncio.to_thread(feedback.accuracy, registry.engine)
    except Exception:
        logger.exception("reading feedback for /metrics failed")
        rows = []
    write_accuracy(out, rows, thresholds)


async def serve(
    settings: Settings,
    demo: bool = False,
    progress: Callable[[str], None] = print,
) -> None:
    registry = await asyncio.to_thread(Registry.from_settings, settings)
    if demo:
        from inferd.demo.install import install_demo

        await asyncio.to_thread(
            install_demo,
            registry,
            settings.data_dir / "demo-src",
            progress,
            settings.demo_llm,
            settings.demo_text,
        )
    if not settings.auth.enabled and not _loopback(settings.host):
        warning = (
            f"WARNING: serving on {settings.host} WITHOUT AUTHENTICATION: anyone who can "
            "reach this port can run, deploy and delete models. Turn it on with "
            "INFERD_AUTH__ENABLED=true and create a key with `inferd keys create`."
        )
        logger.warning(warning)
        progress(warning)
    reserved = _resolve_ports(settings)
    # The job runner's credential with the gateways (they get it in their settings).
    settings.auth.internal_token = secrets.token_urlsafe(32)
    run_dir = settings.run_dir or Path(tempfile.mkdtemp(prefix="inferd-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    publisher = TablePublisher(run_dir / "control.sock")
    await publisher.start()
    controller = Controller(settings, registry, run_dir, publisher.publish)
    publisher.on_reconcile = controller.reconcile  # a gateway changed a model's desired state
    requests = RequestMetrics()
    writer = _take_rows(settings, publisher, requests)
    gateways = GatewayPool(settings, publisher.path)
    publisher.on_metrics = functools.partial(
        render_metrics, requests, controller, gateways, writer, registry
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    upkeep = None
    jobs = None
    try:
        if settings.inference_log.enabled:
            await asyncio.to_thread(_log_upkeep, registry, settings)  # partitions first
            upkeep = loop.create_task(_log_upkeep_forever(registry, settings))
        await controller.start()
        await gateways.start()
        for sock in reserved:
            sock.close()
        if settings.jobs.runner:
            jobs = JobService(settings, registry)
            await jobs.start()
            publisher.on_metrics = functools.partial(
                render_metrics, requests, controller, gateways, writer, registry, jobs
            )
        models = ", ".join(sorted(controller.models)) or "none yet"
        grpc = f", gRPC on {settings.host}:{settings.grpc_port}" if settings.grpc_port >= 0 else ""
        progress(
            f"inferd {inferd.__version__} serving on http://{settings.host}:{settings.port}"
            f"{grpc} ({settings.gateway_workers} gateway process(es)); models: {models}"
        )
        await stop.wait()
        progress("shutting down: draining gateways, then replicas")
    finally:
        if upkeep is not None:
            upkeep.cancel()
        if jobs is not None:
            await jobs.stop()  # what runs comes back from the queue after its lease
        await gateways.stop()
        await controller.stop()
        await publisher.close()
        if writer is not None:
            await asyncio.to_thread(writer.close)  # the last rows the gateways sent
            writer.engine.dispose()
        registry.close()
        if settings.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    logger.info("stopped")
