"""``GET /api/v1/whoami``: who the server takes the caller to be, so a client (the web
console) can hide what its credential may not do. It needs only the ``infer`` scope and
never echoes the credential: ``subject`` is a key id or a JWT's ``sub``.

With auth off every caller may do everything: ``{"auth": false, "admin": true, ...}``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.access.principal import Principal
from inferd.api.http import context_of, json_response

router = APIRouter(prefix="/api/v1", tags=["auth"])

_ANYONE = {
    "auth": False,
    "kind": None,
    "subject": None,
    "scopes": ["admin", "infer"],
    "models": None,
    "admin": True,
}


def identity(principal: Principal | None) -> dict[str, Any]:
    """The caller as whoami answers it (``models``: its allow-list, None for any model;
    an admin may use every model whatever its list says)."""
    if principal is None:
        return dict(_ANYONE)
    return {
        "auth": True,
        "kind": principal.kind,
        "subject": principal.subject,
        "scopes": sorted(principal.scopes),
        "models": None if principal.models is None else sorted(principal.models),
        "admin": principal.admin,
    }


@router.get("/whoami")
async def whoami(request: Request) -> Response:
    """Who is calling: the credential's kind, subject, scopes and models; never the
    credential itself."""
    return json_response(identity(context_of(request.scope).principal))
