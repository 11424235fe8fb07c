"""``/openapi.json`` is generated from the route table and the request/response structs."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from umbra.api.app import all_routes
from umbra.api.openapi import build_document, openapi_path

pytestmark = pytest.mark.anyio


def _refs(node, found: set[str]) -> set[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                found.add(value)
            else:
                _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)
    return found


def _declared():
    return [route.endpoint_info for route in all_routes() if hasattr(route, "endpoint_info")]


async def test_document_lists_every_declared_route_with_its_auth(live_server):
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    doc = response.json()
    assert doc["openapi"].startswith("3.1")
    for info in _declared():
        operation = doc["paths"][openapi_path(info.path)][info.method.lower()]
        assert operation["summary"] == info.summary
        assert operation["x-umbra-auth"] == info.auth
        assert operation["x-umbra-scopes"] == list(info.scopes)
        for status in info.success:
            assert str(status) in operation["responses"]
        if info.auth != "none":
            assert {"401", "403"} <= set(operation["responses"])
        names = {p["name"] for p in operation.get("parameters", [])}
        assert set(info.query) <= names
    operation_ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(operation_ids) == len(set(operation_ids))


def test_every_api_route_is_declared_with_endpoint():
    undeclared = [r.path for r in all_routes() if r.path.startswith("/v1") and not hasattr(r, "endpoint_info")]
    assert undeclared == []


def test_schemas_come_from_the_structs_and_every_ref_resolves():
    routes = all_routes()
    doc = build_document(routes)
    components = doc["components"]["schemas"]
    for ref in _refs(doc, set()):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in components
    for info in _declared():
        for struct in (info.body, info.response):
            if isinstance(struct, type) and issubclass(struct, msgspec.Struct):
                schema = components[struct.__name__]
                fields = {f.encode_name for f in msgspec.structs.fields(struct)}
                assert set(schema["properties"]) == fields


def test_a_new_struct_field_appears_without_editing_the_document():
    class Thing(msgspec.Struct, kw_only=True):
        name: str
        added_later: int = 0

    from starlette.responses import Response

    from umbra.api.routing import endpoint

    async def handler(request):
        return Response()

    doc = build_document([endpoint("POST", "/v1/things", handler, summary="s", auth="api_key", body=Thing)])
    assert set(doc["components"]["schemas"]["Thing"]["properties"]) == {"name", "added_later"}
    assert doc["paths"]["/v1/things"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Thing"
    }


@pytest.mark.parametrize("path", ["/v1/agent/claim", "/v1/agent/jobs/{id}/complete", "/v1/agent/complete"])
def test_every_claim_declares_its_repeatable_kind_parameter(path):
    operation = build_document(all_routes())["paths"][path]["post"]
    [kind] = [p for p in operation["parameters"] if p["name"] == "kind"]
    assert kind["in"] == "query" and not kind["required"] and kind["schema"] == {"type": "array", "items": {"type": "string"}}
