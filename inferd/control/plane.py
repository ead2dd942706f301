"""The server process without its gateway processes: the registry's consumers that run
once per server — the controller and its replicas, the table publisher gateways follow,
the inference log writer and ``/metrics``.

``inferd serve`` runs one beside its gateway processes (:mod:`inferd.server`); the
in-process test tier runs one beside a gateway app in the same process. Gateways reach
it only through the publisher's socket: routing tables down; reconcile requests, log
rows and ``/metrics`` queries up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable, Container
from pathlib import Path
from typing import TYPE_CHECKING

from inferd.config import Settings
from inferd.control.backends import ReplicaBackend
from inferd.control.console import ConsoleFeed
from inferd.control.controller import Controller
from inferd.control.drift import DriftMonitor
from inferd.control.publisher import TablePublisher
from inferd.control.state import reachable
from inferd.monitoring import feedback
from inferd.monitoring.exposition import (
    ReplicaStatuses,
    RequestMetrics,
    Text,
    write_accuracy,
    write_gpus,
    write_on_demand,
    write_processes,
    write_replicas,
    write_requests,
    write_scaling,
)
from inferd.monitoring.inference_log import InferenceLog, log_engine, maintain
from inferd.monitoring.sinks import SinkRunner, open_sinks, write_sinks
from inferd.registry import Registry
from inferd.registry.uploads import UPLOADS
from inferd.shapes.control import LogRows

if TYPE_CHECKING:
    from inferd.jobs.service import JobService

logger = logging.getLogger(__name__)
UPKEEP_INTERVAL_S = 3600.0
"""How often old inference log rows go and new partitions are made."""


class ControlPlane:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        run_dir: Path,
        backend: ReplicaBackend | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.publisher = TablePublisher(run_dir / "control.sock", settings.cluster.control_listen)
        self.controller = Controller(settings, registry, run_dir, self.publisher.publish, backend)
        self.requests = RequestMetrics()
        self.statuses = ReplicaStatuses()
        """The replicas' status frames, for ``/metrics`` and the console."""
        self.console = ConsoleFeed(
            settings, self.controller, self.publisher, self.metric_samples, self.statuses
        )
        self.drift = DriftMonitor(settings.drift, self.controller, registry)
        """Input drift: the replicas' counts, windows and scores."""
        self.console.drift = self.drift.answer
        self.writer: InferenceLog | None = None
        self.sinks: list[SinkRunner] = []
        """The payload sinks (``payload_log.sinks``), each with its buffer and thread."""
        self.jobs: JobService | None = None
        """The job service, once the server started one (its figures join /metrics)."""
        self.gateway_pids: Callable[[], list[int]] = list
        """The gateway processes' pids, for process metrics."""
        self._upkeep: asyncio.Task[None] | None = None

    @property
    def control_socket(self) -> Path:
        return self.publisher.path

    async def start(self) -> None:
        """Listen for gateways, open the inference log, and reconcile once (replicas
        start loading); returns without waiting for them."""
        # Uploads a crash cut short (gateways write there; none runs yet).
        await asyncio.to_thread(
            shutil.rmtree, Path(self.settings.data_dir) / UPLOADS, ignore_errors=True
        )
        try:  # before anything starts: a sink the settings cannot make stops the server
            self.sinks = open_sinks(self.settings.payload_log)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        await self.publisher.start()
        self.publisher.on_reconcile = self.controller.reconcile  # a gateway changed a model
        self.publisher.on_log_rows = self._take_rows
        self.publisher.on_metrics = self.render_metrics
        self.publisher.on_console = self.console.answer
        self.publisher.on_demand = self.controller.demand
        self.publisher.on_join = self.controller.joins.join
        if self.settings.inference_log.enabled:
            cfg = self.settings.inference_log
            engine = log_engine(self.settings.resolved_database_url)
            self.writer = InferenceLog(engine, cfg.flush_interval_s, cfg.max_buffer_rows)
            self.writer.start()
            await asyncio.to_thread(_log_upkeep, self.registry, self.settings)  # partitions first
            self._upkeep = asyncio.get_running_loop().create_task(
                _log_upkeep_forever(self.registry, self.settings)
            )
        await self.controller.start()
        self.console.start()
        self.drift.start()

    async def stop(self) -> None:
        """Drain and stop the replicas, then close the socket and the log."""
        if self._upkeep is not None:
            self._upkeep.cancel()
        await self.console.stop()
        await self.drift.stop()
        self.statuses.close()
        await self.controller.stop()
        await self.publisher.close()
        # The gateways' last rows are in: each sink sends what it holds, within its timeout.
        await asyncio.gather(*(asyncio.to_thread(sink.close) for sink in self.sinks))
        if self.writer is not None:
            await asyncio.to_thread(self.writer.close)  # the last rows the gateways sent
            self.writer.engine.dispose()

    def _take_rows(self, message: LogRows) -> None:
        """What gateways ship: request rows and counters feed ``/metrics`` and, when the
        inference log is on, the writer; and the payload sinks, when there are any."""
        self.requests.observe(message.rows)
        self.controller.used(message.rows)
        self.console.figures.observe(message.rows, self.controller.models)
        if message.counters:
            self.requests.add_counters(message.counters)
        if self.writer is not None:
            self.writer.extend(message.rows)
        for sink in self.sinks:  # a bounded buffer each: never waits on the sink
            sink.offer(message.rows)

    async def render_metrics(self) -> str:
        """``/metrics``: requests from every gateway, then every replica and process,
        then accuracy from feedback, then jobs."""
        return (await self._exposition()).render()

    async def metric_samples(
        self, names: Container[str]
    ) -> list[tuple[str, dict[str, str], float]]:
        """The samples of ``/metrics`` named ``names`` (for the console's alert rules)."""
        return (await self._exposition(names)).samples

    async def _exposition(self, keep: Container[str] | None = None) -> Text:
        out = Text(keep)
        write_requests(out, self.requests, 0 if self.writer is None else self.writer.dropped)
        if self.sinks:
            write_sinks(out, self.sinks, self.requests.counters.get("payload_skipped", 0))
        states = []
        processes = [({"process": "server", "id": "server"}, os.getpid())]
        for i, pid in enumerate(self.gateway_pids()):
            processes.append(({"process": "gateway", "id": str(i)}, pid))
        seen: set[int] = set()
        for name, model in self.controller.models.items():
            for version, vset in model.versions.items():
                for replica in vset.replicas:
                    labels = {"model": name, "version": version, "replica": replica.id}
                    states.append((labels, replica.state.value, replica.restarts))
                    if replica.pid and replica.pid not in seen:  # shared: one process
                        seen.add(replica.pid)
                        processes.append(({"process": "replica", "id": replica.id}, replica.pid))
        write_replicas(out, states, await self.statuses(reachable(self.controller.models)))
        self.drift.write_metrics(out)
        desired = [
            (name, version, vset.desired, vset.autoscaler is not None)
            for name, model in self.controller.models.items()
            for version, vset in model.versions.items()
            if not vset.retiring
        ]
        scaling = self.controller.scaling
        write_scaling(out, desired, scaling.decisions, scaling.cold_starts)
        if (on_demand := self.controller.on_demand) is not None:
            sets = [v for m in self.controller.models.values() for v in m.versions.values()]
            loaded = [v for v in sets if v.on_demand and v.live()]
            unloaded = sum(v.on_demand and not v.live() for v in sets)
            resident = sum(
                on_demand.footprint.get((v.record.model_name, v.record.version), 0)
                for v in sets
                if v.live()
            )
            write_on_demand(out, on_demand, len(loaded), unloaded, resident)
        write_processes(out, processes)
        write_gpus(out)
        if self.writer is not None:  # feedback needs the inference log
            await self._write_accuracy(out)
        if self.jobs is not None:
            await self.jobs.write_metrics(out)
        return out

    async def _write_accuracy(self, out: Text) -> None:
        thresholds = []
        for name, model in self.controller.models.items():
            for version, vset in model.versions.items():
                value = vset.record.metadata.get("accuracy_threshold")
                if isinstance(value, int | float) and not isinstance(value, bool):
                    thresholds.append(({"model": name, "version": version}, float(value)))
        try:
            rows = await asyncio.to_thread(feedback.accuracy, self.registry.engine)
        except Exception:
            logger.exception("reading feedback for /metrics failed")
            rows = []
        write_accuracy(out, rows, thresholds)


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
