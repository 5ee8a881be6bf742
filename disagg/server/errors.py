"""Errors of the front door, each with the HTTP status and OpenAI error type it answers with.

The body of every error response has the OpenAI shape:
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`. `headers()` adds what
a client needs to retry well (`Retry-After` on 429 and 503: X5b).
"""

from __future__ import annotations

from disagg.errors import DisaggError


class APIError(DisaggError):
    """A request the server answers with an error response instead of a completion."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Response headers that go with this error (none by default)."""
        return {}


class InvalidRequest(APIError):
    """A field is missing, of the wrong type or out of range (HTTP 400)."""


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve (HTTP 400, code model_not_found).
    """

    def __init__(self, model: str) -> None:
        super().__init__(f"the model {model!r} does not exist", "model", "model_not_found")


class BodyTooLarge(InvalidRequest):
    """A request body over `HTTPConfig.max_body_bytes`, refused before it is read whole
    (HTTP 413)."""

    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes", None,
                         "body_too_large")


# Seconds a client is told to wait before retrying a refusal for load (429, 503).
RETRY_AFTER_S = 1


class Overloaded(APIError):
    """More requests in flight than the server admits (HTTP 429)."""

    status = 429
    type = "rate_limit_exceeded"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)}


class Unavailable(APIError):
    """No decoder can take the request (HTTP 503)."""

    status = 503
    type = "service_unavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)}


class ChatTemplateError(InvalidRequest):
    """Messages the model's chat template cannot render (HTTP 400)."""


class AuthenticationError(APIError):
    """A request without the server's API key, or with another (HTTP 401, code
    invalid_api_key, as OpenAI answers). The message never repeats the key that was sent."""

    status = 401

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "invalid_api_key")

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}  # RFC 9110: a 401 names its scheme
