"""The server side of the web console: recent figures, firing alerts and the health of
the control plane, answered to gateways over the control channel
(:class:`~inferd.shapes.control.ConsoleQuery`).

- **Figures** (:class:`~inferd.monitoring.recent.RecentFigures`): requests from the
  log rows gateways ship; replicas' status frames once a slot, over the connections
  ``/metrics`` keeps (:class:`~inferd.monitoring.exposition.ReplicaStatuses`;
  measured: no CPU the server's processes would notice).
- **Alerts**: the shipped Prometheus rules (``inferd/monitoring/alerts.yml``, the
  same file as ``deploy/prometheus/alerts.yml``) evaluated here every
  ``console.alert_interval_s`` over this server's own ``/metrics`` samples, with
  Prometheus' ``for:`` semantics (:mod:`inferd.monitoring.alerting`), so the console
  shows what a Prometheus loaded with those rules would fire, with no Prometheus.
- **Health**: this server (the leader: only a leading controller answers), the gateways
  connected to it and the hosts replicas joined from.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Container
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

import inferd
from inferd.config import Settings
from inferd.control.state import reachable
from inferd.monitoring.exposition import ReplicaStatuses
from inferd.monitoring.recent import RecentFigures
from inferd.shapes.control import ConsoleQuery, ConsoleView

if TYPE_CHECKING:
    from inferd.control.controller import Controller
    from inferd.control.publisher import TablePublisher
    from inferd.monitoring.alerting import Alerting, AlertRules
    from inferd.monitoring.promql import SampleHistory

logger = logging.getLogger(__name__)
Samples = list[tuple[str, dict[str, str], float]]


class _EveryName:
    """Every metric name (rules that select names by a regex read any)."""

    def __contains__(self, name: object) -> bool:
        return True


EVERY_NAME = _EveryName()


class ConsoleFeed:
    def __init__(
        self,
        settings: Settings,
        controller: Controller,
        publisher: TablePublisher,
        scrape: Callable[[Container[str]], Awaitable[Samples]],
        statuses: ReplicaStatuses,
    ) -> None:
        cfg = settings.console
        self.settings = settings
        self.controller = controller
        self.publisher = publisher
        self.scrape = scrape
        """This server's ``/metrics`` samples of the named metrics."""
        self.statuses = statuses
        settle_s = settings.inference_log.flush_interval_s + 0.5
        self.figures = RecentFigures(cfg.slot_s, cfg.history_s, settle_s)
        self.rules: AlertRules | None = None
        self.alerting: Alerting | None = None
        self.history: SampleHistory | None = None
        if cfg.alerts:
            self._load_rules()
        self.alerts: list[dict[str, Any]] = []
        self.alerts_at: float | None = None
        self.leader: dict[str, Any] = {}
        """How this server leads (set by the server once it does)."""
        self.role = "serve"
        self.drift: Callable[[str, str | None], Awaitable[dict[str, Any]]] | None = None
        """The drift view of a model's version (:meth:`~inferd.control.drift.DriftMonitor.
        answer`), for ``drift`` queries."""
        self.started_at = datetime.now(UTC).isoformat()
        self._tasks: list[asyncio.Task[None]] = []

    def _load_rules(self) -> None:
        from inferd.monitoring.alerting import Alerting, AlertRules
        from inferd.monitoring.promql import SampleHistory

        path = self.settings.console.alert_rules_file
        self.rules = AlertRules.load(path) if path is not None else AlertRules.shipped()
        self.alerting = Alerting(self.rules)
        retention_s = self.rules.history_s() + 2 * self.settings.console.alert_interval_s
        self.history = SampleHistory(retention_s, keep=self.rules.metric_names())

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._sample_forever()))
        if self.alerting is not None:
            self._tasks.append(loop.create_task(self._alert_forever()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- answering gateways ----------------------------------------------------------------

    async def answer(self, query: ConsoleQuery) -> bytes:
        models = None if query.models is None else set(query.models)
        now = time.time()
        if query.what is ConsoleView.DRIFT and self.drift is not None and query.models:
            return orjson.dumps(await self.drift(query.models[0], query.version))
        if query.what is ConsoleView.SERIES:
            body = self.figures.series(models, query.since, query.window_s, now)
        else:
            body = {
                "figures": self.figures.summary(models, query.window_s, now),
                "alerts": self._alerts_for(models),
                "alerts_evaluated_at": self.alerts_at,
                "health": self.health(),
            }
        return orjson.dumps(body)

    def _alerts_for(self, models: set[str] | None) -> list[dict[str, Any]]:
        """Firing and pending alerts; a caller limited to some models sees theirs only."""
        if models is None:
            return self.alerts
        return [a for a in self.alerts if a["labels"].get("model") in models]

    def health(self) -> dict[str, Any]:
        hosts: dict[str, dict[str, int]] = {}
        pods = 0
        for model in self.controller.models.values():
            for vset in model.versions.values():
                for replica in vset.replicas:
                    where = replica.placement
                    if where.startswith("host "):
                        entry = hosts.setdefault(where[5:], {"replicas": 0, "ready": 0})
                        entry["replicas"] += 1
                        entry["ready"] += replica.ready
                    elif where == "pod":
                        pods += 1
        return {
            "server": {
                "role": self.role,
                "version": inferd.__version__,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_at": self.started_at,
                "epoch": self.controller.epoch,
            },
            "leader": self.leader,
            "gateways": self.publisher.gateways(),
            "hosts": [{"host": h, **counts} for h, counts in sorted(hosts.items())],
            "pods": pods,
            "replica_backend": self.settings.replica_backend,
        }

    # -- sampling --------------------------------------------------------------------------

    async def _sample_forever(self) -> None:
        slot_s = self.figures.slot_s
        while True:
            await asyncio.sleep(slot_s - time.time() % slot_s + 0.05)
            try:
                found = await self.statuses(reachable(self.controller.models), min(slot_s, 2.0))
                self.figures.sample_replicas(time.time(), found)
                self.figures.prune()
            except Exception:
                logger.exception("sampling the replicas for the console failed")

    async def _alert_forever(self) -> None:
        assert self.alerting is not None and self.rules is not None and self.history is not None
        interval_s = self.settings.console.alert_interval_s
        names: Container[str] = self.rules.metric_names() or EVERY_NAME
        while True:
            try:
                samples = await self.scrape(names)
                now = time.time()
                self.history.add(now, samples)
                alerts = self.alerting.evaluate(self.history, now)
                self.alerts = [a.to_dict() for a in alerts]
                self.alerts_at = now
            except Exception:
                logger.exception("evaluating the alert rules failed")
            await asyncio.sleep(interval_s)
