"""API keys, in the registry's database (``registry.keys``).

A key reads ``ik_<key id>_<secret>``: the id (12 hex digits) is public and names the key
in listings and logs; the secret (43 URL-safe characters, 256 random bits) is shown once,
when the key is created, and only its SHA-256 is stored. A plain hash is enough for a
secret with 256 bits of entropy (nothing to guess; a slow password hash would only cost
every request). Verification compares hashes in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferd.errors import InvalidInput, NotFound
from inferd.registry.tables import ApiKey, utcnow

if TYPE_CHECKING:
    from inferd.registry.registry import Registry

SCOPES = ("admin", "infer")
"""admin: the control plane (models, deployments, keys, logs, repository) and all of
infer; infer: the data plane (predict, infer, generate, model metadata)."""
PREFIX = "ik_"
_KEY = re.compile(r"ik_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    name: str
    scopes: tuple[str, ...]
    models: tuple[str, ...] | None
    created_by: str
    created_at: datetime
    revoked_at: datetime | None
    secret_sha256: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "name": self.name,
            "scopes": list(self.scopes),
            "models": None if self.models is None else list(self.models),
            "created_by": self.created_by,
            "created_at": self.created_at.isoformat(),
            "revoked_at": None if self.revoked_at is None else self.revoked_at.isoformat(),
        }


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


def parse_key(key: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed key, else None."""
    match = _KEY.fullmatch(key)
    return (match.group(1), match.group(2)) if match else None


def secret_matches(record: KeyRecord, secret: str) -> bool:
    digest = hashlib.sha256(secret.encode()).hexdigest()
    return hmac.compare_digest(digest, record.secret_sha256)


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
