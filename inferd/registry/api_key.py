"""An API key without the database: its format, its record, and the check of a secret
(what a gateway needs on every keyed request; the keys themselves are
:class:`inferd.registry.keys.ApiKeys`, in the registry's database).

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
from dataclasses import dataclass
from datetime import datetime
from typing import Any

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


def parse_key(key: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed key, else None."""
    match = _KEY.fullmatch(key)
    return (match.group(1), match.group(2)) if match else None


def secret_matches(record: KeyRecord, secret: str) -> bool:
    digest = hashlib.sha256(secret.encode()).hexdigest()
    return hmac.compare_digest(digest, record.secret_sha256)
