"""Who is calling: the :class:`~inferd.access.principal.Principal` of a credential, an
API key or a JWT, as HTTP headers and gRPC metadata carry it (:func:`credential_of`).

- API keys (``ik_...``, :mod:`inferd.registry.keys`) are looked up by their public id
  and kept for ``auth.cache_s`` seconds per gateway process (unknown ids too), so a
  request costs a dict lookup and one SHA-256, and a revocation takes effect within
  that time everywhere.
- JWTs are verified with an HS256 secret, or RS256/ES256 public keys (PEM or a JWKS
  file), all read from files named in the settings (never from the command line of a
  process): ``exp`` and ``sub`` are required, ``aud``/``iss`` checked when configured;
  scopes come from the ``scope`` claim (space-separated, OAuth 2) or a ``scopes`` list;
  an optional ``models`` list is an allow-list.

No or bad credential: :class:`~inferd.errors.Unauthorized` (401). Credentials never
reach a log line.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferd.access.principal import INTERNAL, Principal, is_internal_token
from inferd.config import AuthConfig
from inferd.errors import Overloaded, Unauthorized
from inferd.registry.api_key import KeyRecord, parse_key, secret_matches

if TYPE_CHECKING:
    from inferd.registry.keys import ApiKeys


class Authenticator:
    def __init__(self, config: AuthConfig, keys: ApiKeys) -> None:
        self.config = config
        self.keys = keys
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}
        self._jwt_keys = _load_jwt_keys(config)
        self._lookups, self._lookups_at = config.lookups_per_s, time.monotonic()

    async def authenticate(self, credential: str | None) -> Principal:
        principal = self.known(credential)
        if principal is not None:
            return principal
        parsed = parse_key(credential or "")
        assert parsed is not None  # known() returns None for a well-formed key only
        key_id, secret = parsed
        self._lookup_allowed()
        record = await asyncio.to_thread(self.keys.get, key_id)
        if len(self._cache) > 10_000:
            self._cache.clear()  # bounded: bogus ids cannot grow it without end
        self._cache[key_id] = (time.monotonic() + self.config.cache_s, record)
        return _key_principal(key_id, secret, record)

    def _lookup_allowed(self) -> None:
        """One read of the registry from the lookup budget (``auth.lookups_per_s``), or
        a 503: what made-up keys can make the registry do is bounded."""
        rate = self.config.lookups_per_s
        now = time.monotonic()
        tokens = min(rate, self._lookups + (now - self._lookups_at) * rate)
        self._lookups_at = now
        if tokens < 1:
            self._lookups = tokens
            raise Overloaded(
                f"API keys are read from the registry at most {rate:g} a second and that "
                "was spent (auth.lookups_per_s); retry",
                1,
            )
        self._lookups = tokens - 1

    def known(self, credential: str | None) -> Principal | None:
        """The caller, when that takes no lookup (the internal token, a JWT, an API key
        read within ``auth.cache_s``); None when its key must be read from the registry
        (:meth:`authenticate` does). Raises :class:`Unauthorized` refusing it."""
        if credential and is_internal_token(credential, self.config.internal_token):
            return INTERNAL
        if not credential:
            raise Unauthorized(
                "this server needs a credential: Authorization: Bearer <API key or JWT>, "
                "or X-API-Key: <API key>"
            )
        if credential.startswith("ik_"):
            parsed = parse_key(credential)
            if parsed is None:
                raise Unauthorized("malformed API key")
            cached = self._cache.get(parsed[0])
            if cached is None or cached[0] < time.monotonic():
                return None
            return _key_principal(parsed[0], parsed[1], cached[1])
        if credential.count(".") == 2:
            return self._jwt(credential)
        raise Unauthorized("malformed credential: expected an inferd API key (ik_...) or a JWT")

    def _jwt(self, token: str) -> Principal:
        import jwt

        if not self._jwt_keys:
            raise Unauthorized("JWTs are not accepted here: no JWT key is configured")
        config = self.config
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"invalid token: {exc}") from None
        alg, kid = str(header.get("alg")), header.get("kid")
        candidates = [
            key
            for key, algorithms, key_kid in self._jwt_keys
            if alg in algorithms and (kid is None or key_kid in (None, kid))
        ]
        if not candidates:
            raise Unauthorized(f"invalid token: no configured key for algorithm {alg!r}")
        last: Exception | None = None
        for key in candidates:
            try:
                claims = jwt.decode(
                    token,
                    key,
                    algorithms=[alg],
                    audience=config.jwt_audience,
                    issuer=config.jwt_issuer,
                    options={"require": ["exp", "sub"]},
                )
                break
            except jwt.ExpiredSignatureError:
                raise Unauthorized("token expired") from None
            except jwt.InvalidSignatureError as exc:
                last = exc  # maybe another of the configured keys
            except jwt.PyJWTError as exc:
                raise Unauthorized(f"invalid token: {exc}") from None
        else:
            raise Unauthorized(f"invalid token: {last}")
        raw = claims.get(config.jwt_scopes_claim) or claims.get("scopes") or ""
        scopes = raw.split() if isinstance(raw, str) else [str(s) for s in raw or []]
        models = claims.get("models")
        return Principal(
            "token",
            str(claims["sub"]),
            frozenset(scopes),
            _models(models if isinstance(models, list) else None),
        )


def _key_principal(key_id: str, secret: str, record: KeyRecord | None) -> Principal:
    if record is None or not secret_matches(record, secret):
        raise Unauthorized("unknown API key")
    if record.revoked_at is not None:
        raise Unauthorized(f"API key {key_id} was revoked")
    return Principal("API key", key_id, frozenset(record.scopes), _models(record.models))


def _models(models: Any) -> frozenset[str] | None:
    return None if models is None else frozenset(str(m) for m in models)


def _load_jwt_keys(config: AuthConfig) -> list[tuple[Any, list[str], str | None]]:
    """(key, algorithms, kid) to verify with, from the files the settings name."""
    keys: list[tuple[Any, list[str], str | None]] = []
    if config.jwt_secret_file is not None:
        secret = Path(config.jwt_secret_file).read_text().strip()
        if len(secret) < 32:
            raise ValueError("auth.jwt_secret_file must hold a secret of at least 32 characters")
        keys.append((secret, ["HS256"], None))
    if config.jwt_public_key_file is not None:
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        pem = Path(config.jwt_public_key_file).read_bytes()
        public = load_pem_public_key(pem)
        if isinstance(public, rsa.RSAPublicKey):
            keys.append((public, ["RS256"], None))
        elif isinstance(public, ec.EllipticCurvePublicKey):
            keys.append((public, ["ES256"], None))
        else:
            raise ValueError("auth.jwt_public_key_file must hold an RSA or EC public key (PEM)")
    if config.jwt_jwks_file is not None:
        import jwt

        for jwk in json.loads(Path(config.jwt_jwks_file).read_text()).get("keys", []):
            key = jwt.PyJWK(jwk)
            keys.append((key.key, [key.algorithm_name], jwk.get("kid")))
    return keys


def credential_of(pairs: Iterable[tuple[str, str]]) -> str | None:
    """The Bearer credential or the X-API-Key value among ``(name, value)`` pairs
    (lower-case names: HTTP headers, gRPC metadata)."""
    for name, value in pairs:
        if name == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthorized("malformed Authorization header: expected 'Bearer <credential>'")
            return token.strip()
        if name == "x-api-key":
            return value.strip()
    return None
