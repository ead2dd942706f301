"""The Open Inference Protocol's model repository extension without its transports: index,
load and unload, called by the REST routes (:mod:`inferd.api.v2_repository`) and the
gRPC service alike.

Load and unload set the model's desired state in the registry (so it survives a
restart), ask the controller to reconcile now over this gateway's control connection,
then wait on the routing table -- every applied table wakes the waiters, nothing polls --
until the controller has done it: the model serves (load) or its replicas are gone
(unload).

Index states, as Triton names them: READY (serving), LOADING (replicas starting),
UNLOADING (replicas draining), UNAVAILABLE (unloaded, or its replicas fail to load;
``reason`` says which). A failed load leaves the model loaded: the controller keeps
restarting its replicas with backoff, as for any model, until it is unloaded.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inferd.config import Settings
from inferd.errors import ModelError, RequestTimeout
from inferd.registry import ModelRecord
from inferd.routing.router import Router
from inferd.shapes.control import ModelRoute, RoutingTable

if TYPE_CHECKING:
    from inferd.registry import Registry

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
UNLOADED_REASON = "unloaded"
SLACK_S = 10.0
"""Added to the load timeout (process start, one controller pass) and to the shutdown
grace (the controller's SIGKILL comes 5 s after it) when waiting for the controller."""


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One model in the repository index."""

    name: str
    version: str
    state: str
    reason: str = ""


# -- transport-free handlers ----------------------------------------------------------------


async def repository_index(
    registry: Registry, router: Router, ready_only: bool = False
) -> list[IndexEntry]:
    """Every registered model (loaded or not) with its state, in registration order;
    with ``ready_only``, only the models that serve now."""
    records = await asyncio.to_thread(registry.list_models)
    entries = [_entry(r, router.table.models.get(r.name)) for r in records if r.versions]
    return [e for e in entries if e.state == READY] if ready_only else entries


def _entry(record: ModelRecord, route: ModelRoute | None) -> IndexEntry:
    newest = record.versions[-1].version
    if route is None:  # registered after the controller's last pass
        if record.loaded:
            return IndexEntry(record.name, newest, LOADING)
        return IndexEntry(record.name, newest, UNAVAILABLE, UNLOADED_REASON)
    if route.default_version is not None:
        return IndexEntry(record.name, route.default_version, READY)
    version = next(reversed(route.versions), newest)
    if not route.loaded:
        state = UNLOADING if route.versions else UNAVAILABLE
        return IndexEntry(record.name, version, state, UNLOADED_REASON)
    failure = _load_failure(route)
    if failure is not None:
        return IndexEntry(record.name, version, UNAVAILABLE, failure)
    return IndexEntry(record.name, version, LOADING)


def _load_failure(route: ModelRoute) -> str | None:
    """Why the newest deployed version's replicas failed, if one did."""
    if not route.versions:
        return None
    newest = route.versions[next(reversed(route.versions))]
    for replica in newest.replicas:
        if replica.state == "failed":
            return replica.message or "a replica failed"
    return None


async def load_model(registry: Registry, router: Router, settings: Settings, name: str) -> None:
    """Mark ``name`` loaded and return once it serves (at once if it already does).

    Raises ModelNotFound, ModelError (a replica failed to load; the message says why)
    or RequestTimeout (not serving within the load timeout).
    """
    record = await asyncio.to_thread(registry.get_model, name)
    if record.loaded and _load_outcome(name, router.table) == "":
        return
    if not record.loaded:
        await asyncio.to_thread(registry.set_loaded, name, True)
    await router.server.request_reconcile(name)
    timeout_s = settings.load_timeout_s + SLACK_S
    outcome = await router.wait_for(functools.partial(_load_outcome, name), timeout_s)
    if outcome is None:
        raise RequestTimeout(f"model {name!r} did not load within {timeout_s:.0f}s", model=name)
    if outcome:
        raise ModelError(f"failed to load model {name!r}: {outcome}", model=name)


def _load_outcome(name: str, table: RoutingTable) -> str | None:
    """ "" once ``name`` serves, the failure once a replica failed, None meanwhile."""
    route = table.models.get(name)
    if route is None or not route.loaded:
        return None  # the controller has not acted on the load yet
    if route.default_version is not None:
        return ""
    return _load_failure(route)


async def unload_model(registry: Registry, router: Router, settings: Settings, name: str) -> None:
    """Mark ``name`` unloaded and return once its replicas have stopped.

    Requests get 503 (not ready) from the moment the controller acts. Raises
    ModelNotFound or RequestTimeout.
    """
    record = await asyncio.to_thread(registry.get_model, name)
    if record.loaded:
        await asyncio.to_thread(registry.set_loaded, name, False)
    elif _unloaded(name, router.table):
        return
    await router.server.request_reconcile(name)
    timeout_s = settings.shutdown_grace_s + SLACK_S
    if await router.wait_for(functools.partial(_unloaded, name), timeout_s) is None:
        raise RequestTimeout(f"model {name!r} did not unload within {timeout_s:.0f}s", model=name)


def _unloaded(name: str, table: RoutingTable) -> bool | None:
    """True once the controller runs nothing for ``name``, else None."""
    route = table.models.get(name)
    if route is None or (not route.loaded and not route.versions):
        return True
    return None
