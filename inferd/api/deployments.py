"""Deployments over REST (``/api/v1/deployments``): which versions of a model run, and
the traffic split between them.

The registry (:mod:`inferd.registry.deployments`) holds the desired state and checks
every value; the routes here only check JSON shapes, call it in a thread, and then ask
the controller to act now instead of on its next periodic pass. Reads join the
registry's rows with this gateway's routing table: each version's live ``state`` and
replicas. A model without deployments is in *automatic* mode: its serving version takes
all the traffic.

Optimistic concurrency: reads return the model's traffic ``revision`` (also as the
``ETag`` of ``GET /{model}``); ``PUT /{model}/traffic`` with ``If-Match: <revision>``
(or ``?revision=``) is refused with 409 when the split changed since. Reads fetch the
revision *before* the rows, so a client never pairs a stale split with a fresh revision.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from starlette.responses import Response

from inferd.api import docs
from inferd.api.http import json_response, read_json
from inferd.api.state import gateway_of
from inferd.control import canary
from inferd.errors import BadRequest, InvalidInput
from inferd.routing.router import Router
from inferd.shapes.control import ModelRoute, ReplicaRoute, VersionRoute
from inferd.shapes.replica import ReplicaState

if TYPE_CHECKING:
    from inferd.registry import Registry
    from inferd.registry.deployments import DeploymentRecord, TrafficRecord

HISTORY_LIMIT = 20
"""Traffic changes shown by ``GET /{model}``."""
_DEPLOY_FIELDS = frozenset(
    {
        "model_name",
        "version",
        "traffic_percent",
        "resources",
        "strategy",
        "batching",
        "fallback",
        "rollout",
        "autoscaling",
    }
)
_RESOURCE_FIELDS = frozenset({"replicas", "gpu"})

router = APIRouter(prefix="/api/v1/deployments", tags=["deployments"])

Actor = Annotated[
    str | None,
    Header(
        alias="X-Inferd-Actor",
        max_length=128,
        description='Who makes the change, for the audit history (default "api").',
    ),
]


# -- what the registry has, joined with what runs -----------------------------------------


@dataclass(frozen=True, slots=True)
class ModelDeployments:
    """One model's deployments as the registry has them."""

    name: str
    revision: int
    rows: list[DeploymentRecord]
    history: list[TrafficRecord] = field(default_factory=list)
    scaling: list[dict[str, Any]] = field(default_factory=list)
    """The latest autoscaling decisions, newest first."""


def read_all(registry: Registry) -> list[ModelDeployments]:
    """Every registered model with its deployments (none: automatic mode)."""
    models = registry.list_models()
    revisions = {m.name: registry.deployments.revision(m.name) for m in models}
    rows: dict[str, list[DeploymentRecord]] = {}
    for row in registry.deployments.list_all():
        rows.setdefault(row.model_name, []).append(row)
    return [ModelDeployments(m.name, revisions[m.name], rows.get(m.name, [])) for m in models]


def read_one(registry: Registry, model: str) -> ModelDeployments:
    """``model``'s deployments and its latest traffic changes; ModelNotFound if unknown."""
    registry.get_model(model)
    d = registry.deployments
    revision = d.revision(model)
    return ModelDeployments(
        model,
        revision,
        d.list_all(model),
        d.history(model, HISTORY_LIMIT),
        d.scaling_events(model, HISTORY_LIMIT),
    )


def version_state(status: str | None, replicas: list[ReplicaRoute], desired: int | None) -> str:
    """deploying | active | draining | failed: a draining deployment (or one whose
    replicas all stop) is draining; all desired replicas ready is active; a failed replica
    and none ready is failed; anything else is still deploying."""
    states = [r.state for r in replicas]
    ready = states.count(ReplicaState.READY)
    if status == "draining" or (states and all(s in ("draining", "stopped") for s in states)):
        return "draining"
    if desired is not None and ready >= desired:
        return "active"
    if ready == 0 and "failed" in states:
        return "failed"
    return "deploying"


def live_fields(status: str | None, vroute: VersionRoute | None) -> dict[str, Any]:
    """A version's state and replicas as the routing table has them; ``replicas_desired``
    is null until the controller has picked the version up."""
    replicas = vroute.replicas if vroute is not None else []
    desired = vroute.desired_replicas if vroute is not None else None
    return {
        "state": version_state(status, replicas, desired),
        "replicas_ready": sum(r.state == "ready" for r in replicas),
        "replicas_desired": desired,
        "replicas": [
            {
                "id": r.id,
                "state": r.state,
                "pid": r.pid,
                "restarts": r.restarts,
                "message": r.message,
                "placement": r.placement,
                **({} if r.gpus is None else {"gpus": r.gpus}),
            }
            for r in replicas
        ],
    }


def _deployed_version(record: DeploymentRecord, vroute: VersionRoute | None) -> dict[str, Any]:
    """The record with its live fields; the record's replica count is renamed
    ``replicas_requested`` (null: the server's default), as ``replicas`` lists the
    running replicas, like ``GET /api/v1/models/{model}`` does."""
    view = record.to_dict()
    view["replicas_requested"] = view.pop("replicas")
    return {**view, **live_fields(record.status, vroute)}


def model_view(model: ModelDeployments, route: ModelRoute | None) -> dict[str, Any]:
    """The JSON of one model: mode, revision, split and versions (newest first)."""
    vroutes = route.versions if route is not None else {}
    if model.rows:
        mode = "deployments"
        traffic = {r.version: r.traffic_pct for r in model.rows}
        versions = [_deployed_version(r, vroutes.get(r.version)) for r in model.rows]
    else:
        mode = "automatic"
        serving = route.default_version if route is not None else None
        traffic = {serving: 100} if serving is not None else {}
        versions = [
            {"version": v, "traffic_pct": traffic.get(v, 0), **live_fields(None, vroutes[v])}
            for v in reversed(vroutes)
        ]
    return {
        "model": model.name,
        "mode": mode,
        "revision": model.revision,
        "traffic": traffic,
        "versions": versions,
    }


# -- request shapes -------------------------------------------------------------------------


def _known_fields(value: dict[str, Any], what: str, known: frozenset[str]) -> dict[str, Any]:
    """``value``, refused when it has fields outside ``known`` (a typo, usually)."""
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown} in {what}; known: {sorted(known)}")
    return value


def _deploy_args(body: Any) -> tuple[str, str, dict[str, Any]]:
    """(model, version, keyword arguments of ``deploy``) from a POST body. Only shapes
    are checked here: values are the registry's to refuse."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    _known_fields(body, "the request body", _DEPLOY_FIELDS)
    names = []
    for key in ("model_name", "version"):
        if not isinstance(body.get(key), str):
            raise InvalidInput(f"'{key}' is required and must be a string", field=key)
        names.append(body[key])
    resources = body.get("resources")
    resources = {} if resources is None else resources
    if not isinstance(resources, dict):
        raise InvalidInput("'resources' must be an object or null", field="resources")
    _known_fields(resources, "'resources'", _RESOURCE_FIELDS)
    batching = body.get("batching")
    if batching is not None and not isinstance(batching, dict):
        raise InvalidInput("'batching' must be an object or null", field="batching")
    return (
        names[0],
        names[1],
        {
            "traffic_pct": body.get("traffic_percent"),
            "replicas": resources.get("replicas"),
            "gpu_type": resources.get("gpu"),
            "strategy": body.get("strategy", "rolling"),
            "batching": batching,
            "fallback": body.get("fallback", True),
            "rollout": body.get("rollout"),
            "autoscaling": body.get("autoscaling"),
        },
    )


def _expected_revision(if_match: str | None, query: int | None) -> int | None:
    """The revision a change was computed from: ``If-Match`` (an ETag, quoted or not;
    ``*`` means any) or ``?revision=``; None when neither is given."""
    if if_match is None or if_match.strip() == "*":
        return query
    tag = if_match.strip().removeprefix('"').removesuffix('"')
    if not tag.isdigit():
        raise InvalidInput(
            f'If-Match must be the revision the change is based on, e.g. "7"; got {if_match!r}'
        )
    if query is not None and query != int(tag):
        raise InvalidInput(f"If-Match ({tag}) and ?revision= ({query}) disagree")
    return int(tag)


# -- routes -----------------------------------------------------------------------------------


def _registry(request: Request) -> Registry:
    return gateway_of(request).registry


def _etag(revision: int) -> dict[str, str]:
    return {"ETag": f'"{revision}"'}


def _change_view(model: str, change: TrafficRecord) -> dict[str, Any]:
    return {"model": model, "traffic": change.split, "revision": change.revision}


async def live_figures(router: Router, model: str, version: str) -> dict[str, Any] | None:
    """What a version's replicas measured since they started: requests answered and
    failed, the error rate, p50/p99/mean of the time requests spent in them (queue +
    compute) and of the time their batches computed; a shadow's comparisons with the
    live answers. None for replicas that do not measure it (text generation)."""
    clients = [c for c in router.clients_of(model, version) if not c.closed]
    statuses = await asyncio.gather(
        *(c.status(timeout_s=2.0) for c in clients), return_exceptions=True
    )
    samples, shadow = {}, {"compared": 0, "agreed": 0, "failed": 0}
    for status in statuses:
        if isinstance(status, BaseException):
            continue  # a replica that cannot answer now
        found = canary.sample_of(status.metrics)
        if found is None:
            continue  # one without these figures
        samples[(status.version, status.pid)] = found
        for key in shadow:
            shadow[key] += int(status.metrics.get("shadow", {}).get(key, 0))
    figures = canary.window({}, samples)  # everything since the replicas started
    if not figures.replicas:
        return None
    view = figures.to_dict()
    view.pop("crashes")
    view["replicas_measured"] = view.pop("replicas")
    if shadow["compared"] or shadow["failed"]:
        view["shadow"] = {
            **shadow,
            "agreement": round(shadow["agreed"] / shadow["compared"], 6)
            if shadow["compared"]
            else None,
        }
    return view


async def _with_live_figures(router: Router, view: dict[str, Any]) -> dict[str, Any]:
    entries = view["versions"]
    figures = await asyncio.gather(
        *(live_figures(router, view["model"], e["version"]) for e in entries)
    )
    for entry, live in zip(entries, figures, strict=True):
        entry["live"] = live
    return view


@router.get("")
async def list_deployments(request: Request) -> Response:
    """Every model: its mode, traffic split, and each version's state, replicas and live
    figures (``live``: requests, errors, error rate, p50/p99 since its replicas started)."""
    models = await asyncio.to_thread(read_all, _registry(request))
    router = gateway_of(request).router
    views = [model_view(m, router.table.models.get(m.name)) for m in models]
    await asyncio.gather(*(_with_live_figures(router, v) for v in views))
    return json_response({"models": views})


@router.get("/{model}")
async def get_deployments(model: str, request: Request) -> Response:
    """One model as in the list, with its latest traffic changes (``history``)."""
    found = await asyncio.to_thread(read_one, _registry(request), model)
    router = gateway_of(request).router
    view = await _with_live_figures(router, model_view(found, router.table.models.get(model)))
    view["history"] = [h.to_dict() for h in found.history]
    view["scaling_events"] = found.scaling
    return json_response(view, headers=_etag(found.revision))


@router.post("", status_code=201, openapi_extra=docs.DEPLOY)
async def deploy(request: Request, actor: Actor = None) -> Response:
    """Run a registered version with ``traffic_percent`` % of the model's traffic; the
    other deployed versions share the rest in proportion."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    model, version, kwargs = _deploy_args(body)
    deployments = _registry(request).deployments

    def run() -> tuple[DeploymentRecord, TrafficRecord]:
        record = deployments.deploy(model, version, actor=actor or "api", **kwargs)
        return record, deployments.history(model, 1)[0]

    record, change = await asyncio.to_thread(run)
    await gateway_of(request).router.server.request_reconcile(model)
    return json_response(
        {"deployment": record.to_dict(), "traffic": change.split, "revision": change.revision},
        status_code=201,
        headers=_etag(change.revision),
    )


@router.put("/{model}/traffic", openapi_extra=docs.TRAFFIC)
async def set_traffic(
    model: str,
    request: Request,
    actor: Actor = None,
    if_match: Annotated[
        str | None,
        Header(alias="If-Match", description="Refuse (409) unless the split is at this revision."),
    ] = None,
    revision: Annotated[int | None, Query(description="Same as If-Match.")] = None,
) -> Response:
    """Set the whole split (weights sum to 100; versions left out get 0)."""
    split = await read_json(request, gateway_of(request).settings.max_body_bytes)
    change = await asyncio.to_thread(
        _registry(request).deployments.set_traffic,
        model,
        split,
        actor=actor or "api",
        revision=_expected_revision(if_match, revision),
    )
    await gateway_of(request).router.server.request_reconcile(model)
    return json_response(_change_view(model, change), headers=_etag(change.revision))


@router.post("/{model}/rollback")
async def rollback(model: str, request: Request, actor: Actor = None) -> Response:
    """Back to the last stable split (one still-deployed version at 100 %), at once."""
    change = await asyncio.to_thread(
        _registry(request).deployments.rollback, model, actor=actor or "api"
    )
    await gateway_of(request).router.server.request_reconcile(model)
    view = {**_change_view(model, change), "detail": change.detail}
    return json_response(view, headers=_etag(change.revision))


@router.delete("/{model}/{version}", status_code=202)
async def undeploy(model: str, version: str, request: Request, actor: Actor = None) -> Response:
    """Remove a deployment that takes no traffic: it drains, then the controller stops
    its replicas and deletes it (202: that happens after the reply)."""
    record = await asyncio.to_thread(
        _registry(request).deployments.undeploy, model, version, actor=actor or "api"
    )
    await gateway_of(request).router.server.request_reconcile(model)
    return json_response(
        {"model": model, "version": version, "status": record.status}, status_code=202
    )


@router.patch("/{model}/{version}")
async def scale(model: str, version: str, request: Request) -> Response:
    """Change a deployment's replica count, ``{"resources": {"replicas": 3}}``, or its
    autoscaling, ``{"autoscaling": {...}}`` (null: back to the fixed count). New replicas
    take traffic once ready; extra ones drain before they stop."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    if not isinstance(body, dict) or not body or set(body) - {"resources", "autoscaling"}:
        raise InvalidInput(
            'body must be {"resources": {"replicas": <count>}} and/or {"autoscaling": {...}}'
        )
    deployments = _registry(request).deployments
    record = None
    if "resources" in body:
        resources = body["resources"]
        if not isinstance(resources, dict) or set(resources) != {"replicas"}:
            raise InvalidInput('resources must be {"replicas": <count>}')
        record = await asyncio.to_thread(deployments.scale, model, version, resources["replicas"])
    if "autoscaling" in body:
        record = await asyncio.to_thread(
            deployments.set_autoscaling, model, version, body["autoscaling"]
        )
    await gateway_of(request).router.server.request_reconcile(model)
    assert record is not None
    return json_response({"deployment": record.to_dict()})
