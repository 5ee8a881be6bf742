"""The API key check: with `HTTPConfig.api_key` set, every request to `/v1/*`, `/tokenize` and
`/detokenize` must carry `Authorization: Bearer KEY`, else it is answered 401 in OpenAI's
error shape (`AuthenticationError`). `/health`, `/metrics`, `/version` and `/openapi.json`
stay open, as in vLLM, for probes and scrapers that hold no key.

A pure ASGI middleware, not Starlette's `BaseHTTPMiddleware`: an admitted request passes
through untouched, so a streamed answer is not buffered and a disconnect still reaches its
handler. It is no TLS: the key crosses the wire in clear unless a proxy in front encrypts it.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from disagg.server.errors import AuthenticationError

KEYED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize"})


def needs_key(path: str) -> bool:
    """Whether a request to `path` must carry the key (every route under `/v1/`, unknown ones
    too, so that a 404 does not tell a stranger which routes exist)."""
    return path.startswith("/v1/") or path in KEYED_PATHS


def check_authorization(header: bytes | None, key: bytes) -> AuthenticationError | None:
    """The refusal for an `Authorization` header value, or None when it carries `key`.
    The comparison takes the same time wherever the first wrong byte is (`compare_digest`)."""
    if header is None:
        return AuthenticationError("no API key was sent: send it in an Authorization header "
                                   "as `Authorization: Bearer KEY`")
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return AuthenticationError("the Authorization header must be `Bearer KEY`")
    if not hmac.compare_digest(token.strip(), key):
        return AuthenticationError("incorrect API key provided")
    return None


class APIKeyMiddleware:
    """Answers 401 to a keyed path without the key; passes everything else on as it is."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]):
            # The first Authorization header counts: a second cannot override a wrong one.
            header = next((value for name, value in scope["headers"]
                           if name == b"authorization"), None)
            error = check_authorization(header, self._key)
            if error is not None:
                response = JSONResponse(error.body(), error.status, error.headers())
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_api_key(app: FastAPI, api_key: str | None) -> None:
    """Make `app` ask for `api_key` on its keyed paths (None: it asks for nothing)."""
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
