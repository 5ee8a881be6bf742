"""The OpenAPI document of the front door (`/openapi.json`), with the request models (X5b).

The handlers read their bodies raw, so that the body limit, the JSON checks and the OpenAI
error shapes come before FastAPI's own validation would; FastAPI therefore cannot see the
models, and this module publishes them: each endpoint names its model as its request body,
and the models' JSON schemas go into `components`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """An endpoint's `openapi_extra`: its JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` include `models` (and the models they use) as components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign] - FastAPI's documented override
