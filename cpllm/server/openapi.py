"""The OpenAPI document of the server, with the request bodies the routes parse themselves.

The routes read raw bodies (to refuse oversized ones before parsing, and to word
errors OpenAI's way), so FastAPI cannot see their models; they are added here, so
that clients, generators and the fuzz test see the real request shapes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """`app.openapi()` returns the document with `bodies` (path -> model) as the POST request bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template=_REF, by_alias=True)
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
                operation = doc["paths"][path]["post"]
                operation["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
