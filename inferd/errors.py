"""The one error hierarchy of inferd, and its wire shape.

    InferdError (500)                  base; ``code`` is a stable machine-readable name
    ├── BadRequest (400)               body is not valid JSON / not the expected shape
    ├── PayloadTooLarge (413)          body or rows over the configured limit
    │   └── PromptTooLong (413)        a prompt longer than the model's context or the
    │                                  server's llm.max_prompt_tokens (OpenAI routes: 400
    │                                  ``context_length_exceeded``, as OpenAI answers)
    ├── InvalidInput (422)             input does not match the model signature
    ├── Unauthorized (401)             no, malformed, unknown, revoked or expired credential
    ├── Forbidden (403)                a valid credential without the scope or model
    ├── NotFound (404)                 unknown resource (an API key)
    ├── ModelNotFound (404)            unknown model or version
    ├── VersionExists (409)            a registered version is immutable
    ├── Conflict (409)                 a change contradicts the current state, or raced one
    ├── RateLimited (429)              over a rate limit; carries the X-RateLimit-* headers
    ├── ModelNotReady (503)            no ready replica; carries ``retry_after_s``
    ├── Overloaded (503)               a replica queue is full; carries depth and limit
    ├── StoreUnavailable (503)         the artifact store (S3) cannot be reached
    ├── RequestTimeout (504)           the request's deadline passed
    └── ModelError (500)               the model raised; details only in the server log

Every HTTP route returns ``{"error": {"code", "message", ...}}`` for these (see
``inferd.api.app``); nothing else reaches a client.
"""

from __future__ import annotations

from typing import Any


class InferdError(Exception):
    status_code = 500
    code = "internal_error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, **self.details}}

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(InferdError):
    status_code = 400
    code = "bad_request"


class PayloadTooLarge(InferdError):
    status_code = 413
    code = "payload_too_large"


class PromptTooLong(PayloadTooLarge):
    code = "prompt_too_long"


class InvalidInput(InferdError):
    status_code = 422
    code = "invalid_input"


class Unauthorized(InferdError):
    status_code = 401
    code = "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="inferd"'}


class Forbidden(InferdError):
    status_code = 403
    code = "forbidden"


class NotFound(InferdError):
    status_code = 404
    code = "not_found"


class ModelNotFound(InferdError):
    status_code = 404
    code = "model_not_found"


class VersionExists(InferdError):
    status_code = 409
    code = "version_exists"


class Conflict(InferdError):
    """The change was computed from a state that changed meanwhile, or contradicts it."""

    status_code = 409
    code = "conflict"


class RateLimited(InferdError):
    status_code = 429
    code = "rate_limited"

    def __init__(self, message: str, limit_headers: dict[str, str], **details: Any) -> None:
        super().__init__(message, **details)
        self.limit_headers = limit_headers

    def headers(self) -> dict[str, str]:
        return self.limit_headers


class ModelNotReady(InferdError):
    status_code = 503
    code = "model_not_ready"

    def __init__(self, message: str, retry_after_s: int = 1, **details: Any) -> None:
        super().__init__(message, **details)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Overloaded(ModelNotReady):
    code = "overloaded"


class RequestTimeout(InferdError):
    status_code = 504
    code = "request_timeout"


class ModelError(InferdError):
    status_code = 500
    code = "model_error"


class StoreUnavailable(InferdError):
    """The artifact store (an S3-compatible one) could not be reached, or refused."""

    status_code = 503
    code = "store_unavailable"
