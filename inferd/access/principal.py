"""An authenticated caller and what it may use: scopes and a model allow-list.

What a caller may call is what it may see: :meth:`Principal.may_use` is the one rule
behind both the 403 (:meth:`Principal.allow_model`) and every model listing
(:func:`inferd.api.auth.visible_models`), so a key limited to ``fraud`` neither calls
nor lists ``iris``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from inferd.errors import Forbidden


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
