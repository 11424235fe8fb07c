"""``GET /openapi.json``, generated from the route table; there is no hand-kept copy.

Every route declared with :func:`umbra.api.routing.endpoint` carries an
:class:`EndpointInfo` (auth, scopes, query parameters, request and response
types, refusals). The document is built from those records and the *same* msgspec
structs that validate requests, via ``msgspec.json.schema_components``, so a
field added to a request struct appears here without anyone remembering to.
Each operation lists every refusal :func:`umbra.api.routing.refusals` finds for
it, so a client sees the 404, 409, 413, 422... it must handle without reading
the prose.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import msgspec
from starlette.requests import Request

from .http import json_response
from .routing import EndpointInfo, endpoint, refusals

_REF = "#/components/schemas/{name}"
_PATH_PARAM = re.compile(r"{([^}:]+)(?::[^}]+)?}")

_ERROR_RESPONSE = {
    "description": "An error: {\"error\": code, \"message\": sentence}.",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


class Error(msgspec.Struct):
    error: str
    message: str


def _infos(routes: Iterable[Any]) -> list[EndpointInfo]:
    return [route.endpoint_info for route in routes if hasattr(route, "endpoint_info")]


def _scalar_schema(python_type: type) -> dict[str, Any]:
    (schema,), _ = msgspec.json.schema_components([python_type], ref_template=_REF)
    return schema


def openapi_path(path: str) -> str:
    """The route's path as an OpenAPI template: Starlette's ``{slug:path}`` becomes ``{slug}``."""
    return _PATH_PARAM.sub(r"{\1}", path)


def _operation_id(info: EndpointInfo) -> str:
    words = re.split(r"[^A-Za-z0-9]+", _PATH_PARAM.sub(r"by_\1", info.path))
    return "_".join([info.method.lower(), *[w for w in words if w]])


def build_document(routes: Iterable[Any], *, title: str = "Umbra Compute", version: str = "1") -> dict[str, Any]:
    infos = _infos(routes)
    types: list[Any] = [Error]
    for info in infos:
        for t in (info.body, info.response, info.error_body):
            if t is not None and t not in types:
                types.append(t)
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = dict(zip(map(id, types), schemas))

    paths: dict[str, dict[str, Any]] = {}
    for info in infos:
        operation: dict[str, Any] = {
            "summary": info.summary,
            "operationId": _operation_id(info),
            "x-umbra-auth": info.auth,
            "x-umbra-scopes": list(info.scopes),
        }
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PATH_PARAM.findall(info.path)
        ]
        parameters += [
            {"name": name, "in": "query", "required": required, "description": text, "schema": _scalar_schema(t)}
            for name, (t, required, text) in info.query.items()
        ]
        if parameters:
            operation["parameters"] = parameters
        if info.auth != "none":
            operation["security"] = [{"bearer": list(info.scopes)}]
        if info.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema_of[id(info.body)]}},
            }
        responses: dict[str, Any] = {}
        for status in info.success:
            entry: dict[str, Any] = {"description": "Success." if status != 204 else "Nothing to return."}
            if status != 204:
                media_types = (info.produces,) if isinstance(info.produces, str) else info.produces
                if info.response is not None:
                    entry["content"] = {media: {"schema": schema_of[id(info.response)]} for media in media_types}
                elif info.produces != "application/json":
                    entry["content"] = {media: {"schema": {"type": "string"}} for media in media_types}
            responses[str(status)] = entry
        error_schema = schema_of[id(info.error_body if info.error_body is not None else Error)]
        for status, text in refusals(info).items():
            responses[str(status)] = {"description": text, "content": {"application/json": {"schema": error_schema}}}
        responses["default"] = _ERROR_RESPONSE
        operation["responses"] = responses
        paths.setdefault(openapi_path(info.path), {})[info.method.lower()] = operation

    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


async def openapi_json(request: Request):
    document = getattr(request.app.state, "openapi_document", None)
    if document is None:
        document = request.app.state.openapi_document = build_document(request.app.routes)
    return json_response(document)


routes = [
    endpoint(
        "GET",
        "/openapi.json",
        openapi_json,
        summary="This API's OpenAPI 3.1 document, generated from the route table.",
        auth="none",
        response=dict[str, Any],
    )
]
