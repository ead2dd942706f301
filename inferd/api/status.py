"""Model status views: registry records joined with what the gateway sees running."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec

from inferd.registry import ModelRecord, VersionRecord
from inferd.routing.router import Router


class StatusView:
    def __init__(self, router: Router) -> None:
        self.router = router

    def _version_state(self, model: str, version: str) -> str:
        route = self.router.table.models.get(model)
        vroute = route.versions.get(version) if route else None
        if vroute is None:
            return "registered"
        if route is not None and route.default_version == version:
            return "serving"
        if vroute.graph is not None:  # no replica: the gateways run it
            return "ready"
        states = {r.state for r in vroute.replicas}
        return "ready" if "ready" in states else (states.pop() if len(states) == 1 else "loading")

    def model_summary(self, record: ModelRecord) -> dict[str, Any]:
        route = self.router.table.models.get(record.name)
        return {
            "name": record.name,
            "description": record.description,
            "framework": record.framework,
            "owner": record.owner,
            "tags": record.tags,
            "versions": [v.version for v in record.versions],
            "loaded": record.loaded,
            "serving_version": route.default_version if route else None,
            "ready": bool(route and route.default_version),
        }

    async def model_detail(self, record: ModelRecord) -> dict[str, Any]:
        summary = self.model_summary(record)
        summary["versions"] = list(
            await asyncio.gather(*(self.version_detail(v) for v in record.versions))
        )
        summary["created_at"] = record.created_at.isoformat()
        return summary

    def loaded(self, model: str, version: str) -> bool:
        """Whether the version has replicas (running or starting): with a memory budget,
        a serving version may have none until a request loads it."""
        vroute = self.router.version_route(model, version)
        return vroute is not None and any(
            r.state not in ("draining", "stopped") for r in vroute.replicas
        )

    def counts(self, records: list[ModelRecord]) -> dict[str, int]:
        """Versions registered, and loaded (with replicas), over ``records``."""
        return {
            "registered": sum(len(r.versions) for r in records),
            "loaded": sum(self.loaded(r.name, v.version) for r in records for v in r.versions),
        }

    async def version_detail(self, record: VersionRecord) -> dict[str, Any]:
        detail = record.to_dict()
        detail["status"] = self._version_state(record.model_name, record.version)
        detail["loaded"] = self.loaded(record.model_name, record.version)
        detail["replicas"] = await self._replicas(record.model_name, record.version)
        return detail

    async def _replicas(self, model: str, version: str) -> list[dict[str, Any]]:
        vroute = self.router.version_route(model, version)
        if vroute is None:
            return []
        clients = {c.replica_id: c for c in self.router.clients_of(model, version)}
        out = []
        for r in vroute.replicas:
            entry: dict[str, Any] = {
                "id": r.id,
                "state": r.state,
                "pid": r.pid,
                "restarts": r.restarts,
                "placement": r.placement,
            }
            if r.message:
                entry["message"] = r.message
            if r.gpus is not None:
                entry["gpus"] = r.gpus
            client = clients.get(r.id)
            if client is not None and not client.closed:
                # A replica that cannot answer shows without stats.
                with contextlib.suppress(Exception):
                    status = await client.status(timeout_s=2.0)
                    entry["stats"] = msgspec.to_builtins(status.stats)
                    if status.metrics:
                        entry["metrics"] = status.metrics
            out.append(entry)
        return out
