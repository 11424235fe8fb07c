"""``/openapi.json`` is generated from the route table and the request/response structs."""

from __future__ import annotations

import uuid

import httpx
import msgspec
import pytest

from tests.helpers import bearer
from tests.integration.queue_support import http_pair
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


def test_a_route_declares_only_its_own_refusals_and_the_rest_follow_from_its_declaration():
    """Refusals that follow from how a route is declared (credential, path id, body, query) are listed without
    the route naming them, each with the Error schema; the route adds only what is particular to it."""

    class Thing(msgspec.Struct, kw_only=True):
        name: str

    from starlette.responses import Response

    from umbra.api.routing import endpoint

    async def handler(request):
        return Response()

    doc = build_document([
        endpoint("POST", "/v1/things/{id}", handler, summary="s", auth="api_key", body=Thing, errors={409: "taken"}),
        endpoint("GET", "/v1/things", handler, summary="s", auth="none"),
    ])  # fmt: skip
    responses = doc["paths"]["/v1/things/{id}"]["post"]["responses"]
    assert {"401", "403", "404", "409", "413", "422", "429", "503"} <= set(responses)
    assert responses["409"]["description"] == "taken"
    assert responses["409"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert set(doc["paths"]["/v1/things"]["get"]["responses"]) == {"200", "default"}


#: Every path API.md (shared and the project's) names, with its method.
DOCUMENTED_ROUTES = [
    ("post", "/v1/pairings"), ("post", "/v1/pairings/redeem"), ("post", "/v1/agent/heartbeat"),
    ("post", "/v1/agent/claim"), ("post", "/v1/agent/jobs/{id}/renew"), ("post", "/v1/agent/jobs/{id}/complete"),
    ("post", "/v1/agent/jobs/{id}/fail"), ("post", "/v1/agent/jobs/{id}/children"), ("post", "/v1/jobs"),
    ("post", "/v1/jobs/batch"), ("get", "/v1/jobs"), ("get", "/v1/jobs/{id}"), ("post", "/v1/jobs/{id}/cancel"),
    ("get", "/v1/jobs/{id}/events"), ("get", "/v1/jobs/{id}/explain"), ("get", "/v1/nodes"), ("get", "/v1/nodes/{id}"),
    ("post", "/v1/nodes/{id}/drain"), ("post", "/v1/nodes/{id}/retire"), ("post", "/v1/nodes/{id}/revoke"),
    ("get", "/v1/models"), ("put", "/v1/models/{slug}"), ("get", "/v1/events"), ("get", "/v1/events/stream"),
    ("get", "/v1/projections/queue"), ("get", "/v1/projections/nodes"), ("get", "/v1/projections/stream"),
    ("post", "/v1/projections/verify"), ("get", "/metrics"), ("get", "/openapi.json"), ("get", "/"),
    ("post", "/v1/agent/complete"), ("get", "/v1/nodes/{id}/events"), ("post", "/v1/agent/offline"),
    ("get", "/healthz"), ("get", "/readyz"),
]  # fmt: skip


async def test_every_route_api_md_documents_is_an_operation(live_server):
    """A client generated from the document reaches every route API.md names, the probes a monitor is
    configured with included."""
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        doc = (await client.get("/openapi.json")).json()
    missing = [(m, p) for m, p in DOCUMENTED_ROUTES if m not in doc["paths"].get(p, {})]
    assert missing == []


async def test_the_probes_are_described_and_answer_as_they_did(live_server):
    """/healthz and /readyz need no credential and answer 200, or 503 with the same small status object that
    says why; declaring them changed nothing they answer."""
    async with httpx.AsyncClient(base_url=live_server.url) as client:
        doc = (await client.get("/openapi.json")).json()
        health, ready = await client.get("/healthz"), await client.get("/readyz")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert isinstance(ready.json()["listener_connected"], bool)
    for path in ("/healthz", "/readyz"):
        operation = doc["paths"][path]["get"]
        assert operation["x-umbra-auth"] == "none" and "security" not in operation
        for status in ("200", "503"):
            schema = operation["responses"][status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/HealthStatus"}


async def test_every_operation_is_a_real_route(live_server, org):
    """No operation of the document answers 405, or Starlette's plain "Not Found" for want of a route: a
    made-up id may be 404, with a JSON error code."""
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        doc = (await client.get("/openapi.json")).json()
        for path, item in doc["paths"].items():
            concrete = path.replace("{id}", str(uuid.uuid4())).replace("{slug}", "m1").replace("{name}", "dashboard.js")
            for method in item:
                if path.endswith("/stream"):
                    continue  # a stream would not end; its route is checked by other tests
                params = {"wait": 0} if path == "/v1/agent/claim" else None
                response = await client.request(method.upper(), concrete, params=params,
                                                headers=bearer(org[1]), content=b"{}")  # fmt: skip
                assert response.status_code != 405, (method, path)
                if response.status_code == 404:
                    assert response.headers["content-type"].startswith("application/json"), (method, path)
                    assert "error" in response.json(), (method, path, response.text)


#: API.md's Job object.
JOB_FIELDS = {"id", "organization_id", "kind", "status", "priority", "requires", "payload", "project_id", "lang",
              "attempt", "max_attempts", "not_before", "parent_job_id", "idempotency_key", "lease_owner",
              "lease_expires_at", "result", "error", "placement", "created_at", "started_at", "finished_at"}  # fmt: skip


def test_every_route_answering_a_job_describes_it():
    """API.md fixes the Job object's fields; every route answering a Job, a list of them or a claim describes
    that body, so a generated client has the Job type, and the claim's job and placement are typed, not bare
    objects."""
    doc = build_document(all_routes())
    schemas = doc["components"]["schemas"]
    assert JOB_FIELDS <= set(schemas["JobOut"]["properties"])
    undescribed = []
    for method, path, status in [("post", "/v1/jobs", "201"), ("post", "/v1/jobs", "200"), ("get", "/v1/jobs", "200"),
                                 ("get", "/v1/jobs/{id}", "200"), ("post", "/v1/jobs/batch", "201"),
                                 ("post", "/v1/jobs/{id}/cancel", "200"), ("post", "/v1/agent/jobs/{id}/complete", "200"),
                                 ("post", "/v1/agent/jobs/{id}/fail", "200"), ("post", "/v1/agent/jobs/{id}/renew", "200"),
                                 ("post", "/v1/agent/jobs/{id}/children", "201"), ("post", "/v1/agent/complete", "200")]:  # fmt: skip
        if "content" not in doc["paths"][path][method]["responses"][status]:
            undescribed.append(f"{method.upper()} {path} {status}")
    assert undescribed == []
    claim = schemas["Claim"]["properties"]
    assert claim["job"] == {"$ref": "#/components/schemas/JobOut"}
    assert claim["placement"] == {"$ref": "#/components/schemas/Placement"}
    assert {"node_id", "device_id", "device_kind", "reason", "resident", "would_evict", "estimated_seconds"} <= set(
        schemas["Placement"]["properties"]
    )


def test_the_documented_error_statuses_are_listed():
    """API.md fixes status codes per route (unknown id → 404, cancel of an ended job → 409, a report for a job
    not held → 409, redeem → 401/409/429, invalid body or query → 422, body over 1 MiB → 413); each is listed
    for its operation with the Error schema, so a client knows which refusals to handle."""
    doc = build_document(all_routes())
    expect = {("post", "/v1/jobs/{id}/cancel"): {"404", "409"},
              ("post", "/v1/pairings/redeem"): {"401", "409", "413", "422", "429"},
              ("get", "/v1/jobs/{id}"): {"401", "403", "404", "422"},
              ("get", "/v1/jobs"): {"422"},
              ("post", "/v1/jobs"): {"404", "413", "422"},
              ("post", "/v1/jobs/batch"): {"404", "413", "422"},
              ("post", "/v1/nodes/{id}/drain"): {"404", "409"},
              ("post", "/v1/agent/jobs/{id}/renew"): {"404", "409", "413", "422"},
              ("post", "/v1/agent/jobs/{id}/complete"): {"404", "409", "413", "422"},
              ("post", "/v1/agent/jobs/{id}/fail"): {"404", "409", "413", "422"},
              ("post", "/v1/agent/jobs/{id}/children"): {"404", "409", "413", "422"}}  # fmt: skip
    missing = {f"{m.upper()} {p}": sorted(codes - set(doc["paths"][p][m]["responses"]))
               for (m, p), codes in expect.items() if codes - set(doc["paths"][p][m]["responses"])}  # fmt: skip
    assert missing == {}
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            for status, answer in operation["responses"].items():
                if status.startswith(("4", "5")) and path not in ("/healthz", "/readyz"):
                    assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
            if "requestBody" in operation:
                assert {"413", "422"} <= set(operation["responses"]), (method, path)
            if "{id}" in path:
                assert "404" in operation["responses"], (method, path)


async def test_required_fields_are_what_the_server_refuses_when_missing(api, live_server, org):
    """For each request body, leaving out a field the document marks required is refused with
    invalid_request naming that field, and a body holding only the required fields is not refused for a
    missing one: the document and the decoder come from the same structs."""
    doc = (await api.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    assert schemas["JobRequest"]["required"] == ["kind"]
    assert set(schemas["FailRequest"]["required"]) == {"attempt", "error"}
    assert set(schemas["RedeemRequest"]["required"]) == {"code", "name"}
    assert schemas["ModelRequest"]["required"] == ["vram_min_mb"]
    refused = await api.post("/v1/jobs", json={"payload": {}})
    assert refused.status_code in (400, 422) and refused.json()["error"] == "invalid_request"
    assert refused.json().get("field") == "kind"
    refused = await api.put("/v1/models/m1", json={"kind": "llm"})
    assert refused.status_code in (400, 422) and refused.json().get("field") == "vram_min_mb"
    refused = await api.post("/v1/pairings", json={"ttl_seconds": 600})
    assert refused.status_code in (400, 422) and refused.json().get("field") == "name"
    assert (await api.post("/v1/pairings", json={"name": "only-name"})).status_code == 201
    assert (await api.put("/v1/models/m1", json={"vram_min_mb": 1000})).status_code == 200


async def test_live_answers_match_their_response_schemas(api, live_server, org):
    """Each answer, success or refusal, validates against the schema the document gives for its status
    (fields, types, required): a client generated from the document can decode what the server says."""
    import jsonschema_rs

    doc = (await api.get("/openapi.json")).json()
    node_id, credential = await http_pair(api, org[1])
    node = bearer(credential)
    answers: list[tuple[str, str, httpx.Response]] = []

    async def record(method: str, path: str, response: httpx.Response) -> httpx.Response:
        answers.append((method, path, response))
        return response

    first = (await record("post", "/v1/jobs", await api.post("/v1/jobs", json={"kind": "e", "payload": {"n": 1}}))).json()
    await record("post", "/v1/jobs", await api.post("/v1/jobs", json={"kind": "e", "idempotency_key": "k"}))
    await record("post", "/v1/jobs", await api.post("/v1/jobs", json={"kind": "e", "idempotency_key": "k"}))  # 200
    await record("post", "/v1/jobs/batch", await api.post("/v1/jobs/batch", json={"jobs": [{"kind": "e"}] * 4}))
    await record("get", "/v1/jobs", await api.get("/v1/jobs", params={"limit": 2}))
    await record("get", "/v1/jobs/{id}", await api.get(f"/v1/jobs/{first['id']}"))
    claimed = (await record("post", "/v1/agent/claim", await api.post("/v1/agent/claim", params={"wait": 0}, headers=node))).json()
    job = claimed["job"]
    await record("post", "/v1/agent/jobs/{id}/renew",
                 await api.post(f"/v1/agent/jobs/{job['id']}/renew", json={"attempt": job["attempt"]}, headers=node))
    done = await record("post", "/v1/agent/jobs/{id}/complete",
                        await api.post(f"/v1/agent/jobs/{job['id']}/complete", params={"claim_next": "true"},
                                       json={"attempt": job["attempt"], "result": {"ok": 1}}, headers=node))
    following = done.json()["next_claim"]["job"]
    await record("post", "/v1/agent/jobs/{id}/fail",
                 await api.post(f"/v1/agent/jobs/{following['id']}/fail",
                                json={"attempt": following["attempt"], "error": "boom", "retry": False}, headers=node))
    many = (await record("post", "/v1/agent/claim",
                         await api.post("/v1/agent/claim", params={"wait": 0, "max": 2}, headers=node))).json()
    parent, other = (c["job"] for c in many["claims"])
    await record("post", "/v1/agent/jobs/{id}/children",
                 await api.post(f"/v1/agent/jobs/{parent['id']}/children",
                                json={"attempt": parent["attempt"], "children": [{"kind": "e"}]}, headers=node))
    await record("post", "/v1/agent/complete",
                 await api.post("/v1/agent/complete", params={"claim_next": 1}, headers=node,
                                json={"results": [{"job_id": other["id"], "attempt": other["attempt"]},
                                                  {"job_id": str(uuid.uuid4()), "attempt": 1}]}))
    await record("post", "/v1/jobs/{id}/cancel", await api.post(f"/v1/jobs/{first['id']}/cancel"))  # 409 job_terminal
    queued = (await api.post("/v1/jobs", json={"kind": "e"})).json()
    await record("post", "/v1/jobs/{id}/cancel", await api.post(f"/v1/jobs/{queued['id']}/cancel"))
    await record("get", "/v1/jobs/{id}", await api.get(f"/v1/jobs/{uuid.uuid4()}"))  # 404
    await record("post", "/v1/jobs", await api.post("/v1/jobs", json={"payload": {}}))  # 422
    for method, path, concrete in [("get", "/v1/nodes", "/v1/nodes"), ("get", "/v1/nodes/{id}", f"/v1/nodes/{node_id}"),
                                   ("get", "/v1/models", "/v1/models"), ("get", "/v1/events", "/v1/events"),
                                   ("get", "/v1/jobs/{id}/events", f"/v1/jobs/{first['id']}/events"),
                                   ("get", "/v1/nodes/{id}/events", f"/v1/nodes/{node_id}/events"),
                                   ("get", "/v1/jobs/{id}/explain", f"/v1/jobs/{queued['id']}/explain"),
                                   ("get", "/v1/projections/queue", "/v1/projections/queue"),
                                   ("get", "/v1/projections/nodes", "/v1/projections/nodes"),
                                   ("post", "/v1/projections/verify", "/v1/projections/verify"),
                                   ("get", "/healthz", "/healthz"), ("get", "/readyz", "/readyz")]:  # fmt: skip
        await record(method, path, await api.request(method.upper(), concrete))
    await record("post", "/v1/pairings", await api.post("/v1/pairings", json={"name": "z"}))
    await record("put", "/v1/models/{slug}", await api.put("/v1/models/m:1", json={"vram_min_mb": 1}))
    await record("post", "/v1/agent/heartbeat", await api.post("/v1/agent/heartbeat", json={}, headers=node))
    await record("post", "/v1/nodes/{id}/drain", await api.post(f"/v1/nodes/{node_id}/drain"))

    assert {(m, p, r.status_code) for m, p, r in answers} >= {("post", "/v1/jobs", 200), ("post", "/v1/jobs/{id}/cancel", 409),
                                                              ("get", "/v1/jobs/{id}", 404), ("post", "/v1/jobs", 422)}  # fmt: skip
    errors = {}
    for method, path, response in answers:
        schema = doc["paths"][path][method]["responses"][str(response.status_code)]["content"]["application/json"]["schema"]
        validator = jsonschema_rs.validator_for({"components": doc["components"], **schema}, validate_formats=True)
        problems = [e.message for e in validator.iter_errors(response.json())]
        if problems:
            errors[f"{method.upper()} {path} {response.status_code}"] = problems[:3]
    assert errors == {}


async def test_answers_that_are_not_api_objects_are_declared_as_sent(live_server):
    """The routes with no struct to describe (the document itself, the dashboard, its assets, the metrics)
    declare each status they answer and the media type they send it as, and a JSON body's schema holds it: a
    generated client knows the document is a JSON object and an unknown asset is a 404 with the Error body."""
    import jsonschema_rs

    async with httpx.AsyncClient(base_url=live_server.url) as client:
        doc = (await client.get("/openapi.json")).json()
        answers = [(path, await client.get(concrete)) for path, concrete in [
            ("/openapi.json", "/openapi.json"), ("/", "/"), ("/metrics", "/metrics"),
            ("/static/{name}", "/static/dashboard.js"), ("/static/{name}", "/static/dashboard.css"),
            ("/static/{name}", "/static/nothing.js"),
        ]]  # fmt: skip
    assert [r.status_code for _, r in answers] == [200, 200, 200, 200, 200, 404]
    problems = []
    for path, response in answers:
        declared = doc["paths"][path]["get"]["responses"].get(str(response.status_code))
        sent = response.headers["content-type"].split(";")[0]
        if declared is None or sent not in declared.get("content", {}):
            problems.append((path, response.status_code, sent, declared and list(declared.get("content", {}))))
        elif sent == "application/json":
            validator = jsonschema_rs.validator_for({"components": doc["components"], **declared["content"][sent]["schema"]})
            problems += [(path, response.status_code, e.message) for e in validator.iter_errors(response.json())]
    assert problems == []


def test_every_moment_an_answer_carries_is_described_as_a_date_time():
    """The server sends every moment as RFC 3339 in UTC (``...Z``), and the document says so (``format:
    date-time``) wherever an answer holds one, as it does where a request takes one (``not_before``): a client
    generated from it reads a time, not a bare string, from the Job, the claim, the node, the event..."""
    doc = build_document(all_routes())
    answered = {info.response.__name__ for info in _declared()
                if isinstance(info.response, type) and issubclass(info.response, msgspec.Struct)}  # fmt: skip
    schemas = doc["components"]["schemas"]
    for name in list(answered):
        answered |= {ref.rsplit("/", 1)[1] for ref in _refs(schemas[name], set())}
    undescribed = []
    for name in sorted(answered):
        for field, schema in schemas[name].get("properties", {}).items():
            if field.endswith("_at") or field in ("not_before", "expires"):
                choices = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
                if choices != [{"type": "string", "format": "date-time"}]:
                    undescribed.append(f"{name}.{field}")
    assert "JobOut" in answered and "NodeOut" in answered and undescribed == []
