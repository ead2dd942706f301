"""The routing table the controller publishes: what gateways need to know of every
model, version and replica, built from the controller's state in one pass."""

from __future__ import annotations

from inferd.control.state import ModelState, VersionSet
from inferd.registry import VersionRecord
from inferd.shapes.control import ModelRoute, RoutingTable, VersionRoute


def routing_table(generation: int, models: dict[str, ModelState], epoch: str = "") -> RoutingTable:
    return RoutingTable(
        generation,
        {
            name: ModelRoute(
                name,
                state.serving,
                {v: _version(name, state, vset) for v, vset in state.versions.items()},
                state.loaded,
                state.traffic,
            )
            for name, state in models.items()
        },
        epoch,
    )


def _version(model: str, state: ModelState, vset: VersionSet) -> VersionRoute:
    record = vset.record
    mirror_pct, tolerance = state.mirrors.get(record.version, (0, 0.0))
    return VersionRoute(
        version=record.version,
        framework=record.framework,
        signature=record.signature,
        replicas=[r.route() for r in vset.replicas],
        desired_replicas=vset.desired,
        adapters=sorted(adapters(record)),
        fallback=vset.fallback,
        mirror_pct=mirror_pct,
        tolerance=tolerance,
        cache_ttl_s=_cache_ttl(record),
        digest=record.sha256,
        overflow_model=_overflow_model(record, model),
        allow_non_finite=record.metadata.get("allow_non_finite") is True,
        scale_from_zero=vset.on_demand
        or (vset.autoscaler is not None and vset.autoscaler.policy.min_replicas == 0),
        graph=record.metadata.get("graph") if vset.replicaless else None,
    )


def adapters(record: VersionRecord) -> dict[str, str]:
    """LoRA adapters registered with a base model version (name -> folder inside the
    version's artifact folder) load with its replicas."""
    found = record.metadata.get("adapters")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def _cache_ttl(record: VersionRecord) -> float | None:
    value = record.metadata.get("cache_ttl_s")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _overflow_model(record: VersionRecord, model: str) -> str | None:
    value = record.metadata.get("overflow_model")
    return value if isinstance(value, str) and value and value != model else None
