"""``/api/v1/keys``: create, list and revoke API keys (the admin scope, when auth is on).
A new key is in the reply once; only its hash is stored."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api.http import context_of, json_response, read_json
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, InvalidInput
from inferd.registry.api_key import SCOPES

router = APIRouter(prefix="/api/v1/keys", tags=["keys"])


def _actor(request: Request) -> str:
    principal = context_of(request.scope).principal
    return f"{principal.kind} {principal.subject}" if principal is not None else "api"


@router.post("", status_code=201)
async def create_key(request: Request) -> Response:
    """``{"name", "scopes": ["infer"|"admin", ...], "models": [...] | null}`` -> the key
    (shown this once) and its record."""
    body = await read_json(request, 64 * 1024)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(body) - {"name", "scopes", "models"})
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown}; known: name, scopes, models")
    record, key = await asyncio.to_thread(
        gateway_of(request).registry.keys.create,
        body.get("name", ""),  # checked by create: a missing name is refused as ""
        body.get("scopes", ["infer"]),
        body.get("models"),
        _actor(request),
    )
    return json_response({"key": key, **record.to_dict()}, status_code=201)


@router.get("")
async def list_keys(request: Request) -> Response:
    """Every key's record (never the key), revoked ones included."""
    records = await asyncio.to_thread(gateway_of(request).registry.keys.list_all)
    return json_response({"keys": [r.to_dict() for r in records], "scopes": list(SCOPES)})


@router.delete("/{key_id}")
async def revoke_key(key_id: str, request: Request) -> Response:
    """Revoke a key: refused everywhere within ``auth.cache_s`` seconds."""
    record = await asyncio.to_thread(gateway_of(request).registry.keys.revoke, key_id)
    return json_response(record.to_dict())
