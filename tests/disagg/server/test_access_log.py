"""The front door's access log (`http_server.AccessLog`): one line per request once its
response has ended, with client, method, path, status and milliseconds, on stderr while on
and nothing while off."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from disagg.server.http_server import AccessLog, enable_access_log


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
    if scope["path"] == "/boom":
        raise RuntimeError("the app failed before it answered")
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def _request(path: str, method: str = "GET") -> None:
    scope = {"type": "http", "method": method, "path": path, "client": ("10.0.0.7", 5123)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    asyncio.run(AccessLog(_app)(scope, receive, send))


@pytest.fixture
def access_log() -> Any:  # noqa: ANN401
    enable_access_log(True)
    yield
    enable_access_log(False)


@pytest.mark.usefixtures("access_log")
def test_each_request_is_one_line_with_its_status_and_duration(
        capsys: pytest.CaptureFixture[str]) -> None:
    _request("/v1/models", "POST")
    with pytest.raises(RuntimeError):
        _request("/boom")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"10\.0\.0\.7 POST /v1/models 404 \d+\.\d ms", lines[0])
    assert re.fullmatch(r"10\.0\.0\.7 GET /boom 500 \d+\.\d ms", lines[1])


def test_off_it_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    enable_access_log(False)
    _request("/v1/models")
    assert capsys.readouterr().err == ""
