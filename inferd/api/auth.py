"""Who is calling, and may they: API keys and JWTs, scopes, model allow-lists.

Off by default (a laptop); with ``auth.enabled`` every route but health and metrics
needs a credential: ``Authorization: Bearer <key or JWT>`` (what the ``openai`` client
sends as its api_key) or ``X-API-Key: <key>``.

- API keys (``ik_...``, :mod:`inferd.registry.keys`) are looked up by their public id
  and kept for ``auth.cache_s`` seconds per gateway process (unknown ids too), so a
  request costs a dict lookup and one SHA-256, and a revocation takes effect within
  that time everywhere.
- JWTs are verified with an HS256 secret, or RS256/ES256 public keys (PEM or a JWKS
  file), all read from files named in the settings (never from the command line of a
  process): ``exp`` and ``sub`` are required, ``aud``/``iss`` checked when configured;
  scopes come from the ``scope`` claim (space-separated, OAuth 2) or a ``scopes`` list;
  an optional ``models`` list is an allow-list.

Scopes: ``admin`` (control plane: registry writes and artifact downloads, deployments,
keys, logs, repository; includes infer) and ``infer`` (predict, infer, generate, OpenAI,
model metadata). No or bad credential → 401 with ``WWW-Authenticate``; a valid one
without the scope or the model → 403. Credentials never reach a log line.

What a caller may call is what it may see: :meth:`Principal.may_use` is the one rule
behind both the 403 (:meth:`Principal.allow_model`) and every model listing
(:func:`visible_models`), so a key limited to ``fraud`` neither calls nor lists ``iris``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.api.http import PUBLIC_PATHS, context_of, model_in_path, refuse
from inferd.config import AuthConfig
from inferd.errors import Forbidden, InferdError, Overloaded, Unauthorized
from inferd.registry.api_key import KeyRecord, parse_key, secret_matches

if TYPE_CHECKING:
    from inferd.registry.keys import ApiKeys

_ADMIN_PREFIXES = (
    "/api/v1/deployments",
    "/api/v1/keys",
    "/api/v1/logs",
    "/v2/repository",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
_INFER_WRITES = re.compile(r"^/api/v1/models/[^/]+/((versions/[^/]+/)?explain|predict|generate)$")
"""POSTs under ``/api/v1/models`` that run a model (the rest change the registry)."""


def required_scope(method: str, path: str) -> str | None:
    """The scope a request needs: None (public), "infer" or "admin"."""
    if PUBLIC_PATHS.match(path):
        return None
    if path.startswith(_ADMIN_PREFIXES):
        return "admin"
    if path.startswith("/api/v1/models") and (
        (method not in ("GET", "HEAD") and not _INFER_WRITES.match(path))
        or path.endswith("/artifact")
    ):
        return "admin"  # pushing, changing or deleting models; downloading their files
    return "infer"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: ``subject`` is a key id or a JWT ``sub``, never a secret."""

    kind: str
    subject: str
    scopes: frozenset[str]
    models: frozenset[str] | None

    def require(self, scope: str) -> None:
        if scope not in self.scopes and not self.admin:
            raise Forbidden(
                f"this {self.kind} ({self.subject}) lacks the {scope!r} scope",
                required_scope=scope,
            )

    @property
    def admin(self) -> bool:
        return "admin" in self.scopes

    def may_use(self, model: str) -> bool:
        """Whether this caller may call ``model`` (a ``base:adapter`` name counts as its
        base; model names have no colon): an admin or an unrestricted credential, any."""
        return self.models is None or self.admin or model.partition(":")[0] in self.models

    def limited_to(self) -> frozenset[str] | None:
        """The models this caller may use, or None for every one (:meth:`may_use` as a
        set, for filters that take one: the console's figures)."""
        return None if self.models is None or self.admin else self.models

    def allow_model(self, model: str) -> None:
        if not self.may_use(model):
            raise Forbidden(f"this {self.kind} ({self.subject}) may not use model {model!r}")


INTERNAL = Principal("internal", "inferd-jobs", frozenset({"admin"}), None)
"""The server's own job runner, calling its gateways with ``auth.internal_token``."""


def is_internal_token(credential: str | None, token: str | None) -> bool:
    return bool(credential and token and hmac.compare_digest(credential, token))


def internal_caller(scope: Scope, token: str | None) -> bool:
    """Whether the server's job runner sent this request (with auth on or off): its
    requests are not rate limited (the job was, when it was submitted)."""
    if token is None:
        return False
    principal = context_of(scope).principal
    if principal is not None:
        return principal is INTERNAL
    for name, value in scope["headers"]:
        if name == b"authorization":
            return is_internal_token(value.decode("latin-1").removeprefix("Bearer "), token)
    return False


def _any_model(model: str) -> bool:
    return True


def visible_models(scope: Scope) -> Callable[[str], bool]:
    """Which models a listing shows this request's caller: those it may call (an
    adapter goes with its base model), every one when auth is off."""
    principal = context_of(scope).principal
    return _any_model if principal is None else principal.may_use


def authorize_model(scope: Scope, model: str) -> None:
    """A handler's check for a model named in the body (no-op when auth is off)."""
    principal = context_of(scope).principal
    if principal is not None:
        principal.allow_model(model)


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


class AuthGate:
    """ASGI middleware in front of every HTTP route (installed only when auth is on)."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator) -> None:
        self.app = app
        self.auth = authenticator
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        need = required_scope(scope["method"], path)
        if need is not None:
            try:
                headers = ((n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"])
                principal = await self.auth.authenticate(credential_of(headers))
                principal.require(need)
                if (model := model_in_path(path)) is not None:
                    principal.allow_model(model)
            except InferdError as exc:
                await refuse(exc, scope, receive, send)
                return
            context_of(scope).principal = principal
        await self.app(scope, receive, send)
