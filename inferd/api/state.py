"""What the routes of one gateway app share, typed.

``create_app`` builds one :class:`GatewayState` and keeps it on the app (``inferd_gateway``);
a route reads it with :func:`gateway_of` (the one untyped read of it), so a typo
in a field's name, or a field of the wrong type, is a type error rather than an
``AttributeError`` on the first request that takes that path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

if TYPE_CHECKING:
    from inferd.access.limits import RateLimits
    from inferd.api.console import RegistryCache
    from inferd.api.status import StatusView
    from inferd.config import Settings
    from inferd.jobs import Jobs
    from inferd.registry import Registry
    from inferd.routing.dataplane import DataPlane
    from inferd.routing.router import Router
    from inferd.telemetry.log_rows import RowBuffer


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    router: Router
    registry: Registry
    """The registry (opened on first use in a gateway process: see api/worker.py)."""
    dataplane: DataPlane
    """The process's data plane, shared with its gRPC service."""
    status: StatusView
    console_registry: RegistryCache
    inference_log: RowBuffer | None
    jobs: Jobs | None
    limits: RateLimits | None
    """The process's rate limits (None: no limit set), shared with its gRPC service."""


def gateway_of(request: Request) -> GatewayState:
    """The gateway's state (an attribute of the app itself: a lookup through
    ``app.state`` cost several times more, several times per request)."""
    return request.scope["app"].inferd_gateway  # type: ignore[no-any-return]
