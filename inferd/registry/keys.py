"""API keys, in the registry's database (``registry.keys``). What a key looks like and
how its secret is checked: :mod:`inferd.registry.api_key`."""

from __future__ import annotations

import hashlib
import secrets
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferd.errors import InvalidInput, NotFound
from inferd.registry.api_key import PREFIX, SCOPES, KeyRecord
from inferd.registry.tables import ApiKey, utcnow

if TYPE_CHECKING:
    from inferd.registry.registry import Registry


def _record(row: ApiKey) -> KeyRecord:
    return KeyRecord(
        row.key_id,
        row.name,
        tuple(row.scopes),
        None if row.models is None else tuple(row.models),
        row.created_by,
        row.created_at,
        row.revoked_at,
        row.secret_sha256,
    )


class ApiKeys:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def create(
        self,
        name: str,
        scopes: list[str],
        models: list[str] | None = None,
        actor: str = "api",
    ) -> tuple[KeyRecord, str]:
        """A new key: its record, and the key itself (never stored, never shown again)."""
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise InvalidInput("name must be a string of 1 to 128 characters")
        if not isinstance(scopes, list) or not scopes or any(s not in SCOPES for s in scopes):
            raise InvalidInput(f"scopes must be a non-empty list of {list(SCOPES)}, not {scopes!r}")
        if models is not None and (
            not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)
        ):
            raise InvalidInput("models must be a list of model names, or null for all models")
        key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
        row = ApiKey(
            key_id=key_id,
            name=name,
            secret_sha256=hashlib.sha256(secret.encode()).hexdigest(),
            scopes=sorted(set(scopes)),
            models=None if models is None else sorted(set(models)),
            created_by=actor,
            created_at=utcnow(),
            revoked_at=None,
        )
        with Session(self._registry.write_engine) as session, session.begin():
            session.add(row)
            session.flush()
            return _record(row), f"{PREFIX}{key_id}_{secret}"

    def get(self, key_id: str) -> KeyRecord | None:
        with Session(self._registry.engine) as session:
            row = session.get(ApiKey, key_id)
            return None if row is None else _record(row)

    def list_all(self) -> list[KeyRecord]:
        with Session(self._registry.engine) as session:
            rows = session.scalars(select(ApiKey).order_by(ApiKey.created_at))
            return [_record(row) for row in rows]

    def revoke(self, key_id: str) -> KeyRecord:
        """Revoke a key (kept, marked revoked; gateways refuse it within their cache
        time, ``auth.cache_s``)."""
        with Session(self._registry.write_engine) as session, session.begin():
            row = session.get(ApiKey, key_id)
            if row is None:
                raise NotFound(f"no API key {key_id!r}", key_id=key_id)
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            return _record(row)
